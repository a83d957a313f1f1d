from __future__ import annotations

from tasks.stage import StrictModel


class RlhfConfig(StrictModel):
    """Placeholder until the rlhf stage lands."""

    steps: int = 10
