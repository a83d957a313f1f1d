"""`baton k8s`: what a PyTorchJob pod runs (its command, environment and ConfigMap files), run on this machine with the
pod's paths mapped onto folders: the real workers accept the generated spec and arguments. The fast checks of the
manifests themselves are in test_k8s.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"


POD_RUNS = {  # a few steps of each worker, as the pod would run them
    "pretrain": ["pretrain.steps=3", "pretrain.device=cpu", "pretrain.checkpoint_every=3", "pretrain.eval_interval=3",
                 "pretrain.eval_iters=1", "pretrain.warmup_steps=1"],
    "rlhf": ["rlhf.steps=2", "rlhf.device=cpu", "rlhf.micro_batch_size=4"],
}


@pytest.mark.slow
@pytest.mark.parametrize("stage", sorted(POD_RUNS))
def test_the_pod_command_runs_the_real_worker(stage, tmp_path, data_dir, hf_checkpoint):
    """What a PyTorchJob pod runs, here: its container's command and environment, the ConfigMap's files at /etc/baton
    and the volume at /baton mapped onto folders of this machine; PET_* as the operator sets them (1 node, 1 rank)."""
    import os
    import shutil
    import subprocess
    import sys

    from tasks import events
    from flows.config import load
    from flows.cli.k8s_manifests import IMAGE_ROOT, SPEC_DIR, Cluster, manifests
    from tasks.distributed import free_port

    volume, etc = tmp_path / "volume", tmp_path / "etc-baton"
    cfg = load(TINY, POD_RUNS[stage], [stage], host=False)
    files = {k: yaml.safe_load(v) for k, v in manifests(cfg, Cluster(mount=str(volume))).items() if k.endswith(".yaml")}
    shutil.copytree(data_dir, volume / "tiny" / "data")
    shutil.copytree(hf_checkpoint, volume / "tiny" / "input")  # the first stage's input (rlhf's here)
    etc.mkdir()
    for name, text in files[f"{stage}/configmap.yaml"]["data"].items():
        (etc / name).write_text(text)
    master = files[f"{stage}/pytorchjob.yaml"]["spec"]["pytorchReplicaSpecs"]["Master"]
    pod = master["template"]["spec"]["containers"][0]

    def here(arg: str) -> str:
        return arg.replace(str(IMAGE_ROOT), str(REPO)).replace(str(SPEC_DIR), str(etc))

    cmd = [sys.executable if a == "python" else here(a) for a in pod["command"]]
    env = {**os.environ, **{e["name"]: here(e["value"]) for e in pod["env"]}, "GLOO_SOCKET_IFNAME": "lo",
           "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(free_port())}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [e for e in map(events.parse, run.stdout.splitlines()) if e and e["kind"] == "result"]
    assert results, run.stdout[-2000:]
    if stage == "pretrain":
        assert any(r.get("iteration") == 3 for r in results)
        assert (volume / "tiny" / "pretrain" / "checkpoint.partial").is_dir()
    else:
        assert (volume / "tiny" / "rlhf" / "checkpoint" / "config.json").exists()
