"""A second `make up` from another BATON_HOME while a stack holds the ports refuses, naming the owner (before, it
started servers that failed to bind while its profile and credentials replaced the first stack's: the first stack's
runs got 401). A real listening socket plays the first stack's server."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.fast


def test_second_up_refuses_naming_the_stack_that_owns_the_port(tmp_path):
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        owners = tmp_path / "cache" / "baton" / "stack-ports"
        owners.mkdir(parents=True)
        (owners / f"{port}.json").write_text(json.dumps({"home": "/somewhere/first-home", "server": "prefect"}))
        env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), BATON_HOME=str(tmp_path / "second"),
                   BATON_PREFECT_PORT=str(port), PREFECT_HOME=str(tmp_path / "prefect-home"))
        r = subprocess.run([sys.executable, "infra/stack/stack.py", "up"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=120)
    assert r.returncode != 0
    assert f"port {port} (prefect) is already in use by the stack of BATON_HOME=/somewhere/first-home" in r.stderr
    assert not (tmp_path / "second" / "stack" / "pids").exists()  # refused before starting anything
