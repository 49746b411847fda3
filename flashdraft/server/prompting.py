"""Requests to prompt token ids, and the tokenizer endpoints' text <-> ids.

Runs on the event-loop thread while the worker decodes on its own thread, so it uses its
own copy of the tokenizer: a Rust fast tokenizer may refuse concurrent use from two
threads ("Already borrowed") when one call changes its padding/truncation state.
Raw prompts (``/completion``, ``/v1/completions``, ``/tokenize``) follow the target's
encoding (:meth:`flashdraft.targets.torch.Target.encode`: no special tokens added; special-token
strings in the text are parsed as special tokens, llama-server's ``parse_special``), so the
server and ``flashdraft generate`` give the same ids for the same text. Chat messages are
different: only the template's markup may become special tokens, message content is always
plain text (:mod:`.chat_templates`), so no message can speak as another role.
"""

from __future__ import annotations

import copy
import functools

from flashdraft.server import chat_templates
from flashdraft.server.errors import bad_request
from flashdraft.server.schemas import ChatMessage
from flashdraft.targets.torch import Target

#: OpenAI's newer role names mapped to what chat templates know
ROLE_ALIASES = {"developer": "system"}


class PromptBuilder:
    """Builds prompt token ids for one target.

    Args:
        target: the loaded target (only its tokenizer and vocabulary size are used).
        template_kwargs: variables every chat template render gets (e.g.
            ``{"enable_thinking": False}`` from ``--reasoning off``).
        template: ``(kind, value)`` from :func:`~flashdraft.server.chat_templates.resolve_template`:
            the model's Jinja template (default), a given one, or a built-in format.
    """

    def __init__(self, target: Target, template_kwargs: dict | None = None,
                 template: tuple[str, str | None] = ("jinja", None)):
        self.tokenizer = copy.deepcopy(target.tokenizer)
        self.vocab_size = target.vocab_size
        self.template_kwargs = dict(template_kwargs or {})
        model_template = getattr(self.tokenizer, "chat_template", None)
        model_template = model_template if isinstance(model_template, str) else None
        kind, value = template
        if kind == "builtin":
            self.builtin: str | None = value or chat_templates.detect_builtin(model_template)
            self.jinja: str | None = None
        else:
            self.builtin, self.jinja = None, value or model_template
        self.special_tokens = [t for t in getattr(self.tokenizer, "all_special_tokens", []) if t]
        self.special_tokens += [t.content for t in getattr(self.tokenizer, "added_tokens_decoder", {}).values()
                                if getattr(t, "special", False) and t.content not in self.special_tokens]

    @property
    def has_chat_template(self) -> bool:
        return self.builtin is not None or bool(self.jinja)

    @functools.cached_property
    def parallel_tool_calls(self) -> bool:
        """Whether the template can write several tool calls in one turn (the default of a
        request's ``parallel_tool_calls``; probed once)."""
        from flashdraft.server.tools import supports_parallel_tool_calls

        return supports_parallel_tool_calls(self.tokenizer, self.jinja)

    @property
    def chat_template(self) -> str | None:
        """The Jinja template in use, or the built-in format's name."""
        return self.jinja if self.builtin is None else self.builtin

    def chat(self, messages: list[ChatMessage], template_kwargs: dict | None = None,
             system: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[int]:
        """Token ids of ``messages`` rendered with the chat template (see :meth:`render`).

        Raises:
            APIError: 400 as :meth:`render`.
        """
        return self.encode_segments(self.render(messages, template_kwargs, system, add_generation_prompt,
                                                continue_final_message))

    def render(self, messages: list[ChatMessage], template_kwargs: dict | None = None,
               system: str | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> chat_templates.Segments:
        """``messages`` rendered with the chat template, as ``(text, is_content)`` segments.

        llama-server's rules for the end of the conversation: a last message from the
        assistant is a *prefill* that the answer continues (the turns before it are
        rendered with the assistant prefix, then its content follows, left open);
        ``continue_final_message: true`` (vLLM's name) asks for that explicitly and needs
        ``add_generation_prompt: false``; ``add_generation_prompt: false`` alone renders
        the conversation without the assistant prefix.

        Raises:
            APIError: 400 when the model has no chat template, the template rejects the
                conversation (e.g. roles that do not alternate), or the two flags conflict.
        """
        if not self.has_chat_template:
            raise bad_request("this model has no chat template; use /v1/completions or /completion "
                              "with a plain prompt", param="messages")
        from flashdraft.server.tools import history_message

        last_is_prefill = messages[-1].role == "assistant" and not messages[-1].tool_calls
        if continue_final_message:  # asked for: the flags must agree (llama-server, vLLM)
            if add_generation_prompt:
                raise bad_request("cannot set both add_generation_prompt and continue_final_message to true",
                                  param="add_generation_prompt")
            if not last_is_prefill:
                raise bad_request("continue_final_message needs a last message from the assistant",
                                  param="continue_final_message")
        # a prefill's text parts are joined by blank lines, as llama-server continues them
        prefill = messages[-1].text("\n\n") if last_is_prefill else None
        head = messages[:-1] if prefill is not None else messages
        rendered = [history_message(ROLE_ALIASES.get(m.role, m.role), m.text(), m.tool_calls) for m in head]
        if system:  # server-written instructions (the tool list): first in the system turn
            if rendered and rendered[0]["role"] == "system":
                rendered[0] = {"role": "system", "content": system + "\n\n" + rendered[0]["content"]}
            else:
                rendered.insert(0, {"role": "system", "content": system})
        # a prefill opens the assistant turn: the turns before it end with the assistant prefix
        with_prefix = add_generation_prompt or prefill is not None
        segments = self._render(rendered, {**self.template_kwargs, **(template_kwargs or {})}, with_prefix)
        if prefill:
            segments.append((prefill, True))
        return segments

    def _render(self, rendered: list[dict], kwargs: dict, add_generation_prompt: bool) -> chat_templates.Segments:
        if self.builtin is not None:
            return self.bos_segment() + chat_templates.BUILTIN[self.builtin](rendered, add_generation_prompt)
        try:
            text = self.tokenizer.apply_chat_template(rendered, chat_template=self.jinja, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # jinja2 TemplateError from raise_exception(...) in the template
            raise bad_request(f"the chat template rejected these messages: {e}", param="messages") from None
        segments, missing = chat_templates.split_contents(text, [m["content"] for m in rendered])
        for i in missing:  # rewritten by the template: only safe without special-token text
            if any(tok in rendered[i]["content"] for tok in self.special_tokens):
                raise bad_request(f"messages[{i}]: the chat template rewrites this message's content, so the "
                                  "special-token text in it could not be kept as plain text; remove it",
                                  param="messages")
        return segments

    def bos_segment(self) -> chat_templates.Segments:
        """The BOS markup a built-in template starts with: the tokenizer's own BOS when it
        adds one to every text (llama-server adds it at tokenisation), else nothing. Jinja
        templates write their own."""
        bos = getattr(self.tokenizer, "bos_token", None)
        if bos and getattr(self.tokenizer, "add_bos_token", False):
            return [(bos, False)]
        return []

    def text(self, segments: chat_templates.Segments) -> str:
        """The rendered prompt as one string (``/apply-template``)."""
        return "".join(text for text, _ in segments)

    def encode_segments(self, segments: list[tuple[str, bool]]) -> list[int]:
        """Ids of rendered chat segments: markup with special-token parsing, content without."""
        ids: list[int] = []
        for text, is_content in segments:
            if text:
                ids += self.tokenizer(text, add_special_tokens=False, split_special_tokens=is_content)["input_ids"]
        return ids

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of ``text`` (``add_special``: add BOS/EOS the tokenizer would add)."""
        return list(self.tokenizer(text, add_special_tokens=add_special)["input_ids"])

    def prompt(self, prompt: str | list[int | str], param: str = "prompt") -> list[int]:
        """Ids of a text prompt, or of token ids (checked against the vocabulary) mixed with
        text pieces (each encoded and spliced in place).

        Raises:
            APIError: 400 for an empty prompt or a token id outside the vocabulary.
        """
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        else:
            ids = []
            for part in prompt:
                ids += self.encode(part) if isinstance(part, str) else [part]
            self.check_ids(ids, param)
        if not ids:
            raise bad_request("the prompt is empty", param=param)
        return ids

    def check_ids(self, ids: list[int], param: str = "tokens") -> list[int]:
        """Return ``ids`` if all lie in ``[0, vocab_size)``; else raise APIError 400."""
        for i, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise bad_request(f"token id {t} at index {i} is outside the vocabulary [0, {self.vocab_size})",
                                  param=param)
        return list(ids)

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        """Text of ``ids``; ``skip_special`` drops special tokens as generated text does."""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def piece(self, token_id: int) -> str:
        """The text of one token, special tokens included (for ``/tokenize`` pieces)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def piece_and_bytes(self, token_id: int) -> tuple[str, list[int]]:
        """``(text, raw bytes as ints)`` of one token, for log-probability entries."""
        text = self.piece(token_id)
        raw = token_bytes(self.tokenizer, token_id)
        return text, list(raw if raw is not None else text.encode("utf-8"))

    def piece_or_bytes(self, token_id: int) -> str | list[int]:
        """:meth:`piece`, or the token's bytes as a list of ints when they are not whole
        UTF-8 (a byte-level token holding part of a character)."""
        raw = token_bytes(self.tokenizer, token_id)
        if raw is None:
            return self.piece(token_id)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return list(raw)
        return self.piece(token_id)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, printable character -> byte (its published table)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


_BYTE_DECODER = _byte_decoder()


def token_bytes(tokenizer, token_id: int) -> bytes | None:
    """The raw bytes of one token: byte-level BPE (GPT-2 alphabet) or SentencePiece byte
    fallback (``<0xE2>``); None when the vocabulary is neither (the decoded text is then exact)."""
    token = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(token, str):
        return None
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            return None
    if token and all(ch in _BYTE_DECODER for ch in token):
        return bytes(_BYTE_DECODER[ch] for ch in token)
    return None
