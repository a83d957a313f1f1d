"""Under CI=true a skip whose reason is not on tests/skip_policy.py's allowlist fails the pytest session; an allowed
reason, where the machine truly lacks the thing, does not. Each case is a real inner pytest session."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from skip_policy import _has_nvidia_gpu

pytestmark = pytest.mark.fast

HERE = Path(__file__).resolve().parent


def inner_session(tmp_path: Path, reason: str, ci: bool) -> subprocess.CompletedProcess:
    test = tmp_path / "test_inner.py"
    test.write_text(f"import pytest\n\ndef test_ok():\n    pass\n\n"
                    f"def test_skipped():\n    pytest.skip({reason!r})\n")
    env = dict(os.environ, PYTHONPATH=str(HERE), CI="true" if ci else "false")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "skip_policy", "-p", "no:cacheprovider", "-q",
                           "--rootdir", str(tmp_path), "-c", os.devnull, str(test)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_an_unlisted_skip_fails_a_ci_session_and_is_named(tmp_path):
    r = inner_session(tmp_path, "the sglang runtime is not built", ci=True)
    assert r.returncode == 1, r.stdout[-2000:]
    assert "1 passed, 1 skipped" in r.stdout
    assert "test_inner.py::test_skipped: the sglang runtime is not built" in r.stdout


def test_outside_ci_it_is_only_reported(tmp_path):
    r = inner_session(tmp_path, "the sglang runtime is not built", ci=False)
    assert r.returncode == 0, r.stdout[-2000:]
    assert "would fail it under CI=true" in r.stdout


@pytest.mark.skipif(_has_nvidia_gpu(), reason="this machine has a GPU")
def test_an_allowed_reason_where_the_machine_lacks_the_thing_passes(tmp_path):
    r = inner_session(tmp_path, "needs an NVIDIA GPU (none here)", ci=True)
    assert r.returncode == 0, r.stdout[-2000:]
    assert "allowlist" not in r.stdout
