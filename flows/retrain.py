"""Scheduled retraining that never makes things worse.

1. Build the data (usually cached) and compare its digest with the lineage of the current `champion` (the
   `data_digest` tag its registered version carries). Same data: record "skipped" and stop. A candidate already
   trained from this champion version on this data and kept (not promoted) is not trained again (unless
   `policy.force`): record "skipped" and stop.
2. Fine-tune from the champion on the new data (DeepSpeed), convert back to HF through the conversion gate.
3. Compare candidate and champion on the same held-out set: the fine-tuning engine scores its input (the champion)
   and its trained model (the candidate, bit-identical to the converted checkpoint by the L2 parity gate) on
   data/sft/heldout.jsonl with the same greedy decoding.
4. Promote (alias `champion`) only when candidate ≥ champion + margin: first the candidate is served and smoke-tested
   on a side port while the old server keeps serving; then the alias moves by compare-and-set against the champion
   the decision was made on (a champion moved meanwhile aborts: decide again); then the old server is retired. A
   failed smoke test keeps the champion and its server. Otherwise record the result, keep the champion.

Every decision is recorded: an MLflow run `retrain-…` (tags, scores, decision.json), a tag on the candidate version,
and a markdown artifact on this flow run.
"""
from __future__ import annotations

import datetime as dt
import json
from enum import StrEnum

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run as prefect_flow_run
from pydantic import Field

from flows import report, runs
from flows.config import ConfigError, ModelConfig, PipelineConfig, TrackingConfig
from flows.pipeline import pipeline
from flows.step_tracking import data_digest
from tasks import tracking as mlt
from tasks.data.config import DataConfig
from tasks.finetune.config import FinetuneConfig
from tasks.serve import supervisor
from tasks.serve.config import ServeConfig
from tasks.serve.task import record_promotion
from tasks.stage import Failure, Status, StrictModel

DECISION_TAG = "baton.retrain.decision"


class Decision(StrEnum):
    """What one retraining run decided (its MLflow tag and Prefect artifact say the same)."""

    SKIPPED = Status.SKIPPED     # nothing new: the champion's data, or a candidate already judged on this data
    PROMOTED = "promoted"   # the candidate beat the champion, passed its smoke test, and serves now
    KEPT = "kept"           # the champion stays: the candidate failed a gate, the comparison or its smoke test
    FAILED = Status.FAILED       # the run itself failed (a stage crashed, nothing registered)
    ABORTED = "aborted"     # the promotion was refused mid-way (the alias moved under it)


class RetrainPolicy(StrictModel):
    margin: float = Field(0.02, ge=0, description="promote only when the candidate beats the champion by margin "
                                                  "(score higher by it; a held-out loss lower by it)")
    force: bool = Field(False, description="retrain even when the data digest equals the champion's lineage")
    serve: bool = Field(True, description="restart serving on a new champion (smoke-tested; failure rolls back)")


class RetrainFailed(RuntimeError):
    pass


# ---- the registry --------------------------------------------------------------------------------------------------
def champion(c, name: str) -> dict | None:
    from mlflow.exceptions import MlflowException

    try:
        mv = c.get_model_version_by_alias(name, mlt.CHAMPION)
    except MlflowException:
        return None
    path, _, version = mlt.resolve_model_ref(f"{name}/{mv.version}")
    return {"version": version, "path": str(path), "data_digest": mv.tags.get("data_digest", ""), "tags": mv.tags}


# ---- serving ----------------------------------------------------------------------------------------------------
# serving.json: what retrain serves now. "server" is the supervisor's record (its pid and start time, its engine's, its
# state file); "status" is "down" once the supervisor gave up; "candidate" is a side-port server not yet switched to.
serving_file = supervisor.serving_file


def serving() -> dict | None:
    """What is being served now (written when retraining starts a server): version, checkpoint, server pid/url."""
    return supervisor.read_json(serving_file())


def stop_server(server: dict | None, grace: float = 30.0) -> None:
    """Stop a recorded server (supervisor and engine), only while its pids still are those processes (same start
    time): a pid reused by another process since is never signalled."""
    supervisor.stop_recorded(server, grace)


def stop_serving(grace: float = 30.0) -> None:
    current = serving() or {}
    for server in ((current.get("candidate") or {}).get("server"), current.get("server")):
        stop_server(server, grace)
    supervisor.update_serving(lambda _: None)


