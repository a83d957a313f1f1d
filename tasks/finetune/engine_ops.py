"""DeepSpeed's CPU ops, JIT-built once per runtime into the cache its workers load them from (engine_env): the shm
collective every CPU run uses, and async I/O + pinned memory for ZeRO-Infinity's NVMe offload. A training run that
found them missing would build them itself, inside its own launch (5 min alone on 2 cores, 15 min beside a busy test
suite). `make runtimes` runs this; once built it loads and exits in seconds.

    python -m tasks.finetune.engine_ops
"""
from __future__ import annotations

import os
import sys
import time

from tasks.finetune.engine_env import libaio_available, torch_extensions_dir, worker_env

OPS = {"ShareMemCommBuilder": "deepspeed_shm_comm", "AsyncIOBuilder": "async_io", "PinMemoryBuilder": "pin_memory"}
NEEDS_LIBAIO = {"AsyncIOBuilder"}


def wanted() -> list[str]:
    return [name for name in OPS if name not in NEEDS_LIBAIO or libaio_available()]


def missing() -> list[str]:
    """The ops with no built library in this runtime's cache (its key names the torch and DeepSpeed installs)."""
    root = torch_extensions_dir()
    return [name for name in wanted() if not (root / OPS[name] / f"{OPS[name]}.so").exists()]


def build(names: list[str]) -> list[str]:
    os.environ.update(worker_env("cpu"))
    from deepspeed.accelerator import get_accelerator

    built = []
    for name in names:
        started = time.monotonic()
        get_accelerator().create_op_builder(name).load(verbose=False)
        built.append(f"{name} {time.monotonic() - started:.0f}s")
    return built


if __name__ == "__main__":
    if todo := missing():
        print(f"[runtimes] DeepSpeed ops built in {torch_extensions_dir()}: {', '.join(build(todo))}", file=sys.stderr)
    if not libaio_available():
        print("[runtimes] DeepSpeed AsyncIOBuilder not built: no libaio (`make system-deps` installs it)", file=sys.stderr)
