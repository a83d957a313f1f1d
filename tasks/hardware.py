"""The one GPU probe every stage uses before launch (no torch import: config checks stay fast)."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use: CUDA_VISIBLE_DEVICES when set (empty or -1 hides them all), else the
    device nodes, else what nvidia-smi lists (containers without /dev/nvidiaN nodes)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        ids = [d.strip() for d in env.split(",") if d.strip()]
        return 0 if not ids or ids[0] == "-1" else len(ids)
    nodes = glob.glob("/dev/nvidia[0-9]*")
    if nodes:
        return len(nodes)
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0


def resolve_device(device: str) -> str:
    """`auto` becomes cuda when a GPU is visible, else cpu; cpu and cuda stay as given."""
    if device != "auto":
        return device
    return "cuda" if visible_gpus() else "cpu"


def gpu_memory_gb() -> float | None:
    """Memory of the first visible GPU in GiB (nvidia-smi), or None without one."""
    smi = shutil.which("nvidia-smi")
    if not smi or not visible_gpus():
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=15)
        return float(out.stdout.split()[0]) / 1024 if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


def host_memory_gb() -> float:
    """This machine's RAM in GiB."""
    import psutil

    return psutil.virtual_memory().total / 2**30
