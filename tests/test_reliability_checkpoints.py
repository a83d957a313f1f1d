"""Checkpoints that must never be published, served or resumed (issue 12, items 3, 4 and 10), injected for real:
NaN weights, a conversion killed or refused by its gate, a full disk (a real 1 MB tmpfs), a flipped byte in a
training checkpoint."""
from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from conftest import baton
from conversions import hf, manifest as mf, verify

pytestmark = pytest.mark.reliability


def _poisoned(src: Path, dest: Path) -> Path:
    """A copy of an HF checkpoint whose first weight holds a NaN (what a diverged run writes), manifest rewritten."""
    shutil.copytree(src, dest)
    sd = hf.load_state_dict(dest)
    first = sorted(sd)[0]
    sd[first] = sd[first].clone()
    sd[first].view(-1)[0] = float("nan")
    from safetensors.torch import save_file

    for f in hf.safetensors_files(dest):
        f.unlink()
    for extra in dest.glob("*.safetensors.index.json"):
        extra.unlink()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    mf.write(dest, mf.build(dest, format="hf-safetensors", stage="external", dtype="float32",
                            architecture=mf.read(src)["architecture"]))
    return dest


@pytest.mark.fast
def test_nan_weights_fail_the_finite_check_and_serve_preflight(hf_checkpoint, tmp_path, record_property):
    record_property("fault", "NaN weights")
    bad = _poisoned(hf_checkpoint, tmp_path / "nan")
    assert verify.finite_weights(hf_checkpoint)[0]["passed"]
    chk = verify.finite_weights(bad)[0]
    assert not chk["passed"] and "1 NaN/inf" in chk["detail"]
    from tasks.serve.task import preflight

    assert any(c["name"] == "weights.finite" and not c["passed"] for c in preflight(bad))


@pytest.mark.slow
def test_convert_publishes_only_after_its_gate(hf_checkpoint, tmp_path, baton_home, record_property):
    record_property("fault", "convert of NaN weights")
    bad = _poisoned(hf_checkpoint, tmp_path / "nan")
    dst = tmp_path / "out"
    r = baton("convert", str(bad), str(dst), "--to", "megatron-dist", home=baton_home, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "weights.finite" in r.stdout and "was not written" in r.stderr
    assert not dst.exists() and (tmp_path / "out.partial").exists()
    good = baton("convert", str(hf_checkpoint), str(dst), "--to", "megatron-dist", home=baton_home, timeout=600)
    assert good.returncode == 0, good.stdout + good.stderr
    assert verify.integrity(dst)[0]["passed"] and not (tmp_path / "out.partial").exists()


def _mount_tmpfs(mount: Path, size: int) -> None:
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", f"baton-test-{uuid.uuid4().hex[:6]}",
                       str(mount)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")


def _previous_checkpoint(disk: Path) -> Path:
    previous = disk / "previous"
    previous.mkdir()
    (previous / "w.bin").write_bytes(b"\x01" * 1000)
    mf.write(previous, mf.build(previous, format="dataset", stage="test"))
    return previous


@pytest.mark.slow
def test_disk_full_mid_conversion_names_the_disk_and_keeps_the_previous_checkpoint(hf_checkpoint, tmp_path,
                                                                                   baton_home, record_property):
    """A real tmpfs just big enough to pass the free-space check: the save runs out of space half way."""
    record_property("fault", "ENOSPC mid-save")
    weights = sum(f.stat().st_size for f in hf_checkpoint.glob("*.safetensors"))
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, weights + (16 << 10))  # passes the check (needs the weights), not the tokenizer copy
    try:
        previous = _previous_checkpoint(disk)
        r = baton("convert", str(hf_checkpoint), str(disk / "new"), "--to", "megatron-dist", home=baton_home,
                  timeout=600)
        assert r.returncode != 0
        assert f"no space left on device: the disk mounted at {disk}" in r.stderr, r.stderr[-2000:]
        assert not (disk / "new").exists() and not (disk / "new.partial").exists()
        assert verify.integrity(previous)[0]["passed"]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
def test_free_space_is_checked_before_converting(hf_checkpoint, tmp_path, baton_home, record_property):
    record_property("fault", "disk too small (pre-check)")
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, 1 << 20)
    try:
        previous = _previous_checkpoint(disk)
        r = baton("convert", str(hf_checkpoint), str(disk / "new"), "--to", "megatron-dist", home=baton_home,
                  timeout=300)
        assert r.returncode == 2 and f"the disk mounted at {disk}" in r.stderr and "nothing written" in r.stderr
        assert not (disk / "new").exists() and verify.integrity(previous)[0]["passed"]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.fast
