"""A disk that runs out of space inside a training engine's own checkpoint save (issue 12, item 10), for real: the
checkpoint folder on a real tmpfs, the engine's real writer (torch.save through DeepSpeed, DCP through Megatron-Core)
hitting ENOSPC half way through a save. The stage fails at once naming the disk, the partial checkpoint is removed,
the previous one still verifies against its seal, and once space is freed the run resumes from it."""
from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from test_reliability_checkpoints import _mount_tmpfs

pytestmark = pytest.mark.reliability


def _umount(disk: Path) -> None:
    subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(path: Path, size: int) -> None:
    """Another writer on the same disk: a real file of `size` bytes (allocated, not sparse)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


@pytest.mark.fast
def test_torch_writer_enospc_is_named(tmp_path, record_property):
    """torch's zip writer drops errno ("file write failed"); the save guard still says ENOSPC, names the disk, removes
    the partial folder and leaves the folder beside it alone (a real 1 MB tmpfs, a 4 MB tensor)."""
    record_property("fault", "ENOSPC in torch.save (errno dropped)")
    import torch

    from conversions import durable

    disk = tmp_path / "disk"
    _mount_tmpfs(disk, 1 << 20)
    try:
        (disk / "previous").mkdir()
        (disk / "previous" / "w.bin").write_bytes(b"\x01" * 1000)
        partial = disk / "new"
        partial.mkdir()
        with pytest.raises(durable.DiskFullError) as caught:
            with durable.disk_full_names_the_disk(partial):
                torch.save({"w": torch.ones(1 << 20)}, partial / "states.pt")
        msg = str(caught.value)
        assert "ENOSPC" in msg and "No space left on device" in msg and f"the disk mounted at {disk} (" in msg, msg
        assert " MB free of " in msg
        assert not partial.exists() and (disk / "previous" / "w.bin").read_bytes() == b"\x01" * 1000
        with pytest.raises(ValueError):  # anything else on a disk with room passes through untouched
            with durable.disk_full_names_the_disk(tmp_path / "elsewhere"):
                raise ValueError("not a disk problem")
    finally:
        _umount(disk)


def _finetune_setup(tmp_path: Path, tiny_config, data_dir: Path, hf_checkpoint: Path, disk: Path):
    from flows.chain_planner import Step
    from tasks.finetune.config import FinetuneConfig
    from tasks.stage import StageContext

    cfg = FinetuneConfig(zero={"stage": 2}, steps=6, warmup_steps=1, checkpoint_every=3, keep_checkpoints=1,
                         nproc_per_node=2, timeout_s=900, gate={"metric": "heldout_loss"})  # (no decoding: faster)
    ctx = StageContext(stage="finetune", run_id="test", run_dir=disk, work_dir=disk / "work",
                       model=tiny_config.model.model_dump(), seed=0, data_dir=data_dir, input=hf_checkpoint,
                       input_format="hf-safetensors")
    step = Step(name="finetune", label="finetune", consumes="hf-safetensors", produces="deepspeed-zero",
                fingerprint="f" * 64)
    return cfg, ctx, step, tiny_config.model_copy(update={"finetune": cfg})


def _fill_after_first_seal(seal: Path, filler: Path, found: dict, stop: threading.Event) -> None:
    """Once the first checkpoint is sealed, another writer takes the disk's space but half a checkpoint."""
    from conversions import sealed

    while not stop.is_set():
        body = sealed.read(seal.parent, seal.name)
        if body is not None:
            found["checkpoint_bytes"] = size = sum(body["files"].values())
            free = os.statvfs(seal.parent).f_bavail * os.statvfs(seal.parent).f_frsize
            _fill(filler, max(0, free - size // 2))
            found["filled_at"] = time.time()
            return
        time.sleep(0.005)


def _fails_on_the_full_disk(run, seal: Path, disk: Path, partial: Path, found: dict, stop: threading.Event) -> str:
    """Run the stage while another writer fills the disk once `seal` exists; assert the stage failed at once
    ("disk full", not retried) with one line naming the disk, its free space and the partial checkpoint; return it."""
    from flows.step_retries import cause_line, failure_class
    from tasks.launch import LaunchError

    watcher = threading.Thread(target=_fill_after_first_seal, daemon=True,
                               args=(seal, disk / "other-job.bin", found, stop))
    watcher.start()
    t0 = time.time()
    with pytest.raises(LaunchError) as caught:
        run()
    found["failed_s"] = time.time() - t0
    stop.set()
    watcher.join(5)
    e = caught.value
    assert "filled_at" in found, "the first checkpoint was never sealed"
    assert failure_class(e) == "disk full", "\n".join(e.tail)  # fails at once: only "infrastructure" is retried
    line = cause_line(e, "disk full")
    assert "ENOSPC" in line and f"the disk mounted at {disk} (" in line and " MB free of " in line, e.tail
    assert str(partial) in line and "not retried" in line
    return line


@pytest.mark.long  # ~90 s; the TRL and Megatron saves stay in `make test`
def test_enospc_mid_save_in_a_deepspeed_finetune(tmp_path, tiny_config, data_dir, hf_checkpoint, record_property):
    """A real ZeRO-2 finetune on 2 ranks, its work folder on a real tmpfs sized by the stage's free-space check (which
    passes); after the step-3 checkpoint is sealed another writer leaves half a checkpoint free, so the step-6 save
    runs out of space inside torch's writer. Then the space is freed and the same work folder resumes from step 3."""
    record_property("fault", "ENOSPC mid-save in a DeepSpeed finetune")
    from conversions import sealed
    from flows.step_runner import check_free_space, disk_needed
    from tasks.finetune.task import run_finetune

    disk = tmp_path / "disk"
    cfg, ctx, step, pipeline = _finetune_setup(tmp_path, tiny_config, data_dir, hf_checkpoint, disk)
    need = disk_needed(pipeline, step)
    _mount_tmpfs(disk, need + (4 << 20))  # the estimate plus the tokenizer, configs, logs
    stop, found = threading.Event(), {}
    ckpt = ctx.work_dir / "checkpoint"
    try:
        check_free_space(pipeline, step, ctx.work_dir)  # the stage would start: the check passes
        line = _fails_on_the_full_disk(lambda: run_finetune.fn(ctx, cfg), ckpt / "global_step3" / "baton_complete.json",
                                       disk, ckpt / "global_step6", found, stop)
        assert not (ckpt / "global_step6").exists()  # the partial checkpoint is gone, its space with it
        assert sealed.problem(ckpt / "global_step3", "baton_complete.json") is None  # the previous one verifies
        assert (ckpt / "latest").read_text().strip() == "global_step3"

        (disk / "other-job.bin").unlink()  # space freed: the same work folder, the same step, again
        t0 = time.time()
        out = run_finetune.fn(ctx, cfg)
        resumed_s = time.time() - t0
        assert out.metrics["resumed_from_step"] == 3
        integrity = {c["name"]: c for c in out.gate["checks"]}["L0.integrity"]
        assert integrity["passed"] and (out.output / "global_step6" / "baton_complete.json").exists()
        # the pre-check's estimate covers the real peak: the kept checkpoint plus the one being written
        assert need >= 2 * found["checkpoint_bytes"], (need, found["checkpoint_bytes"])
        print(f"\n{line}\ncheckpoint {found['checkpoint_bytes'] / 1e6:.2f} MB, stage needs {need / 1e6:.2f} MB "
              f"(tmpfs {(need + (4 << 20)) / 1e6:.2f} MB); failed run {found['failed_s']:.0f} s, "
              f"resumed run {resumed_s:.0f} s")
    finally:
        stop.set()
        _umount(disk)


@pytest.mark.slow
def test_enospc_mid_save_in_a_megatron_pretrain(tmp_path, data_dir, record_property):
    """The same for Megatron-Core's dist checkpointing (torch_dist, one CPU rank): after iteration 3's checkpoint is
    sealed another writer leaves half a checkpoint free; iteration 6's save runs out inside DCP's writer. The
    `.partial` folder is removed, iteration 3 still verifies, and with the space freed the same work folder resumes
    from it and completes (the L1 reload check included)."""
    record_property("fault", "ENOSPC mid-save in a Megatron pretrain")
    from conftest import TINY
    from conversions import sealed
    from flows.config import load
    from flows.chain_planner import Step
    from flows.step_runner import check_free_space, disk_needed
    from tasks.pretrain.task import run_pretrain
    from tasks.stage import StageContext

    cfg = load(TINY, ["pretrain.steps=6", "pretrain.checkpoint_every=3", "pretrain.eval_interval=6",
                      "pretrain.warmup_steps=1", "pretrain.keep_checkpoints=1"], stages=["data", "pretrain"])
    step = Step(name="pretrain", label="pretrain", consumes=None, produces="megatron-dist", fingerprint="p" * 64)
    disk = tmp_path / "disk"
    need = disk_needed(cfg, step)
    _mount_tmpfs(disk, need + (4 << 20))
    ctx = StageContext(stage="pretrain", run_id="test", run_dir=disk, work_dir=disk / "work",
                       model=cfg.model.model_dump(), seed=0, data_dir=data_dir)
    root, stop, found = ctx.work_dir / "checkpoints", threading.Event(), {}
    try:
        check_free_space(cfg, step, ctx.work_dir)
        line = _fails_on_the_full_disk(lambda: run_pretrain.fn(ctx, cfg.pretrain),
                                       root / "iter_0000003" / "baton_state.json", disk, root / "iter_0000006.partial",
                                       found, stop)
        assert sorted(p.name for p in root.iterdir()) == ["iter_0000003"]  # no partial left, nothing newer
        assert sealed.problem(root / "iter_0000003", "baton_state.json") is None

        (disk / "other-job.bin").unlink()
        t0 = time.time()
        out = run_pretrain.fn(ctx, cfg.pretrain)
        resumed_s = time.time() - t0
        assert out.metrics["resumed_from_step"] == 3 and out.metrics["iteration"] == 6
        assert out.gate["passed"], out.gate
        assert need >= 2 * found["checkpoint_bytes"], (need, found["checkpoint_bytes"])
        print(f"\n{line}\ncheckpoint {found['checkpoint_bytes'] / 1e6:.2f} MB, stage needs {need / 1e6:.2f} MB; "
              f"failed run {found['failed_s']:.0f} s, resumed run {resumed_s:.0f} s")
    finally:
        stop.set()
        _umount(disk)


@pytest.mark.slow
def test_enospc_mid_save_in_a_trl_dpo(tmp_path, tiny_config, data_dir, hf_checkpoint, record_property):
    """The same for TRL's checkpoints (the rlhf stage, DPO on one rank): after step 3's checkpoint is sealed another
    writer leaves half a checkpoint free; step 6's save runs out inside the Trainer's writer. That partial checkpoint
    is removed, step 3's still verifies (the Trainer's own rotation would have deleted it before ours was sealed), and
    with the space freed the same work folder resumes from step 3 and its gate passes."""
    record_property("fault", "ENOSPC mid-save in a TRL rlhf")
    from conversions import sealed
    from flows.chain_planner import Step
    from flows.step_runner import check_free_space, disk_needed
    from tasks.rlhf.config import RlhfConfig
    from tasks.rlhf.task import run_rlhf
    from tasks.stage import StageContext

    cfg = RlhfConfig(algorithm="dpo", steps=6, micro_batch_size=8, lr=5e-4, checkpoint_every=3, keep_checkpoints=1,
                     timeout_s=900)
    pipeline = tiny_config.model_copy(update={"rlhf": cfg})
    step = Step(name="rlhf", label="rlhf", consumes="hf-safetensors", produces="hf-safetensors", fingerprint="r" * 64)
    disk = tmp_path / "disk"
    need = disk_needed(pipeline, step)
    _mount_tmpfs(disk, need + (4 << 20))
    ctx = StageContext(stage="rlhf", run_id="test", run_dir=disk, work_dir=disk / "work",
                       model=tiny_config.model.model_dump(), seed=0, data_dir=data_dir, input=hf_checkpoint,
                       input_format="hf-safetensors")
    trl = ctx.work_dir / "checkpoint.partial.trl"
    stop, found = threading.Event(), {}
    try:
        check_free_space(pipeline, step, ctx.work_dir)
        line = _fails_on_the_full_disk(lambda: run_rlhf.fn(ctx, cfg), trl / "checkpoint-3" / "baton_complete.json",
                                       disk, trl / "checkpoint-6", found, stop)
        assert sorted(p.name for p in trl.glob("checkpoint-*")) == ["checkpoint-3"]
        assert sealed.problem(trl / "checkpoint-3", "baton_complete.json") is None

        (disk / "other-job.bin").unlink()
        out = run_rlhf.fn(ctx, cfg)
        assert out.metrics["resumed_from_step"] == 3 and out.gate["passed"], out.gate
        assert need >= 2 * found["checkpoint_bytes"], (need, found["checkpoint_bytes"])
        print(f"\n{line}\ncheckpoint {found['checkpoint_bytes'] / 1e6:.2f} MB, stage needs {need / 1e6:.2f} MB")
    finally:
        stop.set()
        _umount(disk)
