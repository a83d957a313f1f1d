"""`baton plan` and `baton doctor`: the operator's playbook, checked before anything launches.

Both read configs only (no Prefect, MLflow or engine import), so they answer in about a second.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import yaml

from conversions import durable
from conversions.refusal import Refused
from tasks import memory_plan as mp
from tasks.registry import STAGES, TRAINING_STAGES



def add_parsers(sub) -> None:
    add_plan_parser(sub)
    add_doctor_parser(sub)
    add_batch_parser(sub)


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="choose a parallel layout and show per-rank memory (no launch)")
    p.add_argument("config", nargs="?", help="run config: its model and stage sections are planned")
    p.add_argument("--params", type=float, help="parameter count (e.g. 8e9): a Llama-like shape is chosen")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--query-groups", type=int)
    p.add_argument("--ffn", type=int, help="MLP width (default: 3.5 × hidden, rounded to 256)")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--experts", type=int, help="a mixture of experts: routed experts per layer")
    p.add_argument("--top-k", type=int, default=2, help="with --experts: experts each token is routed to")
    p.add_argument("--expert-ffn", type=int, help="with --experts: one expert's MLP width (default: --ffn)")
    p.add_argument("--shared-ffn", type=int, default=0, help="with --experts: a shared expert's MLP width")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory-gb", type=float, help="per GPU (default: probed; 80 without a GPU)")
    p.add_argument("--cpu", action="store_true", help="plan CPU ranks sharing this machine's RAM")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--global-batch", type=int)
    p.add_argument("--stage", choices=TRAINING_STAGES, help="default: pretrain, or the config's first training stage")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--headroom", type=float, default=mp.DEFAULT_HEADROOM, help="fraction of memory left free")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--write", nargs="?", const="-", metavar="FILE",
                   help="emit the chosen stage config block (YAML) to stdout or FILE")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_plan)


class PlanInputError(Refused):
    pass


def shape_from_args(a) -> mp.Shape:
    explicit = [a.layers, a.hidden, a.heads]
    if all(v is not None for v in explicit):
        groups = a.query_groups or a.heads
        ffn = a.ffn or int(round(3.5 * a.hidden / 256) * 256)
        if a.hidden % a.heads or a.heads % groups:
            raise PlanInputError(f"--hidden {a.hidden}, --heads {a.heads}, --query-groups {groups}: hidden must be "
                                 "divisible by heads and heads by query groups")
        return mp.Shape(a.layers, a.hidden, a.heads, groups, ffn, a.vocab, **experts_from_args(a, ffn))
    if a.experts is not None:
        raise PlanInputError("--experts needs the shape: --layers, --hidden and --heads")
    if any(v is not None for v in explicit):
        raise PlanInputError("give --layers, --hidden and --heads together (or --params alone)")
    if a.params is None:
        raise PlanInputError("give a CONFIG, --params N, or --layers/--hidden/--heads")
    if a.params <= 0:
        raise PlanInputError(f"--params {a.params}: must be positive")
    return mp.shape_for_params(a.params)


def experts_from_args(a, ffn: int) -> dict:
    """Shape's mixture-of-experts fields from --experts/--top-k/--expert-ffn/--shared-ffn (none: dense)."""
    if a.experts is None:
        return {}
    if a.experts < 2 or not 1 <= a.top_k <= a.experts:
        raise PlanInputError(f"--experts {a.experts}, --top-k {a.top_k}: need at least 2 experts and 1 ≤ top-k ≤ "
                             "experts")
    return {"experts": a.experts, "top_k": a.top_k, "expert_ffn": a.expert_ffn or ffn, "shared_ffn": a.shared_ffn}


def hardware_from_args(a, nodes: int | None = None, per_node: int | None = None, device: str | None = None):
    from tasks.hardware import gpu_memory_gb, host_memory_gb

    device = device or ("cpu" if a.cpu else "cuda")
    if device == "cpu":
        memory = host_memory_gb()
    else:
        memory = a.gpu_memory_gb or gpu_memory_gb() or 80.0
    return mp.Hardware(nodes or a.nodes, per_node or a.gpus_per_node, memory, device)


