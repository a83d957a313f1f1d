"""The environment a DeepSpeed worker runs in here: JIT op builds are paid once (the command: tasks.distributed)."""
from __future__ import annotations

import hashlib
import os
import platform
import sys
from pathlib import Path

from tasks.stage import training_engine_env

CACHE_ROOT = Path(os.environ.get("BATON_CACHE", Path.home() / ".cache" / "baton"))


def cpu_flags() -> str:
    """The CPU's instruction-set flags: DeepSpeed builds its CPU ops with -march=native, so builds are keyed on them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_extensions_dir() -> Path:
    """A stable build cache per (CPU flags, python, torch install, deepspeed): ops compile once, not on every run.
    The torch install path is part of the key because the build command names its headers: ninja rebuilds
    whenever the command changes, so two runtimes sharing one cache would rebuild each other's ops."""
    from importlib.metadata import version
    from importlib.util import find_spec

    torch_dir = (find_spec("torch").submodule_search_locations or [""])[0]
    key = "|".join([cpu_flags(), sys.version.split()[0], version("torch"), version("deepspeed"),
                    str(Path(torch_dir).resolve())])
    return CACHE_ROOT / "torch_extensions" / hashlib.sha256(key.encode()).hexdigest()[:16]


def libaio_available() -> bool:
    """libaio's header and library, what DeepSpeed's async I/O op (NVMe offload) compiles and links against."""
    import ctypes.util

    includes = [Path(d) for d in ("/usr/include", "/usr/local/include")]
    includes += [Path(d) for d in os.environ.get("CPATH", "").split(os.pathsep) if d]
    return ctypes.util.find_library("aio") is not None and any((d / "libaio.h").exists() for d in includes)


def worker_env(accelerator: str = "cpu") -> dict:
    env = {"TORCH_EXTENSIONS_DIR": str(torch_extensions_dir()), **training_engine_env(accelerator)}
    if accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    return env