def start_serving(base: PipelineConfig, serve: ServeConfig, path: str, version: str,
                  publish: bool = True) -> tuple[bool, dict]:
    """Serve path with smoke checks; keep the server up when they pass (publish: record it in serving.json)."""
    cfg = base.model_copy(update={"stages": ["serve"], "serve": serve.model_copy(
        update={"keep_alive": True, "promote": False})})
    summary, error = run_pipeline(cfg, path, use_cache=False)
    entry = stage_entry(summary, "serve") or {}
    server = entry.get("server")
    if error or entry.get("status") != Status.COMPLETED:
        stop_server(server, 10.0)
        return False, {"error": error or entry.get("error"), "run_id": (summary or {}).get("run_id")}
    state = {"version": version, "checkpoint": path, "server": server, "run_id": summary["run_id"],
             "served_model_name": entry.get("served_model_name"), "api_key_file": entry.get("api_key_file"),
             "since": dt.datetime.now().isoformat(timespec="seconds")}
    if publish:
        supervisor.update_serving(lambda _: state)
    return True, state


# ---- pipeline runs -------------------------------------------------------------------------------------------------
def run_pipeline(cfg: PipelineConfig, from_ref: str | None, use_cache: bool = True) -> tuple[dict | None, str | None]:
    """Run the pipeline body in this flow run; (summary, error) instead of raising when a stage or gate failed."""
    run_id = runs.new_run_id()
    try:
        return pipeline.fn(cfg, from_ref=from_ref, use_cache=use_cache, run_id=run_id), None
    except ConfigError:
        raise
    except Exception as e:
        path = runs.runs_root() / run_id / "summary.json"
        return (json.loads(path.read_text()) if path.exists() else None), str(e).splitlines()[0]


def stage_entry(summary: dict | None, name: str) -> dict | None:
    for s in (summary or {}).get("stages", []):
        if s["name"] == name:
            return s
    return None


# ---- the decision --------------------------------------------------------------------------------------------------
def better(candidate: float | None, champion_score: float | None, margin: float, metric: str | None = None) -> bool:
    """candidate beats champion by margin; for a loss (lower is better) that means candidate <= champion - margin."""
    from tasks.gates import improvement

    if candidate is None or champion_score is None:
        return False
    return improvement(metric or "", champion_score, candidate) >= margin


def already_kept(c, cfg: PipelineConfig, champion_version: str, digest: str) -> str | None:
    """The id of an earlier decision that kept the champion against a candidate trained on this very data."""
    from mlflow.entities import ViewType

    exp = c.get_experiment_by_name(cfg.tracking.experiment)
    if exp is None:
        return None
    runs = c.search_runs([exp.experiment_id], max_results=1, run_view_type=ViewType.ACTIVE_ONLY,
                         filter_string=f"tags.`{DECISION_TAG}` = '{Decision.KEPT}' and tags.`baton.champion_version` = "
                                       f"'{champion_version}' and tags.`baton.data_digest` = '{digest}'")
    return runs[0].info.run_id if runs else None


def record(c, cfg: PipelineConfig, result: dict) -> None:
    logger = get_run_logger()
    flow_run_id = prefect_flow_run.get_id() or ""
    run = mlt.start_run(c, cfg.tracking.experiment, f"retrain-decision-{result['started']}",
                             tags={"baton.stage": "retrain", DECISION_TAG: result["decision"],
                                   mlt.PREFECT_TAG: flow_run_id, "baton.data_digest": result["data_digest"],
                                   "baton.champion_version": str(result["champion_version"]),
                                   **report.prefect_link_tags(flow_run_id)})
    metrics = {k: result[k] for k in ("champion_score", "candidate_score") if isinstance(result.get(k), (int, float))}
    for k, v in metrics.items():
        c.log_metric(run, f"eval/{k}", float(v))
    mlt.log_json(c, run, result, "decision.json")
    mlt.end_run(c, run, result["decision"] != Decision.FAILED)
    result["mlflow_run_id"] = run
    if result.get("candidate_version"):
        c.set_model_version_tag(cfg.tracking.registered_model, result["candidate_version"], DECISION_TAG,
                                result["decision"])
    rows = "\n".join(f"| {k} | {v} |" for k, v in result.items() if k not in ("runs",) and v not in (None, ""))
    md = f"# retrain: **{result['decision']}**\n\n{result['reason']}\n\n| | |\n|---|---|\n{rows}\n"
    try:
        create_markdown_artifact(markdown=md, key="retrain-decision", description=result["reason"][:200])
    except Exception as e:
        logger.warning("could not create the decision artifact: %s", e)
    logger.info("retrain decision: %s (%s)", result["decision"], result["reason"])


