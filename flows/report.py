"""The run summary a person reads: a markdown table of every stage with its gate and metrics, plus loss plots."""
from __future__ import annotations

import base64
from pathlib import Path

from tasks import events
from tasks.stage import reasons_text


def loss_plot(history: dict, path: Path, title: str) -> Path | None:
    series = {k: v for k, v in history.items() if k in (events.TRAIN_LOSS, events.HELDOUT_LOSS) and len(v) > 1}
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3), dpi=100)
    for name, pts in series.items():
        ax.plot([s for s, _ in pts], [v for _, v in pts], label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _outputs(entry: dict) -> str:
    """The step's checkpoint, or the folders it wrote beside the relay (export: one per GGUF type)."""
    sides = entry.get("side_outputs") or {}
    if sides and not entry.get("output"):
        return "<br>".join(f"{variant}: `{side['output']}`" for variant, side in sides.items())
    return f"`{entry.get('output') or ''}`"


def markdown(summary: dict) -> str:
    lines = [f"# baton run `{summary['run_id']}`", "",
             f"Status: **{summary['status']}** · MLflow run `{summary.get('mlflow_run_id')}` · run dir `{summary.get('run_dir')}`", "",
             "| stage | status | why | engine | gate | key metrics | eval | output |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summary["stages"]:
        gate = s.get("gate") or {}
        checks = gate.get("checks", [])
        g = "—" if not checks else (f"passed ({len(checks)} checks)" if gate.get("passed") else
                                    "FAILED: " + ", ".join(c["name"] for c in checks if not c["passed"]))
        metrics = ", ".join(f"{k}={_fmt(v)}" for k, v in list((s.get("metrics") or {}).items())[:4])
        ev = s.get("eval") or {}
        ev_s = f"{ev.get('metric')}: {_fmt(ev.get('before'))} → {_fmt(ev.get('after'))}" if ev else ""
        lines.append(f"| {s['label']} | {s['status']} | {reasons_text(s.get('reason'))} | "
                     f"{s.get('engine', '')} {s.get('backend', '')} | {g} | {metrics} | {ev_s} | {_outputs(s)} |")
    mem = [s for s in summary["stages"] if (s.get("memory") or {}).get("measured_mb_max")]
    if mem:
        lines += ["", "## Memory per rank (measured peak vs `baton plan`)", "", "| stage | measured MiB | planned MiB |",
                  "|---|---|---|"]
        lines += [f"| {s['label']} | {s['memory']['measured_mb_max']:.0f} ({s['memory']['kind']}) | "
                  f"{s['memory']['predicted_mb_per_rank']} |" for s in mem]
    errors = [s for s in summary["stages"] if s.get("error")]
    if errors:
        lines += ["", "## Errors"] + [f"- **{s['label']}**: {s['error']}" for s in errors]
    plots = [s for s in summary["stages"] if s.get("loss_plot") and Path(s["loss_plot"]).exists()]
    if plots:
        lines += ["", "## Loss"]
        for s in plots:
            data = base64.b64encode(Path(s["loss_plot"]).read_bytes()).decode()
            lines.append(f"![{s['label']} loss](data:image/png;base64,{data})")
    return "\n".join(lines) + "\n"


def prefect_link_tags(flow_run_id: str | None) -> dict:
    """MLflow tags that link a run back to its Prefect flow-run page (only when a Prefect server's UI is in use)."""
    import os

    ui = os.environ.get("PREFECT_UI_URL") or (os.environ.get("PREFECT_API_URL") or "").removesuffix("/api")
    if not flow_run_id or not ui:
        return {}
    url = f"{ui.rstrip('/')}/runs/flow-run/{flow_run_id}"
    return {"prefect.flow_run_url": url, "mlflow.note.content": f"Prefect flow run: [{flow_run_id}]({url})"}


def link_mlflow_run(mlflow_run_id: str, text: str) -> None:
    """A Prefect link artifact from the current flow run to its MLflow run (the MLflow run links back by its tags)."""
    from prefect.artifacts import create_link_artifact

    from tasks import orchestration, tracking

    if orchestration.lost():
        return
    try:
        create_link_artifact(link=f"{tracking.tracking_uri()}#/experiments/-/runs/{mlflow_run_id}", link_text=text,
                             description=f"MLflow run {mlflow_run_id}")
    except Exception:  # outside a flow run there is nowhere to put it
        pass
