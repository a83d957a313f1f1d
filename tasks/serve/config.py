from __future__ import annotations

from tasks.stage import StrictModel


class ServeConfig(StrictModel):
    """Placeholder until the serve stage lands."""

    steps: int = 10
