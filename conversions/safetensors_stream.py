"""The one safetensors writer: shard names, the index, and the shards filled from a plan known up front (names, dtypes,
shapes). Each shard's header (with all offsets) is written first, then the tensors are produced and written one by one
(the next one read while the current one is written): peak memory is about 1.5 × the largest tensor.
torch is imported only when tensors are written, so reading INDEX_NAME costs nothing.
"""
from __future__ import annotations

import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

INDEX_NAME = "model.safetensors.index.json"
METADATA = {"format": "pt"}  # what servers (vLLM, SGLang) require in every shard
DTYPE_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
               "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def shard_name(i: int, n: int) -> str:
    return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_index(root: Path, weight_map: dict[str, str], total_size: int) -> Path:
    path = Path(root) / INDEX_NAME
    path.write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))},
                               indent=2) + "\n")
    return path


@dataclass
class PlannedTensor:
    name: str
    dtype: Any                           # a torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], Any]           # called once, when the tensor is written; returns a torch.Tensor

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


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
        entries[t.name] = {"dtype": DTYPE_CODES[str(t.dtype).removeprefix("torch.")], "shape": list(t.shape),
                           "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned


def _produced(t: PlannedTensor) -> Any:
    data = t.produce()
    if data.dtype != t.dtype or tuple(data.shape) != tuple(t.shape):
        raise ValueError(f"{t.name}: produced {data.dtype} {tuple(data.shape)}, planned {t.dtype} {t.shape}")
    return data


def _write_shard(path: Path, shard: list[PlannedTensor], metadata: dict, budget: int) -> None:
    """Tensor i+1 is read (in a second thread; file I/O releases the GIL) while tensor i is written, whenever the two
    fit in `budget` bytes together: reads and writes overlap, and peak memory stays bounded by the budget."""
    import torch

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
        path = root / shard_name(i, n)
        _write_shard(path, shard, metadata or METADATA, budget)
        files.append(path)
        weight_map.update({t.name: path.name for t in shard})
    if n > 1:
        write_index(root, weight_map, sum(t.nbytes for t in tensors))
    return files
