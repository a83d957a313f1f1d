from __future__ import annotations

from pydantic import Field

from tasks.stage import StrictModel


class ConvertConfig(StrictModel):
    to_format: str = "hf-safetensors"
    max_shard_size_mb: int = Field(2048, ge=1)
    timeout_s: float = Field(3600, gt=0)
