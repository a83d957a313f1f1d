"""The composite flow: the configured stages in order, each a subflow, with conversions where formats differ."""
from __future__ import annotations

import json
from pathlib import Path

import yaml
from prefect import flow, get_run_logger, tags
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.runtime import flow_run as prefect_flow_run

from conversions import manifest as mf
from conversions.manifest import Format
from flows import chain_planner as planning, checkpoint_refs, report, runs
from flows.config import ConfigError, PipelineConfig, launch_parameter_error
from flows.step_entry import RunInfo, StageFailed
from flows.step_runner import describe_stop, run_step, stopped_from_outside
from tasks import orchestration, tracking
from tasks.paths import check_run_id
from tasks.registry import CONVERT_STAGE, DATA_STAGE, STAGES
from tasks.secrets import redact
from tasks.stage import Status


def resolve_input(cfg: PipelineConfig, from_ref: str | None) -> tuple[Path | None, str | None, str | None]:
    """(checkpoint folder, its format, its fingerprint) for the first stage, or (None, None, None)."""
    if from_ref:
        try:
            path = checkpoint_refs.resolve(from_ref).path
        except checkpoint_refs.CheckpointRefError as e:
            raise ConfigError(f"--from {e}") from None
        m = mf.read(path)
        if m is None:
            raise ConfigError(f"--from {path}: no {mf.MANIFEST_NAME}; write one first with `baton manifest {path}`")
        return path, m["format"], mf.digest_of(m)
    prev = planning.predecessor(cfg)
    if prev is None:
        return None, None, None
    rec = runs.Index().get(prev.fingerprint)
    if rec and rec.get("status") == Status.COMPLETED and rec.get("output") and Path(rec["output"]).exists():
        return Path(rec["output"]), prev.produces, prev.fingerprint
    first = next(s for s in cfg.stages if s != DATA_STAGE)
    raise ConfigError(f"stage '{first}' needs an input checkpoint: pass --from PATH or name@alias, or run the "
                      f"earlier stages first (no completed '{prev.label}' with this config in {tracking.baton_home()})")


def check_chat_template(cfg: PipelineConfig, steps: list, input_path: Path | None, input_format: str | None) -> None:
    """A chat stage straight on an HF input without a chat template (and no `model.chat_template`) is refused now,
    with the fix."""
    first = next((s for s in steps if s.name != DATA_STAGE), None)
    if first is None or not STAGES[first.name].chat or input_format != Format.HF_SAFETENSORS or input_path is None:
        return
    if not mf.chat_template_present(input_path) and not cfg.model.chat_template:
        raise ConfigError(f"--from {input_path}: the model has no chat template, and stage '{first.name}' renders "
                          "conversations with it; set model.chat_template in the config (a Jinja template, or the "
                          "path to a .jinja file; e.g. --set model.chat_template=template.jinja), or put the template "
                          "into the checkpoint (chat_template.jinja beside tokenizer_config.json) and run `baton "
                          f"manifest {input_path}` again")


