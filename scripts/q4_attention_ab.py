"""q4 attention A/B at 300 and 2,000 tokens of context: float64 attention (the default, lossless),
bf16 / f16 compressed caches (float32 stable attention) and fp32 weights; ms per 1/8/16-row forward.

    .venv/bin/python scripts/q4_attention_ab.py   # docs/results/q4-attention-ab.txt
"""
import torch, time, statistics
torch.set_num_threads(1)
from flashdraft.targets.torch import Target
from flashdraft.kv_cache import KVCacheSpec
from flashdraft.prompts import SEED_PROMPTS
t=Target.load(None, weights="q4")
t32=Target.load(None, weights="fp32")
ids=t.chat_prompt_ids([{"role":"user","content":" ".join(SEED_PROMPTS)}])
while len(ids)<2000: ids=ids+ids
cfgs={"q4-f64attn":(t,None),"q4-bf16kv":(t,KVCacheSpec("bf16","bf16")),"q4-f16kv":(t,KVCacheSpec("f16","f16")),"fp32":(t32,None)}
for ctx in (300,2000):
    c=torch.tensor(ids[:ctx])
    caches={n:tt.new_cache(ctx+20, kv=kv) for n,(tt,kv) in cfgs.items()}
    for n,(tt,kv) in cfgs.items(): tt.forward(c,caches[n],ctx-1)
    times={(n,T):[] for n in cfgs for T in (1,8,16)}
    for r in range(12):
        for T in (1,8,16):
            for n,(tt,kv) in cfgs.items():
                a=time.perf_counter(); tt.forward(c[:T],caches[n],0); dt=time.perf_counter()-a; caches[n].rollback(ctx)
                if r>=2: times[(n,T)].append(dt*1e3)
    for n in cfgs: print(ctx, n, [round(statistics.median(times[(n,T)]),1) for T in (1,8,16)])
