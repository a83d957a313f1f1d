"""The gate a training stage must pass on held-out data: one metric, before (the input checkpoint) and after.

    gate: {metric: heldout_loss, min_improvement: 0.0}

heldout_loss      mean cross-entropy on answer tokens only (lower is better): the default for files and hub data
exact_match       greedy final reply == reference (finetune; the synthetic default)
preference_accuracy  chosen scored above rejected (rlhf; the synthetic default; must not fall)
heldout_reward    mean reward (rlhf.rewards) of greedy replies to held-out prompts (rlhf grpo; its default there)
lm_eval           an lm-evaluation-harness task's score (higher is better), run on both checkpoints with lm-eval's
                  own `hf` backend (tasks/lm_eval_gate.py); finetune's default task is baton's held-out SFT task
The stage passes when the metric improves by more than `min_improvement` (preference_accuracy: by at least it).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from tasks import events, paths
from tasks.problems import ConfigProblem
from tasks.stage import REPO_ROOT, StrictModel

LOWER_IS_BETTER = {"heldout_loss"}
AT_LEAST = {"preference_accuracy"}  # historical rlhf rule: must not fall

GateMetric = Literal["auto", "heldout_loss", "exact_match", "preference_accuracy", "heldout_reward", "lm_eval"]
LM_EVAL_KEYS = ("task", "score", "include_path", "limit")  # (the names serve.lm_eval uses for the same things)
SCORE_KEY = re.compile(r"^[^,\s]+,[^,\s]+$")  # lm-eval's "<metric>,<filter>" result key


class GateConfig(StrictModel):
    """The stage's quality gate: the held-out metric its output must improve over the input checkpoint's."""

    default_task: ClassVar[str | None] = None  # the lm-eval task scored when `task` is unset (a stage's gate sets it)

    metric: GateMetric = Field("auto", description="auto: heldout_loss for files/hub data, the stage's synthetic "
                                                   "metric (finetune exact_match, rlhf preference_accuracy) otherwise; "
                                                   "rlhf with rewards: heldout_reward")
    min_improvement: float = Field(0.0, ge=0, description="required improvement over the input checkpoint")
    task: str | None = Field(None, description="lm_eval: the lm-eval task; unset: baton's held-out SFT task "
                                               "(finetune; rlhf needs one)")
    score: str | None = Field(None, description="lm_eval: the result key '<metric>,<filter>' the gate compares "
                                                "(higher is better); unset only for baton's task (exact_match,strip)")
    include_path: Path | None = Field(None, description="lm_eval: folder with the task's YAML (and its data)",
                                      json_schema_extra=paths.contents(paths.Contents.FOLDER))
    limit: int | None = Field(None, ge=1, description="lm_eval: evaluate at most this many documents")
    batch_size: int = Field(8, ge=1, description="lm_eval: documents per forward pass when scoring the checkpoints")


def data_source(data_dir, kind: str) -> str:
    """Where the data stage got a dataset: 'synthetic', 'files' or 'hub' (its manifest records it)."""
    from pathlib import Path

    from conversions import manifest as mf

    m = (mf.read(Path(data_dir)) if data_dir else None) or {}
    return ((m.get("extra") or {}).get("datasets") or {}).get(kind, {}).get("source", "synthetic")


def resolve_metric(gate: GateConfig, data_dir, kind: str, synthetic_metric: str) -> str:
    if gate.metric != "auto":
        return gate.metric
    return synthetic_metric if data_source(data_dir, kind) == "synthetic" else "heldout_loss"


def improvement(metric: str, before: float, after: float) -> float:
    return before - after if metric in LOWER_IS_BETTER else after - before


def check(metric: str, before, after, min_improvement: float, name: str | None = None,
          label: str | None = None) -> dict:
    """`label`: how the message names what was measured (default: held-out <metric>)."""
    from conversions import verify

    name = name or metric
    label = label or f"held-out {metric}"
    if not isinstance(before, (int, float)) or not isinstance(after, (int, float)):
        return verify.check(f"eval.{name}", False, f"{label} was not measured ({before} → {after})")
    gain = improvement(metric, before, after)
    ok = gain >= min_improvement if metric in AT_LEAST else gain > min_improvement
    rule = f"{'≥' if metric in AT_LEAST else '>'} {min_improvement}"
    return verify.check(f"eval.{name}", ok, f"{label} {before:.4f} → {after:.4f} (improvement "
                        f"{gain:+.4f}, needs {rule})" + ("" if ok else ": not better than the input checkpoint"))


# ---- lm_eval: config checks (before launch; cheap: no lm-eval import) -----------------------------------------------
def default_lm_eval_task(gate: GateConfig) -> str | None:
    """What the stage's gate model declares (`default_task`): finetune baton's held-out SFT task; rlhf none
    (preference pairs have no generation target)."""
    return type(gate).default_task


def is_baton_task(gate: GateConfig, stage: str) -> bool:
    """The data stage's own held-out task (written by baton, scored by exact_match,strip)."""
    default = default_lm_eval_task(gate)
    return default is not None and gate.include_path is None and gate.task in (None, default)


