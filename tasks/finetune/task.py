"""Finetune stage: launch the DeepSpeed worker on N ranks, then describe and gate its checkpoint.

The output folder `<work_dir>/checkpoint` is DeepSpeed's save dir (tag folders + `latest`) plus what the
deepspeed-zero → HF converter needs beside it: config.json, tokenizer/ and the engine's probe logits. Re-running in
the same work dir resumes from the newest complete tag.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from conversions import folder, hf, manifest as mf, verify
from conversions.manifest import Format
from conversions.refusal import Refused
from tasks import chat, chat_template, events, gates, resuming
from tasks.distributed import (Launch, LaunchConfigError, engine_command, remove_shm_segments, runtime_kind,
                               stage_runtime, with_port)
from tasks.finetune import ds_config, engine_env
from tasks.finetune.config import FinetuneConfig, moe_lora_refusal, validate
from tasks.stage import StageContext, StageOutput

WORKER = Path(__file__).with_name("worker.py")


class FinetuneInputError(Refused):
    pass


def check_inputs(ctx: StageContext, cfg: FinetuneConfig) -> None:
    problems = validate(cfg)
    if ctx.input is None or not (Path(ctx.input) / "config.json").exists():
        problems.append(f"finetune: input {ctx.input} is not an HF checkpoint (no config.json)")
    elif problem := chat_template.missing_problem("finetune", ctx, "render the conversations"):
        problems.append(problem)
    for split in ("train", "heldout"):
        if ctx.data_dir is None or not (Path(ctx.data_dir) / "sft" / f"{split}.jsonl").exists():
            problems.append(f"finetune: data {ctx.data_dir} lacks sft/{split}.jsonl (run the data stage)")
    problems += nvme_problems(cfg) + gates.lm_eval_path_errors(cfg.gate, "finetune")
    if not problems and (problem := moe_lora_problem(Path(ctx.input), cfg)):
        problems.append(problem)
    if not problems:  # the template's replies trained on what engines serve, before any launch
        rows = chat_template.first_rows(Path(ctx.data_dir) / "sft" / "train.jsonl")
        if problem := chat_template.boundary_problem("finetune", ctx, [r["messages"] for r in rows]):
            problems.append(problem)
    if problems:
        raise FinetuneInputError("; ".join(problems))


def moe_lora_problem(src: Path, cfg: FinetuneConfig) -> str | None:
    """LoRA on an input whose own config.json is a mixture of experts (a `--from` model the config does not describe
    as one)."""
    moe = hf.moe_of_hf_config(json.loads((src / "config.json").read_text())) if cfg.lora.enabled else None
    if moe is None:
        return None
    return moe_lora_refusal(f"the input {src} is a mixture of experts ({moe['num_experts']} experts, config.json)")


def command(ctx: StageContext, cfg: FinetuneConfig, spec_path: Path) -> tuple[list[str], int]:
    """The deepspeed launcher (or torchrun) on nnodes × nproc_per_node ranks, on the `main` runtime's target, and the
    rendezvous port when it is picked here (its DeepSpeed shm segments are removed after the run)."""
    launch = Launch(python=ctx.python("main"), script=str(WORKER), args=("--spec", str(spec_path)),
                    nnodes=cfg.nnodes, nproc_per_node=cfg.nproc_per_node, launcher=cfg.launcher,
                    master_port=cfg.master_port)
    runtime = stage_runtime(ctx)
    if runtime_kind(runtime) == "local":
        launch = with_port(launch)
    try:
        return engine_command(launch, runtime, Path(ctx.work_dir)), launch.master_port
    except LaunchConfigError as e:
        raise FinetuneInputError(f"finetune: {e}") from None


def worker_spec(ctx: StageContext, cfg: FinetuneConfig, out: Path, ds_config_path: Path,
                template: Path | None = None, probe: bool = False) -> events.FinetuneSpec:
    """What the worker reads from finetune_spec.json (paths as the worker will see them). `probe`: the batch
    finder's run (training steps only: no evaluation, no checkpoint)."""
    return events.FinetuneSpec(
        input=Path(ctx.input).resolve(), data_dir=Path(ctx.data_dir).resolve(), output=out,
        ds_config=ds_config_path, device=cfg.resolved_device(), seed=ctx.seed, steps=cfg.steps,
        checkpoint_every=cfg.checkpoint_every, keep_checkpoints=cfg.keep_checkpoints,
        max_seq_length=cfg.max_seq_length or ctx.model.get("seq_length", 128),
        eval_max_new_tokens=cfg.eval_max_new_tokens, zero_init=cfg.zero.init,
        activation_checkpointing=cfg.activation_checkpointing, log_every=cfg.log_every,
        lora=cfg.lora.model_dump(), gate_metric=gates.resolve_metric(cfg.gate, ctx.data_dir, "sft", "exact_match"),
        overlong=cfg.overlong, packing=cfg.packing, eval_batch_size=cfg.micro_batch_size,
        chat_template=template, probe=probe)


