"""`baton runs`, `baton show` and `baton resend`: the runs kept in BATON_HOME."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def cmd_runs(args) -> int:
    """A table: run, config, each step's status, the champion marker, age."""
    from flows.runs import list_runs, runs_table

    rows = list_runs(args.limit)
    if not rows:
        print("no runs yet")
        return 0
    print(runs_table(rows, _champion_run_ids()))
    return 0


def _champion_run_ids() -> set[str]:
    """baton runs whose checkpoint is some registered model's `champion` (empty when MLflow has none)."""
    try:
        from tasks import tracking

        c = tracking.client()
        found = set()
        for rm in c.search_registered_models():
            if "champion" in (rm.aliases or {}):
                mv = c.get_model_version(rm.name, rm.aliases["champion"])
                found.add(mv.tags.get("baton.run_id", ""))
        return found - {""}
    except Exception:
        return set()


def cmd_show(args) -> int:
    """One run's summary (the content of its summary.md, without the embedded plots)."""
    from flows.runs import runs_root

    summary = runs_root() / args.run / "summary.md"
    if not summary.exists():
        print(f"baton show: no run {args.run!r} with a summary in {runs_root()}", file=sys.stderr)
        return 2
    text = summary.read_text()
    print("\n".join(line for line in text.splitlines() if "data:image/png;base64," not in line))
    return 0


def cmd_resend(args) -> int:
    """Send MLflow what a run could not record while its tracking server was unreachable (summary.json's
    tracking_missing): the saved metrics, the records (stage.json, gate.json, step.log, the manifest, the loss plot,
    the summary metrics, summary.json) and each MLflow run's end. A registration is not redone: it stays listed."""
    from flows.runs import runs_root, write_summary
    from tasks import tracking
    from tasks.paths import check_run_id

    try:
        run_dir = runs_root() / check_run_id(args.run)
    except ValueError as e:
        print(f"baton resend: {e}", file=sys.stderr)
        return 2
    if not (run_dir / "summary.json").exists():
        print(f"baton resend: no run {args.run!r} with a summary in {runs_root()}", file=sys.stderr)
        return 2
    summary = json.loads((run_dir / "summary.json").read_text())
    c = tracking.client()
    for entry in summary["stages"]:
        if entry.get(tracking.MISSING) and entry.get("mlflow_run_id") and _final(entry):
            _resend_stage(c, entry)
            left = [m for m in entry.pop(tracking.MISSING) if m == tracking.REGISTRATION]
            entry.update({tracking.MISSING: left} if left else {})
    if summary.get(tracking.MISSING) and summary.get("mlflow_run_id") and _final(summary):
        summary.pop(tracking.MISSING)
        write_summary(run_dir, summary)  # what MLflow gets is what the run folder says now
        c.log_artifact(summary["mlflow_run_id"], str(run_dir / "summary.json"))
        c.set_terminated(summary["mlflow_run_id"], _final(summary))
    write_summary(run_dir, summary)
    left = [f"{e['label']}: {m}" for e in summary["stages"] for m in e.get(tracking.MISSING, [])]
    left += [f"run: {m}" for m in summary.get(tracking.MISSING, [])]
    print(f"sent to {tracking.tracking_uri()}" + ("; still missing: " + ", ".join(left) if left else ""))
    return 0


def _final(record: dict) -> str | None:
    """The MLflow end of a run or step whose status is final (None while it is not)."""
    from tasks.stage import Status

    return {Status.COMPLETED: "FINISHED", Status.CACHED: "FINISHED", Status.FAILED: "FAILED",
            Status.CANCELLED: "KILLED", Status.CRASHED: "KILLED"}.get(record.get("status"))


def _resend_stage(c, entry: dict) -> None:
    import time

    from mlflow.entities import Metric

    from tasks import events, tracking

    run = entry["mlflow_run_id"]
    tracking.resend_unsent(c, run)
    if entry.get("gate"):
        tracking.log_json(c, run, entry["gate"], "gate.json")
    for name in ("manifest", "loss_plot", "log"):
        if entry.get(name) and Path(entry[name]).exists():
            tracking.log_file(c, run, Path(entry[name]))
    now = int(time.time() * 1000)
    values = {k: v for k, v in (entry.get("metrics") or {}).items() if isinstance(v, (int, float))}
    if values:
        c.log_batch(run, metrics=[Metric(events.summary_name(k), float(v), now, 0) for k, v in values.items()])
    tracking.log_json(c, run, {k: v for k, v in entry.items() if k != tracking.MISSING}, "stage.json")
    c.set_terminated(run, _final(entry))


def add_parsers(sub) -> None:
    ls = sub.add_parser("runs", help="list recent runs")
    ls.add_argument("--limit", type=int, default=20)
    ls.set_defaults(fn=cmd_runs)
    sh = sub.add_parser("show", help="print one run's summary (summary.md)")
    sh.add_argument("run", help="run id (see `baton runs`)")
    sh.set_defaults(fn=cmd_show)
    rs = sub.add_parser("resend", help="send MLflow what a run could not record while its server was unreachable")
    rs.add_argument("run", help="run id (see `baton runs`)")
    rs.set_defaults(fn=cmd_resend)
