"""The finetune stage for real: DeepSpeed ZeRO-2 (deepspeed launcher, the session's default run: its finetune and
convert steps) and ZeRO-3 (torchrun, here) on 2 CPU ranks (gloo), converted to HF through the convert step and its
gate, matched bit for bit against DeepSpeed's own converter, and resumed after a SIGKILL."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from conversions import hf, manifest as mf
from tasks import events
from tasks.convert.config import ConvertConfig
from tasks.distributed import remove_shm_segments
from tasks.finetune.config import FinetuneConfig
from tasks.stage import StageContext

STEPS, EVERY = 30, 10


def make_ctx(work: Path, tiny_config, data_dir: Path, input_dir: Path, stage: str = "finetune", **kw) -> StageContext:
    return StageContext(stage=stage, run_id="test", run_dir=work, work_dir=work, model=tiny_config.model.model_dump(),
                        seed=0, data_dir=data_dir, input=input_dir, input_format="hf-safetensors", **kw)


def finetune_config(stage: int, launcher: str = "deepspeed", packing: bool = False) -> FinetuneConfig:
    # packed: 4 windows of up to 128 tokens per micro batch, about the tokens of 16 padded rows
    size = {"packing": True, "micro_batch_size": 4} if packing else {}
    return FinetuneConfig(zero={"stage": stage}, steps=STEPS, checkpoint_every=EVERY, launcher=launcher, timeout_s=900,
                          **size)


def run_stage(work: Path, tiny_config, data_dir, hf_checkpoint, cfg: FinetuneConfig):
    from tasks.finetune.task import run_finetune

    return run_finetune.fn(make_ctx(work, tiny_config, data_dir, hf_checkpoint), cfg)


def deepspeed_reference(ckpt: Path, out: Path) -> dict:
    """DeepSpeed's own consolidation of the same checkpoint, as the bit-for-bit reference."""
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

    convert_zero_checkpoint_to_state_dict(str(ckpt), str(out), safe_serialization=True)
    return hf.load_state_dict(out)


