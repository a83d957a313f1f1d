"""`baton run CONFIG --smoke`: every configured stage a few steps on its smallest layout, with its gates ("test on one
device first"). A passing smoke is recorded under the config's fingerprint; `require_smoke: true` makes the full run
of that config refuse to start without one.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from conversions import durable
from conversions.home import home_path
from tasks.registry import STAGES
from tasks.stage import Status

SMOKE_STEPS = 4
# Gate checks that need the full run's steps: held-out improvement, and non-empty greedy generation (after 4
# pretraining steps the model's first greedy token is often EOS — measured on the tiny config).
QUALITY_PREFIXES = ("eval.", "L3.generation")


def fingerprint(cfg) -> str:
    """The config's identity, the same for a full run and its smoke (the two flags are left out)."""
    data = cfg.model_dump(mode="json", exclude={"smoke", "require_smoke"})
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def smoke_config(cfg):
    """The same pipeline at smoke size: every training stage few steps on one rank of one node, and what each stage
    declares its own smoke size (StageSpec.smoke: e.g. no model parallelism, less data, one serving engine)."""
    updates = {"smoke": True}
    for name, spec in STAGES.items():
        sc = cfg.stage_config(name)
        if spec.trains:
            steps = min(sc.steps, SMOKE_STEPS)
            sc = sc.model_copy(update={"steps": steps, "nproc_per_node": 1, "nnodes": 1, "warmup_steps": 0,
                                       "checkpoint_every": steps, "global_batch_size": None,
                                       "gradient_accumulation_steps": None})
        if (change := spec.smoke(sc)) or spec.trains:
            updates[name] = sc.model_copy(update=change)
    # exclude_unset: stages check some keys only when given (e.g. rlhf.num_generations outside grpo)
    raw = cfg.model_dump(exclude_unset=True)
    raw.update({k: v.model_dump(exclude_unset=True) if hasattr(v, "model_dump") else v for k, v in updates.items()})
    return type(cfg).model_validate(raw)


def smoke_gate_passed(gate: dict) -> bool:
    """A smoke run's stage passes when every check but the quality ones passes."""
    return all(c["passed"] for c in gate.get("checks", []) if not c["name"].startswith(QUALITY_PREFIXES))


def _record_path(cfg) -> Path:
    return home_path().resolve() / "smoke" / f"{fingerprint(cfg)}.json"


def record(cfg, summary: dict) -> Path:
    """Remember a passing smoke of this config (atomic: tmp + fsync + rename)."""
    path = _record_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"fingerprint": fingerprint(cfg), "run_id": summary.get("run_id"), "run_dir": summary.get("run_dir"),
            "passed": summary.get("status") == Status.COMPLETED}
    return durable.write_json(path, body, indent=2)


def passing_smoke(cfg) -> dict | None:
    path = _record_path(cfg)
    if not path.exists():
        return None
    try:
        rec = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return rec if rec.get("passed") and rec.get("fingerprint") == fingerprint(cfg) else None
