"""Parser of Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``).

The Messages body becomes the same internal chat request as an OpenAI chat body:

- ``system`` (text or text blocks) -> a system message first; a message of role ``system``
  inside ``messages`` (Claude Code sends one) stays a system message at its place, as
  llama-server hands it to the chat template;
- ``text`` blocks -> the message's text; an assistant's ``tool_use`` blocks -> its tool
  calls; a user's ``tool_result`` blocks -> ``tool`` messages answering those calls, before
  the user's own text (``is_error`` results are marked ``Error:``);
- ``thinking`` / ``redacted_thinking`` blocks of earlier answers are dropped (chat templates
  do not render them); ``thinking.type`` sets the template's ``enable_thinking``;
- ``tools`` (``name``, ``description``, ``input_schema``) and ``tool_choice``
  (``auto`` / ``any`` / ``tool`` / ``none``, ``disable_parallel_tool_use``) -> the same
  constrained tool calls as OpenAI's (lossless with every drafter);
- ``output_config.format`` (``json_schema``) -> the answer's grammar (structured output);
- ``stop_sequences``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stream``
  (the ``anthropic`` SDK sends the sampling fields through ``extra_body``).

Fields that change nothing here (:data:`HARMLESS`, ``output_config.effort``,
``thinking.budget_tokens``) are accepted and named once in the log (:mod:`.ignored`).
As llama-server, ``max_tokens`` may be left out (the server's ``-n``) and an empty
``messages`` list is answered. Images and documents, in a message or inside a
``tool_result``, and server tools are refused with a 400 ("image input is not supported",
llama-server's words for a model without vision; it answers 500).

Source: Anthropic, "Messages" API reference (docs.anthropic.com/en/api/messages).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import Field

from flashdraft.server.errors import APIError, bad_request
from flashdraft.server.ignored import note_ignored
from flashdraft.server.request import GenRequest, Sampling, Tools
from flashdraft.server.schemas import ChatMessage, TokenLimit, _Strict, parse_request
from flashdraft.server.tools import active_tools


#: Messages fields that cannot change the answer here (prompt caching is automatic; there is
#: one machine and one speed; ``context_management`` edits a hosted conversation's stored
#: context, and nothing is stored here): accepted, named once in the log
HARMLESS = ("metadata", "cache_control", "service_tier", "inference_geo", "speed", "user_profile_id", "workspace_id",
            "diagnostics", "context_management")
#: ``output_config`` fields other than ``format`` that a local model has no use for
#: (``effort`` sets how hard a hosted model thinks; a local one decodes as it decodes)
IGNORED_OUTPUT_CONFIG = ("effort",)


class ToolChoice(_Strict):
    """Anthropic ``tool_choice``."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Strict):
    """Anthropic ``thinking``: on or off for templates that know ``enable_thinking``."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)


class MessagesRequest(_Strict):
    """``POST /v1/messages``; ``max_tokens`` optional (llama-server's default ``-n``)."""

    model: str | None = None
    messages: list[dict]
    system: str | list[dict] | None = None
    max_tokens: TokenLimit | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    #: structured output: ``{"format": {"type": "json_schema", "schema": {...}}}``
    output_config: dict | None = None


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a Messages body without the answer's settings."""


def messages(body: bytes) -> GenRequest:
    """``POST /v1/messages`` -> the internal request.

    Raises:
        APIError: 400 for a bad body, a content block of an unsupported type, a
            ``tool_result`` answering no earlier ``tool_use``, a malformed tool or
            ``input_schema``, or a ``tool_choice`` naming no given tool.
    """
    return _request(parse_request(body, MessagesRequest))


def count_tokens(body: bytes) -> GenRequest:
    """``POST /v1/messages/count_tokens`` -> the internal request (its prompt is counted)."""
    return _request(parse_request(body, CountTokensRequest))


def _request(req: MessagesRequest) -> GenRequest:
    extra = dict(req.model_extra or {})
    ignored = [name for name in HARMLESS if name in extra]
    for name in ignored:  # the caller's ids, caching and routing hints: nothing to do with the answer
        extra.pop(name)
    ignored += [f"output_config.{k}" for k in IGNORED_OUTPUT_CONFIG if k in (req.output_config or {})]
    if req.thinking is not None and req.thinking.budget_tokens is not None:
        ignored.append("thinking.budget_tokens")
    note_ignored("messages", ignored)
    kwargs = None
    if req.thinking is not None and req.thinking.type != "adaptive":
        kwargs = {"enable_thinking": req.thinking.type == "enabled"}
    return GenRequest(api="messages", model=req.model, messages=chat_messages(req), max_tokens=req.max_tokens,
                      stream=req.stream, stop=list(req.stop_sequences or []),
                      sampling=Sampling(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p),
                      tools=tools_of(req), constraint=output_format(req.output_config),
                      constraint_param="output_config.format", template_kwargs=kwargs, extra=extra, wire=req)


def output_format(config: dict | None) -> tuple[str, object] | None:
    """``output_config.format`` (structured output) as the answer's grammar, or None.

    ``output_config.effort`` is accepted and ignored (:data:`IGNORED_OUTPUT_CONFIG`).

    Raises:
        APIError: 400 for a format that is not ``json_schema`` with a schema object, or
            other ``output_config`` fields.
    """
    if not config:
        return None
    unknown = set(config) - {"format", *IGNORED_OUTPUT_CONFIG}
    if unknown:
        raise bad_request(f"output_config: {', '.join(sorted(unknown))} not supported (only format and effort)",
                          param="output_config")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict)):
        raise bad_request("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                          param="output_config.format")
    return ("json_schema", fmt["schema"])


def chat_messages(req: MessagesRequest) -> list[ChatMessage]:
    """The conversation as chat messages (see the module's rules). Raises APIError 400."""
    out: list[ChatMessage] = []
    if req.system:
        out.append(ChatMessage(role="system", content=_text(req.system, "system")))
    calls: set[str] = set()  # tool_use ids seen so far: a tool_result must answer one
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant", "system"):
            raise bad_request(f"{where}.role must be 'user', 'assistant' or 'system', got {role!r}",
                              param=f"{where}.role")
        content = m.get("content")
        if role == "system":  # kept at its place, as llama-server passes it on to the chat template
            if not isinstance(content, (str, list)):
                raise bad_request(f"{where}.content must be a string or a list of text blocks",
                                  param=f"{where}.content")
            out.append(ChatMessage(role="system", content=_text(content, f"{where}.content")))
            continue
        if isinstance(content, str):
            out.append(ChatMessage(role=role, content=content))
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or a list of content blocks", param=f"{where}.content")
        texts, tool_calls, results = [], [], []
        for k, block in enumerate(content):
            at = f"{where}.content.{k}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            elif kind == "tool_use" and role == "assistant":
                tool_calls.append(_tool_use(block, at))
                calls.add(block["id"])
            elif kind == "tool_result" and role == "user":
                results.append(_tool_result(block, at, calls))
            elif kind in ("image", "document"):
                raise bad_request(f"{at}: {kind} input is not supported: this server serves text models only",
                                  param=at)
            else:
                allowed = "text, thinking, tool_use" if role == "assistant" else "text, tool_result"
                raise bad_request(f"{at}: a {role} message takes content blocks of type {allowed}; got {kind!r}"
                                  + ("" if kind not in ("text",) else " without a string 'text'"), param=at)
        out += results  # the tools' answers follow the call they answer, then the user's words
        if texts or tool_calls or not results:
            out.append(ChatMessage(role=role, content="".join(texts) if texts else (None if tool_calls else ""),
                                   tool_calls=tool_calls or None))
    if not any(m.role != "system" for m in out):  # llama-server answers an empty conversation too
        out.append(ChatMessage(role="user", content=""))
    return out


def _text(system: str | list[dict], param: str) -> str:
    if isinstance(system, str):
        return system
    parts = []
    for k, block in enumerate(system):
        if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
            raise bad_request(f"{param}.{k} must be a text block ({{\"type\": \"text\", \"text\": ...}})",
                              param=f"{param}.{k}")
        parts.append(block["text"])
    return "\n\n".join(parts)


def _tool_use(block: dict, at: str) -> dict:
    """An assistant's ``tool_use`` block as an OpenAI tool call (how the history is rendered)."""
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
            or not isinstance(block.get("input"), dict):
        raise bad_request(f"{at}: a tool_use block needs a string 'id', a string 'name' and an object 'input'",
                          param=at)
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def _tool_result(block: dict, at: str, calls: set[str]) -> ChatMessage:
    """A user's ``tool_result`` block as a ``tool`` message."""
    call_id = block.get("tool_use_id")
    if call_id not in calls:
        raise bad_request(f"{at}: tool_result answers tool_use_id {call_id!r}, but no earlier assistant message "
                          "has a tool_use block with that id", param=f"{at}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):  # an image in a tool's result (a screenshot, a file read) is refused as above
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image", "document"):
                raise bad_request(f"{at}.content.{k}: {kind} input is not supported: this server serves text "
                                  "models only", param=f"{at}.content.{k}")
    text = content if isinstance(content, str) else _text(content, f"{at}.content") if isinstance(content, list) \
        else None
    if text is None:
        raise bad_request(f"{at}.content must be a string or a list of text blocks", param=f"{at}.content")
    if block.get("is_error"):
        text = "Error: " + text
    return ChatMessage(role="tool", content=text, tool_call_id=call_id)


def tools_of(req: MessagesRequest) -> Tools:
    """Anthropic tools and ``tool_choice`` as the engine's tool calls.

    Raises:
        APIError: 400 for a server tool, a tool without a name, an ``input_schema`` that is
            not a JSON schema object, or a ``tool_choice`` naming no given tool.
    """
    tools, choice = req.tools or [], req.tool_choice
    openai_tools = []
    for i, tool in enumerate(tools):
        at = f"tools.{i}"
        if not isinstance(tool, dict):
            raise bad_request(f"{at} must be an object", param=at)
        if tool.get("type") not in (None, "custom"):
            raise bad_request(f"{at}: server tools ({tool.get('type')!r}) are not supported; give a client tool "
                              "with name, description and input_schema", param=f"{at}.type")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise bad_request(f"{at}.input_schema must be a JSON schema object with \"type\": \"object\"",
                              param=f"{at}.input_schema")
        openai_tools.append({"type": "function", "function": {"name": tool.get("name"),
                                                              "description": tool.get("description", ""),
                                                              "parameters": schema}})
    if choice is None or choice.type == "auto":
        oa_choice: object = "auto"
    elif choice.type == "any":
        oa_choice = "required"
    elif choice.type == "none":
        oa_choice = "none"
    else:
        if not choice.name:
            raise bad_request("tool_choice of type 'tool' needs a 'name'", param="tool_choice.name")
        oa_choice = {"type": "function", "function": {"name": choice.name}}
    try:
        listed, active = active_tools(openai_tools, oa_choice)
    except APIError as e:  # active_tools speaks OpenAI's field names: say it in this API's
        message = e.message.replace(".function.name", ".name").replace(".function.parameters", ".input_schema")
        raise bad_request(message, param="tool_choice" if "tool_choice" in message else "tools") from None
    must_call = choice is not None and choice.type in ("any", "tool")
    parallel = False if choice is not None and choice.disable_parallel_tool_use else None
    return Tools(listed=listed, active=active, must_call=must_call, parallel=parallel, offered=len(tools))
