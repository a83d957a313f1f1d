"""Shared fixtures: an isolated BATON_HOME (MLflow SQLite store, runs, index), the data stage's output, and a small
random-init HF checkpoint with the data stage's tokenizer, for stages that start from HF weights."""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from checkpoints import make_hf_checkpoint, make_qwen2_checkpoint  # noqa: F401  (tests import them from here)
from flows.cli import QUIET_ENV

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"

# One Prefect database per test session (the ephemeral server migrates it once), never the user's ~/.prefect.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="baton-test-prefect-")
os.environ.pop("PREFECT_API_URL", None)
for _k, _v in QUIET_ENV.items():
    os.environ.setdefault(_k, _v)


_MLFLOW_STORE: Path | None = None


def migrated_mlflow_store() -> Path:
    """An empty MLflow SQLite store, migrated once per session (a fresh one costs every new BATON_HOME seconds of
    schema migrations); each BATON_HOME gets a copy, which MLflow then opens as it would its own."""
    global _MLFLOW_STORE
    if _MLFLOW_STORE is None:
        folder = Path(tempfile.mkdtemp(prefix="baton-test-mlflow-"))
        code = ("from mlflow import MlflowClient; import sys; "
                "MlflowClient(tracking_uri=f'sqlite:///{sys.argv[1]}/mlflow.db').search_experiments()")
        subprocess.run([sys.executable, "-c", code, str(folder)], check=True, capture_output=True, timeout=300,
                       env=dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true"))
        _MLFLOW_STORE = folder / "mlflow.db"
    return _MLFLOW_STORE


def mlflow_client(home: Path):
    """A client of the BATON_HOME's own MLflow store, its registry named too: without registry_uri MLflow takes the
    process's registry URI, which baton's tracking.client() sets globally when a test ran a stage in-process (a test
    then read another home's registered models)."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{Path(home) / 'mlflow.db'}"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


@pytest.fixture
def baton_home(tmp_path, monkeypatch):
    home = tmp_path / "baton-home"
    home.mkdir()
    shutil.copy(migrated_mlflow_store(), home / "mlflow.db")
    monkeypatch.setenv("BATON_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return home


def baton(*args: str, home: Path, timeout: float = 1800, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess, as a user would."""
    full = dict(os.environ)
    if not env or "MLFLOW_TRACKING_URI" not in env:
        full.pop("MLFLOW_TRACKING_URI", None)
    full.update(env or {}, BATON_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=timeout)


def cli(*args: str, home: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """The real CLI in this process, for commands where no process boundary is under test (no interpreter start, no
    imports paid again). The environment is put back afterwards: the CLI reads BATON_HOME and a stack's settings
    from it."""
    from flows.cli import main

    import signal

    saved, sigterm = dict(os.environ), signal.getsignal(signal.SIGTERM)  # `run` installs its own SIGTERM handler
    out, err = io.StringIO(), io.StringIO()
    try:
        os.environ.update(env or {})
        os.environ["BATON_HOME"] = str(home)
        if not env or "MLFLOW_TRACKING_URI" not in env:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(args))
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
        signal.signal(signal.SIGTERM, sigterm)
    return subprocess.CompletedProcess(["baton", *args], rc, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session", autouse=True)
def prefect_api(request):
    """One Prefect server for every CLI run of the session (Prefect's own temporary server, started once instead of
    by each `baton run`); tests about starting Prefect leave PREFECT_API_URL out of their run's environment. Not
    started when only fast tests (no engine, server or stack) were selected."""
    if all(item.get_closest_marker("fast") for item in request.session.items):
        yield None
        return
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start()
    os.environ["PREFECT_API_URL"] = server.api_url
    try:
        yield server.api_url
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        server.stop()


@pytest.fixture(scope="session")
def tiny_config():
    from flows.config import load

    return load(TINY)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, tiny_config) -> Path:
    """The data stage's output for configs/tiny.yaml (datasets + tokenizer + manifest), built once per session."""
    from conversions import manifest as mf
    from tasks.data.task import write_data
    from tasks.stage import StageContext

    out = tmp_path_factory.mktemp("data")
    ctx = StageContext(stage="data", run_id="test", run_dir=out, work_dir=out, model=tiny_config.model.model_dump(),
                       seed=0)
    write_data(ctx, tiny_config.data)
    mf.write(out, mf.build(out, format="dataset", stage="data", tokenizer_dir=out / "tokenizer"))
    return out


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory, tiny_config, data_dir) -> Path:
    """A random-init HF checkpoint of the tiny architecture with a manifest (read-only: copy before changing it)."""
    from conversions import hf, manifest as mf

    dest = make_hf_checkpoint(tmp_path_factory.mktemp("hf") / "ckpt", tiny_config.model.model_dump(), data_dir / "tokenizer")
    mf.write(dest, mf.build(dest, format="hf-safetensors", stage="external", parameter_count=hf.parameter_count(dest),
                            dtype="float32", architecture=tiny_config.model.model_dump()))
    return dest


