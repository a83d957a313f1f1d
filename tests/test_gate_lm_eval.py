"""The lm_eval gate metric of rlhf and finetune: its settings refused before launch with one message naming the key,
and (slow) a real finetune whose gate runs lm-evaluation-harness (`hf` backend) on baton's held-out SFT task, on the
input checkpoint and on the DeepSpeed output."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY

GOOD_TASK = """task: mine
dataset_path: json
dataset_kwargs: {data_files: {test: /nowhere/test.jsonl}}
test_split: test
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
process_results: !function utils.process
metric_list: [{metric: exact_match}]
"""


def refused(sets: list[str]) -> str:
    from flows.config import ConfigError, load

    with pytest.raises(ConfigError) as e:
        load(TINY, sets)
    return str(e.value)


@pytest.fixture
def tasks_dir(tmp_path) -> Path:
    (tmp_path / "tasks" / "sub").mkdir(parents=True)
    (tmp_path / "tasks" / "sub" / "mine.yaml").write_text(GOOD_TASK)
    return tmp_path / "tasks"


@pytest.mark.fast
@pytest.mark.parametrize("sets, message", [
    (["rlhf.gate.metric=lm_eval"], "rlhf.gate.task: metric lm_eval on rlhf needs an lm-eval task"),
    (["rlhf.gate.metric=lm_eval", "rlhf.algorithm=rm", "rlhf.gate.task=mine", "rlhf.gate.score=acc,none"],
     "rlhf.gate.metric: lm_eval scores a policy, and algorithm rm trains a reward model"),
    (["finetune.gate.metric=lm_eval", "finetune.gate.score=exact_match"],
     "finetune.gate.score: 'exact_match' is not lm-eval's '<metric>,<filter>' result key"),
    (["finetune.gate.metric=lm_eval", "finetune.gate.task=gsm8k"], "finetune.gate.score: required with task 'gsm8k'"),
    (["finetune.gate.task=gsm8k"], "finetune.gate.task: only used by metric lm_eval (metric is auto)"),
    (["finetune.gate.metric=exact_match", "finetune.gate.limit=4"], "finetune.gate.limit: only used by metric lm_eval"),
    (["finetune.gate.metric=lm_eval", "finetune.gate.limit=0"], "finetune.gate.limit: Input should be greater"),
])
def test_lm_eval_settings_are_refused_naming_the_key(sets, message):
    assert message in refused(sets)


@pytest.mark.fast
def test_the_include_path_must_define_the_task(tmp_path, tasks_dir):
    base = ["finetune.gate.metric=lm_eval", "finetune.gate.score=exact_match,none", f"finetune.gate.include_path={tasks_dir}"]
    assert "finetune.gate.task: 'other' is not defined in include_path" in refused(base + ["finetune.gate.task=other"])
    assert "(its YAML files define: mine)" in refused(base + ["finetune.gate.task=other"])
    missing = tmp_path / "missing"
    assert f"finetune.gate.include_path: {missing}: no such folder" in refused(
        ["finetune.gate.metric=lm_eval", "finetune.gate.task=mine", "finetune.gate.score=acc,none",
         f"finetune.gate.include_path={missing}"])
    (tasks_dir / "broken.yaml").write_text("task: x\n  bad: [\n")
    assert f"finetune.gate.include_path: {tasks_dir / 'broken.yaml'}:2: not valid YAML" in refused(
        base + ["finetune.gate.task=mine"])
    (tasks_dir / "broken.yaml").write_text("[" * 100_000)  # deeper than the parser recurses
    assert f"finetune.gate.include_path: {tasks_dir / 'broken.yaml'}: nested too deeply" in refused(
        base + ["finetune.gate.task=mine"])


@pytest.mark.fast
def test_valid_lm_eval_gates_load(tasks_dir):
    from flows.config import load

    assert load(TINY, ["finetune.gate.metric=lm_eval", "finetune.gate.limit=8"]).finetune.gate.metric == "lm_eval"
    cfg = load(TINY, ["rlhf.gate.metric=lm_eval", "rlhf.gate.task=mine", "rlhf.gate.score=exact_match,none",
                      f"rlhf.gate.include_path={tasks_dir}"])  # found in a subfolder; !function read as nothing
    assert cfg.rlhf.gate.task == "mine"


@pytest.mark.fast
def test_rlhf_stage_without_a_task_is_refused_before_launch(tmp_path, hf_checkpoint, data_dir):
    from tasks.rlhf.config import RlhfConfig
    from tasks.rlhf.task import RlhfInputError, run_rlhf
    from tasks.stage import StageContext

    work = tmp_path / "rlhf"
    ctx = StageContext(stage="rlhf", run_id="test", run_dir=work, work_dir=work, model={}, seed=0,
                       data_dir=data_dir, input=hf_checkpoint, input_format="hf-safetensors")
    with pytest.raises(RlhfInputError, match="rlhf.gate.task: metric lm_eval on rlhf needs an lm-eval task"):
        run_rlhf.fn(ctx, RlhfConfig(gate={"metric": "lm_eval"}))
    assert not (work / "engine.log").exists()  # nothing launched


@pytest.mark.fast
def test_the_lm_eval_check_needs_a_rise_of_the_configured_score():
    from tasks import gates

    ev = {"metric": "lm_eval_mine", "task": "mine", "score": "acc,none", "before": 0.25, "after": 0.5,
          "reported": ["acc,none"]}
    ok = gates.lm_eval_check(ev, 0.0)
    assert ok["passed"] and ok["name"] == "eval.lm_eval_mine" and "lm-eval mine acc,none 0.2500 → 0.5000" in ok["detail"]
    assert gates.lm_eval_check(ev, 0.24)["passed"]
    assert not gates.lm_eval_check(ev, 0.25)["passed"]  # by more than min_improvement
    assert not gates.lm_eval_check(dict(ev, after=0.25), 0.0)["passed"]
    missing = gates.lm_eval_check(dict(ev, score="f1,none", after=None), 0.0)
    assert not missing["passed"] and "reported no 'f1,none' (it reported: acc,none)" in missing["detail"]


@pytest.mark.slow
@pytest.mark.long  # lm-eval's harness over both checkpoints (~30 s, ~15 s): make test-long
def test_finetune_gate_runs_lm_eval_on_both_checkpoints(tmp_path, tiny_config, data_dir, hf_checkpoint):
    """Held-out task written by the data stage; before = the random-init input, after = the DeepSpeed checkpoint
    (converted to HF inside the worker)."""
    from tasks.finetune.config import FinetuneConfig
    from tasks.finetune.task import run_finetune
    from tasks.stage import StageContext

    cfg = FinetuneConfig(nproc_per_node=1, steps=100, checkpoint_every=100, warmup_steps=5, timeout_s=900,
                         gate={"metric": "lm_eval", "limit": 16})
    ctx = StageContext(stage="finetune", run_id="test", run_dir=tmp_path, work_dir=tmp_path,
                       model=tiny_config.model.model_dump(), seed=0, data_dir=data_dir, input=hf_checkpoint,
                       input_format="hf-safetensors")
    out = run_finetune.fn(ctx, cfg)
    ev = out.eval
    assert ev["metric"] == "lm_eval_baton_sft_heldout" and ev["score"] == "exact_match,strip", ev
    assert ev["task"] == "baton_sft_heldout" and ev["lm_eval_version"], ev
    assert ev["samples"]["baton_sft_heldout"]["effective"] == 16, ev
    assert ev["before"] == 0.0 and 0 < ev["after"] <= 1, ev  # the random init answers nothing right
    check = {c["name"]: c for c in out.gate["checks"]}["eval.lm_eval_baton_sft_heldout"]
    assert check["passed"] and out.gate["passed"], out.gate
    assert out.metrics["lm_eval_baton_sft_heldout_after"] == ev["after"] and out.metrics["heldout_loss_after"]
    log = (tmp_path / "engine.log").read_text()
    assert "[lm-eval-gate]" in log or "lm-eval-gate" in log or "baton_sft_heldout" in log
    assert json.loads(json.dumps(ev))  # summary.json can hold it


@pytest.mark.slow
@pytest.mark.long  # lm-eval's harness over both checkpoints (~30 s, ~15 s): make test-long
def test_rlhf_gate_runs_the_configured_lm_eval_task(tmp_path, tiny_config, data_dir, hf_checkpoint):
    """rlhf has no default task: here baton's held-out SFT task, named with its include_path and score. The task wants
    the JSON answer ({"category": ...}); the random-init input gives none, and five DPO steps on "The answer is ..."
    replies teach none: 0.0 → 0.0, no rise, so the gate refuses the policy."""
    from tasks.data import lm_eval_task
    from tasks.rlhf.config import RlhfConfig
    from tasks.rlhf.task import run_rlhf
    from tasks.stage import StageContext

    folder = lm_eval_task.write_lm_eval_task(data_dir, tmp_path / "tasks")
    cfg = RlhfConfig(steps=5, micro_batch_size=8, timeout_s=900, gate={
        "metric": "lm_eval", "task": lm_eval_task.TASK_NAME, "score": "exact_match,strip", "include_path": folder,
        "limit": 4})
    work = tmp_path / "rlhf"
    ctx = StageContext(stage="rlhf", run_id="test", run_dir=work, work_dir=work, model=tiny_config.model.model_dump(),
                       seed=0, data_dir=data_dir, input=hf_checkpoint, input_format="hf-safetensors")
    out = run_rlhf.fn(ctx, cfg)
    ev = out.eval
    assert ev["metric"] == "lm_eval_baton_sft_heldout" and ev["lm_eval_version"], ev
    assert (ev["before"], ev["after"]) == (0.0, 0.0), ev
    check = {c["name"]: c for c in out.gate["checks"]}["eval.lm_eval_baton_sft_heldout"]
    assert not check["passed"] and check["detail"].endswith("not better than the input checkpoint"), check
    assert not out.gate["passed"], out.gate
    assert out.metrics["lm_eval_wall_s"] > 0
