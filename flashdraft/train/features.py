"""Target context features and next-token distributions on disk, beside the answer shards.

Training reads every sequence's context features once per epoch; recomputing them costs a
target forward per sequence (most of a training step's time on a CPU), so they are stored
once as memory-mapped fp16 rows and reused across epochs and restarts.

Layout, per answer shard ``shard-NNNNN.jsonl`` of a data directory::

    features/feat-NNNNN.f16     rows of [n_layers * H] fp16, sequences back to back
    features/topk-NNNNN.bin     per row: the target's top-k next-token ids (int32) and
                                log-probabilities (fp16) at temperature 1
    features/index-NNNNN.jsonl  {"id", "row", "rows"}: where each sequence starts, written
                                after its rows, so a killed writer loses at most one sequence
    features/meta.json          layer ids, hidden size, k, target fingerprint

Row t of a sequence holds the outputs of the stored decoder layers at position t, and the
target's distribution of token t+1 (the soft label of a block position predicting t+1).
Regeneration (:mod:`flashdraft.train.regen`) writes them as it decodes, for free;
:func:`build_features` recomputes them for shards that lack them (one target forward each).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


log = logging.getLogger(__name__)

#: decoder layers stored by default for SmolLM2-135M (30 layers): a superset of every
#: feature-layer choice the recipe table compares
DEFAULT_STORED_LAYERS = (1, 8, 14, 20, 27, 29)
TOPK = 8


def topk_dtype(k: int = TOPK) -> np.dtype:
    return np.dtype([("ids", "<i4", (k,)), ("logp", "<f2", (k,))])


def top_logprobs(logits: torch.Tensor, k: int = TOPK) -> tuple[np.ndarray, np.ndarray]:
    """``logits [T, V]`` -> top-k ``(ids [T, k] int32, log-probs [T, k] float16)`` at T=1."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = logp.topk(k, dim=-1)
    return ids.to(torch.int32).cpu().numpy(), vals.to(torch.float16).cpu().numpy()


class FeatureWriter:
    """Appends sequences' rows for one shard index (see the module docstring)."""

    def __init__(self, data_dir: str | Path, shard_index: int, layer_ids, hidden: int, k: int = TOPK,
                 backend: str = "torch"):
        self.dir = Path(data_dir) / "features"
        self.dir.mkdir(parents=True, exist_ok=True)
        write_meta(self.dir, layer_ids, hidden, k, backend)
        self.width = len(layer_ids) * hidden
        self.k = k
        self.feat = open(self.dir / f"feat-{shard_index:05d}.f16", "ab")
        self.topk = open(self.dir / f"topk-{shard_index:05d}.bin", "ab")
        self.index = open(self.dir / f"index-{shard_index:05d}.jsonl", "a")
        self.row = self.feat.tell() // (2 * self.width)

    def write(self, seq_id: str, features: torch.Tensor, ids: np.ndarray, logp: np.ndarray) -> None:
        """``features [T, width]``, top-k ``ids/logp [T, k]`` of one sequence.

        Raises:
            ValueError: rows of another width or k, or features that are not finite in
                float16 (a target whose hidden states exceed its range, as Gemma's do:
                regenerate with ``--no-features``; the trainer then computes them).
        """
        T = features.shape[0]
        if features.shape[1] != self.width or ids.shape != (T, self.k):
            raise ValueError("feature rows do not match the store's width or k")
        if not torch.isfinite(features.to(torch.float16)).all():
            raise ValueError(f"{seq_id}: the target's hidden states exceed float16's range, so they cannot be "
                             "stored as features; regenerate with --no-features (the trainer computes them)")
        self.feat.write(features.to(torch.float16).numpy().tobytes())
        rec = np.zeros(T, dtype=topk_dtype(self.k))
        rec["ids"], rec["logp"] = ids, logp
        self.topk.write(rec.tobytes())
        self.feat.flush()
        self.topk.flush()
        self.index.write(json.dumps({"id": seq_id, "row": self.row, "rows": T}) + "\n")
        self.index.flush()
        self.row += T

    def close(self) -> None:
        for f in (self.feat, self.topk, self.index):
            f.close()


def write_meta(feature_dir: Path, layer_ids, hidden: int, k: int, backend: str = "torch") -> None:
    """Write ``meta.json`` or check that an existing one agrees. Raises ValueError if not.

    ``backend`` names the engine whose forward made the rows (``torch`` or ``llama``): their
    numbers differ slightly (llama.cpp's quantized kernels), and a walk or a training run can
    then choose the rows of the backend that serves."""
    meta = {"layer_ids": list(layer_ids), "hidden_size": hidden, "topk": k, "backend": backend}
    path = feature_dir / "meta.json"
    if path.exists():
        old = {"backend": "torch", **json.loads(path.read_text())}  # stores before the key: torch's
        if old != meta:
            raise ValueError(f"{feature_dir} holds features of another layout ({old} != {meta})")
        return
    path.write_text(json.dumps(meta) + "\n")


@dataclass
class SequenceFeatures:
    """One sequence's stored rows (views into the memory maps)."""

    features: np.ndarray  # [T, n_layers * H] float16
    topk_ids: np.ndarray  # [T, k] int32
    topk_logp: np.ndarray  # [T, k] float16