# the real local stack (make up) and what runs on it, shared by test_ops* and test_browser*
from ops_stack import initial_champion, ops_stack, retrain_outcomes  # noqa: E402,F401
# the README's default chain, run once per session against that stack
from default_run import default_run  # noqa: E402,F401

# The time a session fixture may take, added to the per-test limit (pyproject's `timeout`) of every test that uses
# it: whichever of them runs first pays for the fixture.
FIXTURE_SECONDS = {"ops_stack": 600, "default_run": 1800, "retrain_outcomes": 1800, "initial_champion": 120,
                   "hf_checkpoint": 120, "data_dir": 120,
                   "w8a8_export": 300,  # test_quant_export: one llm-compressor quantization (106 s at load 15)
                   "w4a16_export": 300,  # and another, w4a16 (25 s at load 3)
                   "engine_registries": 240}  # test_served_architectures: vLLM's and SGLang's registries, once per build


# Markers by module, so `make test-fast` (-m fast) is the inner loop and the heavy families can be picked out:
# fast = no engine, server, stack or cluster is started. A test's own marker wins; an unlisted module counts as slow.
FAST_MODULES = {"test_vocabulary", "test_config", "test_pretrain_config", "test_distributed", "test_rlhf_nemo_rl",
                "test_verify", "test_launch", "test_serve_preflight"}
FAMILIES = {"test_serve": "serve", "test_serve_promotion": "serve", "test_ops": "ops", "test_ops_postgres": "ops",
            "test_browser": "ops"}
KINDS = ("fast", "slow", "serve", "ops", "gpu")


def pytest_configure(config):
    import reliability_table
    import skip_policy

    for plugin, name in ((reliability_table, "reliability_table"), (skip_policy, "skip_policy")):
        if not config.pluginmanager.is_registered(plugin):
            config.pluginmanager.register(plugin, name)


# `make test` runs two pytest-xdist workers (--dist loadgroup), each with its own session fixtures. The tests that read
# one expensive session run are kept on one worker, so it runs once; every other test goes wherever a worker is free.
SHARED_RUNS = {"default_run": "default-run", "retrain_outcomes": "retrain", "w8a8_export": "w8a8-export",
               "w4a16_export": "w4a16-export"}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker and before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    base = float(config.getini("timeout") or 0)
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        extra = sum(FIXTURE_SECONDS.get(name, 0) for name in fixtures)
        groups = sorted(SHARED_RUNS[name] for name in fixtures & SHARED_RUNS.keys())
        if groups:
            item.add_marker(pytest.mark.xdist_group("+".join(groups)))
        mark = item.get_closest_marker("timeout")
        if extra and base:
            own = float(mark.args[0]) if mark and mark.args else base
            item.add_marker(pytest.mark.timeout(own + extra), append=False)  # before its own: the closest wins
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module in FAMILIES:
            item.add_marker(FAMILIES[module])
        if not any(item.get_closest_marker(k) for k in KINDS):
            item.add_marker("fast" if module in FAST_MODULES else "slow")


def reward_spec(**fields) -> dict:
    """One rlhf.rewards entry as the rlhf worker hands it to tasks.rlhf.rewards.build: the config's defaults for every
    key not given (tasks/rlhf/task.py reward_specs, for a built-in kind)."""
    from tasks import events
    from tasks.rlhf.config import RewardConfig

    entry = RewardConfig(**fields).model_dump(exclude={"function"})
    return events.RewardSpec(**entry, path=None, name=None, source=None).model_dump()
