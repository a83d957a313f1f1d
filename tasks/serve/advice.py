"""What `baton doctor` checks for the serve stage: settings that make the engines run out of memory, its port."""
from __future__ import annotations

import os

from tasks.problems import Finding

GPU_MEMORY_UTILIZATION = (0.5, 0.9)


def advice(s) -> list[Finding]:
    found = []
    lo, hi = GPU_MEMORY_UTILIZATION
    u = s.gpu_memory_utilization
    if u is not None and not lo <= u <= hi:
        found.append(Finding("warning", "gpu_memory_utilization", f"serve.gpu_memory_utilization {u} is outside "
                             f"{lo}-{hi}: above, the CUDA graphs, activations and other processes have no room (OOM at "
                             "start); below, the KV cache starves", "serve.gpu_memory_utilization: 0.85"))
    if s.prompt_logprobs:
        found.append(Finding("warning", "prompt_logprobs", f"serve.prompt_logprobs {s.prompt_logprobs}: every request "
                             "then materialises vocabulary × prompt-token log-probs, a common vLLM OOM",
                             "serve.prompt_logprobs: 0"))
    if s.device == "cuda" and "expandable_segments:True" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        found.append(Finding("warning", "cuda_alloc_conf", "PYTORCH_CUDA_ALLOC_CONF lacks expandable_segments:True; "
                             "fragmentation makes vLLM OOM with memory free", "export "
                             "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"))
    return found


def ports(s) -> list[tuple[str, str, int]]:
    return [("serve.port", s.host, s.port)] if s.port else []
