"""Baton's own reader of torch.distributed.checkpoint folders (Megatron's torch_dist): `.metadata` parsed once by the
one restricted unpickler into plain records, tensor chunks read from the `.distcp` byte ranges those records name.

torch's FileSystemWriter stores each tensor chunk as a `torch.save` blob at [offset, offset + length) of a `.distcp`
file (no transform unless an extension, e.g. compression, was asked for: those are refused here). Storage files must
be plain files directly in the checkpoint folder: no absolute path, no `..`, no subfolder, no symlink, and every byte
range within its file. torch.distributed.checkpoint is never imported.
"""
from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import torch_lazy
from .safe_pickle import UnsafeCheckpointError, loads, opaque_name

METADATA = ".metadata"
_DCP = "torch.distributed.checkpoint."


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]  # where the chunk sits in the global tensor
    sizes: tuple[int, ...]
    file: str                 # a file name directly in the checkpoint folder
    offset: int               # the chunk's torch.save blob: bytes [offset, offset + length) of that file
    length: int


@dataclass
class TensorEntry:
    size: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[Chunk] = field(default_factory=list)


class BytesEntry:
    """A non-tensor item (Megatron's sharded objects): listed, never read for a conversion."""


@dataclass
class DistMetadata:
    state_dict_metadata: dict[str, TensorEntry | BytesEntry]


def read_metadata(root: Path) -> DistMetadata:
    """The checkpoint's `.metadata`, read once, unpickled by the restricted loader, checked against the folder."""
    root = Path(root)
    path = root / METADATA
    with torch_lazy.open_regular(path) as f:
        data = f.read()
    md = _records(loads(data, path), path)
    _check_storage_files(root, md)
    return md


def _state(obj, cls: str, path):
    """The state of a record the pickle built as the inert stand-in of torch's `cls`."""
    if opaque_name(obj) != _DCP + cls:
        raise UnsafeCheckpointError(f"{path}: expected a {cls} record, found {opaque_name(obj) or type(obj).__name__}")
    return obj.state


def _fields(obj, cls: str, path) -> dict:
    state = _state(obj, cls, path)
    if isinstance(state, tuple) and len(state) == 2 and state[0] is None:  # slots dataclasses: (None, {slot: value})
        state = state[1]
    if not isinstance(state, dict):
        raise UnsafeCheckpointError(f"{path}: a {cls} record without fields")
    return state


def _ints(values, what: str, path) -> tuple[int, ...]:
    values = tuple(values) if isinstance(values, (tuple, list, torch.Size)) else None
    if values is None or not all(type(v) is int and v >= 0 for v in values):
        raise UnsafeCheckpointError(f"{path}: {what} is not a list of non-negative integers")
    return values


def _records(obj, path) -> DistMetadata:
    top = _fields(obj, "metadata.Metadata", path)
    storage = {}
    for index, info in dict(top.get("storage_data") or {}).items():
        idx = _fields(index, "metadata.MetadataIndex", path)
        where = _fields(info, "filesystem._StorageInfo", path)
        if where.get("transform_descriptors"):
            raise UnsafeCheckpointError(f"{path}: storage transforms {where['transform_descriptors']!r} (compressed or "
                                        "extension-written checkpoints are not supported)")
        offset = idx.get("offset")
        key = (idx.get("fqn"), None if offset is None else _ints(offset, "a chunk offset", path))
        storage[key] = (_storage_file(where.get("relative_path"), path),
                        *_ints((where.get("offset"), where.get("length")), "a storage byte range", path))
    entries = {}
    for key, record in dict(top.get("state_dict_metadata") or {}).items():
        if not isinstance(key, str):
            raise UnsafeCheckpointError(f"{path}: a state-dict key that is not a string")
        if opaque_name(record) == _DCP + "metadata.BytesStorageMetadata":
            entries[key] = BytesEntry()
            continue
        entries[key] = _tensor_entry(key, _fields(record, "metadata.TensorStorageMetadata", path), storage, path)
    return DistMetadata(entries)


