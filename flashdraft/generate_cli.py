"""``flashdraft generate``: one prompt, the text streamed to stdout (or one JSON object)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from flashdraft.engine import EngineConfig, load_engine
from flashdraft.flags import add_model_arguments
from flashdraft.generate import generate_text
from flashdraft.sampling import SamplingParams
from flashdraft.threads import apply_threads, describe


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``flashdraft generate``."""
    add_model_arguments(p)
    p.add_argument("-p", "--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("-n", "--max-tokens", type=int, default=256, help="max tokens to generate (default: 256)")
    p.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="top-k at temperature > 0, 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p at temperature > 0, 1.0 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p at temperature > 0, 0.0 = off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: None = random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, timings")


def run(args) -> int:
    """``flashdraft generate``: prints the text (or JSON with ``--json``).

    Raises:
        ValueError: ``--max-tokens`` below 1, or settings the engine refuses.
    """
    logging.getLogger("flashdraft").info("%s", describe(*apply_threads(args.threads)))
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, seed=args.seed)
    gen = load_engine(EngineConfig.from_args(args))
    t = gen.target
    ids = t.chat_prompt_ids([{"role": "user", "content": args.prompt}]) if args.chat else t.encode(args.prompt)
    if args.json:
        text, token_ids, finish, timings = generate_text(gen, ids, args.max_tokens, params, stop=args.stop)
        print(json.dumps({"text": text, "token_ids": token_ids, "finish_reason": finish,
                          "timings": timings.to_dict(gen.drafting)}))
        return 0
    timings = None
    for step in gen.generate(ids, args.max_tokens, params, stop=args.stop):
        sys.stdout.write(step.text)
        sys.stdout.flush()
        timings = step.timings or timings
    d = timings.to_dict(gen.drafting)
    extra = f", draft {d['draft_n_accepted']}/{d['draft_n']} accepted, tau {d['acceptance_length']:.2f}, " \
        f"mean depth {d['draft_depth']:.1f}" if gen.drafting else ""
    print(f"\n\n[{d['predicted_n']} tokens, {d['predicted_per_second']:.1f} tokens/s{extra}]", file=sys.stderr)
    return 0
