"""Open a `torch.save` file without loading its tensors: each tensor becomes a LazyTensor that reads byte ranges.

A torch.save file is an uncompressed zip: `<archive>/data.pkl` (the pickled object tree) and one record per storage
(`<archive>/data/<key>`). We unpickle only the tree, turning each tensor into a (record offset, dtype, view) reference,
so reading a slice of a multi-GB optimizer partition costs exactly that slice in memory: no mmap pages that stay
resident, no optimizer moments touched.

Nothing in the file runs: a global is resolved only from an allowlist of (module, name) pairs (containers, dtypes,
tensor rebuilders); classes of the engines that write these files (DeepSpeed loss scalers, config enums...) become
inert placeholders, so DeepSpeed need not be importable; any other global (builtins.open, os.system, torch.save,
eval...) refuses the file with UnsafeCheckpointError before anything is called.
"""
from __future__ import annotations

import importlib
import io
import math
import pickle
import struct
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

_SAFE_GLOBALS = {
    ("collections", "OrderedDict"), ("collections", "defaultdict"), ("collections", "deque"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
    ("builtins", "bytearray"), ("builtins", "range"), ("copyreg", "_reconstructor"), ("builtins", "object"),
    ("_codecs", "encode"), ("torch", "Size"), ("torch", "device"),
    # the tensor classes _rebuild_from_type_v2 names (ZeRO-3 optimizer files): a type reference, never called here
    ("torch", "Tensor"), ("torch.nn.parameter", "Parameter"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"), ("numpy.dtypes", "Float32DType"), ("numpy.dtypes", "Float64DType"),
    ("numpy.dtypes", "Int64DType"), ("numpy.dtypes", "UInt32DType"),
}
_TORCH_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}
# Writers of ZeRO checkpoints pickle their own small objects (loss scalers, stage enums, config holders): read as
# inert placeholders, never imported.
_INERT_PREFIXES = ("deepspeed.", "megatron.", "apex.", "transformer_engine.", "argparse", "enum")
_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}


class UnsafeCheckpointError(pickle.UnpicklingError):
    pass


def safe_global(module: str, name: str):
    """The object a pickle may reference as module.name, or UnsafeCheckpointError: the one gate every global of an
    untrusted checkpoint passes through."""
    module = _PY2_MODULES.get(module, module)
    if (module, name) in _REBUILDERS:
        return _REBUILDERS[(module, name)]
    if module == "torch" and name in _TORCH_DTYPES:
        return getattr(torch, name)
    if module == "torch" and name.endswith("Storage") and name.isidentifier():
        return torch.serialization.StorageType(name) if name != "UntypedStorage" else torch.UntypedStorage
    if (module, name) in _SAFE_GLOBALS:
        return getattr(importlib.import_module(module), name)
    if module.startswith(_INERT_PREFIXES) and not name.startswith("_"):
        return _opaque_class(module, name)
    raise UnsafeCheckpointError(f"refers to {module}.{name}, which is not on the allowlist of what a checkpoint may "
                                "contain (a crafted or foreign file: nothing was run)")


class Opaque:
    """Stand-in for an object of an untrusted class (loss scalers, config objects...): keeps its state, runs nothing."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        self.state = state

    def __call__(self, *args, **kwargs):  # also stands in for untrusted functions used in REDUCE
        return Opaque(*args, **kwargs)

    def __int__(self):  # enums pickle as (cls, (value,)): e.g. DeepSpeed's ZeroStageEnum
        if len(self.args) == 1 and isinstance(self.args[0], int):
            return self.args[0]
        raise TypeError(f"{type(self).__name__} has no integer value")


def _opaque_class(module: str, name: str):
    return type(name, (Opaque,), {"__module__": f"opaque.{module}"})


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
        item = torch.empty((), dtype=self.dtype).element_size()
        buf = out.view(torch.uint8).numpy()
        with open(self.storage.path, "rb", buffering=0) as f:
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
        span = 1 + sum((d - 1) * s for d, s in zip(self.shape, self.stride))
        base = LazyTensor(self.storage, self.storage_offset, torch.Size([span]), (1,))
        return base.load().as_strided(self.shape, self.stride).contiguous()


def _rebuild_tensor(storage, storage_offset, size, stride, *_args, **_kwargs):
    return LazyTensor(storage, storage_offset, torch.Size(size), tuple(stride))


def _rebuild_parameter(data, *_args, **_kwargs):
    return data


def _rebuild_from_type(func, _new_type, args, _state):
    return func(*args)


_REBUILDERS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
}


def _record_offsets(path: Path) -> tuple[str, dict[str, int]]:
    """The archive prefix and the byte offset of every stored record's data."""
    offsets = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        prefix = next((n[: -len("data.pkl")] for n in z.namelist() if n.endswith("data.pkl") and n.count("/") == 1),
                      None)
        if prefix is None:
            raise ValueError(f"{path}: not a torch.save zip file (no data.pkl)")
        for info in z.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"{path}: record {info.filename} is compressed")
            f.seek(info.header_offset)
            header = f.read(30)
            if header[:4] != b"PK\x03\x04":
                raise ValueError(f"{path}: bad local header for {info.filename}")
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            offsets[info.filename] = info.header_offset + 30 + name_len + extra_len
    return prefix, offsets


def load(path: Path):
    """The object tree of a torch.save file, with every tensor as a LazyTensor."""
    path = Path(path)
    prefix, offsets = _record_offsets(path)
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        if f"{prefix}byteorder" in names and z.read(f"{prefix}byteorder").decode() != sys.byteorder:
            raise ValueError(f"{path}: saved with a different byte order")
        data = z.read(f"{prefix}data.pkl")

    def persistent_load(saved_id):
        kind, storage_type, key, _location, numel = saved_id
        if kind != "storage":
            raise ValueError(f"{path}: unknown persistent id {kind!r}")
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        record = f"{prefix}data/{key}"
        if record not in offsets:
            raise ValueError(f"{path}: missing storage record {record}")
        return _StorageRef(path, offsets[record], dtype, numel)

    return safe_loads(data, path, {("torch.tensor", name): safe_global("torch._tensor", name)
                                   for name in ("_rebuild_from_type_v2",)}, persistent_load)


def safe_loads(data: bytes, where, extra: dict | None = None, persistent_load=None):
    """Unpickle bytes from an untrusted file: globals only from safe_global or `extra` ({(module, name): object})."""
    extra = extra or {}

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in extra:
                return extra[(module, name)]
            try:
                return safe_global(module, name)
            except UnsafeCheckpointError as e:
                raise UnsafeCheckpointError(f"{where}: {e}") from None

    unpickler = _Unpickler(io.BytesIO(data))
    if persistent_load is not None:
        unpickler.persistent_load = persistent_load
    return unpickler.load()
