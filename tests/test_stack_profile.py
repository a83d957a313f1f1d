"""`make up` makes a `baton` Prefect profile active, so the `prefect` CLI in a fresh shell talks to the stack;
`make down` makes the previous profile active again. Real Prefect profile files in a private PREFECT_HOME."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.fast
PREFECT = str(REPO / ".venv" / "bin" / "prefect")


def _env(tmp_path) -> dict:
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect-home"), BATON_HOME=str(tmp_path / "baton"))
    for k in ("PREFECT_API_URL", "PREFECT_UI_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH"):
        env.pop(k, None)
    return env


def _stack(env: dict, call: str) -> str:
    code = f"import sys; sys.path.insert(0, 'infra/stack'); import stack; print({call})"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip()


def _prefect(env: dict, *args: str) -> str:
    r = subprocess.run([PREFECT, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


def test_up_activates_a_baton_profile_and_down_restores_the_previous_one(tmp_path):
    env = _env(tmp_path)
    home = tmp_path / "prefect-home"
    home.mkdir()
    (home / "profiles.toml").write_text('active = "mine"\n\n[profiles.mine]\nPREFECT_SERVER_EPHEMERAL_ENABLED = "true"\n')
    previous, api = _stack(env, "(stack.activate_profile(), stack.activate_profile(), stack.client_env()['PREFECT_API_URL'])")[1:-1].replace("'", "").split(", ")[1:]
    assert previous == "mine"  # `up` twice still remembers the user's own profile
    view = _prefect(env, "config", "view")
    assert "PREFECT_PROFILE='baton'" in view and f"PREFECT_API_URL='{api}'" in view
    assert _stack(env, "stack.restore_profile()") == "mine"
    view = _prefect(env, "config", "view")
    assert "PREFECT_PROFILE='mine'" in view and "PREFECT_API_URL" not in view
    assert "[profiles.baton]" not in (home / "profiles.toml").read_text()


def test_the_profile_carries_the_auth_string_in_a_file_only_the_user_reads(tmp_path):
    """A fresh shell's `prefect` CLI needs the stack's auth string: the profile holds it, so the profiles file, even
    one the user had made world-readable, becomes 0600 before the secret goes in."""
    env = _env(tmp_path)
    home = tmp_path / "prefect-home"
    home.mkdir()
    (home / "profiles.toml").write_text('active = "mine"\n\n[profiles.mine]\n')
    (home / "profiles.toml").chmod(0o644)
    _stack(env, "stack.activate_profile('baton:not-a-real-secret')")
    assert oct((home / "profiles.toml").stat().st_mode & 0o777) == "0o600"
    assert "PREFECT_API_AUTH_STRING = \"baton:not-a-real-secret\"" in (home / "profiles.toml").read_text()
