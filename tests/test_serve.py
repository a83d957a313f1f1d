"""The SGLang runtime's CPU stand-in for its kernels. (Serving itself, on vLLM then SGLang with every smoke check,
lm-eval, the API key and `champion`: the session's default run, tests/test_default_run.py.)"""
from __future__ import annotations


def test_sgl_kernel_stub_imports_and_fails_loudly_when_called():
    """The CPU stand-in lets sglang import its kernels; calling one names the op instead of computing garbage."""
    import subprocess

    from tasks.runtimes import python_for

    code = ("import sgl_kernel, sgl_kernel.kvcacheio as kv\n"
            "from sgl_kernel import silu_and_mul\n"
            "try:\n    kv.transfer_kv_all_layer(1)\nexcept NotImplementedError as e:\n    print('raised:', e)\n")
    r = subprocess.run([python_for("sglang"), "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "raised: sgl_kernel.kvcacheio.transfer_kv_all_layer" in r.stdout
    assert "import-only stub" in r.stdout