def assert_same_tensors(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and ours[name].shape == theirs[name].shape, name
        assert torch.equal(ours[name], theirs[name]), f"{name} differs"


def convert_and_gate(src: Path, work: Path, tiny_config, data_dir):
    from tasks.convert.task import run_convert

    ctx = make_ctx(work, tiny_config, data_dir, src, stage="convert",
                   extra={"from_format": "deepspeed-zero", "to_format": "hf-safetensors"})
    ctx.input_format = "deepspeed-zero"
    return run_convert.fn(ctx, ConvertConfig())


@pytest.fixture(scope="module")
def zero3(tmp_path_factory, tiny_config, data_dir, hf_checkpoint):
    work = tmp_path_factory.mktemp("zero3")
    return work, run_stage(work, tiny_config, data_dir, hf_checkpoint, finetune_config(3, launcher="torchrun", packing=True))


def assert_trained_checkpoint(work: Path, out_metrics: dict, out_eval: dict, ckpt: Path, stage: int, steps: int):
    assert out_metrics["loss_last"] < 0.5 * out_metrics["loss_first"]
    assert out_eval["metric"] == "heldout_exact_match" and out_eval["after"] > out_eval["before"]
    for key in ("last_tokens_per_s", "last_step_time_s", "peak_mem_mib"):
        assert out_metrics[key] > 0
    ds_config = json.loads((work / "ds_config.json").read_text())  # the generated DeepSpeed config is kept
    assert ds_config["zero_optimization"]["stage"] == stage and ds_config["optimizer"]["params"]["torch_adam"]
    m = mf.read(ckpt)
    assert m["format"] == "deepspeed-zero" and m["parent"]["format"] == "hf-safetensors"
    assert m["extra"]["zero_stage"] == stage and m["extra"]["world_size"] == 2
    assert m["extra"]["tag"] == f"global_step{steps}" and (ckpt / "latest").read_text() == m["extra"]["tag"]
    assert [d.name for d in ckpt.glob("global_step*")] == [m["extra"]["tag"]]  # older tags served resumption only
    assert (ckpt / "tokenizer" / "chat_template.jinja").exists() and (ckpt / "probe_logits.safetensors").exists()


def assert_converted_exactly(ckpt: Path, conv_gate: dict, conv_output: Path, tmp_path: Path) -> None:
    checks = {c["name"]: c for c in conv_gate["checks"]}
    assert conv_gate["passed"], conv_gate
    assert {"L0.integrity", "L1.roundtrip", "L2.logits_parity", "L3.generation"} <= set(checks)
    assert "max |Δlogit| 0 " in checks["L2.logits_parity"]["detail"]  # exact in fp32 vs the engine's own logits
    ours = hf.load_state_dict(conv_output)
    assert_same_tensors(ours, deepspeed_reference(ckpt, tmp_path / "deepspeed"))
    assert sum(t.numel() for t in ours.values()) == hf.parameter_count(conv_output) == mf.read(ckpt)["parameter_count"]


def test_zero3_trains_converts_and_passes_the_gates(zero3, tmp_path, tiny_config, data_dir):
    work, out = zero3
    assert out.gate["passed"], out.gate
    assert out.extra["zero"]["stage"] == 3
    assert out.metrics["packed_windows"] > 0 and 0.5 < out.metrics["packed_fill"] <= 1.0, out.metrics
    assert_trained_checkpoint(work, out.metrics, out.eval, out.output, stage=3, steps=STEPS)
    conv = convert_and_gate(out.output, tmp_path / "convert", tiny_config, data_dir)
    assert_converted_exactly(out.output, conv.gate, conv.output, tmp_path)


def test_zero2_of_the_default_run_trained_and_converted_exactly(default_run, tiny_config, tmp_path):
    """The default chain's finetune (ZeRO-2, deepspeed launcher, 2 ranks) and its convert step."""
    assert default_run.rc == 0, default_run.failure()
    fine, conv = default_run.stages["finetune"], default_run.stages["convert-zero-to-hf"]
    ckpt = Path(fine["output"])
    assert fine["zero"]["stage"] == 2
    assert_trained_checkpoint(ckpt.parent, fine["metrics"], fine["eval"], ckpt, stage=2,
                              steps=tiny_config.finetune.steps)
    assert_converted_exactly(ckpt, conv["gate"], Path(conv["output"]), tmp_path)


def _kill_after_first_checkpoint(cmd: list[str], env: dict, log: Path) -> int:
    """Run the worker tree and SIGKILL all of it as soon as the first checkpoint is reported complete."""
    full_env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent), **env)
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    step = None
    with open(log, "w") as f:
        for line in proc.stdout:
            f.write(line)
            e = events.parse(line.strip())
            if e and e["kind"] == "checkpoint":
                step = e["step"]
                os.killpg(proc.pid, signal.SIGKILL)
                break
    proc.wait(timeout=60)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    assert step is not None, log.read_text()[-3000:]
    return step


def test_resume_after_sigkill_matches_an_uninterrupted_run(zero3, tmp_path, tiny_config, data_dir, hf_checkpoint):
    from tasks.finetune.task import prepare, run_finetune

    work = tmp_path / "interrupted"
    ctx = make_ctx(work, tiny_config, data_dir, hf_checkpoint)
    cfg = finetune_config(3, launcher="torchrun", packing=True)
    cmd, env, ckpt, port = prepare(ctx, cfg)
    try:
        killed_at = _kill_after_first_checkpoint(cmd, env, tmp_path / "killed.log")
    finally:
        remove_shm_segments(port)
    assert killed_at == EVERY
    # a save that never completed (no marker) must be ignored and cleaned up, never loaded
    partial = ckpt / f"global_step{STEPS + 5}"
    partial.mkdir()
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"torn write")

    out = run_finetune.fn(ctx, cfg)
    assert out.metrics["resumed_from_step"] == EVERY
    assert not partial.exists()
    assert out.gate["passed"], out.gate

    from conversions import zero

    reference = zero3[1].output
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        zero.to_hf(out.output, Path(a), max_shard_bytes=1 << 30)
        zero.to_hf(reference, Path(b), max_shard_bytes=1 << 30)
        assert_same_tensors(hf.load_state_dict(Path(a)), hf.load_state_dict(Path(b)))
    assert out.metrics["loss_last"] == zero3[1].metrics["loss_last"]
