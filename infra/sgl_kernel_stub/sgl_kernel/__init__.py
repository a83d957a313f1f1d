"""Import-only stand-in for `sgl_kernel` (SGLang's CUDA kernel package) on CPU hosts.

Why: sglang 0.5.23 imports `sgl_kernel` ops at module import time, even on CPU, and PyPI has no CPU build of it (the
CPU kernels build only from SGLang's GitHub sources; PyPI `sglang-kernel` is CUDA-only). On a CPU without AMX, a Llama
served with `--attention-backend torch_native --sampling-backend pytorch` never calls these ops, so names that resolve
to a function raising NotImplementedError are enough for the imports to succeed.

Scope: dense Llama-style models on non-AMX x86 CPUs. It breaks AMX hosts (SGLang picks the intel_amx backend there),
MoE, quantized and mamba models: any call ends in a clear NotImplementedError naming the op.
Installed into the sglang runtime by infra/runtimes/sglang.post.sh. Never used on GPU hosts (real sgl-kernel there).
"""
from sgl_kernel._stub import missing

__version__ = "0.0.0+baton.cpu.stub"


def __getattr__(name: str):
    return missing(__name__, name)
