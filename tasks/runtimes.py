"""Where each engine runs: the main venv, a cached runtime venv, later a container or a cluster job."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BUILD = Path(__file__).resolve().parent.parent / "infra" / "runtimes" / "build.py"


class RuntimeMissing(RuntimeError):
    pass


def runtime_dir(name: str) -> Path:
    out = subprocess.check_output([sys.executable, str(BUILD), name, "--path-only"], text=True)
    return Path(out.strip())


def python_for(name: str, runtimes: dict | None = None) -> str:
    """The python that runs a worker for this runtime (configured path, else main venv or the cached runtime)."""
    spec = (runtimes or {}).get(name) or {}
    if spec.get("python"):
        return spec["python"]
    if name == "main":
        return sys.executable
    d = runtime_dir(name)
    if not (d / ".baton-ready").exists():
        raise RuntimeMissing(f"runtime '{name}' is not built ({d}): run `make runtimes`")
    return str(d / "bin" / "python")


def check_available(name: str, runtimes: dict | None = None) -> str | None:
    """An error message when the runtime cannot be used, else None (checked before anything launches)."""
    try:
        py = python_for(name, runtimes)
    except RuntimeMissing as e:
        return str(e)
    if not Path(py).exists():
        return f"runtime '{name}': python {py} does not exist"
    return None
