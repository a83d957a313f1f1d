"""The export stage's section of a run config: which GGUF files to write and, for one type, another gate bound."""
from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator

from conversions import gguf_export
from tasks.stage import StrictModel


class ExportConfig(StrictModel):
    types: list[str] = Field(["f16"], min_length=1,
                             description="the GGUF files written, one per llama.cpp type (f16, q8_0), each gated "
                                         "against the HF checkpoint and registered as its own model version")
    max_logit_rms: dict[str, float] = Field(
        default_factory=dict, description="another gate bound for a type (rms logit difference in units of the "
                                          "source logits' std; default the type's own: f16 0.01, q8_0 0.1)")
    timeout_s: float = Field(3600, gt=0, description="wall-clock limit of one file's conversion")

    @field_validator("types")
    @classmethod
    def _known_types(cls, types: list[str]) -> list[str]:
        for name in types:
            gguf_export.export_type(name)  # an ExportError (a ValueError's message) names the type and the recipe
        if len(set(types)) != len(types):
            raise ValueError(f"{types}: a type is listed twice")
        return types

    @field_validator("max_logit_rms")
    @classmethod
    def _bounds_of_listed_types(cls, bounds: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        types = info.data.get("types") or []
        if extra := sorted(set(bounds) - set(types)):
            raise ValueError(f"names {extra}, not in export.types {types}")
        if bad := sorted(k for k, v in bounds.items() if not v > 0):
            raise ValueError(f"the bound of {bad} must be > 0")
        return bounds
