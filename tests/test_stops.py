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


def _metaspace_decode(ids: list[int]) -> str:
    """SentencePiece-like: token id 1 is "▁a" (a word with a leading space), 2 is "b", 3 is
    "▁." ; the first token's leading space is dropped, and " ." is cleaned up to "."."""
    pieces = {1: " a", 2: "b", 3: " ."}
    text = "".join(pieces[i] for i in ids)
    return text.removeprefix(" ").replace(" .", ".")


@pytest.mark.parametrize("decode,alphabet", [(_byte_decode, list(EMOJIS.encode())), (_metaspace_decode, [1, 2, 3])])
def test_incremental_text_equals_decoding_everything(decode, alphabet):
    import random

    rng = random.Random(0)
    for _ in range(50):
        stream, ids = TextStream(decode), []
        for _ in range(rng.randint(1, 40)):
            tok = rng.choice(alphabet)
            ids.append(tok)
            stream.add(tok)
            assert stream.text == decode(ids)


def test_incremental_text_on_the_real_tokenizer():
    """SmolLM2's tokenizer (byte-level BPE): random ids, special tokens among them, and a
    real text's ids give every prefix's full decoding at every token."""
    import random
    from pathlib import Path

    from transformers import AutoTokenizer

    from flashdraft.targets.torch import default_model_path

    path = Path(default_model_path())
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    rng = random.Random(0)
    texts = [tok.encode("Hello, wörld! 😀 naïve café — 「日本語」 x = [1, 2]; print(x)\n\tdone. " * 3),
             [rng.randrange(len(tok)) for _ in range(300)]]
    for ids in texts:
        stream = TextStream(decode)
        for i, t in enumerate(ids):
            stream.add(t)
            assert stream.text == decode(ids[:i + 1]), i
