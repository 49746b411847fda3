"""OpenAI tool calls on ``/v1/chat/completions``: a documented prompt, a grammar, a parser.

The model is told about the tools in a system message (:func:`tool_prompt`) and answers a
call as one JSON object, ``{"tool_calls": [{"name": ..., "arguments": {...}}]}``, which the
grammar (:func:`tool_grammar`) holds to the tools' names and parameter schemas, so the
arguments always parse and validate. With ``tool_choice: "auto"`` the answer is either that
object or plain text not starting with ``{``; ``"required"`` or a named function allows only
calls. The same constraint runs with every drafter (lossless, see :mod:`flashdraft.constraints`).

Earlier turns are written back the same way: an assistant message's ``tool_calls`` become
that JSON object, a ``tool`` message's content is the result the model reads.

The format is this server's own for every model (the model's chat template renders the
messages; its own tool syntax, where it has one, is not used): small models follow a short
JSON instruction well, and one format keeps parsing exact.
"""

from __future__ import annotations

import json
import uuid

from flashdraft.constraints import close_objects
from flashdraft.server.errors import bad_request

#: the probe's two calls (names no real tool is likely to use, so finding them means the
#: template wrote them)
_PROBE_CALLS = ("flashdraft_probe_first", "flashdraft_probe_second")


def active_tools(tools: list[dict] | None, tool_choice: object) -> tuple[list[dict], list[dict]]:
    """``(listed, callable)``: the tools the prompt lists and those the answer may call, each
    ``[{"name", "description", "parameters"}]``. ``listed`` is every tool given (none with
    ``tool_choice: "none"``) whatever the choice, so the prompt's preamble, and the prompt
    cache behind it, stay the same when a client varies ``tool_choice``; a named choice
    narrows only ``callable`` (the grammar).

    Raises:
        APIError: 400 for a malformed tool, or a ``tool_choice`` naming a function
            that is not among ``tools`` (too many tools: :mod:`.limits`, before this).
    """
    if not tools or tool_choice == "none":
        if isinstance(tool_choice, dict) or tool_choice == "required":
            raise bad_request("tool_choice asks for a tool call but no tools were given", param="tool_choice")
        return [], []
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string", param="tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        out.append({"name": name, "description": fn.get("description", ""), "parameters": params})
    callable_ = out
    if isinstance(tool_choice, dict):
        wanted = (tool_choice.get("function") or {}).get("name")
        callable_ = [t for t in out if t["name"] == wanted]
        if not callable_:
            raise bad_request(f"tool_choice names {wanted!r}, which is not among the tools", param="tool_choice")
    elif tool_choice not in (None, "auto", "required"):
        raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                          "{\"name\": ...}}", param="tool_choice")
    return out, callable_


def tool_prompt(tools: list[dict]) -> str:
    """The system text that lists the tools, one compact JSON object per line, and the call
    format. The same bytes for any ``tool_choice``: whether the answer must call (or which
    tool) is the grammar's to enforce, so a client that varies it keeps its prompt cache."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False, separators=(",", ":")) for t in tools)
    return (f"You can call these tools:\n{listing}\nTo call tools, answer with only this JSON object, "
            'nothing else: {"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}; '
            "otherwise answer in plain text.")


def calls_schema(tools: list[dict], parallel: bool) -> dict:
    """JSON schema of a tool-call answer: each call names one tool and matches its parameters."""
    one = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                             "arguments": close_objects(t["parameters"])},
            "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    items = one[0] if len(one) == 1 else {"anyOf": one}
    calls = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    return {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
            "additionalProperties": False}


def tool_grammar(tools: list[dict], must_call: bool, parallel: bool) -> tuple[str, object]:
    """``(kind, source)`` for :func:`~flashdraft.constraints.compile_grammar`: only calls, or
    (``auto``) calls or plain text that does not start with ``{``."""
    schema = calls_schema(tools, parallel)
    if must_call:
        return "json_schema", schema
    return "lark", "start: TEXT | calls\nTEXT: /[^{\\s][\\s\\S]*/\ncalls: %json " + json.dumps(schema)


def parse_calls(text: str) -> list[dict] | None:
    """The answer's tool calls in OpenAI's shape (``id``, ``type``, ``function.name``,
    ``function.arguments`` as a JSON string), or None for a plain-text answer."""
    stripped = text.strip()
    if not stripped.startswith("{"):
        return None
    try:
        calls = json.loads(stripped)["tool_calls"]
    except (ValueError, KeyError, TypeError):
        return None  # cut by max_tokens: not a call the client could run
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in calls]


def supports_parallel_tool_calls(tokenizer, jinja_template: str | None) -> bool:
    """Whether the chat template can write several tool calls in one assistant turn: the
    default of ``parallel_tool_calls``, as llama-server's ``supports_parallel_tool_calls``
    (llama.cpp probes a template the same way: render an assistant message with two calls,
    look for both). A built-in template (``--no-jinja``) or one that fails to render or
    drops the calls (SmolLM2's renders only ``content``) cannot.

    Args:
        tokenizer: a transformers tokenizer (its ``apply_chat_template`` renders the probe).
        jinja_template: the Jinja source in use, or None.
    """
    if not jinja_template:
        return False
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": {"x": i}}}
             for i, name in enumerate(_PROBE_CALLS)]
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=jinja_template, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses tool calls cannot write two
        return False
    return all(name in text for name in _PROBE_CALLS)


def history_message(role: str, content: str, tool_calls: list | None) -> dict:
    """One earlier message as the template renders it: an assistant's calls as the JSON
    answer it gave, a tool result as a ``tool`` turn."""
    if role == "assistant" and tool_calls:
        calls = []
        for c in tool_calls:
            fn = c.get("function", {}) if isinstance(c, dict) else {}
            args = fn.get("arguments", "{}")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except ValueError:
                pass
            calls.append({"name": fn.get("name", ""), "arguments": args})
        return {"role": role, "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)}
    return {"role": role, "content": content}


class CallSniffer:
    """Decides, while an answer streams, whether it is a tool call: an answer that opens with
    ``{`` is one (the grammar allows no other text to start so) and is held back whole, to be
    sent parsed at the end; any other answer streams as it comes.

    Args:
        tools: whether the request offered tools (without, every answer is text).
    """

    def __init__(self, tools: bool):
        self.held = ""  # text not yet sent while it may be a call
        self.calling = False
        self.decided = not tools  # whether the answer's first visible character has been seen

    def feed(self, text: str) -> str:
        """The part of ``text`` to send as text now ("" while held back or calling)."""
        if self.decided and not self.calling:
            return text
        self.held += text
        if self.calling or not self.held.strip():
            return ""
        self.decided = True
        self.calling = self.held.lstrip().startswith("{")
        if self.calling:
            return ""
        text, self.held = self.held, ""
        return text
