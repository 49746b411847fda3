"""Try each of llama-server's n-gram speculative modes once, to pick ``llama-server-lookup``'s.

Runs llama-server (``make llama-peer``) plain and with every ``--spec-type ngram-*`` at its
defaults on the first ``--limit`` prompts of each set, greedy, and prints decode tokens/s
(llama-server's ``predicted_n / predicted_ms`` over all prompts), drafts, accepted drafts and
whether the greedy tokens equal the plain run's. One pass: a choice, not a measurement.

    python scripts/llama_server_lookup_trial.py --limit 2 -n 256 -t 1
"""

from __future__ import annotations

import argparse

from transformers import AutoTokenizer

from flashdraft.bench.llama_server import INSTALL_HINT, LlamaServerProcess, find_binary
from flashdraft.prompts import load_prompt_set
from flashdraft.targets.torch import default_model_path

MODES = ("none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sets", default="seed,sharegpt-heldout,humaneval")
    p.add_argument("--limit", type=int, default=2)
    p.add_argument("-n", "--max-tokens", type=int, default=256)
    p.add_argument("-t", "--threads", type=int, default=1)
    args = p.parse_args()
    binary = find_binary()
    if binary is None:
        raise SystemExit(f"no llama-server binary ({INSTALL_HINT})")
    gguf = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    prompts = []
    for s in args.sets.split(","):
        for item in load_prompt_set(s, args.limit):
            text = tok.apply_chat_template([{"role": "user", "content": item["prompt"]}], tokenize=False,
                                           add_generation_prompt=True)
            prompts.append((item["id"], tok.encode(text, add_special_tokens=False)))
    plain: dict[str, list[int]] = {}
    print(f"{len(prompts)} prompts, {args.max_tokens} tokens, -t {args.threads}")
    print("| mode | decode tok/s | drafted | accepted | same greedy tokens as plain |")
    print("| --- | --- | --- | --- | --- |")
    for mode in MODES:
        extra = [] if mode == "none" else ["--spec-type", mode]
        server = LlamaServerProcess(binary, gguf, args.threads, 4096, extra)
        n = ms = drafted = accepted = same = 0
        try:
            for pid, ids in prompts:
                a = server.post("/completion", {"prompt": ids, "n_predict": args.max_tokens, "temperature": 0,
                                                "cache_prompt": False, "return_tokens": True})
                t = a["timings"]
                n, ms = n + t["predicted_n"], ms + t["predicted_ms"]
                drafted, accepted = drafted + t.get("draft_n", 0), accepted + t.get("draft_n_accepted", 0)
                if mode == "none":
                    plain[pid] = a["tokens"]
                same += a["tokens"] == plain[pid]
        finally:
            server.close()
        print(f"| {mode} | {1e3 * n / ms:.1f} | {drafted} | {accepted} | {same}/{len(prompts)} |")


if __name__ == "__main__":
    main()
