"""Convert stage: its own step between two stages whose formats differ, with its own gate."""
from __future__ import annotations

import shutil
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from conversions import durable, probe, sealed, verify
from conversions.manifest import Format
from tasks import events
from tasks.convert.config import ConvertConfig
from tasks.stage import StageContext, StageOutput, training_engine_env

WORKER = Path(__file__).with_name("worker.py")


def worker_spec(src: Path, dst: Path, cfg: ConvertConfig, stage: str, from_format: str | None = None,
                require_seal: bool = False) -> events.ConvertSpec:
    """What the worker reads, for the pipeline's step and `baton convert` alike: every value from the convert
    config."""
    return events.ConvertSpec(src=src, dst=dst, to_format=cfg.to_format, from_format=from_format,
                              max_shard_size_mb=cfg.max_shard_size_mb, stage=stage, require_seal=require_seal)


def gate(out: Path, src: Path, to_format: str) -> dict:
    """L0 + finite weights, then for HF: preflight + L1 + L2 (against the engine's probe logits when the source has
    them) + L3, and, from a checkpoint in the engine's own names (ZeRO), every parameter against the source's."""
    seconds: dict[str, float] = {}
    checks = verify.timed(seconds, "L0", lambda: verify.integrity(out))
    if not checks[-1]["passed"]:
        return verify.report(checks, seconds)
    finite = verify.timed(seconds, "finite", lambda: verify.finite_weights(out))
    if to_format != Format.HF_SAFETENSORS or not finite[0]["passed"]:
        return verify.report(checks + finite, seconds)
    ref = src / probe.PROBE_FILE
    rep = verify.verify(out, against=ref if ref.exists() else None)  # its L0 reuses the digests just computed
    for level, s in rep["seconds"].items():
        seconds[level] = round(seconds.get(level, 0) + s, 3)
    source = verify.timed(seconds, "L1", lambda: verify.source_parity(out, src))
    return verify.report(rep["checks"] + finite + source, seconds)


@task(name="convert", cache_policy=NO_CACHE)
def run_convert(ctx: StageContext, cfg: ConvertConfig) -> StageOutput:
    cfg = cfg.model_copy(update={"to_format": ctx.extra.get("to_format", cfg.to_format)})
    to_format = cfg.to_format
    out = ctx.work_dir / "checkpoint"
    if out.exists():
        shutil.rmtree(out)  # a conversion is cheap to redo and must never be half-written
    tmp = ctx.work_dir / "checkpoint.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    # a training stage of this run sealed its checkpoint with this BATON_HOME's key
    sealed_input = bool(ctx.extra.get("source_stage")) and ctx.input_format in sealed.MARKERS
    spec = events.write_spec(ctx.work_dir / "convert_spec.json",
                             worker_spec(ctx.input, tmp, cfg, ctx.stage, ctx.input_format, sealed_input))
    res = ctx.launch([ctx.python("main"), str(WORKER), "--spec", str(spec)], name="convert", timeout=cfg.timeout_s,
                     env=training_engine_env("cpu"))
    g = gate(tmp, ctx.input, to_format)
    if g.get("passed"):  # published only once its gate passed: a folder named `checkpoint` is always a good one
        durable.publish_dir(tmp, out)
    r = res.result(events.ConvertResult)
    return StageOutput(output=out if g.get("passed") else tmp, engine="baton-convert",
                       backend=f"{r.from_format}→{to_format}", gate=g, metrics={"wall_s": r.seconds},
                       extra={"from_format": r.from_format, "to_format": to_format})
