"""Parser of OpenAI's Responses API (``POST /v1/responses``).

- ``input``: a string (one user message) or a list of items: messages (``role`` +
  ``content`` as text or ``input_text`` / ``output_text`` parts), ``function_call`` items
  (an earlier answer's calls; consecutive ones are one assistant turn) and
  ``function_call_output`` items (a tool's result, answering an earlier ``call_id``);
  ``reasoning`` items of earlier answers are dropped (chat templates do not render them);
- ``instructions`` -> a system message first;
- ``tools`` (function tools: ``name``, ``description``, ``parameters``, also inside
  ``namespace`` tools), ``tool_choice``, ``parallel_tool_calls`` -> the same constrained
  tool calls as chat completions; tools of other types are dropped with a warning;
- ``text.format`` (``text``, ``json_object``, ``json_schema`` with ``schema``) -> the
  answer's grammar;
- ``max_output_tokens``, ``temperature``, ``top_p``, ``stream``.

Stateless: responses are not stored, so ``previous_response_id`` is a 400 that says to send
the whole conversation in ``input``; ``store`` is accepted and changes nothing.

Source: OpenAI, "Responses" API reference (platform.openai.com/docs/api-reference/responses).
"""

from __future__ import annotations

from pydantic import Field

from flashdraft.server.errors import APIError, bad_request
from flashdraft.server.ignored import note_ignored
from flashdraft.server.request import GenRequest, Sampling, Tools
from flashdraft.server.schemas import ChatMessage, TokenLimit, _Strict, parse_request
from flashdraft.server.tools import active_tools

#: the text part types of an input message
TEXT_PARTS = ("input_text", "output_text", "text")
#: fields that change nothing here (``client_metadata``: Codex CLI's ids for its own logs),
#: accepted and named once in the log; some only with a neutral value (:func:`_harmless`)
HARMLESS = ("metadata", "client_metadata", "user", "truncation", "include", "reasoning", "service_tier",
            "prompt_cache_key", "safety_identifier", "stream_options", "background")
#: Codex CLI's namespace for its plain function tools; other namespaces' tools are named
#: ``{namespace}__{name}`` for the model
DEFAULT_NAMESPACE, NAMESPACE_SEP = "functions", "__"


class ResponsesRequest(_Strict):
    """``POST /v1/responses``."""

    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: TokenLimit | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    #: llama-server's: every streamed event carries the timings so far
    timings_per_token: bool = False
    #: llama-server's: a stream reports the prefill's progress (``prompt_progress`` events)
    return_progress: bool = False


def responses(body: bytes) -> GenRequest:
    """``POST /v1/responses`` -> the internal request.

    Raises:
        APIError: 400 for a bad body, ``previous_response_id``, an input item of an
            unsupported type, a ``function_call_output`` answering no earlier call, a
            malformed tool, or a ``text.format`` json_schema without a schema.
    """
    req = parse_request(body, ResponsesRequest)
    if req.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported: this server does not store responses; send the "
                          "whole conversation in input", param="previous_response_id")
    extra = dict(req.model_extra or {})
    ignored = [name for name in HARMLESS if name in extra and _harmless(name, extra[name])]
    for name in ignored:
        extra.pop(name)
    note_ignored("responses", ignored)
    return GenRequest(api="responses", model=req.model, messages=chat_messages(req),
                      max_tokens=req.max_output_tokens, limit_param="max_output_tokens", stream=req.stream,
                      sampling=Sampling(temperature=req.temperature, top_p=req.top_p), tools=tools_of(req),
                      constraint=text_format(req.text), constraint_param="text.format",
                      timings_per_token=req.timings_per_token, return_progress=req.return_progress,
                      extra=extra, wire=req)


def _harmless(name: str, value: object) -> bool:
    """Whether a Responses field leaves the answer as it is (else it stays to be refused)."""
    if name == "truncation":
        return value in (None, "disabled")
    if name == "reasoning":
        return value is None or value == {} or (isinstance(value, dict) and value.get("effort") in (None, "none"))
    if name == "background":
        return value in (None, False)
    return True


def chat_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """``instructions`` and ``input`` as chat messages (see the module's rules). Raises APIError 400."""
    out: list[ChatMessage] = []
    if req.instructions:
        out.append(ChatMessage(role="system", content=req.instructions))
    if isinstance(req.input, str):
        return out + [ChatMessage(role="user", content=req.input)]
    calls: set[str] = set()
    for i, item in enumerate(req.input):
        at = f"input.{i}"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            out.append(_message(item, at))
        elif kind == "function_call":
            call = _call(item, at)
            calls.add(item["call_id"])
            if out and out[-1].role == "assistant" and out[-1].tool_calls and not out[-1].text():
                out[-1].tool_calls.append(call)  # calls of one answer are one assistant turn
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            if item.get("call_id") not in calls:
                raise bad_request(f"{at}: function_call_output answers call_id {item.get('call_id')!r}, but no "
                                  "earlier function_call item has that call_id", param=f"{at}.call_id")
            output = item.get("output")
            if not isinstance(output, str):
                output = _parts_text(output, f"{at}.output")
            out.append(ChatMessage(role="tool", content=output, tool_call_id=item["call_id"]))
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"{at}: input items of type {kind!r} are not supported (message, function_call, "
                              "function_call_output)", param=f"{at}.type")
    if not any(m.role != "system" for m in out):
        raise bad_request("input has no message to answer", param="input")
    return out