class FeatureStore:
    """Read-only view of a data directory's ``features/`` (memory-mapped; see module docstring).

    Args:
        data_dir: the directory holding ``shard-*.jsonl`` and ``features/``.
    Raises:
        FileNotFoundError: no ``features/meta.json``.
    """

    def __init__(self, data_dir: str | Path):
        self.dir = Path(data_dir) / "features"
        meta_path = self.dir / "meta.json"
        if not meta_path.exists():
            raise FileNotFoundError(f"{meta_path} missing: run `flashdraft train --build-features` "
                                    f"or regenerate with `python -m flashdraft.train.regen`")
        meta = json.loads(meta_path.read_text())
        self.layer_ids = list(meta["layer_ids"])
        self.hidden = int(meta["hidden_size"])
        self.k = int(meta["topk"])
        #: the engine whose forward made the rows (``torch`` for stores written before the key)
        self.backend = meta.get("backend", "torch")
        self.width = len(self.layer_ids) * self.hidden
        self._where: dict[str, tuple[int, int, int]] = {}
        self._maps: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.refresh()

    def refresh(self) -> None:
        """Pick up sequences written since the last look (a running regeneration)."""
        for idx in sorted(self.dir.glob("index-*.jsonl")):
            shard = int(idx.stem.split("-")[1])
            for line in idx.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                self._where.setdefault(rec["id"], (shard, rec["row"], rec["rows"]))
        self._maps = {}

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._where

    def __len__(self) -> int:
        return len(self._where)

    def _map(self, shard: int):
        if shard not in self._maps:
            feat = np.memmap(self.dir / f"feat-{shard:05d}.f16", dtype=np.float16, mode="r").reshape(-1, self.width)
            topk = np.memmap(self.dir / f"topk-{shard:05d}.bin", dtype=topk_dtype(self.k), mode="r")
            self._maps[shard] = (feat, topk)
        return self._maps[shard]

    def get(self, seq_id: str) -> SequenceFeatures:
        """The rows of ``seq_id``. Raises KeyError when it has none."""
        shard, row, rows = self._where[seq_id]
        feat, topk = self._map(shard)
        part = topk[row:row + rows]
        return SequenceFeatures(feat[row:row + rows], part["ids"], part["logp"])

    def columns(self, layer_ids) -> list[int]:
        """Feature columns of ``layer_ids`` (in that order). Raises ValueError for a layer not stored."""
        missing = [i for i in layer_ids if i not in self.layer_ids]
        if missing:
            raise ValueError(f"layers {missing} are not stored (stored: {self.layer_ids}); rebuild the features")
        cols = []
        for i in layer_ids:
            j = self.layer_ids.index(i)
            cols.extend(range(j * self.hidden, (j + 1) * self.hidden))
        return cols


def storable_layers(target, layer_ids) -> list[int]:
    """The subset of ``layer_ids`` whose outputs ``target`` can give as features.

    The llama backend exposes layer *inputs*, so the last layer's output is not among them, and
    a graph without layer inputs (:data:`~flashdraft.targets.llama.LAYER_INPUT_ARCHS`) gives
    none (the trainer and the walk then compute features themselves). Logs what it drops.
    """
    layer_ids = list(layer_ids)
    if target.backend != "llama":
        return layer_ids
    from flashdraft.targets.llama import LAYER_INPUT_ARCHS

    if layer_ids and target.architecture not in LAYER_INPUT_ARCHS:
        log.warning("llama.cpp's %s graph exports no layer inputs: storing no features", target.architecture)
        return []
    last = [i for i in layer_ids if i >= target.num_layers - 1]
    if last:
        log.warning("the llama backend cannot store layer %s (the last layer's output); storing %s",
                    last, [i for i in layer_ids if i not in last])
    return [i for i in layer_ids if i not in last]


def build_features(data_dir: str | Path, target, layer_ids=DEFAULT_STORED_LAYERS, progress: bool = True) -> int:
    """Compute stored rows for every shard sequence that has none (one target forward each),
    on ``target``'s backend (recorded in ``meta.json``; see :func:`storable_layers`).

    Returns the number of sequences written. Resumable: sequences already stored are skipped.
    Raises:
        ValueError: the store holds rows of another layout or backend.
    """
    from tqdm import tqdm

    from flashdraft.train.shards import read_shards

    data_dir = Path(data_dir)
    try:
        have = FeatureStore(data_dir)
    except FileNotFoundError:
        have = None
    todo = [(sid, ids, n, shard) for sid, ids, n, shard in read_shards(data_dir, with_shard=True)
            if have is None or sid not in have]
    if not todo:
        return 0
    layer_ids = storable_layers(target, layer_ids)
    if not layer_ids:
        return 0
    backend = target.backend
    target.set_feature_layers(list(layer_ids))
    writers: dict[int, FeatureWriter] = {}
    try:
        for sid, ids, _, shard in tqdm(todo, desc="features", unit="seq", disable=not progress):
            if shard not in writers:
                writers[shard] = FeatureWriter(data_dir, shard, layer_ids, target.hidden_size, backend=backend)
            logits, feats = target.forward(ids, target.new_cache(ids.shape[0] + 1), 0)
            top_ids, top_logp = top_logprobs(logits)
            writers[shard].write(sid, feats, top_ids, top_logp)
    finally:
        for w in writers.values():
            w.close()
    return len(todo)
