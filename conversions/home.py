"""BATON_HOME, where baton keeps its state (runs, the step index, the registry, API and seal keys): the variable, else
./.baton. The one home of that default; it lives in conversions/ because the seal key (conversions/sealed.py) is found
through it and conversions/ imports nothing above itself."""
from __future__ import annotations

import os
from pathlib import Path

ENV = "BATON_HOME"
DEFAULT = ".baton"


def home_path(base: Path | None = None) -> Path:
    """$BATON_HOME (an empty value counts as unset), else `.baton` under base (the working directory); absolute, not
    created."""
    return Path(os.environ.get(ENV) or (base or Path.cwd()) / DEFAULT).absolute()
