"""The README's first command, `baton run configs/tiny.yaml`, as a person runs it (see default_run.py): every stage and
every gate passes, the losses fall, the served model becomes `champion`, and the terminal ends with the summary table
and the run folder. Then what the run left behind: the data stage's files and MLflow datasets, the pretraining curve,
both serving engines' smoke checks, the API key, `baton runs`/`show`/`verify` on its outputs."""
from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest

from conftest import TINY, baton, cli

pytestmark = pytest.mark.ops

CHAIN = ["data", "pretrain", "convert-megatron-to-hf", "rlhf", "finetune", "convert-zero-to-hf", "export", "serve"]
SMOKE = ["server", "smoke.models", "smoke.auth_401", "smoke.chat", "smoke.chat_template_parity",
         "smoke.stops_at_end_of_turn", "smoke.generation_defaults", "smoke.json_schema", "smoke.regex",
         "smoke.greedy_parity"]


@pytest.fixture(scope="module")
def run(default_run):
    assert default_run.rc == 0, default_run.failure()
    return default_run


def test_every_stage_and_gate_passes_and_the_view_ends_with_the_table(run):
    assert run.summary["status"] == "completed"
    assert list(run.stages) == CHAIN
    for label, entry in run.stages.items():
        assert entry["status"] == "completed", (label, entry.get("error"))
        failed = [c["name"] for c in entry["gate"]["checks"] if not c["passed"]]
        assert entry["gate"]["passed"] and entry["gate"]["checks"] and not failed, (label, failed)
    text = "\n".join(run.lines)
    assert run.lines[-1].strip() == str(run.run_dir)
    for label in CHAIN:  # the summary table: one row per step with its gate count
        assert re.search(rf"^\s+{re.escape(label)}\s+completed\s+\S+\s+gate \d+/\d+", text, re.M), (label, text)


def test_no_live_row_was_cut_on_an_80_column_terminal(run):
    from default_run import _CSI

    text = _CSI.sub(lambda m: "" if m.group(3) == "m" else "\n", run.raw)  # colours go, cursor moves end a row
    frames = re.split(r"[\r\n]+", text)
    rows = [line.rstrip() for line in frames if line[:2] in {f"{m} " for m in "·▶✓✗■"}]
    assert any("running" in r and "/" in r and "loss" in r for r in rows), rows[-20:]
    assert not [r for r in rows if "…" in r or len(r) > 80], [r for r in rows if "…" in r or len(r) > 80][:5]


def test_losses_fall_and_evaluations_improve(run):
    for label in ("pretrain", "rlhf", "finetune"):
        m, ev = run.stages[label]["metrics"], run.stages[label]["eval"]
        assert m["loss_last"] < m["loss_first"], (label, m)
        assert ev["before"] is not None and ev["after"] is not None, (label, ev)
    assert run.stages["pretrain"]["eval"]["metric"] == "heldout_ppl"
    assert run.stages["pretrain"]["eval"]["after"] < run.stages["pretrain"]["eval"]["before"]
    assert run.stages["finetune"]["eval"]["after"] > run.stages["finetune"]["eval"]["before"]


def test_the_served_model_is_the_champion(run):
    serve = run.stages["serve"]
    version = serve["champion"]["version"]
    assert str(run.champion) == str(version)
    assert serve["served_model_names"] == {"vllm": f"baton-tiny:{version}", "sglang": f"baton-tiny-v{version}"}
    assert run.stages["convert-zero-to-hf"]["registered"]["alias"] == "candidate"


def test_the_export_stage_published_and_registered_each_gguf_file(run, ops_stack):
    from test_export_stage import check_exports

    r = cli("lineage", "baton-tiny-gguf-file@q8_0", "--json", home=run.home, env=run.env)
    assert r.returncode == 0, r.stderr[-3000:]
    lineage = json.loads(r.stdout)
    assert [n["label"] for n in lineage] == CHAIN[:-1]
    check_exports(run.stages["export"], run.stages["convert-zero-to-hf"]["output"], ops_stack.mlflow(), lineage)


