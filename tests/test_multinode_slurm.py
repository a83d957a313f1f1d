"""Slurm target across two hosts (network namespaces, slurmctld + one slurmd each): from inside `salloc -N2`,
pretrain (DP=2, PP=2) and finetune ZeRO-2 with one rank per host pass their gates and end with the weights of the
single-host run with the same world size; outside an allocation the stage submits an sbatch job and follows it."""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from multinode import (Slurm, cancel_while_training, dist_weights, max_abs_diff, reference_run, run_stage,
                       stage_spec, timed, two_hosts, zero_weights)

# a two-host Slurm cluster (apt-installed on a fresh machine) comes up first
pytestmark = [pytest.mark.slow, pytest.mark.multinode, pytest.mark.timeout(1500)]

TOLERANCE = 1e-5  # same world size and data order; only the all-reduce transport differs
PRETRAIN = ("pretrain.steps=12", "pretrain.checkpoint_every=12", "pretrain.eval_interval=6", "pretrain.warmup_steps=2",
            "pretrain.timeout_s=1200")
FINETUNE = ("finetune.steps=30", "finetune.checkpoint_every=30", "finetune.timeout_s=1200")
SLURM = {"kind": "slurm"}


@pytest.fixture(scope="module")
def hosts():
    yield from two_hosts(with_slurm=True)


@pytest.fixture(scope="module")
def slurm(hosts):
    folder = Path(tempfile.mkdtemp(prefix="bslurm", dir="/tmp"))
    t0 = time.time()
    cluster = Slurm(hosts, folder).up()
    print(f"Slurm (slurmctld + slurmd n1 | slurmd n2) up in {time.time() - t0:.1f}s")
    yield cluster
    cluster.down()
    hosts.kill_all()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("layout", ["DP2", "PP2"])
def test_pretrain_across_two_slurm_nodes(layout, tmp_path, tmp_path_factory, hosts, slurm, data_dir):
    """DP=2: gradients all-reduced across the hosts; PP=2: activations sent between them (one stage per host)."""
    extra = ("pretrain.pipeline_parallel=2",) if layout == "PP2" else ()
    ref = timed(f"pretrain {layout}, 1 host x 2 ranks", reference_run, tmp_path_factory.getbasetemp(),
                f"pretrain-{layout}", hosts, stage_spec("pretrain", tmp_path, data_dir, *PRETRAIN, *extra,
                                                        "pretrain.nproc_per_node=2"))
    spec = stage_spec("pretrain", tmp_path / "slurm", data_dir, *PRETRAIN, *extra, "pretrain.nnodes=2",
                      "pretrain.nproc_per_node=1", runtime=SLURM)
    out = timed(f"pretrain {layout}, salloc -N2 x 1 rank", run_stage, hosts, spec, via=["salloc", "-N2"],
                env=slurm.env)
    assert out["gate"]["passed"], json.dumps(out["gate"], indent=1)
    assert out["slurm_job"] and ("DP2" if layout == "DP2" else "PP2") in out["backend"]
    diff = max_abs_diff(dist_weights(Path(out["output"])), dist_weights(Path(ref["output"])))
    print(f"pretrain {layout} Slurm 2x1 vs 1x2: max |Δweight| = {diff:g} (tolerance {TOLERANCE:g})")
    assert diff <= TOLERANCE


@pytest.mark.parametrize("zero", [3])
def test_finetune_zero_across_two_slurm_nodes(zero, tmp_path, tmp_path_factory, hosts, slurm, data_dir,
                                              hf_checkpoint):
    """ZeRO-3: optimizer state, gradients and the parameters partitioned across the hosts (each layer's parameters
    gathered from the other host for its forward and backward), weights equal to one host's two ranks. ZeRO-2 across
    two hosts: test_multinode_ray.py (the same parity) and the sbatch test below."""
    stage = f"finetune.zero.stage={zero}"
    ref = timed(f"finetune ZeRO-{zero}, 1 host x 2 ranks", reference_run, tmp_path_factory.getbasetemp(),
                f"finetune-zero{zero}", hosts, stage_spec("finetune", tmp_path, data_dir, *FINETUNE, stage,
                                                          "finetune.nproc_per_node=2", input=hf_checkpoint))
    spec = stage_spec("finetune", tmp_path / "slurm", data_dir, *FINETUNE, stage, "finetune.nnodes=2",
                      "finetune.nproc_per_node=1", input=hf_checkpoint, runtime=SLURM)
    out = timed(f"finetune ZeRO-{zero}, salloc -N2 x 1 rank", run_stage, hosts, spec, via=["salloc", "-N2"],
                env=slurm.env)
    assert out["gate"]["passed"], json.dumps(out["gate"], indent=1)
    assert f"ZeRO-{zero}" in out["backend"], out["backend"]
    diff = max_abs_diff(zero_weights(Path(out["output"])), zero_weights(Path(ref["output"])))
    print(f"finetune ZeRO-{zero} Slurm 2x1 vs 1x2: max |Δweight| = {diff:g} (tolerance {TOLERANCE:g})")
    assert diff <= TOLERANCE


def test_outside_an_allocation_an_sbatch_job_is_submitted_and_followed(tmp_path, hosts, slurm, data_dir,
                                                                       hf_checkpoint):
    """No SLURM_JOB_ID: the stage writes job.sbatch, submits it, streams its log and takes its exit code (a short run:
    the training itself is proven by the tests above)."""
    env = {k: v for k, v in slurm.env.items() if not k.startswith("SLURM_JOB")}
    spec = stage_spec("finetune", tmp_path, data_dir, "finetune.steps=4", "finetune.checkpoint_every=4",
                      "finetune.warmup_steps=1",
                      "finetune.nnodes=2", "finetune.nproc_per_node=1", input=hf_checkpoint, runtime=SLURM)
    out = timed("finetune ZeRO-2 as an sbatch job on 2 nodes", run_stage, hosts, spec, env=env)
    assert out["slurm_job"] is None and (Path(out["output"]) / "latest").exists()  # 4 steps: no gate asked
    assert "#SBATCH --nodes=2" in (tmp_path / "slurm" / "job.sbatch").read_text()
    log = (tmp_path / "engine.log").read_text()
    assert "submitted Slurm job" in log and "node 1/2" in log and '"kind": "result"' in log


def test_cancelling_stops_the_ranks_on_both_hosts(tmp_path, hosts, slurm, data_dir, hf_checkpoint):
    spec = stage_spec("finetune", tmp_path, data_dir, "finetune.steps=100000", "finetune.nnodes=2",
                      "finetune.nproc_per_node=1", input=hf_checkpoint, runtime=SLURM)
    seconds = cancel_while_training(hosts, spec, via=["salloc", "-N2"], env=slurm.env)
    print(f"Slurm: every rank on both hosts gone {seconds:.1f}s after SIGTERM to the stage")
