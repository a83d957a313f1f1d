"""Open a `torch.save` file without loading its tensors: each tensor becomes a LazyTensor that reads byte ranges.

A torch.save file is an uncompressed zip: `<archive>/data.pkl` (the pickled object tree) and one record per storage
(`<archive>/data/<key>`). We unpickle only the tree, turning each tensor into a (record offset, dtype, view) reference,
so reading a slice of a multi-GB optimizer partition costs exactly that slice in memory: no mmap pages that stay
resident, no optimizer moments touched. The zip may also sit inside a larger file (a tensor blob of a `.distcp` file).

Nothing in the file runs: the tree is read by baton's one restricted unpickler (safe_pickle), and every view is
checked against its storage record before any byte is read.
"""
from __future__ import annotations

import math
import os
import stat
import struct
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .safe_pickle import StorageType, UnsafeCheckpointError, loads as safe_loads  # noqa: F401 (re-exported)


@dataclass
class _StorageRef:
    path: Path
    offset: int           # byte offset of the storage record in the file
    dtype: torch.dtype
    numel: int


@dataclass
class LazyTensor:
    """A view (shape, stride, storage offset) on a storage record; reads only what is asked for."""

    storage: _StorageRef
    storage_offset: int
    shape: torch.Size
    stride: tuple

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    def numel(self) -> int:
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        expected, acc = [], 1
        for d in reversed(self.shape):
            expected.append(acc)
            acc *= d
        return all(s == e for s, e, d in zip(self.stride, reversed(expected), self.shape) if d != 1)

    def read_flat_into(self, out: torch.Tensor, start: int, count: int) -> None:
        """Copy elements [start, start+count) of this (contiguous) tensor, flattened, into the 1-D tensor out."""
        if not self.is_contiguous():
            raise ValueError("read_flat_into needs a contiguous tensor")
        if start < 0 or start + count > self.numel():
            raise IndexError(f"elements [{start}, {start + count}) outside a tensor of {self.numel()}")
        if out.dtype != self.dtype or out.numel() != count or not out.is_contiguous():
            raise ValueError("out must be a contiguous tensor of the same dtype and `count` elements")
        if count == 0:
            return
        item = self.dtype.itemsize
        buf = out.view(torch.uint8).numpy()
        with open_regular(self.storage.path) as f:
            f.seek(self.storage.offset + (self.storage_offset + start) * item)
            view, done = memoryview(buf), 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise EOFError(f"{self.storage.path}: truncated storage record")
                done += n

    def load(self) -> torch.Tensor:
        """The whole tensor in memory (for small things: buffers, frozen fragments)."""
        if self.is_contiguous():
            out = torch.empty(self.numel(), dtype=self.dtype)
            self.read_flat_into(out, 0, self.numel())
            return out.view(self.shape)
        base = LazyTensor(self.storage, self.storage_offset, torch.Size([_span(self.shape, self.stride)]), (1,))
        return base.load().as_strided(self.shape, self.stride).contiguous()


def _span(shape, stride) -> int:
    """Elements of storage a view covers from its offset (0 for an empty view)."""
    if math.prod(shape) == 0:
        return 0
    return 1 + sum((d - 1) * s for d, s in zip(shape, stride))


def open_regular(path: Path):
    """A checkpoint file opened for reading, never through a symlink, and only if it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise UnsafeCheckpointError(f"{path}: refused: cannot open it as a plain file ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeCheckpointError(f"{path}: refused: not a regular file")
    return os.fdopen(fd, "rb", buffering=0)


def _checked_view(storage, storage_offset, size, stride):
    """(offset, shape, stride) of a tensor in the pickle, refused unless it lies within its storage record: the
    file's numbers decide what is read, so they are checked before anything is allocated."""
    if not isinstance(storage, _StorageRef):
        raise UnsafeCheckpointError("a tensor without a storage record")
    if type(storage_offset) is not int or storage_offset < 0:
        raise UnsafeCheckpointError(f"storage offset {storage_offset!r}")
    size, stride = tuple(size), tuple(stride)
    if len(size) != len(stride) or not all(type(v) is int and v >= 0 for v in size + stride):
        raise UnsafeCheckpointError(f"shape {size!r} / stride {stride!r}")
    if storage_offset + _span(size, stride) > storage.numel or math.prod(size) > storage.numel:
        # the second: a broadcast view (stride 0) of a few stored bytes would expand to whatever shape it names
        raise UnsafeCheckpointError(f"a view (offset {storage_offset}, shape {list(size)}, stride {list(stride)}) "
                                    f"beyond its storage of {storage.numel} elements")
    return storage_offset, torch.Size(size), stride


