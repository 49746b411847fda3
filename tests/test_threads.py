"""The default CPU thread count and the startup line that reports it."""

from __future__ import annotations

import pytest
import torch

from flashdraft.threads import apply_threads, default_threads, describe


@pytest.mark.parametrize("cores,threads", [(1, 1), (2, 1), (3, 2), (4, 3), (16, 15)])
def test_default_leaves_a_core_and_never_runs_two_threads_on_two_cores(cores, threads):
    assert default_threads(cores) == threads


def test_apply_sets_torch_and_says_why(monkeypatch):
    before = torch.get_num_threads()
    try:
        assert apply_threads(2) == (2, "from -t") and torch.get_num_threads() == 2
        monkeypatch.setattr("flashdraft.threads.usable_cores", lambda: 4)
        n, why = apply_threads(None)
        assert n == 3 and torch.get_num_threads() == 3 and "4 usable cores" in why and "-t N" in why
        monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
        assert describe(n, why) == f"CPU threads: 3 ({why}, OMP_WAIT_POLICY=PASSIVE)"
        with pytest.raises(ValueError, match="--threads must be >= 1"):
            apply_threads(0)
    finally:
        torch.set_num_threads(before)
