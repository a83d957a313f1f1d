"""The export stage: each type of `export.types` written from the HF checkpoint the relay hands it, by the same
export as `baton export` (run.py: llama.cpp's converter, the gate, then the folder published with its manifest), the
converter launched through the stage's context so its log streams. The relay goes on with the HF checkpoint: the GGUF
folders are side outputs, registered each as its own model version only when every type passed its gate."""
from __future__ import annotations

import shutil
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from conversions import manifest as mf
from conversions.verify import report
from tasks import events
from tasks.export import run
from tasks.export.config import ExportConfig
from tasks.stage import StageContext, StageOutput


@task(name="export", cache_policy=NO_CACHE)
def run_export(ctx: StageContext, cfg: ExportConfig) -> StageOutput:
    checks, seconds, metrics, published = [], {}, {}, {}
    for type_name in cfg.types:
        dest = ctx.work_dir / type_name
        shutil.rmtree(dest, ignore_errors=True)  # an earlier attempt of this step: exported again, not trusted
        outcome = run.export(ctx.input, dest, type_name, cfg.max_logit_rms.get(type_name),
                             converter=launched(ctx, cfg, type_name))
        checks += [{**c, "name": f"{type_name}.{c['name']}"} for c in outcome.report["checks"]]
        seconds.update({f"{type_name}.{k}": v for k, v in (outcome.report.get("seconds") or {}).items()})
        metrics.update(measures(type_name, outcome))
        if outcome.published is not None:
            published[type_name] = outcome.published
    return StageOutput(output=None, engine="llama.cpp", gate=report(checks, seconds), metrics=metrics,
                       side_outputs=published)


def launched(ctx: StageContext, cfg: ExportConfig, type_name: str):
    """run.export's converter: the worker in the llamacpp runtime through ctx.launch (a failure raises LaunchError,
    the step runner's engine failure)."""
    def convert(src: Path, out: Path, out_type: str) -> tuple[events.ExportResult, str]:
        spec = events.write_spec(ctx.work_dir / f"export_spec_{type_name}.json", run.worker_spec(src, out, out_type))
        res = ctx.launch([ctx.python("llamacpp"), str(run.WORKER), "--spec", str(spec)], name=f"export-{type_name}",
                         runtime="llamacpp", timeout=cfg.timeout_s)
        return res.result(events.ExportResult), ""
    return convert


def measures(type_name: str, outcome: run.Outcome) -> dict:
    """The gate's numbers of one type as the stage's metrics: the logit measures (a failed check's too), the gate's
    seconds, and for a published file its size and the conversion's seconds. Named by the type in lower case (metric
    names are lower_snake_case: q4_K_M's are q4_k_m_*)."""
    logits = next((c for c in outcome.report["checks"] if c["name"] == "gguf.logits"), {})
    kind = type_name.lower()
    out = {f"{kind}_{k}": logits[k] for k in run.LOGIT_MEASURES if k in logits}
    out[f"{kind}_gate_s"] = round(sum((outcome.report.get("seconds") or {}).values()), 3)
    if outcome.published is not None:
        extra = mf.read(outcome.published)["extra"]
        out.update({f"{kind}_size_bytes": extra["size"], f"{kind}_convert_s": extra["seconds"]})
    return out
