"""Ray target across two hosts (network namespaces): finetune ZeRO-2 and rlhf DPO, one process per host, pass their
gates and end with the weights of the single-host run with the same world size; cancelling stops both hosts' ranks."""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from multinode import (Ray, cancel_while_training, hf_weights, max_abs_diff, reference_run, run_stage,
                       stage_spec, timed, two_hosts, zero_weights)

# a two-host Ray cluster comes up first
pytestmark = [pytest.mark.slow, pytest.mark.multinode, pytest.mark.timeout(1200)]

# same world size, same data order: only the all-reduce transport differs (gloo over the veth pair vs one host)
TOLERANCE = 1e-5
FINETUNE = ("finetune.steps=30", "finetune.checkpoint_every=30", "finetune.timeout_s=1200")
RLHF = ("rlhf.steps=30", "rlhf.timeout_s=1200")


@pytest.fixture(scope="module")
def hosts():
    yield from two_hosts(with_slurm=False)


@pytest.fixture(scope="module")
def ray_cluster(hosts):
    folder = Path(tempfile.mkdtemp(prefix="bray", dir="/tmp"))  # short: Ray's socket paths live below it
    t0 = time.time()
    cluster = Ray(hosts, folder).up()
    print(f"Ray cluster (head + worker in two namespaces) up in {time.time() - t0:.1f}s")
    yield cluster
    hosts.kill_all()
    shutil.rmtree(folder, ignore_errors=True)


def ray_runtime(cluster: Ray) -> dict:
    return {"kind": "ray", "address": cluster.address, "resources_per_node": {"CPU": 1}}


def test_finetune_zero2_across_two_ray_nodes(tmp_path, tmp_path_factory, hosts, ray_cluster, data_dir, hf_checkpoint):
    ref = timed("finetune ZeRO-2, 1 host x 2 ranks", reference_run, tmp_path_factory.getbasetemp(), "finetune-zero2",
                hosts, stage_spec("finetune", tmp_path, data_dir, *FINETUNE, "finetune.nproc_per_node=2",
                                  input=hf_checkpoint))
    spec = stage_spec("finetune", tmp_path / "ray", data_dir, *FINETUNE, "finetune.nnodes=2",
                      "finetune.nproc_per_node=1", input=hf_checkpoint, runtime=ray_runtime(ray_cluster))
    out = timed("finetune ZeRO-2, 2 Ray nodes x 1 rank", run_stage, hosts, spec)
    assert out["gate"]["passed"], json.dumps(out["gate"], indent=1)
    assert "x2" in out["backend"]
    diff = max_abs_diff(zero_weights(Path(out["output"])), zero_weights(Path(ref["output"])))
    print(f"finetune ZeRO-2 Ray 2x1 vs 1x2: max |Δweight| = {diff:g} (tolerance {TOLERANCE:g})")
    assert diff <= TOLERANCE


def test_rlhf_dpo_across_two_ray_nodes(tmp_path, tmp_path_factory, hosts, ray_cluster, data_dir, hf_checkpoint):
    ref = timed("rlhf DPO, 1 host x 2 ranks", reference_run, tmp_path_factory.getbasetemp(), "rlhf-dpo", hosts,
                stage_spec("rlhf", tmp_path, data_dir, *RLHF, "rlhf.nproc_per_node=2", input=hf_checkpoint))
    spec = stage_spec("rlhf", tmp_path / "ray", data_dir, *RLHF, "rlhf.nnodes=2", "rlhf.nproc_per_node=1",
                      input=hf_checkpoint, runtime=ray_runtime(ray_cluster))
    out = timed("rlhf DPO, 2 Ray nodes x 1 rank", run_stage, hosts, spec)
    assert out["gate"]["passed"], json.dumps(out["gate"], indent=1)
    diff = max_abs_diff(hf_weights(Path(out["output"])), hf_weights(Path(ref["output"])))
    print(f"rlhf DPO Ray 2x1 vs 1x2: max |Δweight| = {diff:g} (tolerance {TOLERANCE:g})")
    assert diff <= TOLERANCE


def test_cancelling_stops_the_ranks_on_both_hosts(tmp_path, hosts, ray_cluster, data_dir, hf_checkpoint):
    spec = stage_spec("finetune", tmp_path, data_dir, "finetune.steps=100000", "finetune.nnodes=2",
                      "finetune.nproc_per_node=1", input=hf_checkpoint, runtime=ray_runtime(ray_cluster))
    seconds = cancel_while_training(hosts, spec)
    print(f"Ray: every rank on both hosts gone {seconds:.1f}s after SIGTERM to the stage")
