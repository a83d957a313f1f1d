"""Cancelling a two-host fine-tuning run from Prefect, end to end: the real local stack (`make up`: Prefect server,
process worker, deployments, MLflow) and a real Slurm cluster on two network-namespace hosts. The worker runs here, on
the "login host" (the root namespace, which reaches only slurmctld's host), so the stage submits an sbatch job
(DeepSpeed, one rank per host) and follows it. Once both hosts train, `prefect flow-run cancel ID` (what the UI's
Cancel button sends) must stop every process of the job on both hosts, end the Slurm job CANCELLED, and close every
record as test_ops_cancel.py checks on one host."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from flows.config import ALLOW_LAUNCH_PARAMETERS, load
from flows.runs import StepLock
from multinode import Hosts, Slurm, engine_processes, two_hosts, wait_for
from ops_stack import REPO, register_initial_champion, running_stack
from test_ops_cancel import _flow_process, _mlflow_runs, _step_record

# a two-host Slurm cluster (apt-installed on a fresh machine) and the stack come up first
pytestmark = [pytest.mark.multinode, pytest.mark.ops, pytest.mark.reliability, pytest.mark.timeout(1500)]

RUN_ID = "mn-cancel-1"
FINETUNE = {"steps": 100000, "nnodes": 2, "nproc_per_node": 1, "checkpoint_every": 100000, "warmup_steps": 1,
            "timeout_s": 900}
GONE_WITHIN_S = 90  # Slurm: SIGTERM to the steps, KillWait=10 s, then SIGKILL; Prefect SIGKILLs the flow after 30 s
DAEMONS = ("slurmctld", "slurmd", "slurmscriptd")  # the cluster itself, which stays


@pytest.fixture(scope="module")
def ops_stack():
    """The stack of a platform whose worker's owner lets flow runs choose the runtime (here: the Slurm target). Without
    that, a deployment run's `runtimes` parameter is refused (tests/test_deployment_parameters.py)."""
    yield from running_stack(**{ALLOW_LAUNCH_PARAMETERS: "1"})


@pytest.fixture(scope="module")
def initial_champion(ops_stack, hf_checkpoint, tmp_path_factory) -> dict:
    return register_initial_champion(ops_stack, hf_checkpoint, tmp_path_factory.mktemp("champion") / "v0")


@pytest.fixture(scope="module")
def hosts():
    yield from two_hosts(with_slurm=True)


@pytest.fixture(scope="module")
def slurm(hosts):
    folder = Path(tempfile.mkdtemp(prefix="bslurm", dir="/tmp"))
    cluster = Slurm(hosts, folder).up()
    hosts.reach_from_root()
    yield cluster
    cluster.down()
    hosts.kill_all()
    shutil.rmtree(folder, ignore_errors=True)


def _config(slurm_conf: Path) -> dict:
    cfg = load(REPO / "configs" / "tiny.yaml", stages=["data", "finetune"]).model_dump(mode="json")
    cfg.update(name="mncancel")
    cfg["finetune"].update(FINETUNE)
    # what a user on a login node sets: the Slurm target, and the cluster's slurm.conf for sbatch/scancel
    cfg["runtimes"] = {"main": {"kind": "slurm", "env": {"SLURM_CONF": str(slurm_conf)}}}
    return cfg


def _slurm(slurm: Slurm, *cmd: str) -> str:
    """A Slurm client command from this (login) host."""
    return subprocess.run(list(cmd), env=slurm.env, capture_output=True, text=True, timeout=30).stdout


def _job_processes(hosts: Hosts) -> list[str]:
    """Every process on either host that is not a cluster daemon (slurmstepd, the batch shell, srun, launchers, ranks)."""
    left = []
    for pid in hosts.pids():
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
        if not cmd.strip():  # a process exiting this instant (a zombie has no command line): already gone
            continue
        if cmd.replace(":", " ").split()[0].rsplit("/", 1)[-1] not in DAEMONS:  # slurmscriptd is ": slurmscriptd"
            left.append(f"{pid}: {cmd[:160]}")
    return left


def _ranks_per_host(hosts: Hosts) -> list[int]:
    counts = []
    for ns in hosts.names:
        pids = [int(p) for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]
        cmds = []
        for pid in pids:
            try:
                cmds.append(" ".join(psutil.Process(pid).cmdline()))
            except psutil.Error:
                pass
        # a rank: `python -u worker.py --local_rank=0 --spec ...` (launchers and srun name the script too)
        counts.append(sum("tasks/finetune/worker.py --" in c and "deepspeed.launcher" not in c for c in cmds))
    return counts