def test_both_engines_pass_every_smoke_check(run):
    serve = run.stages["serve"]
    checks = {c["name"]: c for c in serve["gate"]["checks"]}
    for engine in ("vllm", "sglang"):
        for name in SMOKE:
            assert checks[f"{engine}.{name}"]["passed"], (engine, name, checks.get(f"{engine}.{name}"))
        assert "20/20 strictly valid" in checks[f"{engine}.smoke.json_schema"]["detail"]
        assert "401" in checks[f"{engine}.smoke.auth_401"]["detail"]
        assert serve["metrics"][f"{engine}_tokens_per_s"] > 0 and serve["metrics"][f"{engine}_ttft_s"] > 0
    assert checks["sglang.smoke.sgl_frontend"]["passed"]
    assert serve["engine"] == "vllm+sglang" and serve["metrics"]["json_valid_rate"] == 1.0
    assert serve["eval"]["metric"] == "lm_eval_exact_match" and 0.0 <= serve["eval"]["after"] <= 1.0


def test_the_api_key_is_private_and_in_no_log(run):
    work = next(run.run_dir.glob("*-serve"))
    key_file = work / "api_key"
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    key = key_file.read_text().strip()
    logs = list(work.rglob("*.log")) + [run.run_dir / "run.log"]
    assert (work / "server-vllm.log").exists() and (work / "server-sglang.log").exists()
    for log in logs:
        assert key not in log.read_text(errors="replace"), log
    assert key not in run.raw


def test_the_data_stage_left_its_files_and_mlflow_datasets(run, ops_stack):
    stage = run.stages["data"]
    out = Path(stage["output"])
    for f in ("tokenizer/tokenizer.json", "tokenizer/chat_template.jinja", "pretrain/train.jsonl",
              "preference/heldout.jsonl", "sft/train.jsonl", "baton_manifest.json"):
        assert (out / f).exists(), f
    row = json.loads((out / "sft" / "train.jsonl").read_text().splitlines()[0])
    assert set(row) == {"messages"} and [m["role"] for m in row["messages"]] == ["user", "assistant"]
    c = ops_stack.mlflow()
    parent = c.get_run(run.summary["mlflow_run_id"])
    assert parent.data.tags["prefect.flow_run_id"] == run.summary["prefect_flow_run_id"]
    child = c.get_run(stage["mlflow_run_id"])
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert {"pretrain-train", "preference-heldout", "sft-train", "sft-heldout"} <= {
        d.dataset.name for d in child.inputs.dataset_inputs}
    assert child.data.params["stage.pretrain_docs"] == "3000"