def nvme_problems(cfg: FinetuneConfig) -> list[str]:
    """ZeRO-Infinity needs a writable swap folder and libaio to build DeepSpeed's async I/O op (found before launch,
    not minutes into the op build)."""
    if not ds_config.uses_nvme(cfg):
        return []
    problems = []
    folder = Path(cfg.zero.nvme_path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        problems.append(f"finetune.zero.nvme_path: cannot create {folder}: {e.strerror}")
    else:
        if not os.access(folder, os.W_OK):
            problems.append(f"finetune.zero.nvme_path: {folder} is not writable")
    if not engine_env.libaio_available():
        problems.append("finetune.zero: nvme offload builds DeepSpeed's async I/O op against libaio, which is not "
                        "installed (make system-deps: Debian's libaio-dev)")
    return problems



def prepare(ctx: StageContext, cfg: FinetuneConfig, probe: bool = False) -> tuple[list[str], dict, Path, int]:
    """Write the DeepSpeed config and the worker spec into the work dir, seed the output folder, build the command."""
    check_inputs(ctx, cfg)
    work = Path(ctx.work_dir)
    out = work / "checkpoint"
    out.mkdir(parents=True, exist_ok=True)
    template = chat_template.for_input(ctx)
    hf.copy_tokenizer(Path(ctx.input), out / "tokenizer", chat_template=template)
    for name in ("config.json", "generation_config.json"):
        if (Path(ctx.input) / name).exists():
            folder.copy_file(Path(ctx.input) / name, out / name)
    if template is not None:  # model.chat_template: its end-of-turn token ends a served reply too
        chat.add_end_of_turn_stop(out, out / "tokenizer")
    ds = ds_config.build(cfg)
    (work / "ds_config.json").write_text(json.dumps(ds, indent=2) + "\n")
    spec = worker_spec(ctx, cfg, out, work / "ds_config.json", template, probe)
    events.write_spec(work / "finetune_spec.json", spec)
    cmd, port = command(ctx, cfg, work / "finetune_spec.json")
    if port:
        remove_shm_segments(port)
    return cmd, engine_env.worker_env(cfg.resolved_device()), out, port


def finalize(out: Path, ctx: StageContext, cfg: FinetuneConfig, r: events.FinetuneResult) -> dict:
    """Keep only the final tag (earlier ones served resumption), then write the manifest."""
    final = (out / "latest").read_text().strip()
    for d in resuming.checkpoints(out, resuming.CheckpointKind.DEEPSPEED):
        if d.name != final:
            shutil.rmtree(d)
    config = json.loads((out / "config.json").read_text())
    params = (mf.read(Path(ctx.input)) or {}).get("parameter_count") or hf.parameter_count(Path(ctx.input))
    m = mf.build(
        out, format=Format.DEEPSPEED_ZERO, stage="finetune",
        engine={"name": "deepspeed", "launcher": cfg.launcher,
                **mf.engine_versions("deepspeed", "torch", "transformers")},
        architecture=dict(ctx.architecture(), hf_architectures=config.get("architectures")), parameter_count=params,
        dtype=cfg.torch_dtype(), parent=mf.parent_ref(Path(ctx.input)),
        extra={"zero_stage": cfg.zero.stage, "world_size": r.world_size, "tag": final, "step": r.steps, "lora": cfg.lora.model_dump() if cfg.lora.enabled else None,
               "deepspeed_config": json.loads((Path(ctx.work_dir) / "ds_config.json").read_text())},
        tokenizer_dir=out / "tokenizer")
    mf.write(out, m)
    return m


def gate_eval(ctx: StageContext, cfg: FinetuneConfig, out: Path, metric: str, before: dict,
              after: dict) -> tuple[dict, dict]:
    """(summary eval entry, gate check): the worker's held-out metric, or lm-eval run on the input and the output."""
    if metric == "lm_eval":
        ev = gates.run_lm_eval(ctx, cfg.gate, out, cfg.resolved_device(), cfg.timeout_s)
        return ev, gates.lm_eval_check(ev, cfg.gate.min_improvement)
    ev = {"metric": eval_name(metric), "before": before.get(metric), "after": after.get(metric)}
    return ev, gates.check(metric, ev["before"], ev["after"], cfg.gate.min_improvement, ev["metric"])


def eval_name(metric: str) -> str:
    return metric if metric.startswith("heldout_") else f"heldout_{metric}"


def heldout_metrics(before: dict, after: dict) -> dict:
    """{"heldout_loss": x, "exact_match": y} before and after → heldout_loss_before, heldout_exact_match_after, ..."""
    return {f"{eval_name(k)}_{when}": v
            for when, facts in (("before", before), ("after", after)) for k, v in facts.items()}


def clear_nvme_swap(cfg: FinetuneConfig) -> int:
    """DeepSpeed leaves its NVMe swap files (a copy of the partitions and optimizer states) behind; a finished run
    removes them. Returns how many bytes they held (what was offloaded)."""
    if not ds_config.uses_nvme(cfg):
        return 0
    swap = Path(cfg.zero.nvme_path) / "zero_stage_3"  # the only folder DeepSpeed writes there
    size = sum(f.stat().st_size for f in swap.rglob("*") if f.is_file())
    shutil.rmtree(swap, ignore_errors=True)
    return size


@task(name="finetune", cache_policy=NO_CACHE)
def run_finetune(ctx: StageContext, cfg: FinetuneConfig) -> StageOutput:
    cmd, env, out, port = prepare(ctx, cfg)
    try:
        res = ctx.launch(cmd, name="finetune", env=env, timeout=cfg.timeout_s)
    finally:
        if port:
            remove_shm_segments(port)
    r = res.result(events.FinetuneResult)
    swap_bytes = clear_nvme_swap(cfg)
    m = finalize(out, ctx, cfg, r)
    before, after = r.before, r.after
    metric = events.FinetuneSpec.model_validate_json((Path(ctx.work_dir) / "finetune_spec.json").read_bytes()).gate_metric
    ev, eval_check = gate_eval(ctx, cfg, out, metric, before, after)
    metric_events = res.metrics()
    last = metric_events[-1] if metric_events else {}
    return StageOutput(
        output=out, engine="deepspeed", backend=f"ZeRO-{cfg.zero.stage} x{r.world_size} "
                                                f"{cfg.resolved_device()} {cfg.precision}",
        gate=verify.report(verify.integrity(out) + [eval_check]),
        metrics={"loss_first": metric_events[0].get(events.TRAIN_LOSS) if metric_events else None,
                 "loss_last": last.get(events.TRAIN_LOSS),
                 **heldout_metrics(before, after), **gates.lm_eval_metrics(ev),
                 "overlong_dropped": r.overlong_dropped, "overlong_truncated": r.overlong_truncated,
                 **({"packed_windows": r.packed_windows, "packed_fill": r.packed_fill} if cfg.packing else {}),
                 "peak_mem_mib": last.get(events.PEAK_MEM_MIB, r.peak_mem_mib),
                 "peak_reserved_mib": r.peak_reserved_mib,
                 "resumed_from_step": r.resumed_from,
                 "last_step_time_s": last.get(events.STEP_TIME_S), "last_tokens_per_s": last.get(events.TOKENS_PER_S),
                 "wall_s": round(res.seconds, 2),
                 **({"nvme_swap_bytes": swap_bytes} if ds_config.uses_nvme(cfg) else {})},
        eval=ev,
        extra={"zero": m["extra"]["deepspeed_config"]["zero_optimization"], "deepspeed_config":
               m["extra"]["deepspeed_config"], "tag": m["extra"]["tag"], "samples": r.samples})