def _rebuild_tensor(storage, storage_offset, size, stride, *_args, **_kwargs):
    offset, shape, stride = _checked_view(storage, storage_offset, size, stride)
    return LazyTensor(storage, offset, shape, stride)


def _rebuild_parameter(data, *_args, **_kwargs):
    if not isinstance(data, LazyTensor):
        raise UnsafeCheckpointError("a parameter that is not a tensor")
    return data


def _rebuild_from_type(func, _new_type, args, _state):
    if func not in (_rebuild_tensor, _rebuild_parameter) or not isinstance(args, tuple):
        raise UnsafeCheckpointError("_rebuild_from_type_v2 of something other than a tensor")
    return func(*args)


_REBUILDERS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch.tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
}


class _FileSlice:
    """Bytes [base, base+length) of an open file as a seekable file of its own (a zip inside a .distcp file)."""

    def __init__(self, f, base: int, length: int):
        self.f, self.base, self.length, self.pos = f, base, length, 0

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, pos, whence=0):
        self.pos = max(0, {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence])
        return self.pos

    def read(self, n=-1):
        n = self.length - self.pos if n is None or n < 0 else min(n, max(0, self.length - self.pos))
        self.f.seek(self.base + self.pos)
        data = self.f.read(n)
        self.pos += len(data)
        return data


def _records(path: Path, f, base: int, length: int) -> tuple[str, bytes, dict[str, tuple[int, int]]]:
    """data.pkl's bytes and, for every stored record, (absolute byte offset of its data, its size)."""
    records = {}
    view = _FileSlice(f, base, length)
    with zipfile.ZipFile(view) as z:
        prefix = next((n[: -len("data.pkl")] for n in z.namelist() if n.endswith("data.pkl") and n.count("/") == 1),
                      None)
        if prefix is None:
            raise ValueError(f"{path}: not a torch.save zip file (no data.pkl)")
        for info in z.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"{path}: record {info.filename} is compressed")
            view.seek(info.header_offset)
            header = view.read(30)
            if header[:4] != b"PK\x03\x04":
                raise ValueError(f"{path}: bad local header for {info.filename}")
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            start = info.header_offset + 30 + name_len + extra_len
            if start + info.file_size > length:
                raise UnsafeCheckpointError(f"{path}: record {info.filename} runs past the end of its file")
            records[info.filename] = (base + start, info.file_size)
        names = set(z.namelist())
        if f"{prefix}byteorder" in names and z.read(f"{prefix}byteorder") != sys.byteorder.encode():
            raise ValueError(f"{path}: saved with a different byte order")
        data = z.read(f"{prefix}data.pkl")
    return prefix, data, records


def load(path: Path, base: int = 0, length: int | None = None):
    """The object tree of a torch.save file (or of the one at bytes [base, base+length) of path), every tensor a
    LazyTensor."""
    path = Path(path)
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        length = size - base if length is None else length
        if base < 0 or length < 0 or base + length > size:
            raise UnsafeCheckpointError(f"{path}: refused: bytes [{base}, {base + length}) outside the file")
        try:
            prefix, data, records = _records(path, f, base, length)
        except UnsafeCheckpointError:
            raise
        except Exception as e:  # zipfile's many ways of saying the container is broken: one refusal
            raise UnsafeCheckpointError(f"{path}: refused: not a readable torch.save file ({type(e).__name__}: "
                                        f"{str(e)[:200]})") from None

    def persistent_load(saved_id):
        if not (isinstance(saved_id, tuple) and len(saved_id) == 5 and saved_id[0] == "storage"):
            raise UnsafeCheckpointError(f"unknown persistent id {str(saved_id)[:80]}")
        _, storage_type, key, _location, numel = saved_id
        if not isinstance(storage_type, StorageType) or not isinstance(key, str) or type(numel) is not int \
                or numel < 0:
            raise UnsafeCheckpointError(f"malformed storage reference {str(saved_id)[:80]}")
        record = f"{prefix}data/{key}"
        if record not in records:
            raise UnsafeCheckpointError(f"missing storage record {record}")
        offset, nbytes = records[record]
        dtype = storage_type.dtype
        if numel * dtype.itemsize > nbytes:
            raise UnsafeCheckpointError(f"storage {key} claims {numel} elements, its record holds {nbytes} bytes")
        return _StorageRef(path, offset, dtype, numel)

    return safe_loads(data, path, _REBUILDERS, persistent_load)
