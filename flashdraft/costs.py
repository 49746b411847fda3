"""What one target call of k rows costs on this machine, measured at load.

Speculative decoding pays when ``τ · step > block(k) + draft(k)`` (DESIGN.md §12): the
accepted tokens of a checked block must outweigh what checking it costs against a one-token
step. On a GPU block(16) ≈ step; on a CPU a block costs more with every row, and how much
depends on the weight type, the kernels, the CPU and the threads (docs/performance.md,
"Cheap verify"). So the depth controller starts from a table measured here rather than from
a guess: :func:`measure` times one target call of k rows (k = 1..``k_max``, the anchor plus
k-1 drafts) at a fixed context, the way a verify step runs it (one-token steps on the step
threads, blocks on all), and :func:`load_or_measure` caches the table per model file, CPU
backend, library build, threads and repack, in ``~/.cache/flashdraft/costs.json``.

The table gives the controller the *shape* of the cost curve; what the drafter and the loop
add per step is measured online (:class:`flashdraft.adaptive.ProfitController`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclasses.dataclass
class CostTable:
    """Median wall time of one target call per row count.

    Attributes:
        block_ms: ``[k_max]``: ``block_ms[k-1]`` = ms of one call of k rows at ``context``
            cached positions; ``block_ms[0]`` is a one-token step.
        context: cached positions before each call.
        key: what the table was measured for (see :func:`cache_key`).
    """

    block_ms: list[float]
    context: int
    key: str = ""

    def block(self, rows: int) -> float:
        """ms of a call of ``rows`` rows (>= 1); past the table, extended with its last slope."""
        if rows < 1:
            raise ValueError(f"a target call has at least 1 row, got {rows}")
        k = len(self.block_ms)
        if rows <= k:
            return self.block_ms[rows - 1]
        slope = (self.block_ms[-1] - self.block_ms[0]) / max(k - 1, 1)
        return self.block_ms[-1] + slope * (rows - k)

    def verify_seconds(self, n_max: int) -> list[float]:
        """``[c(0), ..., c(n_max)]`` [s]: a verify step at depth d checks d + 1 rows."""
        return [1e-3 * self.block(d + 1) for d in range(n_max + 1)]

    def describe(self) -> str:
        """One log line: a step, and 4/8/16 rows in steps."""
        step = self.block_ms[0]
        parts = [f"{k} rows {self.block(k) / step:.1f}" for k in (4, 8, 16) if k <= len(self.block_ms)]
        return f"cost table: one-token step {step:.1f} ms; " + ", ".join(parts) + " steps"


def measure(target, k_max: int = 16, context: int = 256, reps: int = 5) -> CostTable:
    """Time one forward of k rows, k = 1..``k_max``, at ``context`` cached positions.

    Rows run in an interleaved order (k = 1..k_max, ``reps`` times), so a burst of load on a
    shared machine spreads over every k instead of one. Each call is rolled back.

    Args:
        target: a target (torch or llama backend): ``new_cache``, ``forward``, ``encode``.
    Returns:
        the :class:`CostTable` (medians).
    """
    text = "The quick brown fox jumps over the lazy dog, and then it reads a book about Python. " * 64
    ids = (target.encode(text) * 2)[: context + k_max]
    cache = target.new_cache()
    target.forward(torch.tensor(ids[:context]), cache, context - 1)
    base = cache.length
    times: list[list[float]] = [[] for _ in range(k_max)]
    for rep in range(reps + 1):  # the first round warms every shape up and is not kept
        for k in range(1, k_max + 1):
            x = torch.tensor(ids[context:context + k])
            t0 = time.perf_counter()
            target.forward(x, cache)
            dt = time.perf_counter() - t0
            cache.rollback(base)
            if rep:
                times[k - 1].append(dt)
    return CostTable([1e3 * statistics.median(t) for t in times], context)


def cache_key(target, k_max: int, context: int) -> str:
    """What a table depends on: the model file, CPU backend and its module's build, library
    build, threads (batches and one-token steps), repack, KV types (llama backend) or weights
    and threads (torch)."""
    if target.backend == "llama":  # its own threads, and the GGUF file it runs
        st = target.path.stat()
        b = target._b
        lib = Path(b.api.__file__).parent / "lib" / "libllama.so"
        parts = [target.backend, str(k_max), str(context), str(target.threads), str(target.path.resolve()),
                 str(st.st_size), str(st.st_mtime_ns), b.cpu.variant, str(lib.stat().st_mtime_ns), target.repack,
                 "/".join(target.cache_types), str(target.exact_step_threads),
                 str(b.cpu.path.stat().st_mtime_ns) if b.cpu.path else "built-in"]
    else:
        parts = [target.backend, str(k_max), str(context), str(torch.get_num_threads()), target.name, target.weights]
    try:
        flags = next((x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")), "")
    except OSError:
        flags = ""
    parts.append(flags)
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def _cache_file() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flashdraft"
    return root / "costs.json"


def load_or_measure(target, k_max: int = 16, context: int = 256, reps: int = 5, use_cache: bool = True) -> CostTable:
    """The cached :class:`CostTable` for ``target`` on this machine, measured (a few seconds)
    and stored when there is none. A cache that cannot be read or written is skipped."""
    key = cache_key(target, k_max, context)
    path = _cache_file()
    if use_cache:
        try:
            row = json.loads(path.read_text()).get(key)
            if row:
                return CostTable(row["block_ms"], row["context"], key)
        except (OSError, ValueError, KeyError, TypeError):
            pass
    t0 = time.perf_counter()
    table = measure(target, k_max, context, reps)
    table.key = key
    log.info("measured the target's %s in %.1f s", table.describe(), time.perf_counter() - t0)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        seen = json.loads(path.read_text()) if path.exists() else {}
        seen[key] = {"block_ms": [round(x, 4) for x in table.block_ms], "context": context}
        path.write_text(json.dumps(seen))
    except (OSError, ValueError):
        pass
    return table
