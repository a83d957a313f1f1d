"""Write safetensors shards one tensor at a time from a plan known up front (names, dtypes, shapes).

Because every shape is known before any data is read, each shard's header (with all offsets) is written first and
tensors are then produced and written one by one: peak memory is one tensor, not one shard or one model.
"""
from __future__ import annotations

import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

INDEX_NAME = "model.safetensors.index.json"
DTYPE_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}


@dataclass
class PlannedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]  # called once, when the tensor is written

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def plan_shards(tensors: list[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _header(shard: list[PlannedTensor], metadata: dict) -> bytes:
    entries: dict = {"__metadata__": metadata}
    offset = 0
    for t in shard:
        entries[t.name] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape),
                           "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned


def _produced(t: PlannedTensor) -> torch.Tensor:
    data = t.produce()
    if data.dtype != t.dtype or tuple(data.shape) != tuple(t.shape):
        raise ValueError(f"{t.name}: produced {data.dtype} {tuple(data.shape)}, planned {t.dtype} {t.shape}")
    return data


def _write_shard(path: Path, shard: list[PlannedTensor], metadata: dict, budget: int) -> None:
    """Tensor i+1 is read (in a second thread; file I/O releases the GIL) while tensor i is written, whenever the two
    fit in `budget` bytes together: reads and writes overlap, and peak memory stays bounded by the budget."""
    header = _header(shard, metadata)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f, ThreadPoolExecutor(1) as reader:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        pending = reader.submit(_produced, shard[0]) if shard else None
        for i, t in enumerate(shard):
            data = pending.result()
            nxt = shard[i + 1] if i + 1 < len(shard) else None
            ahead = nxt is not None and t.nbytes + nxt.nbytes <= budget
            pending = reader.submit(_produced, nxt) if ahead else None
            f.write(data.contiguous().reshape(-1).view(torch.uint8).numpy())
            del data
            if nxt is not None and pending is None:
                pending = reader.submit(_produced, nxt)
    os.replace(tmp, path)


def write(root: Path, tensors: list[PlannedTensor], max_shard_bytes: int, metadata: dict | None = None) -> list[Path]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + the index; tensors sorted by name within shards."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in the plan")
    shards = [sorted(s, key=lambda t: t.name) for s in plan_shards(sorted(tensors, key=lambda t: t.name),
                                                                    max_shard_bytes)]
    n = len(shards)
    budget = int(1.5 * max((t.nbytes for t in tensors), default=0))  # never two of the largest tensors at once
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        path = root / ("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors")
        _write_shard(path, shard, metadata or {"format": "pt"}, budget)
        files.append(path)
        weight_map.update({t.name: path.name for t in shard})
    if n > 1:
        total = sum(t.nbytes for t in tensors)
        (root / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                  indent=2, sort_keys=True) + "\n")
    return files
