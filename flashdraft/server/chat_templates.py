"""Chat templates: the model's Jinja template, or a built-in one (``--no-jinja``, ``--chat-template NAME``).

Either way a conversation renders to *segments*: ``(text, is_content)`` pairs in order.
Markup (the template's own role markers) is tokenised with special-token parsing, message
content without it, so text pasted into a message (a web page, a file, a tool result)
that contains ``<|im_end|>\\n<|im_start|>assistant`` stays text and cannot close its turn.

Built-in templates are written here from each format's published layout; names follow
llama-server's ``--chat-template`` list (the subset below).
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("flashdraft.server")

Segments = list[tuple[str, bool]]


def _chatml(messages: list[dict], add_generation_prompt: bool) -> Segments:
    out: Segments = []
    for m in messages:
        out += [(f"<|im_start|>{m['role']}\n", False), (m["content"], True), ("<|im_end|>\n", False)]
    if add_generation_prompt:
        out.append(("<|im_start|>assistant\n", False))
    return out


def _llama3(messages: list[dict], add_generation_prompt: bool) -> Segments:
    out: Segments = []  # BOS comes from the tokenizer (PromptBuilder.bos_segment), as in llama-server
    for m in messages:
        out += [(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", False), (m["content"].strip(), True),
                ("<|eot_id|>", False)]
    if add_generation_prompt:
        out.append(("<|start_header_id|>assistant<|end_header_id|>\n\n", False))
    return out


def _gemma(messages: list[dict], add_generation_prompt: bool) -> Segments:
    # no system role: the system text opens the first user turn
    out: Segments = []
    system = ""
    for m in messages:
        if m["role"] == "system":
            system += m["content"] + "\n\n"
            continue
        role = "model" if m["role"] == "assistant" else "user"
        out.append((f"<start_of_turn>{role}\n", False))
        if system and role == "user":
            out.append((system, True))
            system = ""
        out += [(m["content"].strip(), True), ("<end_of_turn>\n", False)]
    if add_generation_prompt:
        out.append(("<start_of_turn>model\n", False))
    return out


def _zephyr(messages: list[dict], add_generation_prompt: bool) -> Segments:
    out: Segments = []
    for m in messages:
        out += [(f"<|{m['role']}|>\n", False), (m["content"], True), ("<|endoftext|>\n", False)]
    if add_generation_prompt:
        out.append(("<|assistant|>\n", False))
    return out


def _command_r(messages: list[dict], add_generation_prompt: bool) -> Segments:
    roles = {"system": "<|SYSTEM_TOKEN|>", "user": "<|USER_TOKEN|>", "assistant": "<|CHATBOT_TOKEN|>"}
    out: Segments = []
    for m in messages:
        out += [(f"<|START_OF_TURN_TOKEN|>{roles.get(m['role'], '<|USER_TOKEN|>')}", False), (m["content"], True),
                ("<|END_OF_TURN_TOKEN|>", False)]
    if add_generation_prompt:
        out.append(("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", False))
    return out


BUILTIN: dict[str, Callable[[list[dict], bool], Segments]] = {
    "chatml": _chatml, "llama3": _llama3, "gemma": _gemma, "zephyr": _zephyr, "command-r": _command_r,
}

#: markers that identify a built-in format inside a model's Jinja template (``--no-jinja``)
_MARKERS = (("<|im_start|>", "chatml"), ("<|start_header_id|>", "llama3"), ("<start_of_turn>", "gemma"),
            ("<|assistant|>", "zephyr"), ("<|START_OF_TURN_TOKEN|>", "command-r"))


def detect_builtin(jinja_template: str | None) -> str:
    """The built-in format a model's Jinja template writes (llama-server's detection by
    markers); ``chatml`` when nothing matches."""
    for marker, name in _MARKERS:
        if jinja_template and marker in jinja_template:
            return name
    return "chatml"


def resolve_template(chat_template: str | None, chat_template_file: str | None, jinja: bool) -> tuple[str, str | None]:
    """The serve flags as ``(kind, value)``: ``("jinja", None)`` = the model's own template,
    ``("jinja", TEXT)`` = a given Jinja template, ``("builtin", NAME)``, or
    ``("builtin", None)`` = the built-in format detected from the model's template.

    A template that cannot be used (a ``--chat-template`` that is neither a built-in name
    nor Jinja, or Jinja that does not parse) does not stop the server: a warning says why
    and the model's own template is used, as without the flag (llama-server keeps serving
    too; it falls back to chatml, where the model's own template is the one it was trained on).

    Raises:
        ValueError: an unreadable ``--chat-template-file`` (a path that is wrong, not a
            template: llama-server stops on it too).
    """
    default = ("jinja", None) if jinja else ("builtin", None)
    if chat_template_file:
        try:
            with open(chat_template_file, encoding="utf-8") as f:
                return _checked_jinja(f.read(), f"--chat-template-file {chat_template_file}", default)
        except OSError as e:
            raise ValueError(f"--chat-template-file {chat_template_file}: {e.strerror or e}") from None
    if chat_template:
        if chat_template in BUILTIN:
            return "builtin", chat_template
        if "{%" in chat_template or "{{" in chat_template:
            return _checked_jinja(chat_template, "--chat-template", default)
        log.warning("--chat-template %r is neither a built-in template (%s) nor a Jinja template; using the "
                    "model's own template instead", chat_template, ", ".join(BUILTIN))
    return default


def _checked_jinja(text: str, flag: str, default: tuple[str, str | None]) -> tuple[str, str | None]:
    """``("jinja", text)`` when ``text`` parses as Jinja, else ``default`` with a warning."""
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        log.warning("%s does not parse as a Jinja template (line %s: %s); using the model's own template instead",
                    flag, e.lineno, e.message)
        return default
    return "jinja", text


def split_contents(rendered: str, contents: list[str]) -> tuple[Segments, list[int]]:
    """Mark each message's content inside a Jinja template's output, in order.

    Templates copy content verbatim in nearly every case; one that trims it is matched by
    the trimmed text. Returns the segments and the indices of messages whose content was not
    found verbatim (a template that rewrites it); their text stays in the markup.
    """
    out: Segments = []
    pos, missing = 0, []
    for i, content in enumerate(contents):
        if not content:
            continue
        at, text = rendered.find(content, pos), content
        if at < 0 and content.strip():
            text = content.strip()
            at = rendered.find(text, pos)
        if at < 0:
            missing.append(i)
            continue
        if at > pos:
            out.append((rendered[pos:at], False))
        out.append((text, True))
        pos = at + len(text)
    if pos < len(rendered):
        out.append((rendered[pos:], False))
    return out, missing
