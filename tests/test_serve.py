"""The SGLang runtime's CPU stand-in for its kernels, and its start while memory shrinks. (Serving itself, on vLLM
then SGLang with every smoke check, lm-eval, the API key and `champion`: the session's default run,
tests/test_default_run.py.)"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest


def test_sgl_kernel_stub_imports_and_fails_loudly_when_called():
    """The CPU stand-in lets sglang import its kernels; calling one names the op instead of computing garbage."""
    from tasks.runtimes import python_for

    code = ("import sgl_kernel, sgl_kernel.kvcacheio as kv\n"
            "from sgl_kernel import silu_and_mul\n"
            "try:\n    kv.transfer_kv_all_layer(1)\nexcept NotImplementedError as e:\n    print('raised:', e)\n")
    r = subprocess.run([python_for("sglang"), "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "raised: sgl_kernel.kvcacheio.transfer_kv_all_layer" in r.stdout
    assert "import-only stub" in r.stdout


# Takes 3 GiB, page by page, says so, and holds it until killed.
MEMORY_HOG = ("import time\nheld = []\nfor _ in range(24):\n    b = bytearray(128 << 20)\n"
              "    for i in range(0, len(b), 4096):\n        b[i] = 1\n    held.append(b)\n"
              "print('held', flush=True)\ntime.sleep(600)\n")
HOG_GB = 3 * 1.073741824


@pytest.mark.long  # one SGLang start (~40 s)
@pytest.mark.reliability
def test_sglang_starts_while_another_process_takes_memory_during_its_load(tmp_path, hf_checkpoint, record_property):
    """On CPU SGLang measures the machine's free memory before loading and again after. Another process taking
    3 GiB in between (an engine or a test beside it) failed its start with baton's old --mem-fraction-static 0.05:
    "Loaded weights leave no GPU memory for the KV cache" (seen in make test beside the other xdist worker).
    The fault is made to happen, not hoped for: right after SGLang's first measurement ("Load weight begin") its
    processes are paused until the hog holds its 3 GiB; SGLang's own second measurement must then count them."""
    import psutil

    from tasks.runtimes import python_for
    from tasks.serve import engines
    from tasks.serve.config import ServeConfig
    from tasks.serve.server import Server, free_port, redactor

    record_property("fault", "free memory shrinks during an engine's load")
    hogs: list[subprocess.Popen] = []
    held: list[str] = []
    load_usage_gb: list[float] = []

    def take_memory_between_its_measurements(line: str) -> None:
        if "Load weight begin" in line and not hogs:
            paused = psutil.Process(server.proc.pid).children(recursive=True)
            for proc in paused:
                proc.suspend()
            try:
                hogs.append(subprocess.Popen([sys.executable, "-c", MEMORY_HOG], stdout=subprocess.PIPE, text=True))
                held.append(hogs[0].stdout.readline().strip())
            finally:
                for proc in paused:
                    proc.resume()
        found = re.search(r"Load weight end\..* mem usage=([0-9.]+) GB", line)
        if found:
            load_usage_gb.append(float(found.group(1)))

    port = free_port("127.0.0.1")
    cmd, env = engines.sglang_command(ServeConfig(engine="sglang"), python_for("sglang"), hf_checkpoint, port, "m",
                                      "key", secrets_dir=tmp_path)
    server = Server("sglang", cmd, env, f"http://127.0.0.1:{port}", tmp_path / "sglang.log", redactor("key"),
                    on_line=take_memory_between_its_measurements)
    try:
        with server:
            server.wait_healthy(300)
    finally:
        for hog in hogs:
            hog.kill()
    # the fault happened: the hog held its memory, and SGLang's own load measurement counted it. The tiny model's
    # weights are a few MB, so a usage over 1 GB is the hog's; the bound sits well under the hog's 3.2 GB because
    # the machine's free memory also moves with the test beside this one (CI measured 2.09 GB with the hog counted)
    assert held == ["held"], "the hog never took its memory during SGLang's load"
    assert load_usage_gb and load_usage_gb[0] > HOG_GB / 3, \
        f"SGLang's load measured {load_usage_gb} GB: the hog's memory fell outside its two measurements"
