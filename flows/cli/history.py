"""`baton runs` and `baton show`: the runs kept in BATON_HOME."""
from __future__ import annotations

import sys


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


def add_parsers(sub) -> None:
    ls = sub.add_parser("runs", help="list recent runs")
    ls.add_argument("--limit", type=int, default=20)
    ls.set_defaults(fn=cmd_runs)
    sh = sub.add_parser("show", help="print one run's summary (summary.md)")
    sh.add_argument("run", help="run id (see `baton runs`)")
    sh.set_defaults(fn=cmd_show)