def _base_config(data, finetune, serve, model, tracking, seed) -> PipelineConfig:
    base = PipelineConfig(name="retrain", stages=["finetune"], model=model, data=data, finetune=finetune,
                          serve=serve, tracking=tracking, seed=seed)
    errors = base.validate_stages()
    if errors:
        raise ConfigError("invalid parameters:\n" + "\n".join(f"  {e}" for e in errors))
    return base


def _new_data(base: PipelineConfig, champ: dict, result: dict, force: bool) -> bool:
    """Build the data; False (decision recorded as skipped) when it is the champion's lineage."""
    summary, error = run_pipeline(base.model_copy(update={"stages": ["data"]}), None)
    if error:
        raise RetrainFailed(f"data stage failed: {error}")
    result["runs"].append(summary["run_id"])
    result["data_digest"] = digest = data_digest(stage_entry(summary, "data")["output"])
    result["data_revision"] = base.data.revision
    if digest == champ["data_digest"] and not force:
        result.update(decision=Decision.SKIPPED,
                      reason=f"data digest {digest[:12]} is the champion's lineage: nothing new")
        return False
    return True


def _train_candidate(base: PipelineConfig, champ: dict, result: dict) -> str | None:
    """Fine-tune from the champion and convert; the scores and the candidate into result; the error, if any."""
    summary, error = run_pipeline(base, champ["path"])
    result["runs"].append((summary or {}).get("run_id"))
    ft = stage_entry(summary, "finetune") or {}
    ev = ft.get("eval") or {}
    result.update(champion_score=ev.get("before"), candidate_score=ev.get("after"), metric=ev.get("metric"))
    conv = stage_entry(summary, "convert") or {}
    if conv.get("registered"):
        result["candidate_version"] = conv["registered"]["version"]
        result["candidate_path"] = conv.get("output")
    if error:
        gate_failure = Failure.GATE in (ft.get("failure"), conv.get("failure"))
        result.update(decision=Decision.KEPT if gate_failure else Decision.FAILED,
                      reason=f"candidate not promoted: {error}")
    return error


def _switch(c, base: PipelineConfig, serve: ServeConfig, policy: RetrainPolicy, champ: dict, result: dict) -> None:
    """Smoke-test the candidate on a side port (the old server keeps serving), then compare-and-set the alias against
    the champion this decision was made on, then retire the old server. Any step failing leaves the earlier state; a
    crash between the steps is reconciled by the next run (`reconcile_serving`)."""
    name = base.tracking.registered_model
    candidate = None
    if policy.serve:
        candidate = serve_candidate(base, serve, result["candidate_path"], result["candidate_version"])
        if candidate.get("error"):
            result.update(decision=Decision.KEPT, serving=candidate,
                          reason=f"candidate failed its serving smoke test on a side port ({candidate['error']}); "
                                 "champion and its server unchanged")
            return
    try:
        promoted = mlt.promote_champion(c, name, result["candidate_version"], expected=champ["version"],
                                        tags={"data_digest": result["data_digest"],
                                              "retrain_score": result["candidate_score"]})
    except mlt.AliasMoved as e:
        if candidate:
            drop_candidate()
        result.update(decision=Decision.ABORTED, reason=str(e))
        return
    result.update(decision=Decision.PROMOTED, previous_champion=promoted["previous"],
                  reason=f"candidate {result['metric']} {result['candidate_score']} ≥ champion's "
                         f"{result['champion_score']} + {policy.margin}")
    if candidate:
        result["serving"] = switch_serving(name, candidate)


def serve_candidate(base: PipelineConfig, serve: ServeConfig, path: str, version: str) -> dict:
    """Serve and smoke-test a candidate on a side port; recorded in serving.json as "candidate" before anything moves,
    so that a crash after this leaves no unrecorded server. Its state, or {"error": ...} (nothing left running)."""
    ok, candidate = start_serving(base, serve.model_copy(update={"port": 0}), path, version, publish=False)
    if ok:
        record_candidate(candidate)
    return candidate


def record_candidate(candidate: dict) -> None:
    supervisor.update_serving(lambda current: {**(current or {}), "candidate": candidate})


def drop_candidate() -> None:
    """Stop the recorded side-port candidate and forget it."""
    stop_server(((serving() or {}).get("candidate") or {}).get("server"))
    supervisor.update_serving(lambda current: {k: v for k, v in current.items() if k != "candidate"}
                              if current and len(current) > 1 else None)


