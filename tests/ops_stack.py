"""The real local stack for operations tests: `make up` in a private BATON_HOME on free ports, `make down` after.

Shared by tests/test_ops*.py and tests/test_browser*.py through the session fixtures below (imported by conftest).
Also: the initial champion every retraining test starts from, and helpers to drive the Prefect CLI and API.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tasks import orchestration
from tasks.distributed.net import free_port

REPO = Path(__file__).resolve().parent.parent


MLFLOW_CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


class Stack:
    def __init__(self, home: Path, db: str = "sqlite"):
        self.home, self.db = home, db
        self.saved_credentials: dict | None = None
        self.ports = {"BATON_PREFECT_PORT": str(free_port()), "BATON_MLFLOW_PORT": str(free_port()),
                      "BATON_PG_PORT": str(free_port())}

    def make_env(self, **more) -> dict:
        # the stack's own Prefect profiles (`make up` makes a `baton` profile active there), not the test session's
        env = dict(os.environ, BATON_HOME=str(self.home), PREFECT_HOME=str(self.home / "prefect-client"), **self.ports,
                   **more)
        # and not this session's client settings: the stack sets its worker's own (PREFECT_CLIENT_MAX_RETRIES)
        for k in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "PREFECT_UI_URL", "PREFECT_PROFILE", *MLFLOW_CREDENTIALS,
                  "PREFECT_API_AUTH_STRING", *orchestration.CLIENT_DEFAULTS):
            env.pop(k, None)
        return env

    def up(self, timeout: float = 600, **more) -> subprocess.CompletedProcess:
        t0 = time.time()
        proc = subprocess.run(["make", "--no-print-directory", "up", f"DB={self.db}"], cwd=REPO,
                              env=self.make_env(**more), capture_output=True, text=True, timeout=timeout)
        self.up_seconds = time.time() - t0
        assert proc.returncode == 0, f"make up failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        return proc

    def down(self, purge: bool = True) -> None:
        for k, v in (self.saved_credentials or {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self.saved_credentials = None
        subprocess.run(["make", "--no-print-directory", "down"], cwd=REPO, env=self.make_env(), capture_output=True,
                       text=True, timeout=180)
        if purge:
            subprocess.run([sys.executable, str(REPO / "infra" / "stack" / "stack.py"), "down", "--purge"], cwd=REPO,
                           env=self.make_env(), capture_output=True, timeout=120)

    @property
    def env(self) -> dict:
        """The client environment: what `baton` and `prefect` read from stack.env."""
        env = self.make_env()
        for line in (self.home / "stack.env").read_text().splitlines():
            if "=" in line and not line.startswith("#"):
                k, v = line.split("=", 1)
                env[k] = v
        return env

    @property
    def prefect_url(self) -> str:
        return self.env["PREFECT_UI_URL"]

    @property
    def mlflow_url(self) -> str:
        return self.env["MLFLOW_TRACKING_URI"]

    def prefect(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(REPO / ".venv" / "bin" / "prefect"), *args], cwd=REPO, env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        if check:
            assert proc.returncode == 0, f"prefect {' '.join(args)}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        return proc

    def api(self, method: str, path: str, body: dict | None = None):
        import urllib.request

        req = urllib.request.Request(self.env["PREFECT_API_URL"] + path, method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json", **self.auth_headers(),
                                              **self.csrf_headers()})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"null")

    def auth_headers(self) -> dict:
        """The stack's Prefect server wants its auth string (stack.env) as HTTP basic auth, as Prefect's clients
        send it."""
        import base64

        return {"Authorization": "Basic " + base64.b64encode(self.env["PREFECT_API_AUTH_STRING"].encode()).decode()}

    def csrf_headers(self) -> dict:
        """The stack's Prefect server wants a CSRF token on every write, as its own clients and UI send one."""
        import urllib.request
        import uuid

        client = uuid.uuid4().hex
        req = urllib.request.Request(f"{self.env['PREFECT_API_URL']}/csrf-token?client={client}",
                                     headers=self.auth_headers())
        with urllib.request.urlopen(req, timeout=30) as r:
            return {"Prefect-Csrf-Token": json.loads(r.read())["token"], "Prefect-Csrf-Client": client}

    def use_mlflow_credentials(self) -> None:
        """MLflow's client reads the basic-auth user from the environment at each request: tests' own MlflowClients
        (in this process) log in as `baton` does, with the credentials in this stack's stack.env."""
        env = self.env
        if self.saved_credentials is None:  # another stack's, given back by down()
            self.saved_credentials = {k: os.environ.get(k) for k in MLFLOW_CREDENTIALS}
        for k in MLFLOW_CREDENTIALS:
            os.environ[k] = env[k]

    def mlflow(self):
        from mlflow import MlflowClient

        self.use_mlflow_credentials()
        return MlflowClient(tracking_uri=self.mlflow_url, registry_uri=self.mlflow_url)

    def run_deployment(self, name: str, params: dict, watch: bool = True, timeout: float = 1200,
                       job_variables: dict | None = None) -> str:
        """`prefect deployment run NAME --param k=json ...` (what a user types); returns the flow run id."""
        args = ["deployment", "run", name]
        for k, v in params.items():
            args += ["--param", f"{k}={json.dumps(v)}"]
        for k, v in (job_variables or {}).items():
            args += ["--job-variable", f"{k}={json.dumps(v)}"]
        if watch:
            args += ["--watch", "--watch-timeout", str(int(timeout))]
        proc = self.prefect(*args, timeout=timeout + 60, check=False)
        out = proc.stdout + proc.stderr
        run_id = next((line.split("UUID:")[1].strip().split()[0] for line in out.splitlines() if "UUID:" in line), None)
        assert run_id, f"no flow run id in:\n{out[-4000:]}"
        self.last_output = out
        return run_id

    def pause_schedules(self) -> None:
        """Tests start runs themselves: a cron run (the nightly retraining) must not fire in the middle of one."""
        for d in self.api("POST", "/deployments/filter", {}):
            for sch in d.get("schedules") or []:
                self.api("PATCH", f"/deployments/{d['id']}/schedules/{sch['id']}", {"active": False})

    def flow_run(self, run_id: str) -> dict:
        return self.api("GET", f"/flow_runs/{run_id}")

    def wait_state(self, run_id: str, states: set[str], timeout: float = 600) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            fr = self.flow_run(run_id)
            if fr["state_type"] in states:
                return fr
            time.sleep(2)
        raise AssertionError(f"flow run {run_id} not in {states} after {timeout}s: {fr['state_type']}")

    def logs(self, run_id: str, min_level: int = 0) -> str:
        rows = self.api("POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}, "level": {"ge_": min_level}},
                                                 "limit": 200})
        return "\n".join(r["message"] for r in rows)

    def logs_all(self, run_id: str, min_level: int = 0) -> str:
        """Logs of the flow run and of its subflow runs (stage logs live in the stage's subflow run)."""
        subs = self.api("POST", "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [run_id]}}})
        return "\n".join(self.logs(i, min_level) for i in [run_id] + [s["id"] for s in subs])


def stack_home(prefix: str) -> Path:
    """A BATON_HOME other users can traverse (PostgreSQL runs as its own user; pytest's tmp dirs are 0700)."""
    d = Path(tempfile.mkdtemp(prefix=prefix))
    d.chmod(0o755)
    return d


def running_stack(**env):
    """Prefect server + process worker + every deployment in prefect.yaml + MLflow server, via `make up`; `env` goes
    to the stack's processes (the worker's owner's settings)."""
    home = stack_home("baton-ops-")
    stack = Stack(home)
    try:
        stack.up(**env)
        stack.use_mlflow_credentials()
        stack.pause_schedules()
        yield stack
    finally:
        stack.down()
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def ops_stack():
    # the worker's owner decides retry timing (job variables cannot carry env: bootstrap.LAUNCH_VARIABLES)
    yield from running_stack(BATON_INFRA_RETRY_DELAY_S="1")


def register_initial_champion(stack: Stack, hf_checkpoint: Path, dest: Path) -> dict:
    """A random-init HF checkpoint registered as baton-tiny with alias `champion` and no data lineage."""
    from conversions import manifest as mf

    shutil.copytree(hf_checkpoint, dest)
    c = stack.mlflow()
    exp = c.get_experiment_by_name("baton").experiment_id
    run = c.create_run(exp, run_name="initial-champion", tags={"baton.stage": "external"}).info
    c.log_artifact(run.run_id, str(dest / mf.MANIFEST_NAME), "checkpoint")
    c.set_terminated(run.run_id)
    try:  # another test on this stack (the browser's tiny run) may have registered it already
        c.create_registered_model("baton-tiny")
    except Exception as e:
        if "RESOURCE_ALREADY_EXISTS" not in str(e):
            raise
    mv = c.create_model_version("baton-tiny", source=f"{run.artifact_uri}/checkpoint", run_id=run.run_id, tags={
        "stage": "external", "format": "hf-safetensors", "manifest_digest": mf.digest_of(mf.read(dest)),
        "data_digest": "", "checkpoint_path": str(dest)})
    c.set_registered_model_alias("baton-tiny", "champion", mv.version)
    return {"version": mv.version, "path": str(dest)}


@pytest.fixture(scope="session")
def initial_champion(ops_stack, hf_checkpoint, tmp_path_factory) -> dict:
    return register_initial_champion(ops_stack, hf_checkpoint, tmp_path_factory.mktemp("champion") / "v0")


def runs_tagged(c, key: str, value: str):
    exp = c.get_experiment_by_name("baton").experiment_id
    return c.search_runs([exp], filter_string=f"tags.`{key}` = '{value}'")


# ---- retraining, run once per session through the nightly deployment ------------------------------------------------
RETRAIN = {"finetune": {"steps": 30, "nproc_per_node": 1, "checkpoint_every": 15, "warmup_steps": 3},
           "serve": {"engine": "vllm", "lm_eval": {"enabled": False},
                     "smoke": {"json_requests": 3, "parity_prompts": 1, "parity_tokens": 8}},
           "policy": {"margin": 0.02, "serve": True}}


def _decision(stack, fr_id: str) -> dict:
    c = stack.mlflow()
    (run,) = [r for r in runs_tagged(c, "prefect.flow_run_id", fr_id) if r.data.tags.get("baton.stage") == "retrain"]
    path = c.download_artifacts(run.info.run_id, "decision.json")
    return json.loads(Path(path).read_text())


def _champion(stack) -> str:
    return stack.mlflow().get_model_version_by_alias("baton-tiny", "champion").version


@pytest.fixture(scope="session")
def retrain_outcomes(ops_stack, initial_champion):
    """The nightly retraining deployment, run twice: new clean data (v2), then new data with every fine-tuning label
    wrong (v3, label_noise 1.0)."""
    out = {"initial": initial_champion["version"]}
    for rev, noise in (("v2", 0.0), ("v3", 1.0)):
        t0 = time.time()
        fr_id = ops_stack.run_deployment("baton-retrain/nightly",
                                         {**RETRAIN, "data": {"revision": rev, "label_noise": noise}})
        serving_file = ops_stack.home / "serving.json"
        out[rev] = {"flow_run": ops_stack.flow_run(fr_id), "decision": _decision(ops_stack, fr_id),
                    "champion": _champion(ops_stack), "seconds": round(time.time() - t0, 1),
                    "serving": json.loads(serving_file.read_text()) if serving_file.exists() else None}
        print(f"retrain {rev}: {out[rev]['decision']['decision']} in {out[rev]['seconds']}s "
              f"(champion {out[rev]['decision'].get('champion_score')} → candidate "
              f"{out[rev]['decision'].get('candidate_score')})")
    return out


