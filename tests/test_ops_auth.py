"""The stack asks who you are (issue 25): on `make up`'s servers an unauthenticated or wrongly authenticated request to
the Prefect API or to the MLflow API gets 401; the credentials live in 0600 files and reach the servers, the worker and
the clients through their environment, never a command line another user's `ps` shows."""
from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
import uuid

import psutil
import pytest

pytestmark = [pytest.mark.ops, pytest.mark.reliability]


def _status(url: str, method: str = "GET", user_pass: str | None = None, body: dict | None = None):
    headers = {"Content-Type": "application/json"}
    if user_pass is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(user_pass.encode()).decode()
    req = urllib.request.Request(url, method=method, headers=headers,
                                 data=json.dumps(body).encode() if body is not None else None)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.headers  # (case-insensitive names)


def test_the_prefect_api_answers_only_with_the_auth_string(ops_stack, record_property):
    record_property("fault", "a request to the Prefect API without its auth string")
    api, auth = ops_stack.env["PREFECT_API_URL"], ops_stack.env["PREFECT_API_AUTH_STRING"]
    flow_run = f"{api}/flow_runs/{uuid.uuid4()}"
    assert _status(f"{api}/admin/version")[0] == 401
    assert _status(flow_run)[0] == 401
    assert _status(f"{api}/csrf-token?client=x")[0] == 401  # so no write either: each needs a CSRF token
    assert _status(f"{api}/admin/version", user_pass=auth + "x")[0] == 401
    assert _status(f"{api}/admin/version", user_pass=auth)[0] == 200
    assert _status(flow_run, user_pass=auth)[0] == 404
    assert _status(f"{api}/health")[0] == 200  # the liveness probe stays open (Prefect's own exemption)


def test_the_mlflow_api_answers_only_with_the_user_and_password(ops_stack, record_property):
    record_property("fault", "a request to the MLflow API without credentials")
    url, env = ops_stack.mlflow_url, ops_stack.env
    search = f"{url}/api/2.0/mlflow/experiments/search?max_results=1"
    code, headers = _status(search)
    assert code == 401 and headers.get("WWW-Authenticate", "").startswith("Basic")  # a browser prompts
    assert _status(f"{url}/ajax-api/2.0/mlflow/experiments/search?max_results=1")[0] == 401  # the UI's API
    assert _status(f"{url}/")[0] == 401
    user, password = env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"]
    assert _status(search, user_pass=f"{user}:{password}x")[0] == 401
    assert _status(search, user_pass=f"{user}:{password}")[0] == 200
    # checked at every request: one PBKDF2 round (the password is 256 random bits), not scrypt's 0.15 s of CPU
    import sqlite3

    with sqlite3.connect(ops_stack.home / "stack" / "mlflow" / "auth.db") as db:
        (stored,), = db.execute("SELECT password_hash FROM users WHERE username = ?", (user,)).fetchall()
    assert stored.startswith("pbkdf2:sha256:1$"), stored.split("$")[0]


def test_the_credentials_are_in_0600_files_and_on_no_command_line(ops_stack, record_property):
    record_property("fault", "the stack's credentials readable by other users")
    home = ops_stack.home
    for f in (home / "stack" / "secrets.env", home / "stack.env", home / "prefect-client" / "profiles.toml"):
        assert oct(f.stat().st_mode & 0o777) == "0o600", f
    env = ops_stack.env
    secrets = [env["PREFECT_API_AUTH_STRING"], env["MLFLOW_TRACKING_PASSWORD"],
               env["PREFECT_API_AUTH_STRING"].split(":", 1)[1]]
    seen, shown = 0, []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        seen += 1
        shown += [p.info["pid"] for s in secrets if s in cmdline]
    assert seen > 10 and not shown, f"a credential on the command line of pids {shown}"
    # they do reach the servers and the worker, through the environment (readable by the user only)
    servers = {name: psutil.Process(int((home / "stack" / "pids" / f"{name}.pid").read_text()))
               for name in ("prefect-server", "prefect-worker", "mlflow-server")}
    assert servers["prefect-server"].environ()["PREFECT_SERVER_API_AUTH_STRING"] == secrets[0]
    assert servers["prefect-worker"].environ()["PREFECT_API_AUTH_STRING"] == secrets[0]
    assert servers["mlflow-server"].environ()["MLFLOW_AUTH_ADMIN_PASSWORD"] == secrets[1]


@pytest.mark.parametrize("job_variables", [{"env": {"PYTHONPATH": "/tmp/planted"}}, {"command": "touch /tmp/pwned"},
                                           {"working_dir": "/tmp"}], ids=["env", "command", "working_dir"])
def test_a_deployment_run_cannot_choose_what_the_worker_runs(ops_stack, job_variables, record_property):
    record_property("fault", "command or env in a deployment run's job variables")
    deployment = ops_stack.api("GET", "/deployments/name/baton-pipeline/tiny")
    far = {"type": "SCHEDULED", "state_details": {"scheduled_time": "2100-01-01T00:00:00Z"}}  # never run if created
    with pytest.raises(urllib.error.HTTPError) as refused:
        ops_stack.api("POST", f"/deployments/{deployment['id']}/create_flow_run",
                      {"job_variables": job_variables, "state": far})
    assert refused.value.code == 422, refused.value.read()
    assert f"'{next(iter(job_variables))}' was unexpected" in refused.value.read().decode()
