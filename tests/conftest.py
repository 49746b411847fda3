"""Shared test setup: make ``tests/`` importable (tiny model helpers) and keep torch lean."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(2)
