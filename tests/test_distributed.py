"""Launch commands for ranks: local torchrun, or one torchrun per node under Slurm."""
import subprocess
import sys

import pytest

from tasks.distributed import torchrun_command, world_size


@pytest.mark.slow
def test_local_torchrun_runs_two_ranks(tmp_path):
    script = tmp_path / "w.py"
    script.write_text("import os; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n")
    cmd = torchrun_command(sys.executable, str(script), [], nproc_per_node=2)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "rank 0 of 2" in out.stdout and "rank 1 of 2" in out.stdout


def test_slurm_command_starts_one_torchrun_per_node():
    cmd = torchrun_command("/shared/venv/bin/python", "/shared/baton/tasks/pretrain/worker.py", ["--spec", "s.json"],
                           nproc_per_node=8, runtime={"kind": "slurm", "nodes": 4, "srun_args": ["--partition=gpu"]},
                           master_port=29500)
    assert cmd[:6] == ["srun", "--nodes", "4", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    assert "--partition=gpu" in cmd and cmd[-3:-1] == ["bash", "-c"]
    inner = cmd[-1]
    assert "--nnodes 4" in inner and '--node-rank "$SLURM_NODEID"' in inner and "--nproc-per-node 8" in inner
    assert "scontrol show hostnames" in inner and "--master-port 29500" in inner and inner.endswith("--spec s.json")
    assert world_size(8, {"kind": "slurm", "nodes": 4}) == 32


def test_unknown_runtime_kind_is_refused():
    with pytest.raises(ValueError, match="container image"):
        torchrun_command("python", "w.py", [], nproc_per_node=1, runtime={"kind": "kubernetes"})
