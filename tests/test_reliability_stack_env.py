"""stack.env (issue 25, stack): BATON_HOME defaults to ./.baton, so `baton` started in a folder someone else prepared
read its stack.env and copied every key into every engine's environment (a planted PYTHONPATH made engines import the
planter's code). Only what `make up` writes is accepted: its keys, loopback URLs, a 0600 file the user owns."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks import stack_env

pytestmark = [pytest.mark.fast, pytest.mark.reliability]
REPO = Path(__file__).resolve().parents[1]
GOOD = {"PREFECT_API_URL": "http://127.0.0.1:4211/api", "PREFECT_UI_URL": "http://127.0.0.1:4211",
        "MLFLOW_TRACKING_URI": "http://127.0.0.1:5011", "BATON_WORK_POOL": "baton-local"}


def _baton_env_in(folder: Path) -> subprocess.CompletedProcess:
    """`baton`'s start-up in folder (no BATON_HOME, no PYTHONPATH): what it puts into the environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("BATON_HOME", "PYTHONPATH", "MLFLOW_TRACKING_URI")}
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from flows.cli import _env_defaults; _env_defaults(); "
            "import os; print(os.environ.get('PYTHONPATH'), os.environ.get('MLFLOW_TRACKING_URI'))")
    return subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True, timeout=60)


def _plant(folder: Path, text: str, mode: int = 0o600) -> Path:
    path = folder / ".baton" / "stack.env"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_planted_pythonpath_is_refused_naming_file_and_key(tmp_path, record_property):
    record_property("fault", "stack.env planted in the current folder")
    _plant(tmp_path, "# written by `make up`\nPYTHONPATH=/tmp/evil-secret-dir\n")
    r = _baton_env_in(tmp_path)
    assert r.returncode != 0 and "/tmp/evil-secret-dir" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert f"{tmp_path}/.baton/stack.env:2: PYTHONPATH is not a key `make up` writes" in r.stderr, r.stderr


@pytest.mark.parametrize("text, mode, expected", [
    ("MLFLOW_TRACKING_URI=http://attacker.example:5000\n", 0o600, ":1: MLFLOW_TRACKING_URI is not an http(s) URL on"),
    ("MLFLOW_TRACKING_URI=http://127.0.0.1:5011\n", 0o644, "has mode 644; `make up` writes it 0600"),
    ("hunter2\n", 0o600, ":1: not a KEY=VALUE line"),
])
def test_a_stack_env_not_as_make_up_writes_it_is_refused(tmp_path, text, mode, expected, record_property):
    record_property("fault", "stack.env planted in the current folder")
    path = _plant(tmp_path, text, mode)
    with pytest.raises(stack_env.StackEnvError, match="stack.env") as e:
        stack_env.read(path)
    assert expected in str(e.value) and "attacker" not in str(e.value) and "hunter2" not in str(e.value)


def test_a_stack_env_owned_by_another_user_or_linked_is_refused(tmp_path, record_property):
    record_property("fault", "stack.env planted in the current folder")
    path = stack_env.write(tmp_path / "stack.env", GOOD)
    link = tmp_path / "linked.env"
    link.symlink_to(path)
    with pytest.raises(stack_env.StackEnvError, match="not a regular file"):
        stack_env.read(link)
    try:
        os.chown(path, os.getuid() + 1, -1)
    except PermissionError:
        pytest.skip("only root can give a file away")
    with pytest.raises(stack_env.StackEnvError, match=r"is owned by uid \d+, not by this user"):
        stack_env.read(path)


def _stack_module():
    sys.path.insert(0, str(REPO / "infra" / "stack"))
    try:
        import stack
    finally:
        sys.path.remove(str(REPO / "infra" / "stack"))
    return stack


def test_what_make_up_writes_is_read_back(tmp_path, monkeypatch):
    stack = _stack_module()
    monkeypatch.setenv("BATON_HOME", str(tmp_path / "home"))
    written = {**stack.client_env(), **stack.credentials()}
    assert set(written) == set(stack_env.KEYS)
    path = stack_env.write(tmp_path / "stack.env", written)
    assert oct(path.stat().st_mode & 0o777) == "0o600" and stack_env.read(path) == written
    _plant(tmp_path / "cwd", path.read_text())
    r = _baton_env_in(tmp_path / "cwd")
    assert r.returncode == 0 and r.stdout.split() == ["None", stack.client_env()["MLFLOW_TRACKING_URI"]], r.stderr


def test_the_stack_s_credentials_are_made_once_per_baton_home_and_kept_0600(tmp_path, monkeypatch):
    """MLflow creates its admin user once, with the first password it is given: `make up` must give the same one
    again (a new one would lock every client out), another BATON_HOME gets its own, and only the user reads them."""
    stack = _stack_module()
    monkeypatch.setenv("BATON_HOME", str(tmp_path / "a"))
    first = stack.credentials()
    assert first == stack.credentials() and set(first) == set(stack_env.CREDENTIAL_KEYS)
    assert oct(stack.secrets_file().stat().st_mode & 0o777) == "0o600"
    assert first["PREFECT_API_AUTH_STRING"].startswith("baton:") and len(first["MLFLOW_TRACKING_PASSWORD"]) >= 40
    monkeypatch.setenv("BATON_HOME", str(tmp_path / "b"))
    other = stack.credentials()
    assert other["PREFECT_API_AUTH_STRING"] != first["PREFECT_API_AUTH_STRING"]
    assert other["MLFLOW_TRACKING_PASSWORD"] != first["MLFLOW_TRACKING_PASSWORD"]
    stack.secrets_file().chmod(0o644)
    with pytest.raises(stack_env.StackEnvError, match="secrets.env: has mode 644"):
        stack.credentials()


def test_a_credential_not_as_make_up_generates_it_is_refused_unechoed(tmp_path, record_property):
    record_property("fault", "stack.env planted in the current folder")
    path = _plant(tmp_path, "PREFECT_API_AUTH_STRING=baton:hunter2 --extra\n")
    with pytest.raises(stack_env.StackEnvError, match=":1: PREFECT_API_AUTH_STRING is not a credential") as e:
        stack_env.read(path)
    assert "hunter2" not in str(e.value)


def test_the_stack_s_prefect_server_wants_csrf_tokens_and_only_its_ui_s_origin(record_property):
    """A web page the user visits must not drive the API: CSRF on (Prefect's default is off), CORS only for the UI
    (its default is `*`). Checked live with `make up`: a tokenless POST gets 403, another origin's preflight 400."""
    record_property("fault", "Prefect API open to any web page")
    stack = _stack_module()
    env = stack.prefect_server_env(None, "baton:x")
    assert env["PREFECT_SERVER_CSRF_PROTECTION_ENABLED"] == "true"
    assert env["PREFECT_SERVER_CORS_ALLOWED_ORIGINS"] == stack.client_env()["PREFECT_UI_URL"]
