"""CPU threads for torch: the default when ``-t`` is not given, and the startup line that says it.

Why a default of our own: torch uses one OpenMP thread per core, and OpenMP threads spin at
every barrier. When other processes use the cores, a spinning thread waits for a thread
that is not running, and a decode step (hundreds of small ops, each ending in a barrier)
gets many times slower: measured on a 2-core machine beside a busy process, 2 threads
decoded at a fraction of 1 thread's speed (``scripts/thread_policy.py``,
``docs/performance.md``, "Threads"). A decode step of a small model is memory-bound, so a
second thread adds little even on a quiet machine.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity; ``os.cpu_count()`` where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads(cores: int | None = None) -> int:
    """Threads when ``-t`` is not given: one per core, less one core left for everything
    else (the server's event loop, the tokenizer, other programs), and 1 on machines with
    up to 2 cores, where a second thread is the one that collapses under load."""
    cores = usable_cores() if cores is None else cores
    return max(1, cores - 1) if cores > 2 else 1


def apply_threads(threads: int | None) -> tuple[int, str]:
    """Set torch's intra-op threads to ``threads`` (None = :func:`default_threads`).

    Returns:
        ``(threads, why)``: the count set and how it was chosen, for the startup log.
    Raises:
        ValueError: ``threads`` < 1.
    """
    import torch

    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    why = "from -t"
    if threads is None:
        cores = usable_cores()
        threads, why = default_threads(cores), f"default for {cores} usable cores; change with -t N"
    torch.set_num_threads(threads)
    return threads, why


def describe(threads: int, why: str) -> str:
    """The startup line: the thread count, why, and OpenMP's wait policy if set."""
    policy = os.environ.get("OMP_WAIT_POLICY")
    extra = f", OMP_WAIT_POLICY={policy}" if policy else ""
    return f"CPU threads: {threads} ({why}{extra})"