def switch_serving(name: str, candidate: dict, promoted: bool = True) -> dict:
    """The candidate serves: its supervisor learns the champion it promoted (to roll back should it keep dying), the
    old server stops, serving.json records the candidate alone."""
    if promoted:
        record_promotion(candidate["server"]["state"], name, candidate["version"])
    stop_server((serving() or {}).get("server"))
    return supervisor.update_serving(lambda _: candidate)


def reconcile_serving(base: PipelineConfig, serve: ServeConfig, champ: dict, name: str) -> str | None:
    """Make serving.json, the champion alias and the live servers agree again after a retrain that died between its
    steps: a candidate the alias moved to is switched to, any other candidate stops; a server that is down or serves
    another version than the champion is replaced by one serving the champion. What was done, if anything."""
    current = serving()
    if current is None:
        return None  # retrain serves nothing (a pipeline's keep_alive server is its own)
    candidate, version = current.get("candidate"), str(champ["version"])
    if candidate and str(candidate.get("version")) == version and supervisor.alive(candidate.get("server")):
        switch_serving(name, candidate)
        return f"switched to candidate version {version}, which the champion alias had moved to"
    if candidate:
        drop_candidate()
    current = serving()
    if current is None:
        return "stopped a leftover candidate server"
    alive = bool(current.get("server")) and supervisor.alive(current["server"])
    if alive and str(current.get("version")) == version:
        return "stopped a leftover candidate server" if candidate else None
    was = f"version {current.get('version')}, {'serving' if alive else 'down'}"
    ok, state = start_serving(base, serve.model_copy(update={"port": 0}), champ["path"], version, publish=False)
    if not ok:
        return f"could not serve champion version {version}: {state['error']}"
    switch_serving(name, state, promoted=False)
    return f"serving champion version {version} again (serving.json said {was})"


@flow(name="baton-retrain", log_prints=True)
def retrain(data: DataConfig = DataConfig(), finetune: FinetuneConfig = FinetuneConfig(),
            serve: ServeConfig = ServeConfig(), policy: RetrainPolicy = RetrainPolicy(),
            model: ModelConfig = ModelConfig(), tracking: TrackingConfig = TrackingConfig(),
            seed: int = 0) -> dict:
    """Retrain the champion on new data; promote the result only when it is better by `policy.margin`."""
    base = _base_config(data, finetune, serve, model, tracking, seed)
    name = tracking.registered_model
    c = mlt.client()
    champ = champion(c, name)
    if champ is None:
        raise ConfigError(f"no '{mlt.CHAMPION}' version of {name} to retrain: run the pipeline (serve promotes "
                          "one) or set the alias on a registered version")
    result: dict = {"started": dt.datetime.now().strftime("%Y%m%d-%H%M%S"), "registered_model": name,
                    "champion_version": champ["version"], "champion_data_digest": champ["data_digest"],
                    "margin": policy.margin, "runs": []}
    if policy.serve:
        result["reconciled"] = reconcile_serving(base, serve, champ, name)
        if result["reconciled"]:
            get_run_logger().warning("serving reconciled: %s", result["reconciled"])
    if not _new_data(base, champ, result, policy.force):
        record(c, base, result)
        return result
    earlier = None if policy.force else already_kept(c, base, str(champ["version"]), result["data_digest"])
    if earlier:
        result.update(decision=Decision.SKIPPED,
                      reason=f"a candidate trained on data {result['data_digest'][:12]} from champion version "
                             f"{champ['version']} was already kept (decision run {earlier}); set policy.force to "
                             "retrain anyway")
        record(c, base, result)
        return result
    get_run_logger().info("new data (digest %s, champion trained on %s): fine-tuning version %s",
                          result["data_digest"][:12], champ["data_digest"][:12] or "unknown data", champ["version"])
    error = _train_candidate(base, champ, result)
    if error is None and not better(result["candidate_score"], result["champion_score"], policy.margin,
                                    result["metric"]):
        result.update(decision=Decision.KEPT,
                      reason=f"candidate {result['metric']} {result['candidate_score']} is not better than the "
                             f"champion's {result['champion_score']} by {policy.margin}")
    elif error is None and not result.get("candidate_version"):
        result.update(decision=Decision.FAILED, reason="the converted candidate was not registered")
    elif error is None:
        _switch(c, base, serve, policy, champ, result)
    record(c, base, result)
    if result["decision"] == Decision.FAILED:
        raise RetrainFailed(result["reason"])
    return result
