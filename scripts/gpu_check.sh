#!/usr/bin/env bash
# One-command GPU check (docs/gpu.md): device-marked tests on CUDA, greedy equality on the
# real default model with every drafter, and a short bench (none vs dflash vs ngram).
# Under 8 minutes on one GPU; on a machine without CUDA it says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
if [ ! -x "$PY" ] || [ ! -f .venv/.setup-done ]; then
  # make setup pins the CPU torch wheel; a GPU machine keeps (or installs) its CUDA torch first
  make setup
fi

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  "$PY" -c 'import torch; print(f"no GPU present (torch {torch.__version__}, CUDA build: {torch.version.cuda}); nothing to check")'
  exit 0
fi

"$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}")'

echo "== 1/3 device-marked tests on CUDA"
timeout 180 "$PY" -m pytest -q -m device tests/test_device.py

echo "== 2/3 greedy equality, real default model, every drafter, on cuda"
timeout 180 "$PY" scripts/gpu_greedy_check.py --device cuda -n 64 --prompts 3 --weights fp32,bf16

echo "== 3/3 bench: none vs dflash vs ngram on cuda (tok/s)"
timeout 150 "$PY" -m flashdraft.cli bench --device cuda --configs none,dflash,ngram --prompts seed \
  -n 128 --temperature 0 --repeats 1 --json-out "${GPU_CHECK_OUT:-/tmp}/gpu_bench.json"
