"""Where each engine runs: the main venv, a cached runtime venv, later a container or a cluster job."""
from __future__ import annotations

import functools
import importlib.util
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


@functools.cache
def _build_module():
    spec = importlib.util.spec_from_file_location("baton_runtime_build", BUILD)  # standard library only
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def engine_facts(names: set[str], runtimes: dict | None = None, root: Path = BUILD.parents[2]) -> dict[str, str]:
    """What decides the engine versions a step runs on, per runtime it uses: the cached runtime's digest (its pinned
    requirements, hash lock, post-install script and Python version), or what the user configured in its place (an
    interpreter, a checkout, an image) — so an engine upgrade re-runs the steps it could change. `root`: the project
    tree whose infra/runtimes/ is read."""
    facts = {}
    for name in sorted(names):
        spec = (runtimes or {}).get(name) or {}
        chosen = {k: spec[k] for k in ("python", "path", "image") if spec.get(k)}
        facts[name] = ", ".join(f"{k}={v}" for k, v in chosen.items()) or f"lock {_build_module().digest(name, root / 'infra' / 'runtimes')}"
    return facts
