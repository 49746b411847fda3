"""Stream-safe text: stop strings held back across tokens, and no broken character at any cut."""

from __future__ import annotations

import pytest

from flashdraft.stops import TextStream

EMOJIS = "ok 😀🎉 done ñ"


def _byte_decode(ids: list[int]) -> str:
    """A byte-level "tokenizer": token id = one byte (how BPE models split rare characters)."""
    return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("cut", range(1, len(EMOJIS.encode()) + 1))
def test_a_cut_at_any_byte_returns_whole_characters(cut):
    data = EMOJIS.encode()
    stream, streamed = TextStream(_byte_decode), []
    for b in data[:cut]:
        stream.add(b)
        streamed.append(stream.delta())
    streamed.append(stream.delta(final=True))  # a length stop (or a cancellation) here
    text = "".join(streamed)
    assert "\ufffd" not in text
    assert EMOJIS.startswith(text)
    # everything up to the last whole character is there
    assert len(text.encode()) > cut - 4


@pytest.mark.parametrize("stop", ["🎉", " done", "ñ", "😀🎉"])
def test_stop_strings_next_to_multibyte_characters(stop):
    stream, out = TextStream(_byte_decode, [stop]), []
    for b in EMOJIS.encode():
        if stream.add(b):
            break
        out.append(stream.delta())
    out.append(stream.delta(final=True))
    text = "".join(out)
    assert text == EMOJIS[: EMOJIS.index(stop)]


def test_whole_text_is_unchanged():
    stream = TextStream(_byte_decode)
    for b in EMOJIS.encode():
        stream.add(b)
    assert stream.delta(final=True) == EMOJIS
