"""Run megatron.core on a machine without a GPU. Apply before importing megatron.core; never on a GPU host.

Megatron-Core assumes CUDA in a few places that matter on CPU: `torch.cuda.current_device()` for placing tensors,
`device="cuda"` / `.cuda()` in buffers and reductions, `Tensor.type() == "torch.cuda.FloatTensor"` assertions in
gradient clipping, and the CUDA RNG tracker that is forked on every tensor-parallel layer (even with dropout 0).
Each is pointed at the CPU here, and nothing else is changed. Read against megatron-core 0.16.1 (the `main` runtime's
version): an upgrade re-checks these places first.

Mixture-of-experts layers (transformer/moe/) add three: the router moves its weight to `torch.cuda.current_device()`
(the CPU here, as above) and calls `te_general_gemm`, a name moe_utils defines only when Transformer Engine imports;
the all-to-all token dispatcher copies its split sizes to the host on a side CUDA stream and hands them to
`all_to_all_single` as numpy arrays, which its host copy (`maybe_move_tensor_to_cpu`) makes only of CUDA tensors.
On the CPU every stream is the one stream the process has, and the split sizes are made host arrays as on a GPU. The
expert-parallel all-gather buffers are placed with `torch.cuda.current_device()` as well.
"""
from __future__ import annotations

import os

MEGATRON_CORE_VERSION = "0.16.1"  # what the patched places were read against

_applied = False


def _to_cpu(device):
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int):  # a bare CUDA ordinal
        return "cpu"
    import torch

    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def apply() -> None:
    global _applied
    if _applied:
        return
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # megatron's jit_fuser is torch.compile
    import torch
    from torch.overrides import TorchFunctionMode

    cpu_rng = torch.default_generator
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *a, **k: cpu_rng.get_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: cpu_rng.set_state(state)
    torch.cuda.manual_seed = lambda seed: cpu_rng.manual_seed(seed)  # not manual_seed_all: it recurses back here

    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: cpu_rng.get_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: cpu_rng.set_state(state)

    cuda_types = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
                  torch.bfloat16: "torch.cuda.BFloat16Tensor", torch.int64: "torch.cuda.LongTensor",
                  torch.int32: "torch.cuda.IntTensor"}

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs:
                kwargs["device"] = _to_cpu(kwargs["device"])
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                return cuda_types.get(args[0].dtype, "torch.cuda.FloatTensor")  # what the asserts expect
            if func is torch.Tensor.to and len(args) > 1:
                args = (args[0], _to_cpu(args[1]), *args[2:])
            return func(*args, **kwargs)

    CudaToCpu().__enter__()  # global for the life of the process
    _one_stream(torch)
    _moe_on_cpu(torch)
    _applied = True


class _Event:
    """A CUDA event on a machine whose work is done when it returns: nothing to wait for."""

    def synchronize(self):
        return None

    def wait(self, *a, **k):
        return None

    def record(self, *a, **k):
        return None

    def query(self):
        return True


class _Stream(_Event):
    def wait_stream(self, other):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event or _Event()


def _one_stream(torch) -> None:
    """CUDA streams and events (the all-to-all dispatcher's device-to-host side stream) as the CPU's single stream."""
    import contextlib

    main = _Stream()
    torch.cuda.Stream = lambda *a, **k: _Stream()
    torch.cuda.Event = lambda *a, **k: _Event()
    torch.cuda.current_stream = lambda *a, **k: main
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()


def _moe_on_cpu(torch) -> None:
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):  # the router's gating then takes its torch.mm branch
        moe_utils.te_general_gemm = None
    to_host = dispatcher.maybe_move_tensor_to_cpu

    def host_split_sizes(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    dispatcher.maybe_move_tensor_to_cpu = host_split_sizes
