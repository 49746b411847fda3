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

from flashdraft.server.errors import bad_request


def active_tools(tools: list[dict] | None, tool_choice: object) -> list[dict]:
    """The tools the answer may call: ``[{"name", "description", "parameters"}]``.

    Raises:
        APIError: 400 for a malformed tool, or a ``tool_choice`` naming a function
            that is not among ``tools`` (too many tools: :mod:`.limits`, before this).
    """
    if not tools or tool_choice == "none":
        if isinstance(tool_choice, dict) or tool_choice == "required":
            raise bad_request("tool_choice asks for a tool call but no tools were given", param="tool_choice")
        return []
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
    if isinstance(tool_choice, dict):
        wanted = (tool_choice.get("function") or {}).get("name")
        out = [t for t in out if t["name"] == wanted]
        if not out:
            raise bad_request(f"tool_choice names {wanted!r}, which is not among the tools", param="tool_choice")
    elif tool_choice not in (None, "auto", "required"):
        raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                          "{\"name\": ...}}", param="tool_choice")
    return out


def tool_prompt(tools: list[dict], must_call: bool) -> str:
    """The system text that describes the tools and the answer format."""
    listing = json.dumps(tools, ensure_ascii=False, indent=1)
    when = ("Answer with a tool call." if must_call else
            "If a tool helps, answer with a tool call; otherwise answer normally in plain text.")
    return (f"You can call these tools:\n{listing}\n{when} A tool call is only this JSON object, nothing "
            'else: {"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}')


#: schema keywords whose value is one subschema, a list of them, or a name -> subschema map
_SUBSCHEMA = ("items", "additionalItems", "contains", "additionalProperties", "propertyNames", "if", "then", "else")
_SUBSCHEMAS = ("prefixItems", "anyOf", "oneOf")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def closed(schema: object) -> object:
    """A copy of a tool's parameter schema in which an object that lists ``properties``
    takes no others, unless it says so with ``additionalProperties`` (or
    ``patternProperties``). That is how llama-server constrains a tool call (its
    json-schema-to-grammar), and what a tool expects: a call with only the arguments it
    declares. Parts of an ``allOf`` are left as given (closing each would refuse the
    others' properties)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA or key in _SUBSCHEMAS:
            out[key] = closed(value)
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed(sub) for name, sub in value.items()}
        else:
            out[key] = value
    open_by_choice = {"additionalProperties", "patternProperties", "allOf"} & set(out)
    if isinstance(out.get("properties"), dict) and not open_by_choice:
        out["additionalProperties"] = False
    return out


def calls_schema(tools: list[dict], parallel: bool) -> dict:
    """JSON schema of a tool-call answer: each call names one tool and matches its parameters
    (:func:`closed`: only the properties they list)."""
    one = [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": closed(t["parameters"])},
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
