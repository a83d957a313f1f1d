from __future__ import annotations

from tasks.stage import StrictModel


class PretrainConfig(StrictModel):
    """Placeholder until the pretrain stage lands."""

    steps: int = 10
