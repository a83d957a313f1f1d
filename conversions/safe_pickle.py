"""The one restricted unpickler: every pickle baton reads from a checkpoint (ZeRO `*_states.pt`, Megatron `.metadata`
and `common.pt`, the tensor blobs of `.distcp` files) goes through `loads`.

Two gates, so that nothing in the bytes runs, crashes or allocates more than the file holds:
1. `scan` walks the opcodes (pickletools) before anything is built: it refuses the opcodes that call a class with
   arguments the pickle chooses (NEWOBJ_EX, INST, OBJ), extension codes, out-of-band buffers, every global whose name
   is dotted or not on the allowlist (STACK_GLOBAL's module and name must come from the string opcodes just before it),
   and memo indices past the opcodes seen (the C unpickler sizes its memo to the largest index).
2. The unpickler's find_class hands out only inert stand-ins: functions that check their arguments (never a real
   class that NEWOBJ could instantiate: torch.Tensor, UntypedStorage or numpy.ndarray would allocate or dereference
   what the file says), tensor rebuilders that return references, and `Opaque` placeholders for the record classes of
   the engines that write checkpoints (DeepSpeed loss scalers, torch.distributed.checkpoint metadata records). NEWOBJ
   is allowed because those writers use it (protocol 2+ pickles every plain object with it): it can only ever build an
   `Opaque`, whose constructor stores its arguments and runs nothing.
"""
from __future__ import annotations

import collections
import io
import pathlib
import pickle
import pickletools

import torch

from .refusal import Refused

MAX_PICKLE_BYTES = 1 << 30  # a pickle (the object tree, not the tensor data) larger than this is not a checkpoint's

_REFUSED_OPCODES = {"NEWOBJ_EX", "INST", "OBJ", "EXT1", "EXT2", "EXT4", "PERSID", "NEXT_BUFFER", "READONLY_BUFFER"}
_STRING_OPCODES = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE",
                   "BINUNICODE8"}
_PUT_OPCODES = {"PUT", "BINPUT", "LONG_BINPUT"}
_GET_OPCODES = {"GET", "BINGET", "LONG_BINGET"}
# Classes of the programs that write checkpoints: read as inert placeholders, never imported.
_INERT_MODULES = ("deepspeed.", "megatron.", "apex.", "transformer_engine.", "argparse", "enum",
                  "torch.distributed.checkpoint.")
_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}


class UnsafeCheckpointError(pickle.UnpicklingError, Refused):
    """A checkpoint file baton refuses to read (a ValueError too: callers that catch bad input catch this)."""


class Opaque:
    """Stand-in for an object of an untrusted class (loss scalers, config objects, checkpoint records...): keeps its
    arguments and state, runs nothing."""

    args: tuple = ()
    kwargs: dict = {}
    state = None

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


def opaque_class(module: str, name: str) -> type:
    return type(name, (Opaque,), {"__module__": f"opaque.{module}"})


def opaque_name(obj) -> str | None:
    """'module.Name' of the class an Opaque stands in for, else None."""
    if isinstance(obj, Opaque):
        return f"{type(obj).__module__.removeprefix('opaque.')}.{type(obj).__name__}"
    return None