def plan_from_config(a):
    """(plan of the configured layout, search result or None) for the config's training stage."""
    from flows.config import load

    cfg = load(a.config, a.set, check_stages=False)  # the plan itself checks the layout
    stage = a.stage or next((s for s in cfg.stages if s in TRAINING_STAGES), None)
    if stage is None:
        raise PlanInputError(f"{a.config}: no training stage ({', '.join(TRAINING_STAGES)}) in stages {cfg.stages}")
    sc = cfg.stage_config(stage)
    if problems := STAGES[stage].validate_layout(sc, cfg):  # e.g. an expert grid that fits no number of GPUs
        raise PlanInputError("; ".join(problems))
    device = sc.resolved_device()
    hw = hardware_from_args(a, sc.nnodes, sc.nproc_per_node, device)
    shape = mp.shape_of_model(cfg.model)
    seq = sc.max_seq_length or cfg.model.seq_length
    layout = mp.layout_of_stage(stage, sc, device)
    precision = sc.precision
    configured = mp.Plan(shape, hw, stage, seq, precision, a.headroom, mp.strategy_for(shape.params()), layout,
                         mp.breakdown(shape, layout, seq, precision, device))
    if configured.memory.total() <= configured.budget():
        return configured, None
    search = mp.plan(shape, hw, stage, seq, sc.micro_batch_size, sc.global_batch_size, precision, a.headroom)
    return configured, search


def cmd_plan(a) -> int:
    from flows.config import ConfigError

    try:
        if a.config:
            configured, search = plan_from_config(a)
        else:
            configured = None
            hw = hardware_from_args(a)
            search = mp.plan(shape_from_args(a), hw, a.stage or "pretrain", a.seq_len, a.micro_batch,
                             a.global_batch, a.precision, a.headroom)
    except (ConfigError, PlanInputError) as e:
        print(f"baton plan: {e}", file=sys.stderr)
        return 2
    chosen = search if configured is None or search is not None else configured
    if a.json:
        print(json.dumps(plan_json(configured, search), indent=2))
    else:
        if configured is not None:
            print("# the configured layout")
            print(mp.format_plan(configured))
            if search is not None:
                print(f"\n# it does not fit with {a.headroom:.0%} headroom; searching this hardware:")
        if search is not None:
            print(mp.format_plan(search))
    if chosen.layout is None:
        return 1
    if a.write:
        write_block(chosen, a.write, with_model=a.config is None)
    return 0 if configured is None or search is None else 1


def plan_json(configured, search) -> dict:
    def one(p):
        if p is None:
            return None
        return {"stage": p.stage, "strategy": p.strategy, "parameters": p.shape.params(),
                "active_parameters": p.shape.params(active=True),
                "layout": p.layout.__dict__ if p.layout else None,
                "memory_gib": p.memory.as_gib() if p.memory else None,
                "capacity_gib": p.hardware.per_rank_bytes() / mp.GiB, "reason": p.reason, "rejected": p.rejected}
    return {"configured": one(configured), "search": one(search)}


def write_block(p: mp.Plan, dest: str, with_model: bool) -> None:
    block = {**(mp.model_block(p.shape, p.seq) if with_model else {}), **mp.stage_block(p)}
    text = f"# baton plan: {p.layout.describe()}; {p.memory.total() / mp.GiB:.1f} GiB per rank estimated\n"
    text += yaml.safe_dump(block, sort_keys=False)
    if dest == "-":
        print(text, end="")
        return
    print(f"wrote {durable.write_text(Path(dest), text)}")


