"""Per-token cost of the grammar mask on this CPU: llguidance vs xgrammar, SmolLM2's tokenizer.

For each engine: compile a JSON schema (and a GBNF grammar), then walk a fixed valid answer
token by token, computing the next-token mask before each token and advancing the matcher.
Reports compile time and mean / p90 microseconds per mask. Used to pick the grammar engine
(docs/structured-output.md).

    python scripts/grammar_mask_cost.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}}, "required": ["name", "age", "tags", "address"]}
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"],
                     "address": {"city": "London", "zip": "W1"}})
GBNF = 'root ::= "yes" | "no" | item+\nitem ::= [a-z]+ " "'
GBNF_ANSWER = "abc def ghi "


def stats(us: list[float]) -> str:
    us = sorted(us)
    return f"mean {statistics.mean(us):7.1f} us, p90 {us[int(0.9 * (len(us) - 1))]:7.1f} us"


def llguidance_run(tok, hf, text_ids, grammar_kind, grammar):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf)
    t1 = time.perf_counter()
    g = llguidance.grammar_from(grammar_kind, grammar)
    m = llguidance.LLMatcher(lltok, g)
    assert not m.is_error(), m.get_error()
    t2 = time.perf_counter()
    mask = lt.allocate_token_bitmask(1, lltok.vocab_size)
    times = []
    for t in text_ids:
        a = time.perf_counter()
        lt.fill_next_token_bitmask(m, mask, 0)
        times.append(1e6 * (time.perf_counter() - a))
        assert m.consume_token(t), m.get_error()
    return t1 - t0, t2 - t1, times


def xgrammar_run(tok, hf, text_ids, grammar_kind, grammar):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t1 = time.perf_counter()
    compiled = (compiler.compile_json_schema(json.dumps(SCHEMA)) if grammar_kind == "json_schema"
                else compiler.compile_grammar(grammar))
    m = xgr.GrammarMatcher(compiled)
    t2 = time.perf_counter()
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for t in text_ids:
        a = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        times.append(1e6 * (time.perf_counter() - a))
        assert m.accept_token(t)
    return t1 - t0, t2 - t1, times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    from flashdraft.targets.torch import Target

    target = Target.load()
    hf = target.tokenizer
    cases = [("json_schema", json.dumps(SCHEMA), ANSWER), ("gbnf", GBNF, GBNF_ANSWER)]
    print(f"tokenizer: {target.name}, vocab {len(hf)}")
    for kind, grammar, answer in cases:
        ids = hf(answer, add_special_tokens=False)["input_ids"]
        for name, run in (("llguidance", llguidance_run), ("xgrammar", xgrammar_run)):
            all_times, tok_s, comp_s = [], [], []
            for _ in range(args.repeats):
                a, b, times = run(None, hf, ids, "grammar" if kind == "gbnf" and name == "llguidance" else kind, grammar)
                tok_s.append(a)
                comp_s.append(b)
                all_times += times
            print(f"{kind:12s} {name:11s} tokenizer setup {1e3 * min(tok_s):7.1f} ms, compile {1e3 * min(comp_s):7.1f} ms, "
                  f"mask per token over {len(ids)} tokens: {stats(all_times)}")


if __name__ == "__main__":
    main()
