"""The engine options that need no engine to check: interleaved pipeline and FP8 (pretrain), ZeRO-Infinity NVMe
offload and ZeRO++ (finetune). Each is refused before launch, with the reason, where it cannot run; where it can, it
reaches the engine's own config (the Megatron worker spec, the DeepSpeed JSON)."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from conversions import sealed
from tasks import resuming

from conftest import TINY

pytestmark = pytest.mark.fast


def _load(stage: str, *overrides: str):
    from flows.config import load

    return load(TINY, list(overrides), stages=["data", stage])


def _errors(stage: str, *overrides: str) -> str:
    from flows.config import ConfigError

    with pytest.raises(ConfigError) as e:
        _load(stage, *overrides)
    return str(e.value)


VP = ["pretrain.device=cpu", "pretrain.nproc_per_node=2", "pretrain.pipeline_parallel=2"]


@pytest.mark.parametrize("overrides, message", [
    (["pretrain.virtual_pipeline_parallel=2"], "virtual_pipeline_parallel 2 needs pipeline_parallel > 1 (it is 1)"),
    ([*VP, "pretrain.virtual_pipeline_parallel=4"],
     "model.num_layers 4 is not divisible by pipeline_parallel × virtual_pipeline_parallel = 8"),
    ([*VP, "pretrain.virtual_pipeline_parallel=2", "pretrain.global_batch_size=24"],
     "micro batches per step (global_batch_size / (micro_batch_size × data parallel) = 3) to be a multiple of "
     "pipeline_parallel 2"),
    (["pretrain.device=cpu", "pretrain.fp8=hybrid"],
     "pretrain.fp8 hybrid: FP8 needs a GPU with Transformer Engine (Hopper or newer); this run's device is cpu"),
    (["pretrain.fp8=e5m2"], "pretrain.fp8"),
])
def test_pretrain_options_are_refused_before_launch(overrides, message):
    assert message in _errors("pretrain", *overrides)


def test_fp8_on_a_gpu_host_needs_transformer_engine_and_its_layer_spec(monkeypatch):
    import importlib.util

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # the probe's input: one visible GPU
    assert "needs transformer_impl transformer_engine or auto" in _errors(
        "pretrain", "pretrain.device=cuda", "pretrain.fp8=e4m3", "pretrain.transformer_impl=local")
    if importlib.util.find_spec("transformer_engine") is None:
        assert "Transformer Engine (transformer_engine) is not installed" in _errors(
            "pretrain", "pretrain.device=cuda", "pretrain.fp8=hybrid")
    else:
        assert _load("pretrain", "pretrain.device=cuda", "pretrain.fp8=hybrid").pretrain.fp8 == "hybrid"


def test_interleaved_pipeline_reaches_the_worker_spec(tmp_path, data_dir):
    from tasks.pretrain.task import build_spec
    from tasks.stage import StageContext

    cfg = _load("pretrain", *VP, "pretrain.virtual_pipeline_parallel=2")
    p = cfg.pretrain
    assert (p.pipeline_parallel, p.virtual_pipeline_parallel, p.accumulation(), p.fp8) == (2, 2, 2, "none")
    ctx = StageContext(stage="pretrain", run_id="t", run_dir=tmp_path, work_dir=tmp_path, model=cfg.model.model_dump(),
                       seed=0, data_dir=data_dir)
    spec = build_spec(ctx, p)
    assert spec.config.virtual_pipeline_parallel == 2 and spec.config.fp8 == "none"


NVME = ["finetune.zero.stage=3", "finetune.zero.offload_optimizer=cpu", "finetune.zero.offload_params=nvme"]


@pytest.mark.parametrize("overrides, message", [
    (["finetune.zero.offload_params=nvme", "finetune.zero.nvme_path=/tmp/x"],
     "finetune.zero.offload_params: nvme offload needs ZeRO stage 3 (stage is 2)"),
    (["finetune.zero.stage=3", "finetune.zero.offload_optimizer=nvme", "finetune.zero.nvme_path=/tmp/x"],
     "finetune.zero.offload_optimizer: nvme is refused: DeepSpeed writes no fp32 master weights or Adam state"),
    (NVME, "finetune.zero.nvme_path: required by zero.offload_params: nvme"),
    ([*NVME, "finetune.zero.nvme_path=swap"], "finetune.zero.nvme_path: 'swap' is not an absolute path"),
    (["finetune.zero.nvme_path=/tmp/x"], "neither offload_optimizer nor offload_params is nvme"),
    (["finetune.device=cpu", "finetune.zero.stage=3", "finetune.zero.quantized_weights=true"],
     "finetune.zero.quantized_weights: refused on cpu: ZeRO++ quantization runs DeepSpeed's CUDA quantizer kernels"),
    (["finetune.device=cpu", "finetune.zero.stage=3", "finetune.zero.quantized_gradients=true"],
     "finetune.zero.quantized_gradients: refused on cpu"),
    (["finetune.device=cpu", "finetune.precision=fp16"],
     "finetune.precision fp16: refused on cpu: DeepSpeed's CPU accelerator has no fp16"),
    (["finetune.device=cpu", "finetune.zero.quantized_gradients=true"],
     "finetune.zero.quantized_gradients: ZeRO++ needs ZeRO stage 3 (stage is 2)"),
    (["finetune.zero.stage=3", "finetune.zero.hpz_partition_size=2"],
     "finetune.zero.hpz_partition_size 2: hpZ needs more than one node (nnodes is 1)"),
    (["finetune.zero.stage=3", "finetune.zero.hpz_partition_size=4", "finetune.nnodes=2",
      "finetune.global_batch_size=64"],
     "finetune.zero.hpz_partition_size 4: must divide nproc_per_node 2"),
])
def test_finetune_zero_options_are_refused_before_launch(overrides, message):
    assert message in _errors("finetune", *overrides)


def test_nvme_offload_and_zero_plus_plus_reach_the_deepspeed_config():
    from tasks.finetune import ds_config

    cfg = _load("finetune", *NVME, "finetune.zero.nvme_path=/tmp/swap").finetune
    zero = ds_config.build(cfg)["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert zero["offload_param"] == {"device": "nvme", "nvme_path": "/tmp/swap", "pin_memory": False,
                                     "max_in_cpu": 1_000_000_000, "buffer_count": 5, "buffer_size": 100_000_000}
    assert ds_config.build(cfg)["aio"]["block_size"] == 1 << 20
    assert (zero["zero_quantized_weights"], zero["zero_quantized_gradients"], zero["zero_hpz_partition_size"]) == (
        False, False, 1)
    multi = _load("finetune", "finetune.zero.stage=3", "finetune.zero.hpz_partition_size=2", "finetune.nnodes=2",
                  "finetune.global_batch_size=64").finetune
    assert ds_config.build(multi)["zero_optimization"]["zero_hpz_partition_size"] == 2
    assert "aio" not in ds_config.build(multi) and "zero_hpz_partition_size" not in ds_config.build(
        _load("finetune").finetune)["zero_optimization"]


def test_baton_config_prints_the_new_keys(baton_home):
    from conftest import baton

    r = baton("config", str(TINY), "--stages", "data,pretrain,finetune", "--set", "pretrain.nproc_per_node=2",
              "--set", "pretrain.pipeline_parallel=2", "--set", "pretrain.virtual_pipeline_parallel=2",
              home=baton_home, timeout=120)
    assert r.returncode == 0, r.stderr
    for key in ("virtual_pipeline_parallel", "fp8", "nvme_path", "quantized_weights", "quantized_gradients",
                "hpz_partition_size"):
        assert key in r.stdout, key


def test_rlhf_resumes_only_from_a_checkpoint_marked_complete(tmp_path, monkeypatch):
    monkeypatch.setenv("BATON_HOME", str(tmp_path.with_name(f"{tmp_path.name}-home")))  # where the seal key is made
    from tasks.rlhf import worker

    def checkpoint(step: int, payload: bytes, mark: bool) -> Path:
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        (d / "model.safetensors").write_bytes(payload)
        if mark:
            worker.mark_complete(d)
        return d

    done = checkpoint(2, b"x" * 10, mark=True)
    torn = checkpoint(4, b"x" * 10, mark=True)
    (torn / "model.safetensors").write_bytes(b"x" * 3)  # lost bytes after the marker: not complete
    flipped = checkpoint(5, b"x" * 10, mark=True)
    (flipped / "model.safetensors").write_bytes(b"x" * 9 + b"y")  # same size, one byte changed: complete, corrupt
    unmarked = checkpoint(6, b"x" * 10, mark=False)  # killed before the marker
    assert worker.is_complete(done) and not worker.is_complete(torn) and not worker.is_complete(unmarked)
    assert worker.is_complete(flipped)
    point = resuming.resume_point(tmp_path, worker.KIND)
    assert point.checkpoint == done and point.step == 2
    assert [r.folder for r in point.rejected] == [flipped] and set(point.unfinished) == {torn, unmarked}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]  # the others are deleted
    assert worker.checkpoint_args(argparse.Namespace(checkpoint_every=0, keep_checkpoints=2)) == {"save_strategy": "no"}


def test_with_no_complete_checkpoint_left_training_starts_fresh(tmp_path, monkeypatch, capsys):
    """docs/reliability-and-security.md: a corrupted checkpoint is deleted, falling back to the previous good one, and
    with none left training starts fresh. Every checkpoint here is sealed, then changed: TRL's worker finds nothing to
    resume from (its resumed_from is then 0) and DeepSpeed's keeps no tag; both delete what they rejected."""
    monkeypatch.setenv("BATON_HOME", str(tmp_path.with_name(f"{tmp_path.name}-home")))  # where the seal key is made
    from tasks.finetune import worker as finetune_worker
    from tasks.rlhf import worker as rlhf_worker

    def corrupted(folder: Path, seal) -> Path:
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x" * 10)
        seal(folder)
        (folder / "model.safetensors").write_bytes(b"x" * 9 + b"y")
        return folder

    trl = tmp_path / "trl"
    for step in (2, 4):
        corrupted(trl / f"checkpoint-{step}", rlhf_worker.mark_complete)
    assert len(resuming.complete(trl, rlhf_worker.KIND)) == 2
    point = resuming.resume_point(trl, rlhf_worker.KIND)
    assert point.checkpoint is None and point.step == 0 and len(point.rejected) == 2 and list(trl.iterdir()) == []

    ds = tmp_path / "ds"
    for step in (3, 6):
        corrupted(ds / f"global_step{step}", lambda d, step=step: sealed.seal(d, finetune_worker.COMPLETE, step=step))
    assert resuming.resume_point(ds, finetune_worker.KIND).checkpoint is None and list(ds.iterdir()) == []
    assert f"{ds}: no checkpoint whose contents verify; starting fresh" in capsys.readouterr().out


def deepspeed_can_link_libaio() -> bool:
    """DeepSpeed's own probe for its async I/O op: compile and link a program calling libaio's io_submit."""
    from deepspeed.ops.op_builder.async_io import AsyncIOBuilder

    return AsyncIOBuilder().has_function("io_submit", ("aio",))


def test_nvme_offload_checks_its_folder_and_libaio_before_launch(tmp_path):
    from tasks.finetune.task import nvme_problems

    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = _load("finetune", *NVME, f"finetune.zero.nvme_path={blocker / 'swap'}").finetune
    problems = nvme_problems(cfg)
    assert any(p.startswith(f"finetune.zero.nvme_path: cannot create {blocker / 'swap'}") for p in problems)
    ok = _load("finetune", *NVME, f"finetune.zero.nvme_path={tmp_path / 'swap'}").finetune
    expected = [] if deepspeed_can_link_libaio() else [
        "finetune.zero: nvme offload builds DeepSpeed's async I/O op against libaio, which is not installed "
        "(make system-deps: Debian's libaio-dev)"]
    assert nvme_problems(ok) == expected and (tmp_path / "swap").is_dir()
