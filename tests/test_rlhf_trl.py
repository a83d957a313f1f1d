"""The rlhf stage for real with TRL on CPU, from a random-init HF checkpoint: a reward model (2 processes, torchrun +
gloo), GRPO for a few steps, and DPO killed mid-run then resumed, through the stage task. (DPO through the CLI, with
its margin, held-out accuracy, gate, registration and MLflow metrics: the session's default run,
tests/test_default_run.py.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conversions import hf, manifest as mf
from tasks.rlhf.config import RlhfConfig
from tasks.stage import StageContext


def make_ctx(work: Path, tiny_config, data_dir: Path, input_dir: Path) -> StageContext:
    return StageContext(stage="rlhf", run_id="test", run_dir=work, work_dir=work, model=tiny_config.model.model_dump(),
                        seed=0, data_dir=data_dir, input=input_dir, input_format="hf-safetensors")


def run_stage(work: Path, tiny_config, data_dir, ckpt, cfg: RlhfConfig):
    from tasks.rlhf.task import run_rlhf

    return run_rlhf.fn(make_ctx(work, tiny_config, data_dir, ckpt), cfg)


def test_reward_model_beside_the_chain(tmp_path, tiny_config, data_dir, hf_checkpoint):
    cfg = RlhfConfig(algorithm="rm", steps=4, micro_batch_size=8, nproc_per_node=2, lr=5e-4, timeout_s=900,
                     precision="bf16")  # mixed precision on CPU too (the default run trains rlhf in fp32)
    out = run_stage(tmp_path, tiny_config, data_dir, hf_checkpoint, cfg)
    assert out.gate["passed"], out.gate
    names = {c["name"] for c in out.gate["checks"]}
    assert {"policy.unchanged", "reward_model.L0.integrity", "reward_model.L1.reward_model_roundtrip"} <= names
    rm_dir = Path(out.extra["reward_model"])
    rm_m = mf.read(rm_dir)
    assert rm_m["extra"]["role"] == "reward-model" and rm_m["extra"]["algorithm"] == "rm"
    assert json.loads((rm_dir / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    assert "score.weight" in hf.tensor_shapes(rm_dir)
    policy = mf.read(out.output)
    assert policy["extra"]["reward_model"]["digest"] == mf.digest_of(rm_m)
    assert hf.load_state_dict(out.output).keys() == hf.load_state_dict(hf_checkpoint).keys()
    assert out.eval["metric"] == "heldout_reward_accuracy" and 0.0 <= out.eval["after"] <= 1.0
    assert isinstance(out.metrics["margin_first"], float) and isinstance(out.metrics["margin_last"], float)


def test_grpo_runs_a_few_steps_with_the_preference_reward(tmp_path, tiny_config, data_dir, hf_checkpoint):
    """The random-init input scores every held-out pair's chosen reply ("The answer is plum.") below its one-word
    rejected one, its extra tokens each costing about log(vocab): accuracy starts at 0.0, so it cannot fall, and the
    gate, which only refuses a fall, must pass whatever three GRPO steps did."""
    cfg = RlhfConfig(algorithm="grpo", steps=3, micro_batch_size=8, num_generations=4, max_completion_length=6,
                     lr=1e-4, beta=0.04, timeout_s=900, precision="fp16")  # fp16 autocast on CPU, as on a GPU
    out = run_stage(tmp_path, tiny_config, data_dir, hf_checkpoint, cfg)
    m = mf.read(out.output)
    assert m["extra"]["algorithm"] == "grpo" and m["extra"]["backend"] == "trl"
    log = (tmp_path / "engine.log").read_text()
    steps = [json.loads(line[len("@@baton "):]) for line in log.splitlines() if line.startswith("@@baton ")]
    rewards = [e for e in steps if e["kind"] == "metric" and "train/reward" in e]
    assert len(rewards) == 3 and all("train/kl" in e and "perf/step_time_s" in e for e in rewards)
    assert out.metrics["heldout_kl_to_reference"] >= 0.0
    assert out.eval["metric"] == "heldout_pref_accuracy" and out.eval["before"] == 0.0, out.eval
    assert 0.0 <= out.eval["after"] <= 1.0, out.eval
    acc = next(c for c in out.gate["checks"] if c["name"] == "eval.heldout_pref_accuracy")
    assert acc["passed"] and acc["detail"].startswith("held-out preference_accuracy 0.0000 → "), acc
    assert out.gate["passed"], out.gate


NUMBER_REWARD = """
def has_a_number(prompt, completion, **row):
    return 1.0 if any(c.isdigit() for c in completion) else 0.0
