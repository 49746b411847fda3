"""A 98-token prefill with the int4 kernel vs float32 weights (why q4 prefills on float32).

    .venv/bin/python scripts/q4_prefill.py   # docs/results/q4-prefill.txt (run with QUANT_MAX_ROWS = 128)
"""
import torch, time
torch.set_num_threads(1)
from flashdraft.targets.torch import Target
from flashdraft.prompts import SEED_PROMPTS
t4=Target.load(None, weights="q4"); t32=Target.load(None, weights="fp32")
ids=torch.tensor(t4.chat_prompt_ids([{"role":"user","content":SEED_PROMPTS[0]}]))
print(len(ids))
for r in range(3):
    for n,t in (("fp32",t32),("q4",t4)):
        c=t.new_cache(1024); a=time.perf_counter(); t.forward(ids,c,ids.shape[0]-1); print(n, round(1e3*(time.perf_counter()-a),1))