class StorageType:
    """What `torch.FloatStorage` / `torch.UntypedStorage` mean in a torch.save pickle: a dtype, nothing callable."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype


def _refuse(what: str):
    raise UnsafeCheckpointError(what)


def _checked_ints(values, what: str) -> tuple[int, ...]:
    values = tuple(values)
    if not all(type(v) is int and v >= 0 for v in values):
        _refuse(f"{what} {values!r} is not a tuple of non-negative integers")
    return values


def _size(*args):
    return torch.Size(_checked_ints(args[0] if args else (), "torch.Size"))


def _device(spec="cpu", *rest):
    if not isinstance(spec, str) or len(spec) > 32 or rest and not all(type(r) is int for r in rest):
        _refuse(f"torch.device{(spec, *rest)!r}")
    return torch.device(spec, *rest)


def _latin1(text, encoding="latin1"):  # protocol-2 pickles store bytes as _codecs.encode(str, 'latin1')
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        _refuse(f"_codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


def _reconstructor(cls, base, state=None):  # protocol 0/1 objects: only placeholders
    if not (isinstance(cls, type) and issubclass(cls, Opaque)) or base is not object:
        _refuse("copyreg._reconstructor of a class other than an inert placeholder")
    obj = cls.__new__(cls)
    obj.state = state
    return obj


_LAYOUTS = {"torch.strided": torch.strided, "torch.sparse_coo": torch.sparse_coo}


def _get_layout(name):  # torch.distributed.checkpoint pickles layouts by name
    if name not in _LAYOUTS:
        _refuse(f"layout {name!r}")
    return _LAYOUTS[name]


def _pure_path(*parts):  # StorageMeta.checkpoint_id: kept as text, never opened
    if not all(isinstance(p, str) for p in parts):
        _refuse("a path made of something other than strings")
    return str(pathlib.PurePosixPath(*parts))


def _calls(factory):
    """A function (not a class: NEWOBJ refuses anything but a class) that builds `factory(*args)` from what the pickle
    itself holds: a lazy iterable (a range of 2^60) would make set() or deque() allocate what the file never paid for."""
    def build(*args, **kwargs):
        if any(not isinstance(a, (list, tuple, dict, set, frozenset, str, bytes, int, float, complex, type(None)))
               and not callable(a) for a in (*args, *kwargs.values())):
            _refuse(f"{factory.__name__} of a {type(args[0]).__name__}")
        return factory(*args, **kwargs)
    build.__name__ = getattr(factory, "__name__", "build")
    return build


_NDARRAY = opaque_class("numpy", "ndarray")


def _np_reconstruct(subtype, shape, dtype):
    """numpy's (ndarray, (0,), b'b') prelude of an array pickle: the real shape and data come with BUILD, where numpy
    checks that the data holds exactly shape × itemsize bytes. A shape here would be allocated unchecked."""
    import numpy

    if subtype is not _NDARRAY or shape != (0,) or not isinstance(dtype, bytes) or len(dtype) > 8:
        _refuse("numpy array reconstruction other than numpy's own (ndarray, (0,), dtype) prelude")
    return numpy.ndarray((0,), dtype=numpy.dtype(dtype.decode("latin1")))


def _np_dtype(spec, align=False, copy=True):
    import numpy

    if not isinstance(spec, str) or len(spec) > 8:
        _refuse(f"numpy.dtype({spec!r})")
    return numpy.dtype(spec, bool(align), bool(copy))


def _np_scalar(dtype, data=None):
    import numpy

    if not isinstance(dtype, numpy.dtype) or dtype.hasobject or not isinstance(data, bytes):
        _refuse("numpy scalar other than a plain number")
    return numpy.frombuffer(data, dtype=dtype, count=1)[0]


def _np_dtype_class(name):  # dtype classes build fixed-size dtypes: harmless even as NEWOBJ's class
    import numpy.dtypes

    return getattr(numpy.dtypes, name)


_TORCH_DTYPES = {name: getattr(torch, name) for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}
_TENSOR_CLASSES = {("torch", "Tensor"), ("torch.nn.parameter", "Parameter"), ("torch._tensor", "Tensor")}
_SAFE = {
    ("collections", "OrderedDict"): _calls(collections.OrderedDict),
    ("collections", "defaultdict"): _calls(collections.defaultdict),
    ("collections", "deque"): _calls(collections.deque),
    ("builtins", "set"): _calls(set), ("builtins", "frozenset"): _calls(frozenset),
    ("builtins", "slice"): _calls(slice), ("builtins", "complex"): _calls(complex),
    ("builtins", "range"): _calls(range), ("builtins", "object"): object,
    ("copyreg", "_reconstructor"): _reconstructor, ("_codecs", "encode"): _latin1,
    ("torch", "Size"): _size, ("torch", "device"): _device,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("pathlib", "PosixPath"): _pure_path, ("pathlib", "PurePosixPath"): _pure_path,
    ("numpy", "ndarray"): _NDARRAY, ("numpy", "dtype"): _np_dtype,
    **{(m, "_reconstruct"): _np_reconstruct for m in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(m, "scalar"): _np_scalar for m in ("numpy.core.multiarray", "numpy._core.multiarray")},
}
_NUMPY_DTYPE_CLASSES = {"Float32DType", "Float64DType", "Int64DType", "UInt32DType"}


def safe_global(module: str, name: str, extra: dict | None = None):
    """The stand-in a pickle gets for module.name, or UnsafeCheckpointError: the one gate every global of an
    untrusted checkpoint passes through."""
    module = _PY2_MODULES.get(module, module)
    if not _plain_name(module, name):
        _refuse(f"refers to {module}.{name}: a dotted or malformed global name (a crafted file: nothing was run)")
    if extra and (module, name) in extra:
        return extra[(module, name)]
    if (module, name) in _SAFE:
        return _SAFE[(module, name)]
    if module == "torch" and name in _TORCH_DTYPES:
        return _TORCH_DTYPES[name]
    if module == "torch" and name == "UntypedStorage":
        return StorageType(torch.uint8)
    if module == "torch" and name.endswith("Storage"):
        try:
            return StorageType(torch.serialization.StorageType(name).dtype)
        except (KeyError, AttributeError, RuntimeError):
            pass
    if (module, name) in _TENSOR_CLASSES:  # named by _rebuild_from_type_v2 as the tensor's class: a reference
        return opaque_class(module, name)
    if module == "numpy.dtypes" and name in _NUMPY_DTYPE_CLASSES:
        return _np_dtype_class(name)
    if module.startswith(_INERT_MODULES) and not name.startswith("__"):
        return opaque_class(module, name)
    _refuse(f"refers to {module}.{name}, which is not on the allowlist of what a checkpoint may contain (a crafted or "
            "foreign file: nothing was run)")


def _plain_name(module: str, name: str) -> bool:
    return (isinstance(module, str) and isinstance(name, str) and name.isidentifier()
            and all(part.isidentifier() for part in module.split(".")))


def scan(data: bytes, allowed_persistent_ids: bool, extra: dict | None = None) -> None:
    """Refuse, before anything is built, the opcodes and globals the unpickler must never see (see the module doc)."""
    recent: list = []   # what the last opcodes pushed: a string, or None for anything else
    memo: dict = {}     # memo index -> the string stored there, or None
    n_ops = 0
    try:
        for op, arg, pos in pickletools.genops(data):
            n_ops += 1
            name = op.name
            if name in _REFUSED_OPCODES or name == "BINPERSID" and not allowed_persistent_ids:
                _refuse(f"opcode {name} at byte {pos}")
            if name in ("FRAME", "PROTO", "STOP"):
                continue
            if name == "MEMOIZE":
                memo[len(memo)] = recent[-1] if recent else None
                continue
            if name in _PUT_OPCODES:
                if arg > n_ops:
                    _refuse(f"memo index {arg} at byte {pos}")
                memo[arg] = recent[-1] if recent else None
                continue
            if name in _GET_OPCODES:
                if arg not in memo:
                    _refuse(f"memo index {arg} read before it is stored, at byte {pos}")
                recent.append(memo[arg])
            elif name == "GLOBAL":
                safe_global(*arg.split(" ", 1), extra) if " " in arg else _refuse(f"global {arg!r}")
                recent.append(None)
            elif name == "STACK_GLOBAL":
                if len(recent) < 2 or not isinstance(recent[-2], str) or not isinstance(recent[-1], str):
                    _refuse(f"STACK_GLOBAL at byte {pos} whose module and name are not plain strings just before it")
                safe_global(recent[-2], recent[-1], extra)
                recent.append(None)
            elif name in _STRING_OPCODES:
                recent.append(arg if isinstance(arg, str) else None)
            else:
                recent.append(None)
            del recent[:-2]
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # truncated, malformed: pickletools' own checks
        _refuse(f"not a well-formed pickle ({type(e).__name__}: {e})")


def loads(data: bytes, where, extra: dict | None = None, persistent_load=None):
    """Unpickle bytes of the untrusted file `where`: scanned first, then built from inert stand-ins only (globals
    from safe_global or `extra`, {(module, name): object}). Any refusal is one UnsafeCheckpointError naming the file."""
    try:
        if len(data) > MAX_PICKLE_BYTES:
            _refuse(f"a {len(data)}-byte pickle (more than {MAX_PICKLE_BYTES})")
        scan(data, persistent_load is not None, extra)
        unpickler = _Unpickler(io.BytesIO(data), extra or {})
        if persistent_load is not None:
            unpickler.persistent_load = persistent_load
        return unpickler.load()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(f"{where}: {e}") from None
    except Exception as e:  # anything the stand-ins refuse by type (a crafted tree): still nothing run
        raise UnsafeCheckpointError(f"{where}: refused: not a checkpoint pickle baton reads ({type(e).__name__}: "
                                    f"{str(e)[:200]}); nothing in it was run") from None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, extra: dict):
        super().__init__(file)
        self.extra = extra

    def find_class(self, module, name):
        return safe_global(module, name, self.extra)