def add_doctor_parser(sub) -> None:
    d = sub.add_parser("doctor", help="check the environment and a config against known causes of failed runs")
    d.add_argument("config", nargs="?")
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    d.add_argument("--stages", help="comma-separated ordered subset")
    d.add_argument("--launch-command", help="also lint your own launch line, e.g. 'deepspeed train.py ...'")
    d.add_argument("--shm-dir", default="/dev/shm", help="shared-memory file system the ranks use")
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=cmd_doctor)


def cmd_doctor(a) -> int:
    from flows.cli import doctor
    from flows.config import ConfigError, load

    cfg = None
    if a.config:
        try:
            stages = [s.strip() for s in a.stages.split(",") if s.strip()] if a.stages else None
            cfg = load(a.config, a.set, stages, check_stages=False)  # stage errors come back as findings
        except ConfigError as e:
            print(f"baton doctor: {e}", file=sys.stderr)
            return 2
    found = doctor.doctor(cfg, doctor.Probe(shm_dir=Path(a.shm_dir), launch_command=a.launch_command))
    print(json.dumps(doctor.as_dicts(found), indent=2) if a.json else doctor.format_findings(found))
    return 1 if any(f.severity == "error" for f in found) else 0


def preflight(cfg) -> tuple[bool, list[dict]]:
    """`baton run`'s doctor pass: prints the findings; (ok to launch, findings as dicts for MLflow)."""
    from flows.cli import doctor

    found = doctor.doctor(cfg)
    if found:
        print(doctor.format_findings(found), file=sys.stderr)
    return not any(f.severity == "error" for f in found), doctor.as_dicts(found)


def add_batch_parser(sub) -> None:
    b = sub.add_parser("batch",
                       help="find the largest micro-batch that fits (real engine probes, doubling then bisection)")
    b.add_argument("config")
    b.add_argument("--stage", choices=[n for n, s in STAGES.items() if s.batch_probe], default="finetune")
    b.add_argument("--data-dir", required=True, help="the data stage's output (a run's data folder)")
    b.add_argument("--input", help="the stage's input checkpoint (finetune: an HF checkpoint; pretrain: optional)")
    b.add_argument("--budget-mb", type=float, help="CPU: peak RSS per rank allowed (GPU: default the device memory)")
    b.add_argument("--margin", type=float, default=0.1, help="fraction of the budget kept free")
    b.add_argument("--limit", type=int, default=1024, help="largest micro-batch tried")
    b.add_argument("--steps", type=int, default=2, help="training steps per probe")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    b.add_argument("--write", metavar="FILE", help="write the resolved config with the chosen micro_batch_size")
    b.set_defaults(fn=cmd_batch)


def batch_prober(cfg, stage: str, data_dir: Path, input_path: Path | None, scratch: Path, steps: int = 2):
    """The stage's engine prober: its context as the pipeline builds it (model, runtimes, inputs), in `scratch`."""
    from tasks import chat_template
    from tasks.batch_finder import EngineProber
    from tasks.stage import StageContext

    fmt = None if input_path is None else STAGES[stage].consumes(cfg.stage_config(stage))
    ctx = StageContext(stage=stage, run_id="batch-finder", run_dir=scratch, work_dir=scratch,
                       model=chat_template.resolved(cfg.model.model_dump()), seed=cfg.seed,
                       data_dir=Path(data_dir).resolve(), input=Path(input_path).resolve() if input_path else None,
                       input_format=fmt, runtimes=cfg.engine_runtimes())
    spec = STAGES[stage]
    if not spec.batch_probe:
        raise ValueError(f"stage {stage} declares no batch probe (StageSpec.batch_probe)")
    return EngineProber(stage, ctx, cfg.stage_config(stage), spec.load(spec.batch_probe), steps=steps)


