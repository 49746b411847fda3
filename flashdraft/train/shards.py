"""Regenerated answers on disk: the shard files every training stage reads and writes.

One JSON object per line of ``shard-NNNNN.jsonl`` (gzipped ``.jsonl.gz`` once committed)::

    {"id": str, "prompt": str, "prompt_ids": [int], "response_ids": [int], "finish": "eos"|"length"}

``prompt_ids`` are the chat-templated prompt tokens (no padding); ``response_ids`` are the
generated tokens up to and including the first EOS id when ``finish == "eos"``. A
``manifest.json`` beside them says how they were made (:data:`SHARD_FORMAT`).

This is the bottom of ``flashdraft.train``: it imports nothing from the package, so the
regeneration, the features, the walk and the loop can all read it.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SHARD_FORMAT = "flashdraft-regen-v1"


def _shard_index(path: Path) -> int:
    return int(path.name.split("-")[1].split(".")[0])


def scan_shards(out_dir: Path, repair: bool = True) -> tuple[dict[str, dict], int]:
    """Read existing ``shard-*.jsonl`` (and committed, gzipped ``shard-*.jsonl.gz``) files of ``out_dir``.

    Returns (``{id: {"finish", "n_prompt", "n_response"}}``, next free shard index).
    A line that does not parse (a write cut short by a kill) is dropped; with ``repair``
    the (plain) shard is rewritten without it. Duplicate ids keep their first occurrence.
    """
    done: dict[str, dict] = {}
    shards = sorted(list(out_dir.glob("shard-*.jsonl")) + list(out_dir.glob("shard-*.jsonl.gz")), key=_shard_index)
    for shard in shards:
        good_lines, bad = [], 0
        gz = shard.suffix == ".gz"
        with (gzip.open(shard, "rt", encoding="utf-8") if gz else open(shard, encoding="utf-8")) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    if not line.endswith("\n"):
                        raise ValueError("unterminated line")
                except ValueError:
                    bad += 1
                    continue
                good_lines.append(line)
                if rec["id"] not in done:
                    done[rec["id"]] = {
                        "finish": rec["finish"],
                        "n_prompt": len(rec["prompt_ids"]),
                        "n_response": len(rec["response_ids"]),
                    }
        if bad and repair and not gz:
            log.warning("%s: dropping %d unreadable line(s) left by an interrupted write", shard, bad)
            tmp = shard.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(good_lines), encoding="utf-8")
            os.replace(tmp, shard)
    next_index = _shard_index(shards[-1]) + 1 if shards else 0
    return done, next_index


@dataclass
class ShardWriter:
    """Appends records to ``shard-NNNNN.jsonl`` files, starting a new file every ``shard_size`` lines.

    Never appends to a shard from an earlier run: a restart starts at ``next_index``.
    Each record is flushed at once so a kill loses at most the line being written.
    """

    out_dir: Path
    next_index: int
    shard_size: int = 256
    _file: object = field(default=None, repr=False)
    _lines: int = 0

    def write(self, record: dict) -> None:
        if self._file is None or self._lines >= self.shard_size:
            self.close()
            path = self.out_dir / f"shard-{self.next_index:05d}.jsonl"
            self.next_index += 1
            self._file = open(path, "a", encoding="utf-8")
            self._lines = 0
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        self._lines += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write ``obj`` as indented JSON through a temporary file, so a kill never leaves half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_shards(data_dir: Path, with_shard: bool = False) -> list[tuple]:
    """All regenerated sequences: ``(id, ids [T] int64, n_prompt)`` (plus the shard index
    with ``with_shard``), shards in name order; ``shard-*.jsonl`` or gzipped ``.jsonl.gz``.
    A line being written right now (not yet valid JSON) is skipped."""
    seqs = []
    shards = sorted(list(Path(data_dir).glob("shard-*.jsonl")) + list(Path(data_dir).glob("shard-*.jsonl.gz")))
    for shard in shards:
        index = int(shard.name.split("-")[1].split(".")[0])
        text = gzip.open(shard, "rt").read() if shard.suffix == ".gz" else shard.read_text()
        for line in text.splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if len(rec["response_ids"]) < 2:
                continue
            ids = torch.tensor(rec["prompt_ids"] + rec["response_ids"], dtype=torch.long)
            item = (rec["id"], ids, len(rec["prompt_ids"]))
            seqs.append(item + (index,) if with_shard else item)
    return seqs
