"""The train/inference routing mismatch of a mixture of experts: the share of tokens whose chosen experts differ
between the trainer (HF) and the serving engine, the drift RL users fight with. It can only be measured where the
engine returns the experts it routed each token to; where it cannot, the serve stage's result says why with a
RoutingUnavailable reason, never a 0.

What the pinned engines can do (each tried on a tiny Mixtral, 2026-12-06):
- SGLang: `--enable-return-routed-experts` and a request's `return_routed_experts` (per token, layer and top-k slot).
  On CPU the server does not start with it: the capturer's host buffer is allocated with pin_memory, which needs
  CUDA ("Torch not compiled with CUDA enabled").
- vLLM 0.32: `--enable-return-routed-experts` (with `--enable-scale-out`, the routing comes back from
  /inference/v1/generate). On CPU the server does not start with it: it needs Model Runner V2
  (VLLM_USE_V2_MODEL_RUNNER=1), which needs Triton.
"""
from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path

from conversions import hf


class RoutingUnavailable(StrEnum):
    ENGINE_CPU_BUILD = "engine_cpu_build"            # the engine's CPU build cannot return its routing
    NOT_REQUESTED = "not_requested"                  # the engine can (GPU), baton does not ask it yet


WHY = {
    ("sglang", "cpu"): (RoutingUnavailable.ENGINE_CPU_BUILD,
                        "SGLang's --enable-return-routed-experts pins its host buffer (pin_memory needs CUDA): the "
                        "CPU server fails to start"),
    ("vllm", "cpu"): (RoutingUnavailable.ENGINE_CPU_BUILD,
                      "vLLM's --enable-return-routed-experts needs Model Runner V2, which needs Triton: the CPU "
                      "server refuses to start"),
    ("sglang", "cuda"): (RoutingUnavailable.NOT_REQUESTED,
                         "SGLang returns routed experts with --enable-return-routed-experts (a request's "
                         "return_routed_experts); baton does not request them yet"),
    ("vllm", "cuda"): (RoutingUnavailable.NOT_REQUESTED,
                       "vLLM returns routed experts with --enable-return-routed-experts (/inference/v1/generate, "
                       "--enable-scale-out, Model Runner V2); baton does not request them yet"),
}


def routing_mismatch(engine: str, device: str, model_dir: Path) -> dict | None:
    """The serve result's entry for one engine: None for a dense model; for a mixture of experts, the share of
    tokens routed differently, or (as now on every engine) why it was not measured."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if hf.moe_of_hf_config(config) is None:
        return None
    reason, detail = WHY[(engine, device)]
    return {"measured": False, "share": None, "reason": reason.value, "detail": detail}
