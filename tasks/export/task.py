"""The export stage: each type of `export.types` written from the HF checkpoint the relay hands it, by the same
export as `baton export` (run.py: llama.cpp's converter, or quantize.py: llm-compressor calibrated on the run's data
stage output; the gate, then the folder published with its manifest), the converter launched through the stage's
context so its log streams. The relay goes on with the HF checkpoint: the exported folders are side outputs,
registered each as its own model version only when every type passed its gate."""
from __future__ import annotations

import shutil
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from conversions import manifest as mf
from conversions.verify import report
from tasks import events
from tasks.export import quantize, run
from tasks.export.config import ExportConfig, is_quantization
from tasks.stage import StageContext, StageOutput


@task(name="export", cache_policy=NO_CACHE)
def run_export(ctx: StageContext, cfg: ExportConfig) -> StageOutput:
    checks, seconds, metrics, published = [], {}, {}, {}
    for type_name in cfg.types:
        dest = ctx.work_dir / type_name
        shutil.rmtree(dest, ignore_errors=True)  # an earlier attempt of this step: exported again, not trusted
        outcome = exported(ctx, cfg, type_name, dest)
        checks += [{**c, "name": f"{type_name}.{c['name']}"} for c in outcome.report["checks"]]
        seconds.update({f"{type_name}.{k}": v for k, v in (outcome.report.get("seconds") or {}).items()})
        metrics.update(measures(type_name, outcome))
        if outcome.published is not None:
            published[type_name] = outcome.published
    engine = " + ".join(sorted({"llm-compressor" if is_quantization(t) else "llama.cpp" for t in cfg.types}))
    return StageOutput(output=None, engine=engine, gate=report(checks, seconds), metrics=metrics,
                       side_outputs=published)


def exported(ctx: StageContext, cfg: ExportConfig, type_name: str, dest: Path) -> run.Outcome:
    if is_quantization(type_name):
        return quantize.export(ctx.input, dest, type_name, ctx.data_dir, cfg.max_loss_delta.get(type_name),
                               rows=cfg.calibration_rows, quantizer=launched_quantizer(ctx, cfg, type_name))
    return run.export(ctx.input, dest, type_name, cfg.max_logit_rms.get(type_name),
                      converter=launched(ctx, cfg, type_name))


def launched(ctx: StageContext, cfg: ExportConfig, type_name: str):
    """run.export's converter: the worker in the llamacpp runtime through ctx.launch (a failure raises LaunchError,
    the step runner's engine failure)."""
    def convert(src: Path, out: Path, out_type: str) -> tuple[events.ExportResult, str]:
        spec = events.write_spec(ctx.work_dir / f"export_spec_{type_name}.json", run.worker_spec(src, out, out_type))
        res = ctx.launch([ctx.python("llamacpp"), str(run.WORKER), "--spec", str(spec)], name=f"export-{type_name}",
                         runtime="llamacpp", timeout=cfg.timeout_s)
        return res.result(events.ExportResult), ""
    return convert


def launched_quantizer(ctx: StageContext, cfg: ExportConfig, type_name: str):
    """quantize.export's quantizer: the worker in the llmcompressor runtime through ctx.launch."""
    def run_worker(spec: events.QuantizeSpec) -> tuple[events.QuantizeResult, str]:
        path = events.write_spec(ctx.work_dir / f"export_spec_{type_name}.json", spec)
        res = ctx.launch([ctx.python(quantize.RUNTIME), str(quantize.WORKER), "--spec", str(path)],
                         name=f"export-{type_name}", runtime=quantize.RUNTIME, timeout=cfg.timeout_s)
        return res.result(events.QuantizeResult), ""
    return run_worker


def measures(type_name: str, outcome: run.Outcome) -> dict:
    """The gate's numbers of one type as the stage's metrics: the logit measures (a failed check's too), the gate's
    seconds, and for a published file its size and the conversion's seconds. Named by the type in lower case (metric
    names are lower_snake_case: q4_K_M's are q4_k_m_*)."""
    by_name = {c["name"]: c for c in outcome.report["checks"]}
    logits = by_name.get("gguf.logits", {})
    kind = type_name.lower()
    out = {f"{kind}_{k}": logits[k] for k in run.LOGIT_MEASURES if k in logits}
    if "loss_delta" in by_name.get("quant.heldout_loss", {}):
        out[f"{kind}_loss_delta"] = by_name["quant.heldout_loss"]["loss_delta"]
    out[f"{kind}_gate_s"] = round(sum((outcome.report.get("seconds") or {}).values()), 3)
    if outcome.published is not None:
        extra = mf.read(outcome.published)["extra"]
        out.update({f"{kind}_size_bytes": extra["size"], f"{kind}_convert_s": extra["seconds"]})
        out.update({f"{kind}_{k}": extra[k] for k in ("heldout_loss", "heldout_loss_source") if k in extra})
    return out