def test_flipped_byte_in_a_training_checkpoint_is_not_resumed(tmp_path, monkeypatch, capsys, record_property):
    """Two complete pretrain checkpoints; a byte of the newer one flips on disk (same size): resume takes the older,
    and removes and reports the newer (a log line and a `checkpoint_rejected` event), as every stage does."""
    record_property("fault", "bit flip in a checkpoint")
    monkeypatch.setenv("BATON_HOME", str(tmp_path / "home"))  # where the seal key is made
    pytest.importorskip("megatron.core")
    from conversions import sealed
    from tasks import events, resuming
    from tasks.pretrain import mcore_checkpoint as ckpt

    for it in (1, 2):
        d = tmp_path / f"{ckpt.PREFIX}{it:07d}"
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(bytes([it]) * 4096)
        sealed.seal(d, ckpt.STATE_FILE, iteration=it)
    newest = tmp_path / f"{ckpt.PREFIX}0000002" / "__0_0.distcp"
    data = bytearray(newest.read_bytes())
    data[100] ^= 0xFF
    newest.write_bytes(bytes(data))
    point = resuming.resume_point(tmp_path, ckpt.KIND)
    assert point.checkpoint.name == f"{ckpt.PREFIX}0000001" and point.step == 1
    assert not newest.parent.exists() and [r.folder for r in point.rejected] == [newest.parent]
    rejected = [e for line in capsys.readouterr().out.splitlines() if (e := events.parse(line))]
    assert rejected == [{"kind": "checkpoint_rejected", "tag": newest.parent.name,
                         "reason": "__0_0.distcp differs from the sha256 recorded at save time"}]


@pytest.mark.fast
def test_a_stage_is_not_started_without_the_disk_its_checkpoints_need(tiny_config, tmp_path, record_property):
    """The plan's estimate (kept checkpoints × 16 bytes a parameter + output) against a real 1 MB tmpfs."""
    record_property("fault", "disk too small for a stage")
    from flows.chain_planner import Step
    from flows.step_entry import StageFailed
    from flows.step_runner import check_free_space, disk_needed

    step = Step(name="pretrain", label="pretrain", consumes=None, produces="megatron-dist", fingerprint="f" * 64)
    assert disk_needed(tiny_config, step) > 1 << 20
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, 1 << 20)
    try:
        with pytest.raises(StageFailed, match=f"not enough free space .* the disk mounted at {disk}"):
            check_free_space(tiny_config, step, disk)
        check_free_space(tiny_config, step, tmp_path)  # the real disk has room
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _kill_after_checkpoint(cmd: list[str], env: dict, log: Path, at_step: int) -> None:
    """Run the finetune worker tree; SIGKILL all of it once the checkpoint of `at_step` is reported complete."""
    import os
    import signal

    from tasks import events

    full_env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent), **env)
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen = None
    with open(log, "w") as f:
        for line in proc.stdout:
            f.write(line)
            e = events.parse(line.strip())
            if e and e["kind"] == "checkpoint" and e["step"] == at_step:
                seen = e["step"]
                break
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)
    assert seen == at_step, log.read_text()[-3000:]


@pytest.mark.slow
@pytest.mark.long  # three DeepSpeed launches (~35 s): make test-long
def test_flipped_byte_in_a_deepspeed_checkpoint_is_not_resumed(tmp_path, tiny_config, data_dir, hf_checkpoint,
                                                                record_property):
    """A real ZeRO-2 finetune is killed after its step-4 checkpoint; one byte of that checkpoint's model states flips
    on disk (same size, same names): the next attempt names the file, drops the checkpoint and resumes from step 2
    (2 ranks: rank 0 verifies, every rank loads the tag it chose)."""
    record_property("fault", "bit flip in a DeepSpeed checkpoint")
    from tasks.distributed import remove_shm_segments
    from tasks.finetune.config import FinetuneConfig
    from tasks.finetune.task import prepare, run_finetune
    from tasks.stage import StageContext

    ctx = StageContext(stage="finetune", run_id="test", run_dir=tmp_path, work_dir=tmp_path / "work",
                       model=tiny_config.model.model_dump(), seed=0, data_dir=data_dir, input=hf_checkpoint,
                       input_format="hf-safetensors")
    cfg = FinetuneConfig(zero={"stage": 2}, steps=6, warmup_steps=1, checkpoint_every=2, keep_checkpoints=3, nproc_per_node=2,
                         timeout_s=600)
    cmd, env, ckpt, port = prepare(ctx, cfg)
    try:
        _kill_after_checkpoint(cmd, env, tmp_path / "killed.log", at_step=4)
    finally:
        remove_shm_segments(port)
    marker = json.loads((ckpt / "global_step4" / "baton_complete.json").read_text())
    assert marker["sha256"], marker  # written last, with every file's hash
    (states,) = [n for n in marker["sha256"] if n.endswith("model_states.pt")]
    victim = ckpt / "global_step4" / states
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))

    out = run_finetune.fn(ctx, cfg)
    assert out.metrics["resumed_from_step"] == 2
    log = (ctx.work_dir / "engine.log").read_text()
    assert f"{states} differs from the sha256 recorded at save time; not resuming from it" in log
    integrity = {c["name"]: c for c in out.gate["checks"]}["L0.integrity"]  # (6 steps are too few for the eval gate)
    assert integrity["passed"] and (out.output / "global_step6" / "baton_complete.json").exists()
