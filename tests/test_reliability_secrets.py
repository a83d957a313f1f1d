"""Secrets and permissions (issue 12, item 8), for real: SGLang's own argument parser gets the API key from a 0600
file (not the command line); secrets are redacted from MLflow params and artifacts; BATON_HOME and what `baton`
writes are private; run ids and serve.host are confined; PostgreSQL asks every connection for a password."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TINY, baton, cli, mlflow_client
from tasks import paths, secrets, tracking
from tasks.serve import engines
from tasks.serve.config import ServeConfig

pytestmark = pytest.mark.reliability
KEY = "baton-SECRET-key-123"
TOKEN = "hf_SECRETtoken4242"


def _files_holding(root: Path, secret: str) -> list[str]:
    return [str(f) for f in root.rglob("*") if f.is_file() and not f.is_symlink() and secret.encode() in f.read_bytes()]


@pytest.mark.slow
def test_runtime_env_secrets_stay_out_of_prefect_mlflow_and_the_run_folder(baton_home, tmp_path, record_property):
    """A real `baton run`: the token in runtimes.main.env is nowhere in Prefect's stored parameters (its own client
    and the raw database), MLflow, config.yaml or summary.json; an engine launched on that runtime still gets it."""
    record_property("fault", "secret in runtimes.*.env")
    sets = ["--set", f"runtimes.main.env.HF_TOKEN={TOKEN}", "--set", "runtimes.main.env.OMP_NUM_THREADS=1"]
    r = baton("run", str(TINY), "--stages", "data", *sets, home=baton_home, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert TOKEN not in r.stdout + r.stderr
    run_dir = baton_home / "runs" / r.stdout.strip().splitlines()[-1].rsplit("/", 1)[-1]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert TOKEN not in (run_dir / "config.yaml").read_text() and TOKEN not in json.dumps(summary)

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as pc:
        flow_run = pc.read_flow_run(summary["prefect_flow_run_id"])
        every_run = pc.read_flow_runs(limit=200)
    assert flow_run.parameters["config"]["runtimes"]["main"]["env"]["HF_TOKEN"] == "**********"
    assert len(every_run) >= 2 and not [f.name for f in every_run if TOKEN in json.dumps(f.parameters)]
    prefect_home = Path(os.environ["PREFECT_HOME"])
    assert (prefect_home / "prefect.db").exists()
    assert not _files_holding(prefect_home, TOKEN)  # the ephemeral server's database (+ WAL), logs, results

    c = mlflow_client(baton_home)
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()])
    assert runs and all(TOKEN not in json.dumps([r.data.params, r.data.tags]) for r in runs)
    assert c.get_run(summary["mlflow_run_id"]).data.params["runtimes.main.env.HF_TOKEN"] != TOKEN
    assert not _files_holding(baton_home, TOKEN)  # run folder, logs, MLflow store and artifacts

    # an engine on the `main` runtime, started the way training stages start theirs (torchrun), sees the value
    from flows.config import load
    from tasks.distributed import Launch, engine_command
    from tasks.stage import StageContext

    cfg = load(TINY, [s for s in sets if s != "--set"], ["data"])
    ctx = StageContext(stage="probe", run_id="probe", run_dir=tmp_path, work_dir=tmp_path, model={}, seed=0,
                       runtimes=cfg.engine_runtimes())
    probe = tmp_path / "probe.py"
    probe.write_text("import hashlib, os\nfrom tasks.events import emit\n"
                     "emit('result', token_sha256=hashlib.sha256(os.environ['HF_TOKEN'].encode()).hexdigest(), "
                     "threads=os.environ['OMP_NUM_THREADS'])\n")
    cmd = engine_command(Launch(python=sys.executable, script=str(probe), nnodes=1, nproc_per_node=1,
                                launcher="torchrun", master_port=0), ctx.runtimes["main"], tmp_path)
    assert TOKEN not in " ".join(cmd)
    res = ctx.launch(cmd, name="probe", timeout=300)
    assert res.returncode == 0, res.tail
    assert res.results() == {"token_sha256": hashlib.sha256(TOKEN.encode()).hexdigest(), "threads": "1"}
    assert TOKEN not in (tmp_path / "engine.log").read_text()
    ray = engine_command(Launch(python="py", script="w.py", nnodes=1, nproc_per_node=1, launcher="torchrun",
                                master_port=0),
                         {"kind": "ray", "address": "head:6379", "env": {"HF_TOKEN": TOKEN}})
    assert TOKEN not in " ".join(ray) and json.loads(ray[-1])["launch"]["inherit"] == ["HF_TOKEN"]


@pytest.mark.slow
def test_sglang_reads_its_api_key_from_a_private_file_not_the_command_line(tmp_path, record_property):
    record_property("fault", "API key on a command line")
    cmd, env = engines.sglang_command(ServeConfig(), sys.executable, tmp_path, 30000, "m", KEY, secrets_dir=tmp_path)
    assert not any(KEY in part for part in cmd) and not any(KEY in v for v in env.values())
    cfg_file = Path(cmd[cmd.index("--config") + 1])
    assert stat.S_IMODE(cfg_file.stat().st_mode) == 0o600
    sglang_python = Path.home() / ".cache" / "baton" / "runtimes"
    pythons = sorted(sglang_python.glob("sglang-*/bin/python"))
    if not pythons:
        pytest.skip("the sglang runtime is not built (make runtimes)")
    probe = ("import sys, argparse\nfrom sglang.srt.server_args import ServerArgs\n"
             "from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger\n"
             "p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)\n"
             "argv = ConfigArgumentMerger(p).merge_config_with_args(sys.argv[1:])\n"
             "print(p.parse_args(argv).api_key)\n")
    out = subprocess.run([str(pythons[-1]), "-c", probe, *cmd[cmd.index("--model-path"):]], capture_output=True,
                         text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1:] == [KEY], out.stderr[-2000:]


@pytest.mark.fast
def test_secret_values_are_redacted_from_mlflow_params_and_artifacts(baton_home, record_property):
    record_property("fault", "secrets in config")
    cfg = {"runtimes": {"vllm": {"env": {"HF_HOME": "/x", "SOME_VAR": "v"}}},
           "tracking": {"api_token": "tok-123", "password_file": "/keys/pw"}, "serve": {"api_key": KEY},
           "data": {"tokenizer": "train"}, "finetune": {"eval_max_new_tokens": 8}}
    c = tracking.client()
    run = tracking.start_run(c, "secrets", "r", tags={})
    tracking.log_params(c, run, cfg)
    tracking.log_json(c, run, cfg, "cfg.json")
    params = c.get_run(run).data.params
    assert params["runtimes.vllm.env.SOME_VAR"] == secrets.REDACTED and params["serve.api_key"] == secrets.REDACTED
    assert params["tracking.api_token"] == secrets.REDACTED and params["tracking.password_file"] == "/keys/pw"
    assert params["data.tokenizer"] == "train" and params["finetune.eval_max_new_tokens"] == "8"  # words, not substrings
    import mlflow.artifacts
    art = mlflow.artifacts.load_dict(f"{c.get_run(run).info.artifact_uri}/cfg.json")
    assert KEY not in json.dumps(art) and "tok-123" not in json.dumps(art)


@pytest.mark.fast
def test_secrets_in_command_line_lists_are_refused_before_launch(record_property):
    """Config lists that become arguments (engine args, NeMo-RL overrides, srun/sbatch flags) carry no secret."""
    record_property("fault", "secret in a command-line list")
    from flows.config import ConfigError, load

    cases = {"serve.engine_args.vllm": '["--hf-token", "x"]', "serve.engine_args.sglang": '["--api-key=x"]',
             "rlhf.nemo_rl.overrides": '["logger.wandb.api_key=x"]', "runtimes.main.srun_args": '["--auth-token=x"]'}
    for key, value in cases.items():
        with pytest.raises(ConfigError, match=rf"{key}\[0\]: .* would put a secret on a command line"):
            load(TINY, [f"{key}={value}"])
    assert load(TINY, ['serve.engine_args.vllm=["--max-tokens", "8", "--tokenizer-mode", "auto"]'])


@pytest.mark.fast
def test_run_ids_and_serve_host_are_confined(record_property):
    record_property("fault", "run_id ../.. / remote host")
    for bad in ("../..", "..", "a/b", "/etc", ""):
        with pytest.raises(ValueError):
            paths.check_run_id(bad)
    assert paths.check_run_id("20261201-0101-ab12") == "20261201-0101-ab12"
    with pytest.raises(ValueError, match="allow_remote"):
        ServeConfig(host="0.0.0.0")
    assert ServeConfig(host="0.0.0.0", allow_remote=True).host == "0.0.0.0"
    assert ServeConfig(host="::1").host == "::1"


@pytest.mark.slow
def test_baton_home_and_its_files_are_private(tmp_path, record_property):
    record_property("fault", "world-readable BATON_HOME")
    home = tmp_path / "home"
    folder = tmp_path / "configs"  # a copy: the manifest is written into the folder, never into the checkout
    shutil.copytree(REPO / "configs", folder)
    r = cli("manifest", str(folder), "--format", "dataset", home=home)
    assert r.returncode == 0, r.stderr
    d = tmp_path / "ck"
    d.mkdir()
    (d / "w.bin").write_bytes(b"1")
    code = ("import os, sys; sys.path.insert(0, %r); from flows.cli import main; os.umask(0o022); "
            "from tasks.tracking import baton_home; main(['manifest', %r, '--format', 'dataset']); "
            "print(oct(os.stat(baton_home()).st_mode & 0o777))") % (str(REPO), str(d))
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, BATON_HOME=str(tmp_path / "home2")),
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "0o700", out.stderr[-1000:]
    assert stat.S_IMODE((d / "baton_manifest.json").stat().st_mode) == 0o600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.ops
def test_postgres_asks_every_connection_for_a_password(tmp_path, record_property):
    record_property("fault", "database without password auth")
    if not Path("/usr/lib/postgresql").exists():
        pytest.skip("PostgreSQL not installed (infra/stack/system-deps.sh postgresql)")
    sys.path.insert(0, str(REPO / "infra" / "stack"))
    import postgres

    state = tmp_path / "stack"
    cluster = postgres.Cluster(state, tmp_path / "home", _free_port())
    try:
        cluster.start()
        assert stat.S_IMODE(cluster.root.stat().st_mode) == 0o700  # the socket folder
        psql = [postgres.pg_bin("psql"), "-h", str(cluster.root), "-p", str(cluster.port), "-U", "postgres",
                "-d", "postgres", "-w", "-tAc", "SELECT 1"]
        runas = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        env = {k: v for k, v in os.environ.items() if k != "PGPASSWORD"}
        denied = subprocess.run(runas + psql, capture_output=True, text=True, env=env, cwd="/")
        assert denied.returncode != 0 and "password" in denied.stderr.lower()
        allowed = subprocess.run(runas + psql, capture_output=True, text=True, cwd="/",
                                 env=dict(env, PGPASSWORD=cluster.admin_password))
        assert allowed.stdout.strip() == "1", allowed.stderr
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert cluster.password not in ps and cluster.admin_password not in ps
        assert stat.S_IMODE((state / "postgres.json").stat().st_mode) == 0o600
    finally:
        cluster.stop(purge=True)