def lm_eval_errors(gate: GateConfig, stage: str) -> list[ConfigProblem]:
    """Problems of the lm_eval settings that need no files, each naming its key."""
    key = f"{stage}.gate"
    if gate.metric != "lm_eval":
        return [ConfigProblem(f"{key}.{k}", f"{key}.{k}: only used by metric lm_eval (metric is {gate.metric})")
                for k in LM_EVAL_KEYS if getattr(gate, k) is not None]
    if gate.task is None and default_lm_eval_task(gate) is None:
        return [ConfigProblem(f"{key}.task", f"{key}.task: metric lm_eval on {stage} needs an lm-eval task (and "
                              "gate.score): preference pairs have no generation target, so there is no default "
                              "task; e.g. gate: "
                              "{metric: lm_eval, task: NAME, score: 'exact_match,strict-match', include_path: FOLDER}")]
    if gate.score is not None and not SCORE_KEY.match(gate.score):
        return [ConfigProblem(f"{key}.score", f"{key}.score: {gate.score!r} is not lm-eval's '<metric>,<filter>' "
                              "result key (e.g. 'exact_match,strip'; 'acc,none' for a task without filters)")]
    if gate.score is None and not is_baton_task(gate, stage):
        return [ConfigProblem(f"{key}.score", f"{key}.score: required with task "
                              f"{gate.task or default_lm_eval_task(gate)!r} from include_path or lm-eval: the "
                              "'<metric>,<filter>' result key to compare (e.g. 'exact_match,strict-match' or "
                              "'acc,none')")]
    return []


def lm_eval_path_errors(gate: GateConfig, stage: str) -> list[ConfigProblem]:
    """What the include_path on this machine must hold: a folder of YAML files defining gate.task."""
    if gate.metric != "lm_eval" or gate.include_path is None:
        return []
    key = f"{stage}.gate.include_path"
    folder = Path(gate.include_path)
    if not folder.is_dir():
        return [ConfigProblem(key, f"{key}: {folder} is not a folder" if folder.exists() else
                              f"{key}: {folder}: no such folder")]
    names, problems = defined_task_names(folder)
    if problems:
        return [ConfigProblem(key, f"{key}: {problems[0]}")]
    task = gate.task or default_lm_eval_task(gate)
    if task is not None and task not in names:  # (no task at all: lm_eval_errors says so)
        return [ConfigProblem(f"{stage}.gate.task", f"{stage}.gate.task: {task!r} is not defined in include_path "
                              f"{folder} (its YAML files define: {', '.join(sorted(names)[:10]) or 'no task'})")]
    return []


