"""The one launch module: engine commands for local, Slurm and Ray targets, and one node's launcher run for real."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.config import RuntimeConfig
from tasks import events
from tasks.distributed import (Launch, LaunchConfigError, NodePlacement, NodeSpec, RayDriverSpec, SlurmJobSpec,
                               engine_command, node_command, with_port)
from tasks.distributed.net import free_port, interface_to, socket_ifname_env
from tasks.distributed.slurm import sbatch_script

REPO = Path(__file__).resolve().parent.parent
# one write per rank: print's separate writes of its parts interleave between the two ranks on the shared pipe
RANK_SCRIPT = "import os; os.write(1, f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\\n\".encode())\n"


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_local_torchrun_runs_two_ranks(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(RANK_SCRIPT)
    launch = Launch(python=sys.executable, script=str(script), nnodes=1, nproc_per_node=2, launcher="torchrun",
                    master_port=0)
    cmd = engine_command(launch, {"kind": "venv"})
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env())
    assert out.returncode == 0, out.stderr
    assert "rank 0 of 2" in out.stdout and "rank 1 of 2" in out.stdout


@pytest.mark.slow
def test_two_node_launchers_meet_at_the_first_node(tmp_path):
    """Two `tasks.distributed.node` processes (what srun or Ray start, one per node) form one world of 2 ranks."""
    script = tmp_path / "w.py"
    script.write_text(RANK_SCRIPT)
    launch = Launch(python=sys.executable, script=str(script), nnodes=2, nproc_per_node=1, launcher="torchrun",
                    master_port=0)
    port = free_port()
    specs = [NodeSpec(launch=launch, placement=NodePlacement(node_rank=r, master_addr="127.0.0.1", master_port=port))
             for r in (0, 1)]
    procs = [subprocess.Popen([sys.executable, "-m", "tasks.distributed.node", *events.inline_spec_args(spec)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
             for spec in specs]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "rank 0 of 2" in outs[0] and "rank 1 of 2" in outs[1]
    assert "GLOO_SOCKET_IFNAME=lo" in outs[0]


@pytest.mark.fast
def test_deepspeed_launcher_single_and_multi_node():
    one = with_port(Launch(python="py", script="w.py", args=("--spec", "s"), nnodes=1, nproc_per_node=2,
                           launcher="deepspeed", master_port=0))
    cmd = engine_command(one)
    assert cmd[:5] == ["py", "-m", "deepspeed.launcher.runner", "--num_gpus", "2"]
    assert cmd[-3:] == ["w.py", "--spec", "s"] and str(one.master_port) in cmd
    two = Launch(python="py", script="w.py", nnodes=2, nproc_per_node=4, launcher="deepspeed", master_port=0)
    cmd = node_command(two, node_rank=1, master_addr="10.0.0.1", master_port=29500, hostfile=Path("hf"))
    assert cmd[3:] == ["--hostfile", "hf", "--no_ssh", "--node_rank", "1", "--master_addr", "10.0.0.1",
                       "--master_port", "29500", "w.py"]


@pytest.mark.fast
def test_slurm_in_an_allocation_starts_one_node_launcher_per_node(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    launch = Launch(python="/shared/venv/bin/python", script="/shared/baton/tasks/pretrain/worker.py",
                    args=("--spec", "s.json"), nnodes=4, nproc_per_node=8, launcher="torchrun", master_port=0)
    cmd = engine_command(launch, {"kind": "slurm", "srun_args": ["--partition=gpu"], "env": {"NCCL_DEBUG": "WARN"}})
    assert cmd[:6] == ["srun", "--nodes", "4", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    assert "--partition=gpu" in cmd and cmd[-4:-2] == ["-m", "tasks.distributed.node"]
    spec = events.read_typed_spec(NodeSpec, cmd[-2:]).launch
    assert spec.nnodes == 4 and spec.nproc_per_node == 8
    assert spec.env == {} and spec.inherit == ("NCCL_DEBUG",)  # the value stays off the command line
    assert spec.args == ("--spec", "s.json") and spec.launcher == "torchrun"


@pytest.mark.fast
def test_slurm_outside_an_allocation_submits_an_sbatch_script(monkeypatch, tmp_path):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    launch = Launch(python="py", script="w.py", nnodes=2, nproc_per_node=1, launcher="deepspeed", master_port=0)
    runtime = {"kind": "slurm", "sbatch_args": ["--time=01:00:00"]}
    cmd = engine_command(launch, runtime, tmp_path)
    assert cmd[1:3] == ["-m", "tasks.distributed.slurm"]
    assert events.read_typed_spec(SlurmJobSpec, cmd[3:]).work_dir == tmp_path
    script = sbatch_script(launch, runtime, tmp_path / "job.log")
    assert "#SBATCH --nodes=2" in script and "#SBATCH --time=01:00:00" in script
    assert f"#SBATCH --output={tmp_path / 'job.log'}" in script
    assert script.splitlines()[-1].startswith("exec srun --nodes 2 --ntasks-per-node 1")


@pytest.mark.fast
def test_ray_target_runs_the_driver_against_the_address():
    launch = Launch(python="py", script="w.py", nnodes=2, nproc_per_node=1, launcher="torchrun", master_port=0)
    cmd = engine_command(launch, {"kind": "ray", "address": "head:6379", "resources_per_node": {"CPU": 2, "GPU": 8}})
    assert cmd[1:3] == ["-m", "tasks.distributed.ray_driver"]
    spec = events.read_typed_spec(RayDriverSpec, cmd[3:])
    assert spec.address == "head:6379" and spec.resources_per_node == {"CPU": 2, "GPU": 8}
    with pytest.raises(LaunchConfigError, match="address"):
        engine_command(launch, {"kind": "ray"})
    with pytest.raises(ValueError, match="address"):
        RuntimeConfig(kind="ray")


@pytest.mark.fast
def test_refusals(monkeypatch):
    with pytest.raises(LaunchConfigError, match="container image"):
        engine_command(Launch(python="py", script="w.py", nnodes=1, nproc_per_node=1, launcher="torchrun",
                              master_port=0),
                       {"kind": "kubernetes"})
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(LaunchConfigError, match="MASTER_ADDR"):
        engine_command(Launch(python="py", script="w.py", nnodes=2, nproc_per_node=1, launcher="torchrun",
                              master_port=0),
                       {"kind": "local"})


@pytest.mark.fast
def test_socket_interface_is_the_one_that_routes_to_the_first_node():
    assert interface_to("127.0.0.1") == "lo"
    assert socket_ifname_env("127.0.0.1") == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert socket_ifname_env("127.0.0.1", {"NCCL_SOCKET_IFNAME": "ib0"}) == {"GLOO_SOCKET_IFNAME": "lo"}


@pytest.mark.fast
@pytest.mark.reliability
def test_ray_secrets_stay_out_of_the_runtime_env(monkeypatch, record_property):
    """Ray's agent logs a job's runtime_env in clear: tokens and passwords go to each node's task as an argument,
    straight into its launcher's environment, and only the rest into runtime_env."""
    record_property("fault", "secret env values in Ray's runtime_env")
    from tasks.distributed import ray_driver

    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "mlflow-secret-value")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    launch = Launch(python="py", script="w.py", nnodes=2, nproc_per_node=1, launcher="torchrun", master_port=0,
                    env={"WANDB_API_KEY": "wandb-secret-value"},
                    inherit=("HF_TOKEN",))
    plain, secret = ray_driver.split_secrets(ray_driver.forwarded_env(launch))
    assert "secret-value" not in json.dumps(plain) and "hf_secret" not in json.dumps(plain), plain
    assert plain["OMP_NUM_THREADS"] == "2"
    assert secret == {"HF_TOKEN": "hf_secret_value", "MLFLOW_TRACKING_PASSWORD": "mlflow-secret-value",
                      "WANDB_API_KEY": "wandb-secret-value"}