def _tensor_entry(key: str, fields: dict, storage: dict, path) -> TensorEntry:
    props = _state(fields.get("properties"), "metadata.TensorProperties", path)  # (dtype, layout, ...)
    dtype = props[0] if isinstance(props, tuple) and props else None
    if not isinstance(dtype, torch.dtype):
        raise UnsafeCheckpointError(f"{path}: {key}: no dtype")
    size = _ints(fields.get("size"), f"{key}: size", path)
    entry = TensorEntry(size, dtype)
    for record in list(fields.get("chunks") or []):
        c = _fields(record, "metadata.ChunkStorageMetadata", path)
        offsets, sizes = _ints(c.get("offsets"), f"{key}: chunk offsets", path), _ints(c.get("sizes"), key, path)
        if len(offsets) != len(size) or len(sizes) != len(size) or \
                any(o + s > d for o, s, d in zip(offsets, sizes, size)):
            raise UnsafeCheckpointError(f"{path}: {key}: chunk at {list(offsets)} of {list(sizes)} outside the "
                                        f"tensor's {list(size)}")
        if (key, offsets) not in storage:
            raise UnsafeCheckpointError(f"{path}: {key}: no storage for the chunk at {list(offsets)}")
        entry.chunks.append(Chunk(offsets, sizes, *storage[(key, offsets)]))
    return entry


def _storage_file(name, path) -> str:
    """A storage file name, refused unless it is a plain name directly in the checkpoint folder."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise UnsafeCheckpointError(f"{path}: storage path {str(name)[:200]!r} is not a file name in the checkpoint "
                                    "folder (absolute, `..` and subfolder paths are refused)")
    return name


def _check_storage_files(root: Path, md: DistMetadata) -> None:
    sizes = {}
    for key, entry in md.state_dict_metadata.items():
        for chunk in getattr(entry, "chunks", ()):
            if chunk.file not in sizes:
                try:
                    st = os.lstat(root / chunk.file)
                except FileNotFoundError:
                    st = None
                if st is None or not stat.S_ISREG(st.st_mode):
                    raise UnsafeCheckpointError(f"{root / chunk.file}: refused: storage file missing, a symlink or "
                                                "not a regular file")
                sizes[chunk.file] = st.st_size
            if chunk.offset + chunk.length > sizes[chunk.file]:
                raise UnsafeCheckpointError(f"{root / chunk.file}: {key}: bytes [{chunk.offset}, "
                                            f"{chunk.offset + chunk.length}) past the end of the file")


def read_box(root: Path, key: str, entry: TensorEntry, offsets, sizes, cache: dict | None = None) -> torch.Tensor:
    """The box [offsets, offsets + sizes) of the global tensor `key`, assembled from the chunks it overlaps."""
    offsets, sizes = tuple(offsets), tuple(sizes)
    if len(offsets) != len(entry.size) or any(o + s > d for o, s, d in zip(offsets, sizes, entry.size)):
        raise UnsafeCheckpointError(f"{root}: {key}: box {offsets}+{sizes} outside the tensor's {entry.size}")
    out = torch.empty(sizes, dtype=entry.dtype)
    covered = 0
    for chunk in entry.chunks:
        lo = [max(o, c) for o, c in zip(offsets, chunk.offsets)]
        hi = [min(o + s, c + cs) for o, s, c, cs in zip(offsets, sizes, chunk.offsets, chunk.sizes)]
        if any(h <= l for l, h in zip(lo, hi)):
            continue
        part = _chunk_part(root, key, entry, chunk, lo, hi, cache)
        out[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offsets))] = part
        covered += math.prod(h - l for l, h in zip(lo, hi))
    if covered != out.numel():
        raise UnsafeCheckpointError(f"{root}: {key}: its chunks cover {covered} of the {out.numel()} elements asked "
                                    "for")
    return out


def _chunk_part(root: Path, key: str, entry: TensorEntry, chunk: Chunk, lo, hi, cache) -> torch.Tensor:
    """Elements [lo, hi) (global coordinates) of one chunk: only the rows asked for are read when it is contiguous."""
    lazy = cache.get(chunk) if cache is not None else None
    if lazy is None:
        lazy = torch_lazy.load(root / chunk.file, chunk.offset, chunk.length)
        expected = tuple(lazy.shape) == chunk.sizes and lazy.dtype == entry.dtype \
            if isinstance(lazy, torch_lazy.LazyTensor) else False
        if not expected:
            raise UnsafeCheckpointError(f"{root / chunk.file}: {key}: the chunk at {list(chunk.offsets)} is not a "
                                        f"{entry.dtype} tensor of shape {list(chunk.sizes)}")
        if cache is not None:
            cache[chunk] = lazy
    local = [(l - c, h - c) for l, h, c in zip(lo, hi, chunk.offsets)]
    if not local or not lazy.is_contiguous():
        whole = lazy.load()
        return whole[tuple(slice(a, b) for a, b in local)]
    (r0, r1), row = local[0], math.prod(chunk.sizes[1:])
    rows = torch.empty((r1 - r0, *chunk.sizes[1:]), dtype=entry.dtype)
    lazy.read_flat_into(rows.view(-1), r0 * row, (r1 - r0) * row)
    return rows[(slice(None),) + tuple(slice(a, b) for a, b in local[1:])]
