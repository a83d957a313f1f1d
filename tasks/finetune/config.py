from __future__ import annotations

from tasks.stage import StrictModel


class FinetuneConfig(StrictModel):
    """Placeholder until the finetune stage lands."""

    steps: int = 10
