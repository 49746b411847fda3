#!/usr/bin/env python3
"""How close ``--weights q4`` is to the float32 model dequantised from the same GGUF.

Teacher-forces held-out answers (made by ``flashdraft eval --offline``) through both and
compares the next-token distributions at every response position: mean KL(fp32 ‖ q4)
[nats], top-1 agreement, and each one's perplexity of the answer's actual tokens. The q4
side runs in blocks of at most ``QUANT_MAX_ROWS`` rows so that every row goes through the
int4 kernel, as decoding does. Also reports greedy agreement: how many tokens a q4 greedy
answer shares with the fp32 one from the start.

    .venv/bin/python scripts/weights_agreement.py --limit 20
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F


def logits_chunked(target, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[T, V]`` logits of every position, the sequence fed ``chunk`` rows at a time."""
    cache = target.new_cache(ids.shape[0] + 1)
    return torch.cat([target.forward(ids[i:i + chunk], cache, 0)[0] for i in range(0, ids.shape[0], chunk)])


def greedy(target, prompt: torch.Tensor, n: int) -> list[int]:
    cache = target.new_cache(prompt.shape[0] + n + 1)
    logits, _ = target.forward(prompt, cache, prompt.shape[0] - 1)
    out = [int(logits[-1].argmax())]
    for _ in range(n - 1):
        logits, _ = target.forward(torch.tensor(out[-1:]), cache, 0)
        out.append(int(logits[-1].argmax()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heldout", default="datasets/heldout/SmolLM2-135M-Instruct.Q4_1",
                    help="held-out answers root (one directory per set)")
    ap.add_argument("--sets", default="humaneval-t0,sharegpt-heldout-t0")
    ap.add_argument("--limit", type=int, default=20, help="answers per set")
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from flashdraft.fast_forward import QUANT_MAX_ROWS
    from flashdraft.targets.torch import Target
    from flashdraft.train.shards import read_shards

    ref, q4 = Target.load(weights="fp32"), Target.load(weights="q4")
    report = {}
    for name in [s for s in args.sets.split(",") if s]:
        seqs = read_shards(Path(args.heldout) / name)[: args.limit]
        kl_sum = agree = n_pos = 0
        nll = {"fp32": 0.0, "q4": 0.0}
        shared = []
        with torch.inference_mode():
            for _, ids, n_prompt, *_ in seqs:
                a = ref.forward(ids, ref.new_cache(ids.shape[0] + 1), 0)[0][n_prompt - 1:-1]
                b = logits_chunked(q4, ids, QUANT_MAX_ROWS)[n_prompt - 1:-1]
                la, lb = F.log_softmax(a, -1), F.log_softmax(b, -1)
                kl_sum += float((la.exp() * (la - lb)).sum())
                agree += int((a.argmax(-1) == b.argmax(-1)).sum())
                n_pos += a.shape[0]
                tgt = ids[n_prompt:]
                nll["fp32"] -= float(la.gather(1, tgt[:, None]).sum())
                nll["q4"] -= float(lb.gather(1, tgt[:, None]).sum())
                ga, gb = greedy(ref, ids[:n_prompt], args.greedy_tokens), greedy(q4, ids[:n_prompt], args.greedy_tokens)
                shared.append(next((i for i, (x, y) in enumerate(zip(ga, gb)) if x != y), len(ga)))
        report[name] = {"answers": len(seqs), "positions": n_pos, "kl_nats": kl_sum / n_pos, "top1_agreement": agree / n_pos,
                        "ppl_fp32": math.exp(nll["fp32"] / n_pos), "ppl_q4": math.exp(nll["q4"] / n_pos),
                        "greedy_shared_prefix_mean": sum(shared) / len(shared),
                        "greedy_identical": sum(s == args.greedy_tokens for s in shared) / len(shared)}
        print(name, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in report[name].items()}))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