def _hf_config(input_path: Path) -> dict | None:
    try:
        config = json.loads((input_path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None  # the stages' own checks name the unreadable config
    return config if isinstance(config, dict) else {}


def _architectures(config: dict) -> list:
    archs = config.get("architectures")
    return archs if isinstance(archs, list) else []


def check_architectures(cfg: PipelineConfig, steps: list, input_path: Path | None, input_format: str | None) -> None:
    """The input model's architecture against each step, now instead of after the steps before it (rlhf and finetune
    keep the architecture, so every later step meets the input's): chat stages load it with transformers, and each
    stage checks what it has a limit on (StageSpec.check_input: e.g. what a conversion maps, what an engine serves)."""
    if input_format != Format.HF_SAFETENSORS or input_path is None or (config := _hf_config(input_path)) is None:
        return
    from conversions import verify

    archs = _architectures(config)
    for st in steps:
        if STAGES[st.name].chat and not verify.transformers_classes(archs):
            raise ConfigError(f"--from {input_path}: stage '{st.label}': architecture {archs} has no model class in "
                              "transformers, which the stage trains with")
        if problem := STAGES[st.name].check_input(cfg, st, config, input_path):
            raise ConfigError(f"--from {input_path}: {problem}")


def refuse_launch_parameters(cfg: PipelineConfig) -> None:
    """A run started from a deployment (the API, the UI's Run form, a schedule) takes its config from parameters:
    those may not choose the program it launches (flows.config.LAUNCH_KEYS). `baton run` reads the user's own file."""
    from prefect.runtime import deployment

    if deployment.id and (problem := launch_parameter_error(cfg)):
        raise ConfigError(problem)


def prepare(cfg: PipelineConfig, from_ref: str | None):
    input_path, input_format, input_fp = resolve_input(cfg, from_ref)
    steps = planning.plan(cfg, input_format, input_fp)
    from conversions.registry import supported

    for i, st in enumerate(steps):
        if st.name == CONVERT_STAGE and not supported(st.consumes, st.produces):
            reader = steps[i + 1] if st.implicit and i + 1 < len(steps) else None
            why = f" (stage '{reader.label}' reads {st.produces}, as its config sets it)" if reader else ""
            raise ConfigError(f"step {st.label}: no converter from {st.consumes} to {st.produces}{why}")
    check_chat_template(cfg, steps, input_path, input_format)
    check_architectures(cfg, steps, input_path, input_format)
    first_real = next((s for s in steps if s.name != DATA_STAGE), None)
    if first_real is not None and input_path is None and first_real.consumes is not None:
        if STAGES[first_real.name].input_required:
            raise ConfigError(f"stage '{first_real.label}' needs an input checkpoint ({first_real.consumes}): "
                              "pass --from PATH or name@alias")
    return input_path, input_format, steps


def _open_run(cfg: PipelineConfig, steps: list, run_id: str | None,
              doctor: list | None = None) -> tuple[RunInfo, dict]:
    """The run folder (config, plan), the MLflow parent run and the summary skeleton."""
    run_id = check_run_id(run_id or runs.new_run_id())
    run_dir = runs.runs_root() / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(redact(cfg.model_dump(mode="json")), sort_keys=False))
    (run_dir / "plan.json").write_text(json.dumps([s.to_dict() for s in steps], indent=2))
    flow_run_id = prefect_flow_run.get_id()
    c, missing = tracking.client(), []  # missing: what the tracking server did not get (it was unreachable)
    parent = tracking.attempt(missing, "the run's MLflow parent run", tracking.start_run, c, cfg.tracking.experiment,
                              f"{cfg.name}-{run_id}",
                              tags={tracking.PREFECT_TAG: flow_run_id or "", "baton.run_id": run_id,
                                    "baton.config": cfg.name, "baton.stages": ",".join(s.label for s in steps),
                                    **report.prefect_link_tags(flow_run_id)})
    if parent is not None:
        _log_run_inputs(c, parent, cfg, run_dir, doctor, missing)
    summary = {"run_id": run_id, "mlflow_run_id": parent, "prefect_flow_run_id": flow_run_id, "run_dir": str(run_dir),
               "config": cfg.name, "status": Status.RUNNING, "stages": []}
    if missing:
        summary[tracking.MISSING] = missing
    return RunInfo(run_id, run_dir, parent, flow_run_id), summary


def _log_run_inputs(c, parent: str, cfg: PipelineConfig, run_dir: Path, doctor: list | None, missing: list) -> None:
    tracking.attempt(missing, "params", tracking.log_params, c, parent, cfg.model_dump(mode="json"))
    tracking.attempt(missing, "config.yaml", c.log_artifact, parent, str(run_dir / "config.yaml"))
    if doctor:  # `baton doctor`'s warnings (errors never get this far)
        tracking.attempt(missing, "doctor.json", tracking.log_json, c, parent, doctor, "doctor.json")
        tracking.attempt(missing, "doctor tag", c.set_tag, parent, "baton.doctor_warnings", str(len(doctor)))
    try:
        create_link_artifact(link=f"{tracking.tracking_uri()}#/experiments/-/runs/{parent}", link_text=f"MLflow run {parent}",
                             key="mlflow-run", description="this pipeline's MLflow parent run")
    except Exception:
        pass


def _end_parent_run(run: RunInfo, summary: dict, state: str) -> None:
    """summary.json to the MLflow parent run and the run's end (its end first when cancelled: Prefect SIGKILLs a
    cancelled flow's process 30 s after its SIGTERM); what the server did not get is listed in summary.json."""
    if run.mlflow_parent is None:
        return
    c, missing = tracking.client(), summary.get(tracking.MISSING, [])
    calls = [(f"end of run ({state})", c.set_terminated, run.mlflow_parent, state),
             ("summary.json", c.log_artifact, run.mlflow_parent, str(run.run_dir / "summary.json"))]
    for what, call, *args in (calls if state == "KILLED" else calls[::-1]):
        tracking.attempt(missing, what, call, *args)
    if missing:
        summary[tracking.MISSING] = missing
        runs.write_summary(run.run_dir, summary)


def _run_steps(cfg: PipelineConfig, steps: list, run: RunInfo, summary: dict, input_path, input_format,
               use_cache: bool) -> str | None:
    """Each step in order, its output feeding the next; after a failure the rest are skipped. Returns the failure."""
    current, current_fmt = (str(input_path) if input_path else None), input_format
    data_dir = None
    failed = None
    sides: dict[str, dict[str, str]] = {}  # step label -> format -> its first side output of that format
    for i, step in enumerate(steps):
        if failed:
            summary["stages"].append({"name": step.name, "label": step.label, "status": Status.SKIPPED,
                                      "fingerprint": step.fingerprint})
            continue
        try:
            into, into_fmt = (((sides.get(step.reads_side_of) or {}).get(step.consumes), step.consumes)
                              if step.reads_side_of else (current, current_fmt))
            entry = run_step(step, cfg, run, i, into, into_fmt, data_dir, use_cache)
        except StageFailed as e:
            failed = str(e)
            entry = e.entry or {"name": step.name, "label": step.label, "error": failed}
            entry["status"] = Status.FAILED
        summary["stages"].append(entry)
        runs.write_summary(run.run_dir, summary)
        if entry["status"] in (Status.COMPLETED, Status.CACHED):
            if entry.get("side_outputs"):
                sides[step.label] = first_side_output_by_format(entry["side_outputs"])
            if step.name == DATA_STAGE:
                data_dir = entry.get("output")
            elif entry.get("output") and step.produces is not None:
                current, current_fmt = entry["output"], step.produces
    return failed


def first_side_output_by_format(side_outputs: dict) -> dict[str, str]:
    """Each format's first side output (as the stage listed them), read from its manifest: an export of q4_K_M and
    w8a8 writes a GGUF file and a quantized HF folder, and a later llama.cpp serve reads the GGUF."""
    firsts: dict[str, str] = {}
    for side in side_outputs.values():
        fmt = (mf.read(Path(side["output"])) or {}).get("format")
        if fmt:
            firsts.setdefault(fmt, side["output"])
    return firsts


def _lineage_markdown(summary: dict) -> str:
    """The run's chain from data to its last checkpoint as a Mermaid diagram; registered versions get theirs too."""
    from flows import lineage

    try:
        lineage.describe_versions(summary)
    except Exception as e:  # lineage explains a run; it never fails one
        get_run_logger().warning("lineage in model version descriptions: %s", e)
    try:
        head = lineage.run_head(summary)
        return "\n" + lineage.markdown(lineage.chain(head)) if head else ""
    except Exception as e:  # lineage explains a run; it never fails one
        get_run_logger().warning("lineage: %s", e)
        return ""


def _close_run(run: RunInfo, summary: dict, failed: str | None) -> None:
    """summary.json and summary.md, the MLflow parent run's end, the Prefect summary artifact."""
    summary["status"] = Status.FAILED if failed else Status.COMPLETED
    _note_orchestration_lost(summary)
    runs.write_summary(run.run_dir, summary)
    _end_parent_run(run, summary, "FAILED" if failed else "FINISHED")
    md = report.markdown(summary) + _lineage_markdown(summary)
    (run.run_dir / "summary.md").write_text(md)
    if orchestration.lost():
        return
    try:
        create_markdown_artifact(markdown=md, key="baton-run-summary", description=f"baton run {run.run_id}")
    except Exception as e:
        get_run_logger().warning("could not create the summary artifact: %s", e)


def _note_orchestration_lost(summary: dict) -> None:
    """With the Prefect server gone, the run's own end (its final state, the summary artifact) never reaches it."""
    if orchestration.lost():
        summary[orchestration.ORCHESTRATION_LOST] = list(orchestration.RUN_END)


def _close_cancelled(run: RunInfo, steps: list, summary: dict, e: BaseException) -> None:
    """A run stopped from outside (Prefect's Cancel, a SIGTERM, Ctrl-C): summary.json says cancelled, the MLflow
    parent run ends KILLED. Lean, and in this order: Prefect SIGKILLs a cancelled flow's process 30 s after its
    SIGTERM."""
    reason = describe_stop(e)
    done = {s["label"] for s in summary["stages"]}
    index = runs.Index()
    for step in [s for s in steps if s.label not in done]:
        entry = {"name": step.name, "label": step.label, "status": Status.SKIPPED, "fingerprint": step.fingerprint}
        if not any(s["status"] == Status.CANCELLED for s in summary["stages"]):  # the step that was under way
            rec = index.get(step.fingerprint) or {}
            ours = rec.get("run_id") == run.run_id and (rec.get("entry") or {}).get("status") == Status.CANCELLED
            entry = rec["entry"] if ours else {**entry, "status": Status.CANCELLED, "error": reason}
        summary["stages"].append(entry)
    summary.update(status=Status.CANCELLED, error=reason)
    _note_orchestration_lost(summary)
    runs.write_summary(run.run_dir, summary)
    (run.run_dir / "summary.md").write_text(report.markdown(summary))
    _end_parent_run(run, summary, "KILLED")
    get_run_logger().warning("baton run %s %s; run dir %s", run.run_id, reason, run.run_dir)
    if orchestration.lost():
        return
    try:
        create_markdown_artifact(markdown=report.markdown(summary), key="baton-run-summary",
                                 description=f"baton run {run.run_id}")
    except Exception:  # the server may be what went away
        pass


def _flow_run_name() -> str:
    """`<config>-<run id>` (e.g. tiny-20261201-010533-ab12); a run started without a run id gets a new one here."""
    params = prefect_flow_run.get_parameters()
    cfg = params.get("config")
    name = getattr(cfg, "name", None) or (cfg.get("name") if isinstance(cfg, dict) else None) or "baton"
    return f"{name}-{params.get('run_id') or runs.new_run_id()}"


def _run_id_from_flow_run(cfg: PipelineConfig) -> str:
    name = prefect_flow_run.get_name() or ""
    return name.removeprefix(f"{cfg.name}-") if name.startswith(f"{cfg.name}-") else runs.new_run_id()


def run_tags(cfg: PipelineConfig, steps: list) -> list[str]:
    """Prefect tags that make runs findable by config, stage and registered model."""
    return [f"config:{cfg.name}", *(f"stage:{s.label}" for s in steps), f"model:{cfg.tracking.registered_model}"]


def _tag_flow_run(tag_list: list[str]) -> None:
    flow_run_id = prefect_flow_run.get_id()
    if not flow_run_id:
        return
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            current = client.read_flow_run(flow_run_id).tags
            client.update_flow_run(flow_run_id, tags=sorted(set(current) | set(tag_list)))
    except Exception as e:  # tags help finding runs; they never fail one
        get_run_logger().warning("could not tag the flow run: %s", e)


@flow(name="baton-pipeline", log_prints=True, flow_run_name=_flow_run_name)
def pipeline(config: PipelineConfig, from_ref: str | None = None, use_cache: bool = True,
             run_id: str | None = None, doctor: list | None = None) -> dict:
    """Run the configured stages (data → pretrain → rlhf → finetune → serve by default) and gate every hand-off."""
    cfg = config
    orchestration.reset()
    refuse_launch_parameters(cfg)
    input_path, input_format, steps = prepare(cfg, from_ref)
    run, summary = _open_run(cfg, steps, run_id or _run_id_from_flow_run(cfg), doctor)
    get_run_logger().info("baton run %s: %s", run.run_id, " → ".join(s.label for s in steps))
    tag_list = run_tags(cfg, steps)
    _tag_flow_run(tag_list)
    try:
        with tags(*tag_list):  # the stage subflows carry them too
            failed = _run_steps(cfg, steps, run, summary, input_path, input_format, use_cache)
    except BaseException as e:
        if stopped_from_outside(e):
            _close_cancelled(run, steps, summary, e)
        raise
    _close_run(run, summary, failed)
    if failed:
        raise RuntimeError(f"baton run {run.run_id} failed: {failed}\nrun dir: {run.run_dir}")
    return summary
