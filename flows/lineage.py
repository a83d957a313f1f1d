"""Where a checkpoint came from: the chain from the data through every stage and conversion to the served model.

Read from what the runs left behind: each manifest names its parent checkpoint (path + manifest digest), each run's
summary.json says which step wrote which folder (engine, gate, MLflow run, Prefect flow run), and the MLflow registry
says which versions and aliases point at it. Printed by `baton lineage REF`; drawn as a Mermaid diagram in the run's
Prefect summary artifact and in each registered model version's description.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from conversions import manifest as mf
from conversions.manifest import Format
from conversions.refusal import Refused
from flows import runs
from tasks.registry import DATA_STAGE
from tasks.stage import Status


class LineageError(Refused):
    pass


@dataclass
class Node:
    """One step of the chain: what it wrote and how it was made."""

    label: str
    format: str | None = None
    digest: str | None = None               # manifest digest (for data: the data digest)
    path: str | None = None
    engine: str | None = None
    gate: str | None = None                 # "passed 9/9", "FAILED: L2.logits_parity"
    run_id: str | None = None               # baton run
    mlflow_run_id: str | None = None
    prefect_flow_run_id: str | None = None
    registered: str | None = None           # "baton-tiny/3"
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v not in (None, [], "")}


def _summary_for(path: Path) -> dict | None:
    """The summary.json of the run whose folder holds path."""
    try:
        rel = path.resolve().relative_to(runs.runs_root().resolve())
    except ValueError:
        return None
    summary = runs.runs_root() / rel.parts[0] / "summary.json"
    return json.loads(summary.read_text()) if summary.exists() else None


def _entry_for(path: Path, summary: dict | None) -> dict | None:
    """The summary entry of the step that wrote path; for a side output (an export's GGUF folder), that entry with
    the side output's own registration."""
    target = path.resolve()
    for e in (summary or {}).get("stages", []):
        if e.get("output") and Path(e["output"]).resolve() == target:
            return e
        for side in (e.get("side_outputs") or {}).values():
            if Path(side["output"]).resolve() == target:
                return {**e, "registered": side.get("registered")}
    return None


def _gate(entry: dict) -> str | None:
    gate = entry.get("gate") or {}
    checks = gate.get("checks") or []
    if not checks:
        return None
    if gate.get("passed"):
        return f"passed {len(checks)}/{len(checks)}"
    return "FAILED: " + ", ".join(c["name"] for c in checks if not c["passed"])


def _engine(m: dict) -> str | None:
    engine = m.get("engine") or {}
    name = engine.get("name")
    version = engine.get(name) if name else None
    return f"{name} {version}" if name and isinstance(version, str) else name


def _node(path: Path, m: dict, summary: dict | None) -> Node:
    entry = _entry_for(path, summary) or {}
    reg = entry.get("registered") or {}
    return Node(label=entry.get("label") or m.get("stage") or "?", format=m.get("format"), digest=mf.digest_of(m),
                path=str(path.resolve()), engine=_engine(m) or entry.get("engine"), gate=_gate(entry),
                run_id=(summary or {}).get("run_id"), mlflow_run_id=entry.get("mlflow_run_id"),
                prefect_flow_run_id=entry.get("prefect_flow_run_id"),
                registered=f"{reg['name']}/{reg['version']}" if reg.get("name") else None)


def _data_node(summary: dict | None) -> Node | None:
    """The data stage of the run that trained the first checkpoint: its digest is what retraining watches."""
    from flows.step_tracking import data_digest

    for e in (summary or {}).get("stages", []):
        if e.get("name") == DATA_STAGE and e.get("output") and Path(e["output"]).exists():
            return Node(label=DATA_STAGE, format=Format.DATASET, digest=data_digest(e["output"]), path=e["output"],
                        engine=e.get("engine"), gate=_gate(e), run_id=summary.get("run_id"),
                        mlflow_run_id=e.get("mlflow_run_id"), prefect_flow_run_id=e.get("prefect_flow_run_id"))
    return None


def _served_node(summary: dict | None, head: Path) -> Node | None:
    """A serving step of the same run (its entry names the checkpoint it served) that served head (it promoted
    `champion` when every check passed)."""
    for e in (summary or {}).get("stages", []):
        if "served_checkpoint" in e and e.get("status") in (Status.COMPLETED, Status.CACHED):
            served = e.get("served_checkpoint")
            if served and Path(served).resolve() != head.resolve():
                continue
            champion = e.get("champion") or {}
            node = Node(label=e.get("label") or e["name"], engine=e.get("engine"), gate=_gate(e),
                        run_id=summary.get("run_id"), mlflow_run_id=e.get("mlflow_run_id"), prefect_flow_run_id=e.get("prefect_flow_run_id"))
            if champion.get("version"):
                node.registered = f"{champion.get('name')}/{champion['version']}"
                node.notes.append("champion")
            return node
    return None


def _checkpoints(checkpoint: Path) -> list[tuple[Node, dict | None]]:
    """Every checkpoint from the first to checkpoint (following manifest parents), each with its run's summary."""
    found: list[tuple[Node, dict | None]] = []
    path, seen = Path(checkpoint), set()
    while True:
        m = mf.read(path)
        if m is None:
            raise LineageError(f"{path}: no {mf.MANIFEST_NAME}; lineage follows manifests")
        summary = _summary_for(path)
        found.insert(0, (_node(path, m, summary), summary))
        parent = m.get("parent") or {}
        nxt = parent.get("path")
        if not nxt or nxt in seen or not Path(nxt).exists():
            if parent.get("digest"):
                found.insert(0, (Node(label=parent.get("stage") or "external", format=parent.get("format"),
                                      digest=parent["digest"], path=nxt, notes=["not on this machine"]), None))
            return found
        seen.add(nxt)
        path = Path(nxt)


def chain(checkpoint: Path) -> list[Node]:
    """Every checkpoint from the first to checkpoint, each run's data just before the first step that used it, then
    the serving step when there is one. A chain spanning runs (a later fine-tune of an earlier champion) shows the
    data of each run."""
    nodes: list[Node] = []
    data_seen: set[str] = set()
    for node, summary in _checkpoints(checkpoint):
        data = _data_node(summary)
        if data is not None and data.digest not in data_seen:
            data_seen.add(data.digest)
            nodes.append(data)
        nodes.append(node)
    served = _served_node(_summary_for(Path(checkpoint)), Path(checkpoint))
    if served is not None:
        nodes.append(served)
    return nodes


def resolve(ref: str) -> tuple[Path, str]:
    """A checkpoint folder, name@alias, name/version or a baton run id → (checkpoint folder, what it is)."""
    if Path(ref).is_dir() and (Path(ref) / mf.MANIFEST_NAME).exists():
        return Path(ref).resolve(), f"checkpoint {Path(ref).resolve()}"
    run_summary = runs.runs_root() / ref / "summary.json"
    if "/" not in ref and run_summary.exists():
        summary = json.loads(run_summary.read_text())
        outputs = [e for e in summary["stages"] if e.get("output") and e.get("name") != DATA_STAGE
                   and e.get("status") in (Status.COMPLETED, Status.CACHED)]
        if not outputs:
            raise LineageError(f"run {ref} produced no checkpoint")
        return Path(outputs[-1]["output"]), f"run {ref}: {outputs[-1]['label']}"
    from flows import checkpoint_refs

    try:
        found = checkpoint_refs.resolve(ref)
    except checkpoint_refs.CheckpointRefError as e:
        raise LineageError(f"{e}; nor a run id in {runs.runs_root()}") from None
    return found.path, found.describe()


def _short(digest: str | None) -> str:
    return digest[:12] if digest else "-"


def text(nodes: list[Node], title: str) -> str:
    lines = [title]
    for i, n in enumerate(nodes):
        lines.append(("  ↓ " if i else "    ") + f"{n.label}  [{n.format or '-'}]  digest {_short(n.digest)}"
                     + (f"  · {n.engine}" if n.engine else "") + (f"  · gate {n.gate}" if n.gate else "")
                     + (f"  · registered {n.registered}" if n.registered else "")
                     + (f"  · {', '.join(n.notes)}" if n.notes else ""))
        ids = [f"run {n.run_id}" if n.run_id else "", f"mlflow {n.mlflow_run_id}" if n.mlflow_run_id else "",
               f"prefect {n.prefect_flow_run_id}" if n.prefect_flow_run_id else ""]
        if any(ids):
            lines.append("        " + "  ".join(x for x in ids if x))
    return "\n".join(lines)


def mermaid(nodes: list[Node]) -> str:
    """A left-to-right flowchart, one box per step (label, format, digest, engine, gate)."""
    out = ["flowchart LR"]
    for i, n in enumerate(nodes):
        parts = [f"<b>{n.label}</b>", n.format or "", f"digest {_short(n.digest)}", n.engine or "",
                 f"gate {n.gate}" if n.gate else "", n.registered or "", ", ".join(n.notes)]
        body = "<br/>".join(p.replace('"', "'") for p in parts if p)
        out.append(f'    n{i}["{body}"]')
    for i, j in edges(nodes):
        out.append(f"    n{i} --> n{j}")
    return "\n".join(out)


def edges(nodes: list[Node]) -> list[tuple[int, int]]:
    """Checkpoint to checkpoint in order; each data node feeds the next step (it is an input, not a checkpoint)."""
    out, prev = [], None
    for i, n in enumerate(nodes):
        if n.format == Format.DATASET:
            if i + 1 < len(nodes):
                out.append((i, i + 1))
            continue
        if prev is not None:
            out.append((prev, i))
        prev = i
    return out


def markdown(nodes: list[Node]) -> str:
    return "## Lineage\n\n```mermaid\n" + mermaid(nodes) + "\n```\n"


def run_head(summary: dict) -> Path | None:
    """The last checkpoint a run produced (or reused)."""
    outputs = [e for e in summary.get("stages", []) if e.get("output") and e.get("name") != DATA_STAGE
               and e.get("status") in (Status.COMPLETED, Status.CACHED)]
    return Path(outputs[-1]["output"]) if outputs else None


DESCRIPTION_LIMIT = 5000  # MLflow's model_versions.description column


def version_description(entry: dict, nodes: list[Node]) -> str:
    """What a registered model version's MLflow page shows: data digest, eval before/after, lineage, gate report."""
    gate = entry.get("gate") or {}
    lines = [f"**{entry.get('label')}** of baton run `{nodes[-1].run_id if nodes else ''}` · gate "
             f"**{'passed' if gate.get('passed') else 'FAILED'}**", ""]
    data = next((n for n in nodes if n.label == DATA_STAGE), None)
    if data is not None:
        lines += [f"Data digest: `{data.digest}`", ""]
    ev = entry.get("eval") or {}
    if ev:
        lines += [f"Eval {ev.get('metric')}: before {ev.get('before')} → after {ev.get('after')}", ""]
    lines += [markdown(nodes), "## Gate", "", "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {c['name']} | {'ok' if c['passed'] else 'FAIL'} | {str(c['detail'])[:120].replace('|', '/')} |"
              for c in gate.get("checks", [])]
    return "\n".join(lines)[:DESCRIPTION_LIMIT]


def describe_versions(summary: dict) -> None:
    """Every version this run registered gets its gate report and lineage as its MLflow description."""
    from tasks import tracking

    c = tracking.client()
    for e in summary.get("stages", []):
        if e.get("status") != Status.COMPLETED:
            continue
        sides = (e.get("side_outputs") or {}).values()
        for output, reg in [(e.get("output"), e.get("registered") or {}),
                            *((s["output"], s.get("registered") or {}) for s in sides)]:
            if reg.get("name") and output:
                c.update_model_version(reg["name"], str(reg["version"]),
                                       description=version_description(e, chain(Path(output))))
