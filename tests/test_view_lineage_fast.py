"""The pieces behind the terminal view, `baton runs` and `baton lineage`, on real folders and manifests (no engine)."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from conversions import manifest as mf
from flows import lineage, runs
from flows.cli import view

pytestmark = pytest.mark.fast


def _checkpoint(folder: Path, fmt: str, stage: str, parent: Path | None) -> Path:
    folder.mkdir(parents=True)
    (folder / "weights.bin").write_bytes(stage.encode())
    mf.write(folder, mf.build(folder, format=fmt, stage=stage, engine={"name": f"{stage}-engine"},
                              parent=mf.parent_ref(parent) if parent else None))
    return folder


def _run(home: Path) -> tuple[Path, dict]:
    """A run folder as a pipeline leaves it: data, pretrain, convert outputs with manifests, and summary.json."""
    run_dir = home / "runs" / "20261201-010203-abcd"
    data = _checkpoint(run_dir / "00-data", "dataset", "data", None)
    pre = _checkpoint(run_dir / "01-pretrain" / "checkpoint", "megatron-dist", "pretrain", None)
    hf = _checkpoint(run_dir / "02-convert-megatron-to-hf" / "checkpoint", "hf-safetensors", "convert", pre)
    gate = {"passed": True, "checks": [{"name": "L0.integrity", "passed": True, "detail": "ok"}]}
    stages = [{"name": "data", "label": "data", "status": "completed", "output": str(data), "gate": gate,
               "mlflow_run_id": "m0", "prefect_flow_run_id": "p0", "seconds": 1.0},
              {"name": "pretrain", "label": "pretrain", "status": "completed", "output": str(pre), "gate": gate,
               "mlflow_run_id": "m1", "prefect_flow_run_id": "p1", "metrics": {"loss_first": 6.3, "loss_last": 0.9},
               "registered": {"name": "baton-tiny-megatron-dist", "version": "1"}, "seconds": 61.0},
              {"name": "convert", "label": "convert-megatron-to-hf", "status": "completed", "output": str(hf),
               "gate": gate, "mlflow_run_id": "m2", "prefect_flow_run_id": "p2",
               "registered": {"name": "baton-tiny", "version": "1"}, "seconds": 9.0}]
    summary = {"run_id": run_dir.name, "config": "tiny", "status": "completed", "stages": stages}
    runs.write_summary(run_dir, summary)
    return run_dir, summary


def test_lineage_follows_manifests_back_to_the_data(baton_home):
    run_dir, summary = _run(baton_home)
    path, what = lineage.resolve(run_dir.name)
    assert path == Path(summary["stages"][2]["output"]) and "convert-megatron-to-hf" in what
    nodes = lineage.chain(path)
    assert [n.label for n in nodes] == ["data", "pretrain", "convert-megatron-to-hf"]
    assert [n.mlflow_run_id for n in nodes] == ["m0", "m1", "m2"]
    assert [n.prefect_flow_run_id for n in nodes] == ["p0", "p1", "p2"]
    assert nodes[2].registered == "baton-tiny/1" and nodes[1].format == "megatron-dist"
    assert nodes[2].digest == mf.digest_of(mf.read(path))
    diagram = lineage.mermaid(nodes)
    assert diagram.startswith("flowchart LR") and "n0 --> n1" in diagram and "n1 --> n2" in diagram
    assert "baton-tiny/1" in lineage.text(nodes, what)


def test_a_chain_across_runs_shows_each_runs_data(baton_home):
    _, first = _run(baton_home)
    run2 = baton_home / "runs" / "20261202-010203-ef01"
    data2 = run2 / "00-data"
    data2.mkdir(parents=True)
    (data2 / "rows.jsonl").write_text('{"text": "new data"}\n')
    mf.write(data2, mf.build(data2, format="dataset", stage="data"))
    ft = _checkpoint(run2 / "01-finetune" / "checkpoint", "hf-safetensors", "finetune",
                     Path(first["stages"][2]["output"]))
    runs.write_summary(run2, {"run_id": run2.name, "status": "completed", "stages": [
        {"name": "data", "label": "data", "status": "completed", "output": str(data2), "mlflow_run_id": "m3"},
        {"name": "finetune", "label": "finetune", "status": "completed", "output": str(ft), "mlflow_run_id": "m4"}]})
    nodes = lineage.chain(ft)
    assert [n.label for n in nodes] == ["data", "pretrain", "convert-megatron-to-hf", "data", "finetune"]
    assert nodes[0].digest != nodes[3].digest and [n.run_id for n in nodes][-2:] == [run2.name] * 2
    assert sorted(lineage.edges(nodes)) == [(0, 1), (1, 2), (2, 4), (3, 4)]


def test_lineage_refuses_what_it_cannot_follow(baton_home, tmp_path):
    with pytest.raises(lineage.LineageError, match="no such folder, and not a registered model"):
        lineage.resolve("no-such-run")
    (tmp_path / "bare").mkdir()
    with pytest.raises(lineage.LineageError, match="no baton_manifest.json"):
        lineage.chain(tmp_path / "bare")


def test_plain_view_writes_one_line_per_event_without_control_characters(tmp_path):
    out = io.StringIO()
    v = view.PlainView(["data", "pretrain"], out, "baton run x · tiny")
    v.start()
    v.step_started("pretrain", tmp_path / "step.log")
    for step in range(1, 101):
        v.step_metric("pretrain", step, {"train/loss": 5.0 - step / 50})
        v.step_progress("pretrain", step, 100)
    v.step_finished("pretrain", {"status": "completed"}, None)
    text = out.getvalue()
    assert "\x1b" not in text and "\r" not in text
    lines = text.splitlines()
    assert len(lines) <= 14, text  # title, started, ~10 progress lines, finished
    assert "100/100" in lines[-1] and "loss 3" in lines[-1] and "completed" in lines[-1]


def test_failure_report_names_the_cause_and_shows_the_log_tail(tmp_path):
    log = tmp_path / "step.log"
    log.write_text("\n".join([f"line {i}" for i in range(100)] + ["ValueError: vocab 300 < tokenizer 507"]) + "\n")
    entry = {"label": "pretrain", "status": "failed", "error": "pretrain failed with exit code 1", "log": str(log)}
    report = view.failure_report(entry)
    assert report[0] == ("✗ pretrain failed: pretrain failed with exit code 1 — ValueError: vocab 300 < tokenizer 507")
    assert report[-1] == f"--- full log: {log}" and report[-2] == "ValueError: vocab 300 < tokenizer 507"
    assert len(report) == 1 + 1 + view.FAILURE_TAIL_LINES + 1


def test_failure_tail_leaves_out_library_frames(tmp_path):
    log = tmp_path / "step.log"
    log.write_text("\n".join([
        "12:00:00 ERROR   prefect.task_runs: Task run failed with exception: LaunchError('x')",
        "Traceback (most recent call last):",
        '  File "/venv/lib/python3.11/site-packages/prefect/task_engine.py", line 1, in run',
        "    engine.call_task_fn(txn)",
        "    ^^^^^^^^^^^^^^^^^^^^^^^^",
        '  File "/repo/tasks/pretrain/task.py", line 150, in run_pretrain',
        "    res = ctx.launch(cmd)",
        "tasks.launch.LaunchError: pretrain timed out after 4.0s"]) + "\n")
    report = view.failure_report({"label": "pretrain", "error": "pretrain timed out after 4.0s", "log": str(log)})
    assert report[0] == "✗ pretrain failed: pretrain timed out after 4.0s"
    assert report[2:-1] == ["12:00:00 ERROR   prefect.task_runs: Task run failed with exception: LaunchError('x')",
                            "Traceback (most recent call last):",
                            '  File "/repo/tasks/pretrain/task.py", line 150, in run_pretrain',
                            "    res = ctx.launch(cmd)", "tasks.launch.LaunchError: pretrain timed out after 4.0s"]


def test_runs_table_marks_the_champion(baton_home):
    _, summary = _run(baton_home)
    table = runs.runs_table(runs.list_runs(), {summary["run_id"]})
    header, row, note = table.splitlines()
    assert header.split()[:3] == ["run", "config", "status"]
    assert row.startswith(summary["run_id"] + "*") and "pretrain:ok" in row and "tiny" in row
    assert note.startswith("*")
    assert json.loads((baton_home / "runs" / summary["run_id"] / "summary.json").read_text())["config"] == "tiny"


def _live_frame(width: int) -> list[str]:
    """One frame of the live view of the default chain at `width` columns: two steps done, one mid-way."""
    import time

    from rich.console import Console

    labels = ["data", "pretrain", "convert-megatron-to-hf", "rlhf", "finetune", "convert-zero-to-hf", "serve"]
    out = io.StringIO()
    live = view.LiveView(labels, out, "baton run 20261202-101010-abcd · configs/tiny.yaml")
    live.console = Console(file=out, width=width, color_system=None)
    now = time.time()
    for label in ("data", "pretrain"):
        live.step_started(label, None)
        live.step_progress(label, 60, 60)
        live.step_metric(label, 60, {"train/loss": 1.234567})
        live.step_finished(label, {"status": "completed"}, None)
        live.steps[label].started = now - 754
    live.step_started("rlhf", None)
    live.step_progress("rlhf", 34, 300)
    live.step_metric("rlhf", 34, {"train/loss": 0.6931472})
    live.steps["rlhf"].started, live.steps["rlhf"].progress_started = now - 100, now - 90
    live.console.print(live._render())
    return [line.rstrip() for line in out.getvalue().splitlines()[1:]]


@pytest.mark.parametrize("width", [80, 120])
def test_live_rows_keep_status_time_progress_eta_and_loss_whole(width):
    rows = _live_frame(width)
    assert len(rows) == 7 and all(len(r) <= width for r in rows), rows
    assert not any("…" in r for r in rows), "\n".join(rows)
    rlhf = next(r for r in rows if "rlhf" in r)
    assert re.search(r"running\s+1m40s .*34/300 eta \d+m\d\ds loss 0\.6931$", rlhf), rlhf
    assert re.search(r"completed\s+12m34s .*60/60\s+loss 1\.235$", rows[1]), rows[1]
    assert "━" in rows[1]  # at 80 columns the bar still fits (narrowed), at 120 at its usual width


def test_summary_rows_do_not_wrap_on_a_narrow_terminal():
    stages = [{"label": "convert-megatron-to-hf", "status": "completed", "seconds": 35,
               "gate": {"checks": [{"passed": True}] * 5}, "metrics": {"loss_first": 10.4, "loss_last": 6.13},
               "eval": {"metric": "heldout_ppl", "before": 31000.0, "after": 2500.2}}]
    lines = view.summary_lines({"stages": stages}, 80)
    assert all(len(line) <= 80 for line in lines) and len(lines) == 2, lines
    assert re.search(r"^\s+convert-megatron-to-hf\s+completed\s+35s\s+gate 5/5$", lines[0]), lines
    assert lines[1].strip() == "loss 10.4 → 6.13  heldout_ppl 3.1e+04 → 2.5e+03", lines