def _message(item: dict, at: str) -> ChatMessage:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad_request(f"{at}.role must be user, assistant, system or developer, got {role!r}", param=f"{at}.role")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, f"{at}.content")
    return ChatMessage(role=role, content=text)


def _parts_text(parts: object, at: str) -> str:
    if not isinstance(parts, list):
        raise bad_request(f"{at} must be a string or a list of text parts", param=at)
    texts = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"{at}.{k}: {kind} is not supported: this server serves text models only",
                              param=f"{at}.{k}")
        else:
            raise bad_request(f"{at}.{k}: a content part must be input_text or output_text with a string 'text', "
                              f"got {kind!r}", param=f"{at}.{k}")
    return "".join(texts)


def _call(item: dict, at: str) -> dict:
    if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
        raise bad_request(f"{at}: a function_call item needs string call_id, name and arguments", param=at)
    return {"id": item["call_id"], "type": "function",  # named as the tool was offered to the model
            "function": {"name": visible_name(item.get("namespace"), item["name"]), "arguments": item["arguments"]}}


def visible_name(namespace: str | None, name: str) -> str:
    """The name the model sees for a function of a Responses ``namespace`` tool: its own in
    the default namespace (``functions``), else ``{namespace}__{name}`` (as Codex CLI names
    a namespaced tool for an API without namespaces, so two namespaces' names never clash)."""
    return name if namespace in (None, "", DEFAULT_NAMESPACE) else f"{namespace}{NAMESPACE_SEP}{name}"


def _flat_tools(tools: list) -> tuple[list[dict], dict[str, tuple[str, str]], list[str]]:
    """The function tools of ``tools``, those inside ``namespace`` tools included, as chat
    tools; ``{visible name: (namespace, name)}`` for the namespaced ones; the types dropped."""
    functions, namespaced, dropped = [], {}, []

    def add(tool: dict, namespace: str | None, at: str, about: str = "") -> None:
        if not isinstance(tool.get("name"), str):
            raise bad_request(f"{at}: a function tool needs a string 'name'", param=at)
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        fn["name"] = visible_name(namespace, tool["name"])
        if fn["name"] != tool["name"]:
            namespaced[fn["name"]] = (namespace, tool["name"])
            if about:  # what the namespace is (an MCP server...): the model sees no namespace of its own
                fn["description"] = f"{about}\n\n{fn.get('description', '')}".strip()
        functions.append({"type": "function", "function": fn})

    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            add(tool, None, f"tools.{i}")
        elif kind == "namespace" and isinstance(tool.get("tools"), list):
            for k, nested in enumerate(tool["tools"]):
                nested_kind = nested.get("type") if isinstance(nested, dict) else None
                if nested_kind == "function":
                    add(nested, str(tool.get("name") or ""), f"tools.{i}.tools.{k}",
                        str(tool.get("description") or ""))
                else:
                    dropped.append(f"{nested_kind} (in namespace {tool.get('name')!r})")
        else:
            dropped.append(str(kind))
    return functions, namespaced, dropped


def tools_of(req: ResponsesRequest) -> Tools:
    """Function tools and ``tool_choice`` as the engine's tool calls.

    The function tools inside ``namespace`` tools (Codex CLI's) are offered as function
    tools (:func:`visible_name`); tools of other types (``web_search``, ``custom``,
    ``local_shell``, ``image_generation``...) need a runtime this server does not have: they
    are dropped and named once in the log, so the agent goes on with the tools that work.

    Raises:
        APIError: 400 for a malformed function tool or a ``tool_choice`` naming no given tool.
    """
    openai_tools, namespaced, dropped = _flat_tools(req.tools or [])
    note_ignored("responses", [f"tools of type {kind}" for kind in dropped], why="this server cannot run them; "
                 "dropped from the tools offered")
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                              param="tool_choice")
        choice = {"type": "function", "function": {"name": visible_name(choice.get("namespace"), choice["name"])}}
    try:
        listed, active = active_tools(openai_tools, choice)
    except APIError as e:  # active_tools speaks chat completions' field names: say it in this API's
        raise bad_request(e.message.replace("tools[", "tools.").replace("].function.", "."),
                          param=e.param) from None
    must_call = choice == "required" or isinstance(choice, dict)
    return Tools(listed=listed, active=active, must_call=must_call, parallel=req.parallel_tool_calls, offered=len(openai_tools),
                 namespaced=namespaced)


def text_format(text: dict | None) -> tuple[str, object] | None:
    """``text.format`` as ``(kind, source)`` for the grammar, or None for plain text.

    Raises:
        APIError: 400 for an unknown format type, or ``json_schema`` without a schema object.
    """
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", None)
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise bad_request("text.format of type json_schema needs a 'schema' object", param="text.format.schema")
        return ("json_schema", schema)
    raise bad_request(f"text.format type {kind!r} is not one of text, json_object, json_schema",
                      param="text.format.type")
