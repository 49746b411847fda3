#!/usr/bin/env python
"""What turning tokens into streamed text costs per token: decoding the whole answer on every
token (what TextStream did) against its incremental decoding, on SmolLM2's tokenizer and a
real greedy answer's ids (the first seed prompt's, re-encoded from its text).

    python scripts/detok_cost.py [--tokens 256,1024,2048]
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's flashdraft

from transformers import AutoTokenizer  # noqa: E402

from flashdraft.prompts import load_prompt_set  # noqa: E402
from flashdraft.stops import TextStream  # noqa: E402
from flashdraft.targets.torch import default_model_path  # noqa: E402


def per_token_us(ids, decode, incremental: bool) -> float:
    stream = TextStream(decode)
    t0 = time.perf_counter()
    for i, t in enumerate(ids):
        if incremental:
            stream.add(t)
        else:
            decode(ids[: i + 1])
    return 1e6 * (time.perf_counter() - t0) / len(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="256,1024,2048")
    args = ap.parse_args()
    g = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    text = load_prompt_set("seed")[0]["prompt"]
    base = tok.encode(text, add_special_tokens=False)

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    print("| answer tokens | whole answer decoded per token (µs/token) | incremental (µs/token) |")
    print("| --- | --- | --- |")
    for n in (int(x) for x in args.tokens.split(",")):
        ids = (base * (n // len(base) + 1))[:n]
        print(f"| {n} | {per_token_us(ids, decode, False):.0f} | {per_token_us(ids, decode, True):.0f} |")


if __name__ == "__main__":
    main()
