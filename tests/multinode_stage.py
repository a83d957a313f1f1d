"""Run one stage task on this host, as `baton run` does; its StageOutput facts go to <work_dir>/stage_output.json.

    python tests/multinode_stage.py '{"stage": "finetune", "work_dir": ..., "data_dir": ..., "input": ...,
                                      "model": {...}, "config": {...}, "runtimes": {"main": {...}}}'

The multi-node tests start it inside a network namespace (the head host), inside `salloc` for Slurm.
"""
import json
import os
import sys
from pathlib import Path

from tasks.registry import STAGES
from tasks.stage import StageContext


def main(spec: dict) -> None:
    stage = STAGES[spec["stage"]]
    cfg = stage.config_model(**spec["config"])
    work = Path(spec["work_dir"])
    ctx = StageContext(stage=spec["stage"], run_id="multinode", run_dir=work, work_dir=work, model=spec["model"],
                       seed=spec.get("seed", 0), data_dir=Path(spec["data_dir"]),
                       input=Path(spec["input"]) if spec.get("input") else None,
                       input_format=spec.get("input_format"), runtimes=spec.get("runtimes", {}))
    out = stage.load_task().fn(ctx, cfg)
    facts = {"output": str(out.output), "gate": out.gate, "metrics": out.metrics, "eval": out.eval,
             "backend": out.backend, "slurm_job": os.environ.get("SLURM_JOB_ID")}
    tmp = work / "stage_output.json.tmp"
    tmp.write_text(json.dumps(facts, default=str, indent=2))
    os.replace(tmp, work / "stage_output.json")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
