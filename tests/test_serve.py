"""The SGLang runtime's CPU stand-in for its kernels, and its start while memory shrinks. (Serving itself, on vLLM
then SGLang with every smoke check, lm-eval, the API key and `champion`: the session's default run,
tests/test_default_run.py.)"""
from __future__ import annotations

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


# Takes 3 GiB, page by page, and holds it until killed.
MEMORY_HOG = ("import time\nheld = []\nfor _ in range(24):\n    b = bytearray(128 << 20)\n"
              "    for i in range(0, len(b), 4096):\n        b[i] = 1\n    held.append(b)\ntime.sleep(600)\n")


@pytest.mark.long  # one SGLang start (~40 s)
@pytest.mark.reliability
def test_sglang_starts_while_another_process_takes_memory_during_its_load(tmp_path, hf_checkpoint, record_property):
    """On CPU SGLang measures the machine's free memory before loading and again after. Another process taking
    3 GiB in between (an engine or a test beside it) failed its start with baton's old --mem-fraction-static 0.05:
    "Loaded weights leave no GPU memory for the KV cache" (seen in make test beside the other xdist worker)."""
    from tasks.runtimes import python_for
    from tasks.serve import engines
    from tasks.serve.config import ServeConfig
    from tasks.serve.server import Server, free_port, redactor

    record_property("fault", "free memory shrinks during an engine's load")
    hogs: list[subprocess.Popen] = []

    def take_memory_once_measured(line: str) -> None:
        if "Memory baseline taken" in line and not hogs:  # SGLang's log line right after its first measurement
            hogs.append(subprocess.Popen([sys.executable, "-c", MEMORY_HOG]))

    port = free_port("127.0.0.1")
    cmd, env = engines.sglang_command(ServeConfig(engine="sglang"), python_for("sglang"), hf_checkpoint, port, "m",
                                      "key", secrets_dir=tmp_path)
    server = Server("sglang", cmd, env, f"http://127.0.0.1:{port}", tmp_path / "sglang.log", redactor("key"),
                    on_line=take_memory_once_measured)
    try:
        with server:
            server.wait_healthy(300)
    finally:
        for hog in hogs:
            hog.kill()
    assert hogs, "SGLang never logged its memory baseline: the test did not take memory during the load"
