"""The export stage's section of a run config: which files to write (GGUF types for llama.cpp, quantization types for
vLLM) and, for one type, another gate bound."""
from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator

from conversions import gguf_export, hf, vllm_quant
from tasks.stage import StrictModel


def is_quantization(type_name: str) -> bool:
    """A vLLM quantization type (llm-compressor, compressed-tensors), not a GGUF one."""
    return type_name in vllm_quant.TYPES


def moe_problem(experts: int | None, key: str) -> str | None:
    """Why a mixture of experts (`experts` experts; None: a dense model) is not exported: the gates know a dense
    model's tensors and layers. Measured on a tiny Mixtral: llama.cpp keeps the routers (ffn_gate_inp) F32, which the
    GGUF gate's type check failed, and llm-compressor quantized 16 Linear layers a layer (4 attention, 3 per expert),
    which the coverage check counted against a dense layer's 7; both after the converter had run."""
    if not experts:
        return None
    return (f"{key}: the model is a mixture of experts ({experts} experts), which baton's GGUF and quantized exports "
            "do not gate yet (their checks know a dense model's tensors and layers); serve the HF checkpoint, which "
            "vLLM and SGLang serve (docs/moe.md)")


def moe_problem_of(config: dict, key: str) -> str | None:
    """moe_problem for an HF config.json."""
    return moe_problem((hf.moe_of_hf_config(config) or {}).get("num_experts"), key)


class ExportConfig(StrictModel):
    types: list[str] = Field(["f16"], min_length=1,
                             description="the files written, one per type, each gated against the HF checkpoint and "
                                         "registered as its own model version: GGUF types for llama.cpp (f16, q8_0, "
                                         "q4_K_M, ...) and quantization types for vLLM (w8a8, w4a16: llm-compressor, "
                                         "calibrated on the run's own data)")
    max_logit_rms: dict[str, float] = Field(
        default_factory=dict, description="another gate bound for a GGUF type (rms logit difference in units of the "
                                          "source logits' std; default the type's own: f16 0.01, q8_0 0.1)")
    max_loss_delta: dict[str, float] = Field(
        default_factory=dict, description="another gate bound for a quantization type (held-out loss difference from "
                                          "the unquantized checkpoint, nats per token; default the type's own: w8a8 "
                                          "0.05, w4a16 0.25)")
    calibration_rows: int = Field(vllm_quant.CALIBRATION_ROWS, gt=0,
                                  description="rows of the data stage's pretraining train split a quantization type "
                                              "calibrates on (its held-out loss: as many rows of the held-out split)")
    timeout_s: float = Field(3600, gt=0, description="wall-clock limit of one file's conversion")

    @field_validator("types")
    @classmethod
    def _known_types(cls, types: list[str]) -> list[str]:
        for name in types:
            if not is_quantization(name):
                gguf_export.export_type(name)  # an ExportError (a ValueError's message) names the types
        if len(set(types)) != len(types):
            raise ValueError(f"{types}: a type is listed twice")
        return types

    @field_validator("max_logit_rms")
    @classmethod
    def _bounds_of_listed_types(cls, bounds: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        return _bounds_of(bounds, [t for t in info.data.get("types") or [] if not is_quantization(t)], "GGUF")

    @field_validator("max_loss_delta")
    @classmethod
    def _loss_bounds_of_listed_types(cls, bounds: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        return _bounds_of(bounds, [t for t in info.data.get("types") or [] if is_quantization(t)], "quantization")


def _bounds_of(bounds: dict[str, float], types: list[str], kind: str) -> dict[str, float]:
    if extra := sorted(set(bounds) - set(types)):
        raise ValueError(f"names {extra}, not among the {kind} types of export.types {types}")
    if bad := sorted(k for k, v in bounds.items() if not v > 0):
        raise ValueError(f"the bound of {bad} must be > 0")
    return bounds