def _start_and_wait_for_training(ops_stack, hosts, slurm, initial_champion) -> tuple[str, Path, str]:
    fr_id = ops_stack.run_deployment("baton-pipeline/tiny", {"config": _config(slurm.dir / "slurm.conf"),
                                                             "from_ref": initial_champion["path"], "run_id": RUN_ID},
                                     watch=False)
    log = ops_stack.home / "runs" / RUN_ID / "01-finetune" / "engine.log"

    def training():
        fr = ops_stack.flow_run(fr_id)
        assert fr["state_type"] not in ("FAILED", "CRASHED", "COMPLETED", "CANCELLED"), (
            fr["state"], ops_stack.logs_all(fr_id)[-4000:])
        return log.exists() and '"kind": "metric"' in log.read_text(errors="replace")  # rank 0 finished a step

    wait_for(training, 900, "a training step of the two-host job", poll=2)
    job = re.search(r"submitted Slurm job (\d+)", log.read_text()).group(1)
    ranks = wait_for(lambda: all(c := _ranks_per_host(hosts)) and c, 60, "a rank on each host")
    print(f"flow run {fr_id}: Slurm job {job} training, ranks per host {ranks}")
    return fr_id, log, job


def _cancel_and_time(ops_stack, hosts, fr_id: str) -> dict:
    flow_proc = _flow_process(fr_id)
    tree = [flow_proc] + flow_proc.children(recursive=True)  # the flow, the sbatch follower, sbatch --wait
    t0, times = time.time(), {}
    ops_stack.prefect("flow-run", "cancel", fr_id)
    while time.time() < t0 + GONE_WITHIN_S and not {"engine", "job", "login"} <= set(times):
        for what, alive in (("engine", engine_processes(hosts)), ("job", _job_processes(hosts)),
                            ("login", [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE])):
            if not alive and what not in times:
                times[what] = time.time() - t0
        time.sleep(0.2)
    assert engine_processes(hosts) == [], f"ranks outlived the cancellation by {GONE_WITHIN_S}s"
    assert _job_processes(hosts) == [], f"job processes outlived the cancellation: {_job_processes(hosts)}"
    assert set(times) == {"engine", "job", "login"}, times
    return times


def _assert_records_cancelled(ops_stack, fr_id: str) -> None:
    fr = ops_stack.wait_state(fr_id, {"CANCELLED", "CRASHED", "FAILED", "COMPLETED"}, timeout=120)
    assert fr["state_type"] == "CANCELLED", fr["state"]
    subs = ops_stack.api("POST", "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [fr_id]}}})
    assert {s["name"]: s["state_type"] for s in subs} == {"data": "COMPLETED", "finetune": "CANCELLED"}, subs
    home = ops_stack.home
    rec = _step_record(home, RUN_ID, "finetune")
    assert rec["status"] == "cancelled" and rec["entry"]["error"].startswith("cancelled (SIGTERM"), rec
    assert StepLock(rec["fingerprint"], root=home).holder() is None
    owners = [json.loads(f.read_text()) for f in (home / "locks").glob("*.owner.json")]
    assert not [o for o in owners if o.get("run_id") == RUN_ID], owners
    summary = json.loads((home / "runs" / RUN_ID / "summary.json").read_text())
    assert summary["status"] == "cancelled"
    statuses = {s["label"]: s["status"] for s in summary["stages"]}
    assert statuses["finetune"] == "cancelled" and statuses["data"] in ("completed", "cached"), statuses
    mlruns = _mlflow_runs(ops_stack, RUN_ID)
    assert mlruns["pipeline"].info.status == "KILLED" and mlruns["finetune"].info.status == "KILLED"


def test_prefect_cancel_stops_the_two_host_slurm_job(ops_stack, initial_champion, hosts, slurm, record_property):
    record_property("fault", "prefect flow-run cancel of a two-host Slurm stage mid-training")
    fr_id, _, job = _start_and_wait_for_training(ops_stack, hosts, slurm, initial_champion)
    times = _cancel_and_time(ops_stack, hosts, fr_id)

    # slurmctld learns asynchronously that the steps are gone: the job stays COMPLETING (in squeue) until every
    # slurmd has reported, which on a loaded machine can lag the processes' end by seconds
    wait_for(lambda: _slurm(slurm, "squeue", "-h", "-j", job).strip() == "", 60, f"job {job} out of squeue")
    state = wait_for(lambda: re.search(r"JobState=(\S+)", _slurm(slurm, "scontrol", "show", "job", "-o", job)), 30,
                     f"job {job} known to slurmctld")
    assert state.group(1) == "CANCELLED", state.group(0)
    _assert_records_cancelled(ops_stack, fr_id)
    print(f"`prefect flow-run cancel` → ranks on both hosts gone {times['engine']:.1f}s, every job process on both "
          f"hosts {times['job']:.1f}s, flow + sbatch follower on the login host {times['login']:.1f}s; "
          f"Slurm job {job} {state.group(1)}")
