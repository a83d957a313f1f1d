"""Run megatron.core on a machine without a GPU. Apply before importing megatron.core; never on a GPU host.

Megatron-Core assumes CUDA in a few places that matter on CPU: `torch.cuda.current_device()` for placing tensors,
`device="cuda"` / `.cuda()` in buffers and reductions, `Tensor.type() == "torch.cuda.FloatTensor"` assertions in
gradient clipping, and the CUDA RNG tracker that is forked on every tensor-parallel layer (even with dropout 0).
Each is pointed at the CPU here, and nothing else is changed. Read against megatron-core 0.16.1 (the `main` runtime's
version): an upgrade re-checks these places first.
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
    _applied = True