"""


def prompts_data(data_dir: Path, dest: Path) -> Path:
    """The session's data with the arithmetic task added the data stage's way (data.prompts: synthetic); the
    tokenizer stays the session's (byte-level: every digit is a token of it)."""
    import random
    import shutil

    from tasks.data.config import DataConfig
    from tasks.data.task import _synthetic, write_rows

    shutil.copytree(data_dir, dest)
    train, held = _synthetic("prompts", DataConfig(prompts={"kind": "synthetic"}), random.Random(0))
    (dest / "prompts").mkdir()
    write_rows(dest / "prompts" / "train.jsonl", train)
    write_rows(dest / "prompts" / "heldout.jsonl", held)
    return dest


def test_grpo_with_verifiable_rewards_raises_the_held_out_reward(tmp_path, tiny_config, data_dir, hf_checkpoint):
    """GRPO on the arithmetic task from the random-init input, rewarded by the built-in exact match of the last number
    and a user function (a number at all, weight 0.5): the input's greedy replies hold no digit (reward 0); after
    training they do, so the held-out reward rises and the gate passes."""
    (tmp_path / "rewards.py").write_text(NUMBER_REWARD)
    data = prompts_data(data_dir, tmp_path / "data")
    cfg = RlhfConfig(algorithm="grpo", steps=GRPO_STEPS, micro_batch_size=16, num_generations=4,
                     max_completion_length=3, lr=3e-3, beta=0.0, loss_type="dr_grpo", scale_rewards="none",
                     checkpoint_every=1000, timeout_s=900,
                     rewards=[{"kind": "exact_match"},
                              {"kind": "function", "function": f"{tmp_path}/rewards.py:has_a_number", "weight": 0.5}])
    (tmp_path / "run").mkdir()
    out = run_stage(tmp_path / "run", tiny_config, data, hf_checkpoint, cfg)
    ev = out.eval
    assert ev["metric"] == "heldout_reward" and ev["heldout_prompts"] == 22, ev
    assert ev["after"] > ev["before"], ev
    assert 0.0 <= ev["solved_before"] <= 1.0 and 0.0 <= ev["solved_after"] <= 1.0, ev
    check = next(c for c in out.gate["checks"] if c["name"] == "eval.heldout_reward")
    assert check["passed"] and out.gate["passed"], out.gate
    assert out.metrics["heldout_reward_after"] == ev["after"]
    assert out.metrics["heldout_solved_after"] == ev["solved_after"]
    log = (tmp_path / "run" / "engine.log").read_text()
    logged = [json.loads(line[len("@@baton "):]) for line in log.splitlines() if line.startswith("@@baton ")]
    metrics = [e for e in logged if e["kind"] == "metric"]
    assert any("train/rewards_1_has_a_number_mean" in e for e in metrics)
    steps = [e for e in metrics if "perf/step_time_s" in e]  # where a step's time goes: rollouts against the rest
    assert len(steps) == GRPO_STEPS and all(0 < e["perf/rollout_time_s"] < e["perf/step_time_s"] for e in steps)
    assert all(e["perf/rollout_tokens_per_s"] > 0 and 0 < e["perf/rollout_share"] < 1 for e in steps)
    assert 0 < out.metrics["rollout_share"] < 1 and out.metrics["rollout_tokens_per_s"] > 0, out.metrics
    print(f"heldout_reward {ev['before']:.3f} → {ev['after']:.3f}, solved {ev['solved_before']:.3f} → "
          f"{ev['solved_after']:.3f}; rollouts {out.metrics['rollout_share']:.0%} of the step, "
          f"{out.metrics['rollout_tokens_per_s']:.0f} tokens/s")


GRPO_STEPS = 60


@pytest.mark.fast
@pytest.mark.parametrize("before, after, min_improvement, passed", [
    (0.0, 0.0, 0.0, True),  # level passes (heldout_loss and exact_match need a strict rise: test_data_formats)
    (0.5, 0.45, 0.0, False),
    (0.25, 0.5, 0.25, True),  # a rise of exactly min_improvement is enough
    (0.25, 0.5, 0.3, False),
    (None, 0.5, 0.0, False),  # not measured
])
def test_the_preference_gate_needs_at_least_its_minimum_rise(before, after, min_improvement, passed):
    from tasks import gates

    assert gates.check("preference_accuracy", before, after, min_improvement)["passed"] is passed


