"""One-token step cost at 1 and 2 threads on the llama backend, and whether a 16-row verify
block equals 16 one-token steps with the steps on 1 or on 2 threads (blocks on 2).

    .venv/bin/python scripts/step_threads_drift.py
"""
import time, statistics, torch
from flashdraft.targets.llama import LlamaTarget
from flashdraft.targets.torch import default_model_path
t = LlamaTarget(default_model_path(), n_ctx=2048, threads=2, warn=False, cache_type_k="f16", cache_type_v="f16")
text = "Write a Python function that reverses a string and explain how slicing works. " * 80
ids = t.encode(text)
for ctxlen in (300, 700):
    cache = t.new_cache(); t.forward(torch.tensor(ids[:ctxlen]), cache, ctxlen - 1); base = cache.length
    res = {1: [], 2: []}
    for r in range(15):
        for n in (1, 2):
            t._b.api.llama_set_n_threads(t._ctx, n, 2)
            t0 = time.perf_counter(); t.forward(torch.tensor(ids[ctxlen:ctxlen+1]), cache); res[n].append(time.perf_counter()-t0); cache.rollback(base)
    print(ctxlen, {n: round(1e3*statistics.median(v), 2) for n, v in res.items()})
    for n in (1, 2):
        t._b.api.llama_set_n_threads(t._ctx, n, 2)
        block = t.forward(torch.tensor(ids[ctxlen:ctxlen+16]), cache)[0].clone(); cache.rollback(base)
        steps = torch.cat([t.forward(torch.tensor([x]), cache)[0].clone() for x in ids[ctxlen:ctxlen+16]]); cache.rollback(base)
        print("  step threads", n, "drift", float((block - steps).abs().max()))
