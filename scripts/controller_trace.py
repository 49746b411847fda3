"""Trace the adaptive draft-length controller online: per verify step the depth it chose,
the drafts accepted and the step's wall time, then its estimates (``snapshot``).

    .venv/bin/python scripts/controller_trace.py -md runs/block8/drafter-best --prompts seed
    .venv/bin/python scripts/controller_trace.py --spec-type hybrid --prompts sharegpt-heldout --limit 3
    .venv/bin/python scripts/controller_trace.py --spec-type ngram --controller cost -t 2 --expected-only

Per prompt it also prints the rule's expected against the measured: before each step the
controller's own estimate for the depth it chose (tokens the step yields, ``E(d)``, and its
cost, ``c(d)``), summed over the prompt, beside the tokens and seconds the steps took:
expected tokens/s ``ΣE / Σc`` vs measured ``Σ tokens / Σ seconds``.

One engine for all prompts, as a server or ``flashdraft bench`` keeps it, so the estimates
carry from one prompt to the next. Times depend on the machine's load: this explains a
bench run, it does not replace one.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-md", "--spec-draft-model", default=None, help="DFlash drafter (default: the shipped one)")
    p.add_argument("--spec-type", default="dflash", choices=["dflash", "hybrid", "ngram"])
    p.add_argument("--prompts", default="seed")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("-n", "--max-tokens", type=int, default=256)
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("--controller", default="profit", choices=["profit", "cost"],
                   help="--spec-dm-controller (default: profit)")
    p.add_argument("--expected-only", action="store_true", help="print only the expected-vs-measured line per prompt")
    p.add_argument("--show-steps", type=int, default=16, help="first N steps printed per prompt")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    import flashdraft.adaptive as adaptive
    from flashdraft.engine import EngineConfig, load_engine
    from flashdraft.prompts import load_prompt_set
    from flashdraft.sampling import SamplingParams
    from flashdraft.train.evaluate import prompt_ids

    steps: list[tuple[int, int, float]] = []
    expected: list[tuple[float, float, int, float]] = []  # (E(d), c(d) s, tokens, seconds) per step
    update = adaptive.ProfitController.update

    def traced(self, depth, n_accepted, seconds):
        steps.append((depth, n_accepted, round(1e3 * seconds, 1)))
        costs = self.cost_curve()
        if costs is not None:
            expected.append((self.expected_tokens_curve()[depth], costs[depth], n_accepted + 1, seconds))
        return update(self, depth, n_accepted, seconds)

    adaptive.ProfitController.update = traced  # every controller, also the hybrid's per-source ones
    gen = load_engine(EngineConfig(spec_type=args.spec_type, draft_model=args.spec_draft_model,
                                   controller=args.controller))
    for item in load_prompt_set(args.prompts, args.limit):
        steps.clear()
        expected.clear()
        for _ in gen.generate(prompt_ids(gen, item, True), args.max_tokens, SamplingParams()):
            pass
        if expected:
            e, c, n, sec = (sum(x[i] for x in expected) for i in range(4))
            print(f"{item['id']}: expected {e / c:.1f} tok/s ({e / len(expected):.2f} tokens, {1e3 * c / len(expected):.1f} ms "
                  f"a step), measured {n / sec:.1f} tok/s ({n / len(expected):.2f} tokens, "
                  f"{1e3 * sec / len(expected):.1f} ms), {len(expected)} steps")
        if args.expected_only:
            continue
        by_depth: dict[int, list[float]] = {}
        for d, _, ms in steps:
            by_depth.setdefault(d, []).append(ms)
        print(f"{item['id']}: {len(steps)} steps, {sum(d for d, _, _ in steps)} drafted, "
              f"{sum(a for _, a, _ in steps)} accepted")
        print(f"  first steps (depth, accepted, ms): {steps[:args.show_steps]}")
        print("  median ms by depth: " + ", ".join(f"{d}: {statistics.median(v):.1f} ({len(v)})"
                                                 for d, v in sorted(by_depth.items())))
        print(f"  estimates: {json.dumps(gen.controller.snapshot())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