RESUME_TOLERANCE = 1e-6  # max |Δweight| vs the uninterrupted run; measured 0.0 (TRL restores model, optimizer, RNG, data order)


def _kill_after_checkpoint(work: Path, run, step: int) -> Exception | None:
    """Run the stage in a thread; SIGKILL its TRL worker once the checkpoint of `step` is marked complete."""
    import signal
    import threading
    import time

    import psutil

    failure: dict = {}

    def target():
        try:
            run()
        except Exception as e:  # the launcher reports the killed worker
            failure["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    marker = work / "checkpoint.partial.trl" / f"checkpoint-{step}" / "baton_complete.json"
    deadline = time.time() + 900
    while not marker.exists():
        assert thread.is_alive(), f"the stage ended before checkpoint {step}: {failure}"
        assert time.time() < deadline
        time.sleep(0.05)
    for p in psutil.Process().children(recursive=True):
        try:
            if any(c.endswith("rlhf/worker.py") for c in p.cmdline()):
                p.send_signal(signal.SIGKILL)
        except psutil.Error:
            continue
    thread.join(300)
    return failure.get("error")


def _metric_steps_after_resume(work: Path) -> tuple[int, list[int]]:
    """The last attempt's resume point and the training steps it logged (engine.log accumulates attempts)."""
    lines = [json.loads(line[len("@@baton "):]) for line in (work / "engine.log").read_text().splitlines()
             if line.startswith("@@baton ")]
    start = max(i for i, e in enumerate(lines) if e["kind"] == "start")
    return lines[start]["resumed_from"], [e["step"] for e in lines[start:] if e["kind"] == "metric" and "train/loss" in e]


def test_dpo_killed_mid_run_resumes_from_its_newest_good_checkpoint(tmp_path, tiny_config, data_dir, hf_checkpoint):
    """SIGKILL after checkpoint 4, then one flipped byte in the newest checkpoint: the rerun names it, resumes from
    the one before, and ends with the weights of an uninterrupted run."""
    cfg = RlhfConfig(algorithm="dpo", steps=8, micro_batch_size=8, lr=5e-4, checkpoint_every=2, keep_checkpoints=2,
                     timeout_s=900)
    straight = run_stage(tmp_path / "straight", tiny_config, data_dir, hf_checkpoint, cfg)
    assert straight.metrics["resumed_from_step"] == 0
    work = tmp_path / "killed"
    error = _kill_after_checkpoint(work, lambda: run_stage(work, tiny_config, data_dir, hf_checkpoint, cfg), step=4)
    assert error is not None and not (work / "checkpoint").exists()
    from tasks.rlhf import worker

    kept = sorted((p for p in (work / "checkpoint.partial.trl").glob("checkpoint-*") if worker.is_complete(p)),
                  key=lambda p: int(p.name.split("-")[-1]))
    assert len(kept) == 2  # keep_checkpoints
    newest = kept[-1]
    weights = newest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # a bit flip: same size, so only the sha256 can tell
    weights.write_bytes(bytes(data))
    resumed = run_stage(work, tiny_config, data_dir, hf_checkpoint, cfg)
    start, steps = _metric_steps_after_resume(work)
    assert start == int(newest.name.split("-")[-1]) - 2 and resumed.metrics["resumed_from_step"] == start
    assert "model.safetensors differs from the sha256 recorded at save time" in (work / "engine.log").read_text()
    assert steps and min(steps) == start + 1 and max(steps) == 8  # no step repeated, none skipped
    assert resumed.gate["passed"], resumed.gate
    assert not (work / "checkpoint.partial.trl").exists()  # a finished attempt leaves no scratch
    a, b = hf.load_state_dict(resumed.output), hf.load_state_dict(straight.output)
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    print(f"rlhf resume after SIGKILL at step {start}: max |Δweight| vs uninterrupted = {diff:g}")
    assert diff <= RESUME_TOLERANCE


NAN, INF = float("nan"), float("inf")


@pytest.mark.fast
@pytest.mark.parametrize("precision, logs, named", [
    ("fp32", {"loss": NAN, "grad_norm": 1.5}, "loss nan"),
    ("fp32", {"loss": 0.7, "grad_norm": INF}, "grad_norm inf"),
    ("bf16", {"loss": INF, "grad_norm": NAN}, "loss inf, grad_norm nan"),
    ("fp16", {"loss": -INF, "grad_norm": 1.5}, "loss -inf"),
    ("fp16", {"loss": 0.7, "grad_norm": INF}, None),   # the fp16 loss scaler's overflow: that update was skipped
    ("fp32", {"loss": 0.7, "grad_norm": 1.5}, None),
    ("fp32", {"train_loss": NAN, "train_runtime": 1.0}, None),  # the end-of-training summary is no step
])
def test_a_non_finite_loss_or_gradient_norm_stops_trl_at_that_step(precision, logs, named, capfd):
    """TRL's per-step log through the worker's callback: a NaN or inf stops the rank with the cause announced (one
    failure event, the step and the values named); finite values, and fp16's overflowed norm, do not."""
    from transformers import TrainerState

    from tasks import events
    from tasks.rlhf import worker

    callback = worker.non_finite_callback(precision)
    if named is None:
        callback.on_log(None, TrainerState(global_step=3), None, logs=logs)
        assert "failure" not in capfd.readouterr().out
        return
    with pytest.raises(SystemExit) as stopped:
        callback.on_log(None, TrainerState(global_step=3), None, logs=logs)
    assert str(stopped.value).startswith(f"rank 0: non-finite {named} at step 3;"), stopped.value
    announced = [e for e in map(events.parse, capfd.readouterr().out.splitlines()) if e]
    assert announced == [{"kind": "failure", "cause": "non-finite loss", "detail": str(stopped.value)}]


def test_the_rlhf_gate_names_a_policy_with_non_finite_weights(tmp_path, hf_checkpoint):
    """One inf in a policy whose manifest is rebuilt over it (so integrity holds): the gate fails and names the tensor,
    where before only the L1 round trip said "differs"."""
    import shutil

    from safetensors.torch import load_file, save_file

    from conversions import verify
    from conversions.manifest import Format
    from tasks.rlhf.task import gate

    out = Path(shutil.copytree(hf_checkpoint, tmp_path / "policy"))
    (weights,) = hf.safetensors_files(out)
    tensors = load_file(weights)
    name = "model.norm.weight"
    tensors[name][0] = INF
    save_file(tensors, weights, metadata={"format": "pt"})
    mf.write(out, mf.build(out, format=Format.HF_SAFETENSORS, stage="rlhf", parameter_count=hf.parameter_count(out),
                           dtype="float32", architecture=mf.read(hf_checkpoint)["architecture"]))
    report = gate("dpo", out, out, hf_checkpoint, verify.check("eval.heldout_pref_accuracy", True, "not measured here"))
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["L0.integrity"]["passed"], checks["L0.integrity"]
    assert not checks["weights.finite"]["passed"] and f"{name} (1 NaN/inf)" in checks["weights.finite"]["detail"]
    assert not report["passed"]


def test_trl_packs_no_rlhf_algorithm_so_rlhf_packing_is_refused(tmp_path, hf_checkpoint):
    """The engine facts behind rlhf.packing's refusal on trl (tasks/rlhf/checks.py CANNOT_PACK), read from the runtime's
    TRL: DPOConfig has no packing and DPOTrainer turns padding_free=True back off (it would pad and train anyway);
    RewardConfig and GRPOConfig have neither option. When a TRL upgrade packs exactly, this fails: wire it up then."""
    import dataclasses

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer, GRPOConfig, RewardConfig

    def options(config) -> set[str]:
        return {f.name for f in dataclasses.fields(config)} & {"packing", "padding_free"}

    assert (options(DPOConfig), options(RewardConfig), options(GRPOConfig)) == ({"padding_free"}, set(), set())
    pairs = Dataset.from_list([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 2)
    args = DPOConfig(output_dir=str(tmp_path), padding_free=True, per_device_train_batch_size=2, report_to=[],
                     use_cpu=True, max_length=32)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(str(hf_checkpoint)), args=args,
                         train_dataset=pairs, processing_class=AutoTokenizer.from_pretrained(str(hf_checkpoint)))
    assert trainer.padding_free is False
