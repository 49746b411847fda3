"""Per-op torch profile of a 1-token decode and a 16-token verify step, fp32 vs q4 weights.

    .venv/bin/python scripts/step_profile.py   # docs/results/step-profile.txt
"""
import torch, time
torch.set_num_threads(1)
from torch.profiler import profile
from flashdraft.targets.torch import Target
from flashdraft.prompts import SEED_PROMPTS
for w in ("fp32","q4"):
    t=Target.load(None, weights=w)
    ids=torch.tensor(t.chat_prompt_ids([{"role":"user","content":" ".join(SEED_PROMPTS)}]))
    n=ids.shape[0]
    c=t.new_cache(n+40); t.forward(ids,c,ids.shape[0]-1)
    for T in (1,16):
        for _ in range(3): t.forward(ids[:T],c,0); c.rollback(n)
        with profile() as p:
            for _ in range(10): t.forward(ids[:T],c,0); c.rollback(n)
        ka=p.key_averages()
        tot=sum(e.self_cpu_time_total for e in ka)/10/1e3
        rows=sorted(ka, key=lambda e:-e.self_cpu_time_total)[:7]
        print(f"{w} T={T}: {tot:.1f} ms/step; " + "; ".join(f"{e.key} {e.self_cpu_time_total/10/1e3:.1f}" for e in rows))