def cmd_batch(a) -> int:
    import shutil
    import tempfile

    from flows.config import ConfigError, load
    from tasks.batch_finder import find
    from tasks.hardware import gpu_memory_gb

    try:
        cfg = load(a.config, a.set)
    except ConfigError as e:
        print(f"baton batch: {e}", file=sys.stderr)
        return 2
    device = cfg.stage_config(a.stage).resolved_device()
    budget = a.budget_mb or ((gpu_memory_gb() or 0) * 1024 if device == "cuda" else None)
    if device == "cpu" and not budget:
        print("baton batch: on CPU give --budget-mb (peak RSS per rank)", file=sys.stderr)
        return 2
    spec = STAGES[a.stage]
    if spec.input_required and not a.input:
        print(f"baton batch: {a.stage} probes need --input (the {spec.consumes(cfg.stage_config(a.stage))} checkpoint "
              "the stage starts from)", file=sys.stderr)
        return 2

    scratch = Path(tempfile.mkdtemp(prefix=f"baton-batch-{a.stage}-"))
    try:
        prober = batch_prober(cfg, a.stage, Path(a.data_dir), Path(a.input) if a.input else None, scratch, a.steps)
        chosen = find(prober, budget, a.margin, a.limit)
    except Refused as e:  # the stage's own checks refused an input, before any launch
        shutil.rmtree(scratch, ignore_errors=True)
        print(f"baton batch: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        print(f"baton batch: a probe failed: {e}\n(probe logs kept in {scratch})", file=sys.stderr)
        return 1
    shutil.rmtree(scratch, ignore_errors=True)
    chosen = _batch_compatible(cfg, a.stage, chosen)
    for m, r in sorted(prober.measured.items()):
        peak = r["gpu_peak_mb"] if device == "cuda" else r["peak_rss_mb"]
        ranks = "/".join(f"{v:.0f}" for v in r["rank_peaks_mb"])
        print(f"  micro-batch {m:>5}: " + ("out of memory" if r["oom"] else
                                          f"peak {peak:.0f} MiB (ranks {ranks}; {r['seconds']:.0f} s)"))
    if not chosen:
        print(f"baton batch: even micro-batch 1 exceeds {budget:.0f} MiB less {a.margin:.0%}", file=sys.stderr)
        return 1
    print(f"{a.stage}.micro_batch_size={chosen}  (budget {budget:.0f} MiB, margin {a.margin:.0%})")
    _log_batch_choice(cfg, a.stage, chosen, budget, a.margin, prober.measured, device)
    if a.write:
        resolved = cfg.model_dump(mode="json")
        resolved[a.stage]["micro_batch_size"] = chosen
        print(f"wrote {durable.write_text(Path(a.write), yaml.safe_dump(resolved, sort_keys=False))}")
    return 0


def _batch_compatible(cfg, stage: str, m: int) -> int:
    """The largest micro-batch ≤ m that keeps the stage's global batch valid (global = micro × DP × accumulation)."""
    from tasks.vocabulary import batch_errors

    sc = cfg.stage_config(stage)
    while m > 0 and batch_errors(sc.model_copy(update={"micro_batch_size": m}), stage):
        m -= 1
    return m


def _log_batch_choice(cfg, stage, chosen, budget, margin, measured, device) -> None:
    """One MLflow run per search: the choice, the budget and every probe."""
    from mlflow.entities import Metric

    from tasks import events, tracking

    c = tracking.client()
    run = tracking.start_run(c, cfg.tracking.experiment, f"batch-finder-{stage}", tags={"baton.stage": stage,
                                                                                         "baton.kind": "batch-finder"})
    tracking.log_params(c, run, {"stage": stage, "budget_mb": budget, "margin": margin, "device": device})
    now = int(__import__("time").time() * 1000)
    key = "gpu_peak_mb" if device == "cuda" else "peak_rss_mb"
    metrics = [Metric(events.summary_name("chosen_micro_batch_size"), chosen, now, 0)]
    probe = events.checked("perf/probe_peak_mem_mib")  # one point per probed micro batch size
    metrics += [Metric(probe, r[key] or 0.0, now, m) for m, r in sorted(measured.items())]
    c.log_batch(run, metrics=metrics)
    tracking.end_run(c, run, True)
