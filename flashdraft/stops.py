"""Turning generated token ids into text with stop strings, safe for streaming.

A stop string may span several tokens and several verify blocks; text that could still
turn out to be the start of a stop string is held back, so nothing after a stop is ever
streamed (and tokens after it are never counted).
"""

from __future__ import annotations

from typing import Callable


class TextStream:
    """Accumulates tokens one at a time; finds stop strings; yields stream-safe deltas.

    Args:
        decode: ``list[int] -> str`` of the model's tokenizer.
        stop: stop strings (empty strings are ignored).
    """

    #: tokens decoded again before the new ones, as the tokenizer's context
    CONTEXT_TOKENS = 4

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str] | tuple[str, ...] = ()):
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0  # characters of ``text`` already handed out
        self.stopped = False
        # incremental decoding: text of token_ids[:_read] is final (_final); a few tokens
        # before it (_window on) are decoded again with each new token as context
        self._final = ""
        self._window = self._read = 0
        self._window_text = ""  # decode(token_ids[_window:_read])

    def _decode_new(self) -> str:
        """The text of every token so far, decoding only the tokens since the last complete
        character and a few before them as context: what ``decode(token_ids)`` gives, at a
        cost that does not grow with the answer (decoding the whole answer on every token cost
        36 µs a token at 256 tokens, 278 at 2,048; this costs 7: docs/results/detok-cost.txt).

        The context tokens keep what a tokenizer does at a boundary (SentencePiece's leading
        space, byte fallback); where the window's text does not extend its context's (a
        clean-up rule across the boundary), the whole answer is decoded instead."""
        ids = self.token_ids
        text = self.decode(ids[self._window:])
        if not text.startswith(self._window_text):
            whole = self.decode(ids)  # exact, and rare: start the window over from here
            if not whole.endswith("\ufffd"):
                self._final, self._window, self._read, self._window_text = whole, len(ids), len(ids), ""
            return whole
        out = self._final + text[len(self._window_text):]
        if not text.endswith("\ufffd"):  # a whole character: the text so far is final
            keep = max(self._read, len(ids) - self.CONTEXT_TOKENS)
            self._final, self._read = out, len(ids)
            self._window_text = self.decode(ids[keep:]) if keep < len(ids) else ""
            self._window = keep
        return out

    def add(self, token_id: int) -> bool:
        """Append one token. Returns True when a stop string is now complete; then the
        token is kept (it completed the stop string) and ``text`` is cut before the stop."""
        self.token_ids.append(token_id)
        self.text = self._decode_new()
        for s in self.stop:
            # only the tail can contain a new match: earlier text was checked already
            start = max(0, self.emitted - len(s))
            idx = self.text.find(s, start)
            if idx != -1:
                self.text = self.text[:idx]
                self.stopped = True
        return self.stopped

    def _broken_tail(self) -> int:
        """Trailing U+FFFD characters: the decoding of an incomplete UTF-8 sequence."""
        text, n = self.text, 0
        while n < len(text) and text[len(text) - n - 1] == "\ufffd":
            n += 1
        return n

    def _holdback(self) -> int:
        """Characters at the end of ``text`` that must wait: an incomplete UTF-8 sequence
        (decoded as U+FFFD) or a suffix that is a prefix of a stop string."""
        broken = self._broken_tail()
        text, hold = self.text[: len(self.text) - broken], 0
        # a stop string may go on in the broken character: look before it
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return broken + hold

    def delta(self, final: bool = False) -> str:
        """Text not yet handed out that can no longer change (all of it when ``final``, but
        for a broken character at the very end).

        The last answer of a length stop, a cancellation or a stop string may end inside a
        multi-byte character (its last token holds the first bytes only); the tokenizer
        decodes those bytes as U+FFFD, which is never handed out: the answer ends at the
        last whole character."""
        if final or self.stopped:
            end = len(self.text) - self._broken_tail()
        else:
            end = len(self.text) - self._holdback()
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