def defined_task_names(folder: Path) -> tuple[set[str], list[str]]:
    """Task, group and tag names the YAML files under `folder` define (as lm-eval's TaskManager indexes them), and
    the files that do not parse. lm-eval's own tags (!function) are read as nothing: no code runs here."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    names: set[str] = set()
    problems: list[str] = []
    for path in sorted(folder.rglob("*.yaml")):
        try:
            doc = yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            mark = getattr(e, "problem_mark", None)
            problems.append(f"{path}{f':{mark.line + 1}' if mark else ''}: not valid YAML")
            continue
        except RecursionError:  # a crafted file nests thousands deep
            problems.append(f"{path}: nested too deeply to be a task file")
            continue
        except OSError as e:
            problems.append(f"{path}: cannot read ({e.strerror})")
            continue
        for field in ("task", "group", "tag"):
            value = doc.get(field) if isinstance(doc, dict) else None
            names.update([value] if isinstance(value, str) else
                         [v for v in value if isinstance(v, str)] if field == "tag" and isinstance(value, list) else [])
    return names, problems


# ---- lm_eval: the run (input and output checkpoints, one launch of the lm-eval worker) -------------------------------
LM_EVAL_WORKER = REPO_ROOT / "tasks/serve/lm_eval_worker.py"  # also run by the serve stage (tasks/serve/task.py)


def lm_eval_target(ctx, gate: GateConfig) -> tuple[str, Path | None, str]:
    """(task, include path, score key): the configured task, else baton's held-out SFT task (finetune)."""
    if not is_baton_task(gate, ctx.stage):
        return gate.task, gate.include_path, gate.score
    from tasks.data import lm_eval_task

    folder = lm_eval_task.usable_task_dir(ctx.data_dir) or lm_eval_task.write_lm_eval_task(
        ctx.data_dir, Path(ctx.work_dir) / "lm_eval_tasks")
    return lm_eval_task.TASK_NAME, folder, lm_eval_task.METRIC_KEY


def lm_eval_name(task: str) -> str:
    """The gate check and summary name for a task: lm_eval_<task> in lower snake case."""
    return re.sub(r"[^a-z0-9]+", "_", f"lm_eval_{task}".lower()).strip("_")


def run_lm_eval(ctx, gate: GateConfig, output: Path, device: str, timeout: float | None) -> dict:
    """Score the input checkpoint (before) and `output` (after) with lm-eval; the stage summary's `eval` entry."""
    task, include, score = lm_eval_target(ctx, gate)
    spec = events.LmEvalSpec(
        tasks=[task], include_path=Path(include).resolve() if include else None, limit=gate.limit, server=None,
        local=events.LmEvalLocal(checkpoints={"before": Path(ctx.input).resolve(), "after": Path(output).resolve()},
                                 device=device, batch_size=gate.batch_size, scratch=Path(ctx.work_dir).resolve()))
    cmd = [ctx.python("main"), str(LM_EVAL_WORKER), "--spec",
           str(events.write_spec(Path(ctx.work_dir) / "lm_eval_gate_spec.json", spec))]
    r = ctx.launch(cmd, name="lm-eval-gate", timeout=timeout).results()
    scores = r.get("checkpoints") or {}
    found = {when: (scores.get(when) or {}).get(task) or {} for when in ("before", "after")}
    return {"metric": lm_eval_name(task), "before": found["before"].get(score), "after": found["after"].get(score),
            "task": task, "score": score, "lm_eval_version": r.get("lm_eval_version"),
            "samples": (r.get("samples") or {}).get("after"), "seconds": r.get("seconds"),
            "reported": sorted(found["after"])}


def lm_eval_metrics(ev: dict) -> dict:
    """Summary facts of an lm_eval `eval` entry (none for the other metrics)."""
    if "task" not in ev:
        return {}
    return {f"{ev['metric']}_before": ev["before"], f"{ev['metric']}_after": ev["after"],
            "lm_eval_wall_s": ev["seconds"]}


def lm_eval_check(ev: dict, min_improvement: float) -> dict:
    """The gate check for an lm_eval `eval` entry: the score must rise by more than min_improvement."""
    if ev["after"] is None and ev["reported"]:
        from conversions import verify

        return verify.check(f"eval.{ev['metric']}", False, f"lm-eval task {ev['task']} reported no {ev['score']!r} "
                            f"(it reported: {', '.join(ev['reported'])}); set gate.score to one of them")
    return check("lm_eval", ev["before"], ev["after"], min_improvement, name=ev["metric"],
                 label=f"lm-eval {ev['task']} {ev['score']}")
