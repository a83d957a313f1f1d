"""Under CI (true, 1, yes, on) a skip, a skip while collecting or an xfail whose reason is not on
tests/skip_policy.py's allowlist fails the pytest session; an allowed reason, where the machine truly lacks the thing,
does not; BATON_FAIL_IF_ALL_SKIPPED fails a session that skipped everything. Each case is a real inner pytest session."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from skip_policy import _has_nvidia_gpu

pytestmark = pytest.mark.fast

HERE = Path(__file__).resolve().parent


def inner_session(tmp_path: Path, reason: str, ci: bool | str, body: str | None = None,
                  **env_extra: str) -> subprocess.CompletedProcess:
    test = tmp_path / "test_inner.py"
    test.write_text(body or (f"import pytest\n\ndef test_ok():\n    pass\n\n"
                             f"def test_skipped():\n    pytest.skip({reason!r})\n"))
    env = {k: v for k, v in os.environ.items() if k != "BATON_FAIL_IF_ALL_SKIPPED"}
    env.update(PYTHONPATH=str(HERE), CI=ci if isinstance(ci, str) else "true" if ci else "false", **env_extra)
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
    assert "would fail it under CI" in r.stdout


@pytest.mark.skipif(_has_nvidia_gpu(), reason="this machine has a GPU")
def test_an_allowed_reason_where_the_machine_lacks_the_thing_passes(tmp_path):
    r = inner_session(tmp_path, "needs an NVIDIA GPU (none here)", ci=True)
    assert r.returncode == 0, r.stdout[-2000:]
    assert "allowlist" not in r.stdout


@pytest.mark.parametrize("spelling", ["True", "1", "yes", " ON "])
def test_ci_strictness_takes_the_usual_truthy_spellings(tmp_path, spelling):
    r = inner_session(tmp_path, "the sglang runtime is not built", ci=spelling)
    assert r.returncode == 1, r.stdout[-2000:]


def test_a_skip_while_collecting_fails_a_ci_session(tmp_path):
    body = "import pytest\n\npytest.skip('the vllm runtime is not built', allow_module_level=True)\n\n" \
           "def test_never():\n    pass\n"
    r = inner_session(tmp_path, "", ci=True, body=body)
    assert r.returncode == 1, r.stdout[-2000:]
    assert "test_inner.py: the vllm runtime is not built" in r.stdout


def test_an_xfail_fails_a_ci_session(tmp_path):
    body = ("import pytest\n\ndef test_ok():\n    pass\n\n@pytest.mark.xfail(reason='flaky on CPU')\n"
            "def test_known_bad():\n    assert False\n")
    r = inner_session(tmp_path, "", ci=True, body=body)
    assert r.returncode == 1 and "1 passed, 1 xfailed" in r.stdout, r.stdout[-2000:]
    assert "test_inner.py::test_known_bad: xfail: flaky on CPU" in r.stdout


@pytest.mark.skipif(_has_nvidia_gpu(), reason="this machine has a GPU")
def test_a_session_whose_every_test_skipped_fails_where_that_is_asked(tmp_path):
    """`make test-multinode` sets BATON_FAIL_IF_ALL_SKIPPED: even allowed skips, all of them, prove nothing."""
    body = "import pytest\n\ndef test_a():\n    pytest.skip('needs an NVIDIA GPU (none here)')\n"
    r = inner_session(tmp_path, "", ci=False, body=body, BATON_FAIL_IF_ALL_SKIPPED="1")
    assert r.returncode == 1 and "every selected test was skipped" in r.stdout, r.stdout[-2000:]
    r = inner_session(tmp_path, "needs an NVIDIA GPU (none here)", ci=False, BATON_FAIL_IF_ALL_SKIPPED="1")
    assert r.returncode == 0, r.stdout[-2000:]  # one test ran
