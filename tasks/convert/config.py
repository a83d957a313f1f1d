from __future__ import annotations

from pydantic import Field

from conversions.manifest import Format
from tasks.stage import StrictModel


class ConvertConfig(StrictModel):
    to_format: str = Field(Format.HF_SAFETENSORS.value, description="format a `convert` listed in stages converts to")
    max_shard_size_mb: int = Field(2048, ge=1, description="largest safetensors shard written, MiB")
    timeout_s: float = Field(3600, gt=0, description="wall-clock limit of a conversion")
