"""Context features of the llama backend against the torch forward, and verify drift
(docs/performance.md §10, "Features from ggml" and the lossless table).

    .venv/bin/python scripts/llama_parity_check.py [--gguf FILE ...]

Prints, for the packaged SmolLM2 GGUF, per feature layer of the shipped drafter: min cosine
and max |difference| between llama.cpp's layer inputs and torch's layer outputs on one chat
prompt; then ``LlamaTarget.verify_drift()`` (max |logit| between an 8-row verify and 8
one-token steps) for that GGUF and every ``--gguf`` given.
"""

from __future__ import annotations

import argparse

import torch

from flashdraft.targets.torch import Target, default_model_path
from flashdraft.targets.llama import LlamaTarget


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", action="append", default=[], help="another GGUF to report verify drift for")
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = default_model_path()
    llama, ref = LlamaTarget(path, n_ctx=1024, warn=False), Target.load(path)
    layers = [1, 14, 27]
    prompt = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    ids = torch.tensor(ref.chat_prompt_ids(prompt))
    for t in (llama, ref):
        t.set_feature_layers(layers)
    _, f1 = llama.forward(ids, llama.new_cache())
    _, f2 = ref.forward(ids, ref.new_cache())
    H = ref.hidden_size
    print(f"{path.name}, {len(ids)}-token chat prompt; rows 1.. (row 0 is the attention sink)")
    print("| layer | min cosine | max abs diff | torch row RMS |")
    print("|---|---|---|---|")
    for k, layer in enumerate(layers):
        a, b = f1[1:, k * H:(k + 1) * H], f2[1:, k * H:(k + 1) * H]
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
        print(f"| {layer} | {cos:.5f} | {(a - b).abs().max().item():.2f} | {b.pow(2).mean().sqrt().item():.1f} |")
    llama.set_feature_layers(None)
    print(f"verify drift {path.name}: {llama.verify_drift():.3g}")
    for other in args.gguf:
        print(f"verify drift {other}: {LlamaTarget(other, n_ctx=512, warn=False).verify_drift():.3g}")


if __name__ == "__main__":
    main()