def test_mlflow_holds_one_child_run_per_stage_that_ran(run, ops_stack):
    """README: one MLflow parent run per pipeline, one child run per stage. MLflow's own search for the parent's
    children finds exactly the runs the summary names, one per stage, each tagged with its stage."""
    c = ops_stack.mlflow()
    parent = c.get_run(run.summary["mlflow_run_id"])
    children = c.search_runs([parent.info.experiment_id],
                             filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'", max_results=1000)
    ran = [s for s in run.summary["stages"] if s.get("mlflow_run_id")]
    assert [s["label"] for s in ran] == CHAIN  # a fresh home: every stage of the chain ran, none reused
    assert sorted(r.info.run_id for r in children) == sorted(s["mlflow_run_id"] for s in ran)
    stage_of = {r.info.run_id: r.data.tags.get("baton.stage") for r in children}
    assert all(stage_of[s["mlflow_run_id"]] == s["name"] for s in ran), (stage_of, [(s["label"], s["name"]) for s in ran])


def test_the_pretraining_curve_is_in_mlflow(run, ops_stack):
    pre = run.stages["pretrain"]
    assert {c["name"] for c in pre["gate"]["checks"]} >= {"L0.integrity", "L1.reload", "probe_logits"}
    conv = run.stages["convert-megatron-to-hf"]
    assert {c["name"] for c in conv["gate"]["checks"]} >= {"L0.integrity", "L1.roundtrip", "L2.logits_parity",
                                                          "L3.generation", "preflight.tied_embeddings"}
    c = ops_stack.mlflow()
    loss = sorted(c.get_metric_history(pre["mlflow_run_id"], "train/loss"), key=lambda m: m.step)
    assert len(loss) == 60 and loss[0].step == 1
    assert loss[-1].value <= 0.7 * loss[0].value, (loss[0].value, loss[-1].value)
    ppl = sorted(c.get_metric_history(pre["mlflow_run_id"], "eval/heldout_ppl"), key=lambda m: m.step)
    assert [m.step for m in ppl] == [0, 20, 40, 60] and ppl[-1].value < ppl[0].value
    for name in ("train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/step_time_s", "perf/mfu"):
        assert c.get_metric_history(pre["mlflow_run_id"], name), name


# what `baton verify` must check on each format: engine checkpoints an exact read-back, HF ones the serving checks
EXPECTED_CHECKS = {"pretrain": ({"L0.integrity", "L1.reload"}, "preflight"),
                   "finetune": ({"L0.integrity", "L1.reload"}, "preflight"),
                   "convert-megatron-to-hf": ({"L0.integrity", "preflight.architectures", "L1.roundtrip", "L3.generation"}, None),
                   "convert-zero-to-hf": ({"L0.integrity", "preflight.architectures", "L1.roundtrip", "L3.generation"}, None)}


@pytest.mark.parametrize("label", sorted(EXPECTED_CHECKS))
def test_baton_verify_fits_each_format_the_run_wrote(run, label):
    r = cli("verify", run.stages[label]["output"], "--json", home=run.home, env=run.env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(r.stdout)
    names = {c["name"] for c in report["checks"]}
    wanted, absent = EXPECTED_CHECKS[label]
    assert report["passed"] and wanted <= names, (label, names)
    assert absent is None or not any(n.startswith(absent) for n in names), (label, names)


def test_runs_and_show_list_the_run_and_its_champion(run):
    r = cli("runs", home=run.home, env=run.env)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith(run.summary["run_id"]))
    assert "tiny" in row and "serve:ok" in row, r.stdout
    r = cli("show", run.summary["run_id"], home=run.home, env=run.env)
    assert r.returncode == 0, r.stderr
    for label in CHAIN:
        assert f"| {label} | completed |" in r.stdout, (label, r.stdout[:3000])


def test_an_unchanged_data_step_is_reused(run):
    """The same config again: its data step is not re-run but reused from the first run (same folder)."""
    r = baton("run", str(TINY), "--stages", "data", home=run.home, env=run.env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    again = json.loads((Path(r.stdout.strip().splitlines()[-1]) / "summary.json").read_text())
    (data,) = again["stages"]
    assert data["status"] == "cached" and data["output"] == run.stages["data"]["output"]


def test_dpo_raised_the_margin_and_held_out_accuracy(run, ops_stack):
    from conversions import manifest as mf

    stage = run.stages["rlhf"]
    assert {c["name"] for c in stage["gate"]["checks"]} >= {
        "L0.integrity", "preflight.safetensors_metadata", "preflight.chat_template", "L1.roundtrip", "L3.generation",
        "eval.heldout_pref_accuracy"}
    ev = stage["eval"]
    assert ev["metric"] == "heldout_pref_accuracy" and ev["after"] > ev["before"], ev
    assert stage["metrics"]["margin_last"] > stage["metrics"]["margin_first"] + 0.1, stage["metrics"]
    assert stage["backend"] == "trl" and stage["registered"]["alias"] == "candidate"
    out, parent = Path(stage["output"]), Path(run.stages["convert-megatron-to-hf"]["output"])
    m = mf.read(out)
    assert m["format"] == "hf-safetensors" and m["engine"]["name"] == "trl" and m["engine"]["trl"]
    assert m["extra"]["backend"] == "trl" and m["extra"]["algorithm"] == "dpo"
    assert m["parent"]["digest"] == mf.digest_of(mf.read(parent))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (out / "chat_template.jinja").read_text() == (parent / "chat_template.jinja").read_text()
    assert (out / "generation_config.json").exists()
    c = ops_stack.mlflow()
    mlrun = c.get_run(stage["mlflow_run_id"])
    assert mlrun.data.tags["baton.backend"] == "trl" and mlrun.data.tags["baton.algorithm"] == "dpo"
    for name in ("train/loss", "train/lr", "train/rewards_margins", "train/rewards_accuracies", "train/logps_chosen",
                 "train/logps_rejected", "eval/heldout_pref_accuracy", "eval/heldout_kl_to_reference"):
        assert c.get_metric_history(mlrun.info.run_id, name), f"no MLflow history for {name}"
    held = sorted(c.get_metric_history(mlrun.info.run_id, "eval/heldout_pref_accuracy"), key=lambda x: x.step)
    assert [x.value for x in held] == [ev["before"], ev["after"]]
