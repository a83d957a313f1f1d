"""The worker contract: a worker reads one JSON spec (`worker.py --spec SPEC.json`, written by its stage task from
the stage's config model: defaults live only there) and prints structured lines the launcher streams into MLflow and
Prefect; its one `result` event, a typed model below, is what the stage task reads back (LaunchResult.result).

    @@baton {"kind": "metric", "step": 3, "train/loss": 2.31, "train/lr": 0.001}
    @@baton {"kind": "progress", "step": 3, "total": 100}
    @@baton {"kind": "start", "resumed_from": 0}          (where training starts: a log landmark, read by nothing)
    @@baton {"kind": "result", ...}            (the run's facts, once, at the end: FinetuneResult, RlhfResult, ...)
    @@baton {"kind": "failure", "cause": "non-finite loss", "detail": "..."}    (a cause the worker found itself)

Plain lines are ordinary logs. Only rank 0 should emit events in a distributed job.
The result models live here, not in tasks/<stage>/: a worker imports only conversions, this module and its engine, and
importing its stage package would load the stage's config and Prefect-side modules into the engine's processes.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
from enum import StrEnum
from pathlib import Path

from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from conversions import durable
from conversions.refusal import Refused

PREFIX = "@@baton "
SpecT = TypeVar("SpecT", bound=BaseModel)

# ---- metric names (README "Metric names") ---------------------------------------------------------------------------
# <group>/<quantity>[_<unit>]. MLflow's chart view groups metrics by the part before '/' (`system/` is MLflow's own);
# each stage is its own MLflow run, so the stage is never part of a name. Units are suffixes: _s, _per_s, _mib,
# _bytes; none for losses, rates, ratios and counts. One name per quantity, in every stage.
GROUPS = {"train": "the optimisation loop, one point per step",
          "eval": "held-out measurements (step 0 is the input checkpoint)",
          "perf": "speed and memory, one point per step",
          "summary": "one value per stage, logged when it ends (step 0)"}
TRAIN_LOSS = "train/loss"
TRAIN_LR = "train/lr"
TRAIN_GRAD_NORM = "train/grad_norm"
TRAIN_ROUTER_AUX_LOSS = "train/router_aux_loss"
TRAIN_EXPERT_LOAD_IMBALANCE = "train/expert_load_imbalance"
STEP_TIME_S = "perf/step_time_s"
TOKENS_PER_S = "perf/tokens_per_s"
MFU = "perf/mfu"
ROLLOUT_TIME_S = "perf/rollout_time_s"
ROLLOUT_TOKENS_PER_S = "perf/rollout_tokens_per_s"
ROLLOUT_SHARE = "perf/rollout_share"
ROLLOUT_LOGP_DIFF = "train/rollout_logp_diff"
PEAK_MEM_MIB = "perf/peak_mem_mib"
HELDOUT_LOSS = "eval/heldout_loss"
HELDOUT_PPL = "eval/heldout_ppl"

# name (a `<...>` part stands for any lower-case word or number) → (unit, what it is); the README lists the same
METRICS = {
    TRAIN_LOSS: ("", "training loss of the step (mean over ranks; TRL's own loss in rlhf)"),
    TRAIN_LR: ("", "learning rate of the step"),
    TRAIN_GRAD_NORM: ("", "gradient norm (pretrain, rlhf)"),
    TRAIN_ROUTER_AUX_LOSS: ("", "a mixture of experts' router load-balancing loss, before its coefficient: "
                                "finetune and rlhf (train/loss includes it times router_aux_loss_coef; in rlhf TRL's "
                                "own), pretrain (Megatron's, "
                                "mean over MoE layers; train/loss is the language-model loss alone)"),
    TRAIN_EXPERT_LOAD_IMBALANCE: ("ratio", "pretrain of a mixture of experts: tokens routed to the step's busiest "
                                           "expert over the mean per expert, in the worst layer (1 is even, "
                                           "num_experts all to one)"),
    "train/<trl_log>": ("", "rlhf: TRL's other logs, '/' → '_' (train/rewards_margins, train/logps_chosen, ...)"),
    STEP_TIME_S: ("s", "wall time of the optimizer step"),
    TOKENS_PER_S: ("tokens/s", "training tokens per second, all ranks together"),
    MFU: ("ratio", "model FLOPs utilisation (pretrain)"),
    ROLLOUT_TIME_S: ("s", "rlhf GRPO: time of the step's rollouts (generation), part of perf/step_time_s"),
    ROLLOUT_TOKENS_PER_S: ("tokens/s", "rlhf GRPO: completion tokens generated per second of rollout"),
    ROLLOUT_SHARE: ("ratio", "rlhf GRPO: the share of step time spent generating rollouts"),
    ROLLOUT_LOGP_DIFF: ("nats/token", "rlhf GRPO with rollout_engine vllm: mean |engine - trainer| log-prob of the "
                                      "sampled tokens (TRL's sampling/sampling_logp_difference/mean)"),
    PEAK_MEM_MIB: ("MiB", "peak memory of the busiest rank so far: GPU allocated, or RSS on CPU (finetune)"),
    "perf/rank<n>_peak_mem_mib": ("MiB", "the same, per rank (finetune)"),
    HELDOUT_LOSS: ("", "held-out loss (pretrain: every eval_interval; rlhf: before and after)"),
    HELDOUT_PPL: ("", "held-out perplexity (pretrain)"),
    "eval/heldout_pref_accuracy": ("ratio", "rlhf policy: held-out pairs whose chosen completion scores higher"),
    "eval/heldout_reward_accuracy": ("ratio", "rlhf reward model: the same, scored by the reward model"),
    "eval/heldout_kl_to_reference": ("nats/token", "rlhf policy: KL to the reference model on held-out completions"),
    "eval/champion_score": ("", "retrain decision run: the champion on the new held-out set"),
    "eval/candidate_score": ("", "retrain decision run: the candidate on the same held-out set"),
    "perf/probe_peak_mem_mib": ("MiB", "batch-finder run: the peak of each probe (step = micro batch size)"),
    "perf/<benchmark_measurement>": ("per name", "benchmark runs (experiment baton-benchmarks), e.g. "
                                                 "perf/tiny_hf_safetensors_baton_warm_s"),
    "summary/<fact>": ("per name", "a stage's end-of-run facts, the keys of summary.json `metrics` (loss_first, "
                                   "wall_s, ...)"),
}
_NAME = re.compile(r"^(train|eval|perf|summary)/[a-z][a-z0-9_]*$")
_RETIRED_UNITS = re.compile(r"(^|_)(mb|gb|seconds|secs|sec|ms)($|_)")
_NEEDS_UNIT = {"time": (re.compile(r"(^|_)(time|wall|duration|latency|ttft)($|_)"), ("_s",)),
               "memory": (re.compile(r"(^|_)(mem|rss|allocated|reserved|swap)($|_)"), ("_mib", "_bytes"))}


def name_problem(name: str) -> str | None:
    """Why a metric name breaks the scheme above (None: it follows it)."""
    if not _NAME.match(name):
        return f"{name!r}: not <{'|'.join(GROUPS)}>/<lower_snake_case>"
    quantity = name.split("/", 1)[1]
    if _RETIRED_UNITS.search(quantity):
        return f"{name!r}: units are _s, _per_s, _mib or _bytes"
    for kind, (pattern, units) in _NEEDS_UNIT.items():
        if pattern.search(quantity) and not quantity.endswith(units):
            return f"{name!r}: a {kind} ends with {' or '.join(units)}"
    return None


def checked(name: str) -> str:
    problem = name_problem(name)
    if problem:
        raise ValueError(f"metric name {problem} (tasks/events.py)")
    return name


def summary_name(fact: str) -> str:
    """A stage's end-of-run fact (a key of its summary.json `metrics`) as an MLflow metric name."""
    return checked(f"summary/{fact}")


def write_spec(path: Path, spec: dict | BaseModel) -> Path:
    """The spec a stage task hands its worker (atomic: a worker never reads half of one). A typed spec is validated
    here, when it is built, and again by the worker that reads it (read_typed_spec): one model, both sides."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = spec.model_dump_json(indent=2) if isinstance(spec, BaseModel) else json.dumps(spec, indent=2)
    return durable.write_text(path, body + "\n")


def inline_spec_args(spec: BaseModel) -> list[str]:
    """A typed spec on the command line, for a launcher that starts a program on another host (a Slurm or Ray node),
    where no file of this host can be read. Its values travel in the clear: a spec given this way holds no secret."""
    return ["--spec-json", spec.model_dump_json()]


def _spec_source(argv: list[str] | None) -> tuple[str, bytes]:
    """(where the spec came from, its JSON): the file of `--spec`, or the text of `--spec-json` (inline_spec_args)."""
    ap = argparse.ArgumentParser()
    given = ap.add_mutually_exclusive_group(required=True)
    given.add_argument("--spec", type=Path)
    given.add_argument("--spec-json")
    ap.add_argument("--local_rank", type=int, default=None)  # the deepspeed launcher adds it; the spec is what counts
    a = ap.parse_args(argv)
    return (str(a.spec), a.spec.read_bytes()) if a.spec is not None else ("--spec-json", a.spec_json.encode())


def read_typed_spec(model: type[SpecT], argv: list[str] | None = None) -> SpecT:
    """A launched program's typed spec from `--spec SPEC.json` (or `--spec-json`); a spec its model refuses ends the
    program with one line naming the file and the fields (a writer of another baton version, or a hand-edited file)."""
    where, body = _spec_source(argv)
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        fields = ", ".join(".".join(map(str, err["loc"])) or "(the whole spec)" for err in e.errors())
        raise SystemExit(f"{where}: not a valid {model.__name__} ({fields})") from None


class ProgramSpec(BaseModel):
    """What a program baton launches reads, whole, from its spec file. No field has a default: every value comes from
    a config model (where the defaults live), so a program and the config can never disagree. Unknown fields are
    refused on both sides, like WorkerResult."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class LmEvalServer(ProgramSpec):
    base_url: str
    model: str                                 # the served model name
    key_file: Path                             # 0600; read into OPENAI_API_KEY, never on a command line
    num_concurrent: int
    out: Path                                  # lm-eval's own results JSON


class LmEvalLocal(ProgramSpec):
    checkpoints: dict[str, Path]               # label (before, after) → folder; another format is converted to HF
    device: str
    batch_size: int                            # documents per forward pass
    scratch: Path | None                       # where those conversions go (None: a temporary folder)


class LmEvalSpec(ProgramSpec):
    """tasks/serve/lm_eval_worker.py: a live server, or local checkpoints (the training stages' gate)."""

    tasks: list[str]
    include_path: Path | None
    limit: int | None
    server: LmEvalServer | None
    local: LmEvalLocal | None

    @model_validator(mode="after")
    def _one_mode(self):
        if (self.server is None) == (self.local is None):
            raise ValueError("give either server or local")
        return self


class SupervisorSpec(ProgramSpec):
    """tasks/serve/supervisor.py: watch one detached engine server (serve.keep_alive, retrain's promoted server)."""

    name: str
    log: Path
    state: Path
    url: str
    restarts: int
    health_timeout_s: float
    cmd: list[str]                             # the engine's command line (secrets come through BATON_REDACT)


class ConvertSpec(ProgramSpec):
    """tasks/convert/worker.py: one checkpoint conversion (the pipeline's convert step and `baton convert`)."""

    src: Path
    dst: Path
    to_format: str
    from_format: str | None                    # None: the source's manifest says
    max_shard_size_mb: int
    stage: str                                 # recorded in the output's manifest
    require_seal: bool                         # a training stage of this run sealed the source


class ExportSpec(ProgramSpec):
    """tasks/export/worker.py: llama.cpp's HF -> GGUF converter on one HF checkpoint (`baton export`)."""

    src: Path                                  # the HF folder
    out: Path                                  # the GGUF file to write
    out_type: str                              # llama.cpp's --outtype: f16, q8_0
    quantize: str | None                       # llama-quantize's type (Q4_K_M, ...) applied to the converter's f16


class QuantizeSpec(ProgramSpec):
    """tasks/export/quantize_worker.py: llm-compressor's one-shot quantization of one HF checkpoint to a
    compressed-tensors folder for vLLM, calibrated on rows of the run's own data, and the held-out loss of the source
    and of the written folder (read back from disk)."""

    src: Path                                  # the HF folder
    out: Path                                  # the compressed-tensors folder to write
    scheme: str                                # llm-compressor's preset scheme: W8A8, W4A16
    calibration: Path                          # a jsonl of {"text": ...} rows (the data stage's pretrain train split)
    calibration_rows: int
    heldout: Path                              # a jsonl of {"text": ...} rows the calibration never saw
    heldout_rows: int
    max_seq_length: int


class FinetuneSpec(ProgramSpec):
    """tasks/finetune/worker.py: paths as the worker sees them. probe: the batch finder's run (training steps only:
    no evaluation, no checkpoint)."""

    input: Path
    data_dir: Path
    output: Path
    ds_config: Path
    device: str
    seed: int
    steps: int
    checkpoint_every: int
    keep_checkpoints: int
    max_seq_length: int
    eval_max_new_tokens: int
    zero_init: bool
    activation_checkpointing: bool
    log_every: int
    lora: dict                                 # finetune.lora as its config dumps it (enabled, r, lora_alpha, ...)
    gate_metric: str
    overlong: str
    packing: bool
    eval_batch_size: int
    chat_template: Path | None                 # model.chat_template, for an input without one
    probe: bool


class RewardSpec(ProgramSpec):
    """One rlhf.rewards entry as the rlhf worker builds it (tasks.rlhf.rewards.build); a user function travels as the
    text of its file (path, name, source: None for the built-in kinds), read and checked once by the task."""

    kind: str
    weight: float
    extract: str
    answer_field: str
    pattern: str | None
    json_schema: dict | None
    min_chars: int | None
    max_chars: int | None
    code: str
    tests_field: str
    timeout_s: float
    memory_mb: int
    isolation: str
    path: str | None
    name: str | None
    source: str | None


class EnvironmentSpec(ProgramSpec):
    """rlhf.environment as the worker runs it: the text of its file, read and checked once by the task."""

    path: str
    name: str
    source: str


class RlhfSpec(ProgramSpec):
    """tasks/rlhf/worker.py: TRL's run (or, evaluate, only the held-out measurement of an output trained elsewhere),
    every value from the rlhf config (tasks.rlhf.task.worker_spec)."""

    input: Path
    data: Path                                 # the data stage's folder
    output: Path
    algorithm: str                             # dpo, rm, grpo
    steps: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    lr: float
    lr_schedule: str
    warmup_steps: int
    grad_clip: float
    weight_decay: float
    precision: str
    beta: float
    max_seq_length: int
    overlong: str
    sft_weight: float
    reference: str
    reference_model: Path | None
    num_generations: int
    max_completion_length: int
    temperature: float                         # grpo: rollout sampling temperature
    rollout_engine: str                        # hf or vllm
    rollout_engine_python: str | None          # vllm: the vllm runtime's python, which serves the rollouts
    dataset: str                               # preference or prompts
    rewards: list[RewardSpec]
    tools: list[str]                           # rlhf.tools: multi-turn episodes when not empty
    environment: EnvironmentSpec | None        # rlhf.environment: multi-turn episodes too
    max_turns: int
    tool_timeout_s: float
    clip_epsilon: float
    clip_epsilon_high: float | None
    loss_type: str
    scale_rewards: str
    seed: int
    dataloader_workers: int
    checkpoint_every: int
    keep_checkpoints: int
    stage: str                                 # recorded in the output's manifest
    chat_template: Path | None                 # model.chat_template, for an input without one
    evaluate: bool


class PretrainTraining(ProgramSpec):
    """The pretrain config's values the Megatron worker reads (global_batch_size resolved)."""

    tensor_parallel: int
    pipeline_parallel: int
    virtual_pipeline_parallel: int | None
    expert_parallel: int
    expert_tensor_parallel: int                # resolved: tensor_parallel when the config leaves it out
    moe_token_dispatcher: str
    micro_batch_size: int
    global_batch_size: int
    steps: int
    lr: float
    min_lr: float
    lr_schedule: str
    warmup_steps: int
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    grad_clip: float
    precision: str
    recompute_granularity: str
    distributed_optimizer: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    sequence_parallel: bool
    eval_interval: int
    eval_iters: int
    checkpoint_every: int
    keep_checkpoints: int
    transformer_impl: str
    attention: str
    fp8: str
    profile_steps: list[int]
    peak_tflops_per_rank: float | None


class PretrainSpec(ProgramSpec):
    """tasks/pretrain/worker.py, on every rank: resolved and checked by tasks.pretrain.task.build_spec. probe: the
    batch finder's run (training steps only)."""

    config: PretrainTraining
    architecture: dict                         # the model's, as checkpoint manifests record it (conversions.megatron)
    padded_vocab_size: int
    seq_length: int
    seed: int
    device: str
    data_dir: Path
    work_dir: Path
    input: Path | None                         # a checkpoint to start from (None: from scratch)
    probe: bool


class SglProgramSpec(ProgramSpec):
    """tasks/serve/sgl_program.py: SGLang's frontend language against the live server."""

    url: str
    key_file: Path
    n: int                                     # parallel forks of the program


def emit(kind: str, **fields) -> None:
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in fields.items()}
    sys.stdout.write(PREFIX + json.dumps({"kind": kind, **clean}, default=str) + "\n")
    sys.stdout.flush()


def metric(step: int, values: dict) -> None:
    """One step's metrics, named by the scheme above (a name outside it is a bug: it raises)."""
    emit("metric", step=step, **{checked(k): float(v) for k, v in values.items()})


def progress(step: int, total: int) -> None:
    emit("progress", step=step, total=total)


def started(resumed_from: int) -> None:
    """Where training starts (0, or the step of the checkpoint it resumed from): marks the attempt in the log."""
    emit("start", resumed_from=resumed_from)


# ---- results: one typed `result` event per run, emitted by rank 0 at the end --------------------------------------
class WorkerResult(BaseModel):
    """A worker's final facts. Unknown fields are refused on both sides: a worker and its stage task that disagree
    fail on the first run, naming the field. Floats that may be non-finite are optional (emit writes NaN as null)."""

    model_config = ConfigDict(extra="forbid")


class FinetuneResult(WorkerResult):
    before: dict[str, float | None]            # held-out facts of the input: heldout_loss, exact_match
    after: dict[str, float | None]             # the same of the trained model
    samples: list[dict[str, str]]              # a few held-out prompts, answers and greedy outputs
    resumed_from: int
    tag: str                                   # the final checkpoint's tag folder
    steps: int
    world_size: int
    zero_stage: int
    train_examples: int
    overlong_dropped: int
    overlong_truncated: int
    packed_windows: int | None = None          # packing only
    packed_fill: float | None = None
    timings: dict[str, float]                  # start-up phases and training, seconds
    peak_mem_mib: float | None
    peak_reserved_mib: float | None            # CUDA's caching allocator at its peak (None on CPU)


class RlhfResult(WorkerResult):
    """rlhf's worker: a TRL run, or (evaluate only) the measurement of another engine's output."""

    algorithm: str
    metric: str                                # heldout_pref_accuracy, heldout_reward_accuracy, heldout_reward
    before: float | None
    after: float | None
    heldout_pairs: int | None = None
    heldout_prompts: int | None = None         # GRPO with rlhf.rewards
    heldout_kl_to_reference: float | None = None
    heldout_loss_before: float | None = None
    heldout_loss_after: float | None = None
    solved_before: float | None = None
    solved_after: float | None = None
    train_pairs: int | None = None
    train_prompts: int | None = None
    overlong_dropped: int | None = None
    overlong_truncated: int | None = None
    resumed_from: int | None = None            # training runs only, from here on
    backend: str | None = None
    steps: int | None = None
    seconds: float | None = None
    peak_mem_mib: float | None = None          # rank 0's peak RSS
    episodes: dict | None = None               # rlhf.tools: training and held-out episodes' ends, turns, tool calls


class InputParity(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_abs_diff: float
    top1_agreement: float
    reference: str


class ConvertResult(WorkerResult):
    seconds: float
    from_format: str
    to_format: str
    info: dict                                 # what the converter reported (tensors, architecture, ...)


class ExportResult(WorkerResult):
    seconds: float
    size: int                                  # bytes of the GGUF file
    converter: str                             # what wrote it: llama-cpp-python <version>'s convert_hf_to_gguf.py
                                               # (and llama-quantize <type>)
    notes: list[str]                           # how the source was read where it differs from plain (worker.py)


class QuantizeResult(WorkerResult):
    seconds: float                             # the quantization alone (loading and the losses not counted)
    size: int                                  # bytes of the written weights (*.safetensors)
    source_size: int                           # bytes of the source's weights
    quantizer: str                             # llmcompressor <version> (compressed-tensors <version>): <modifier>
    calibration_sha256: str                    # of the calibration rows' text as fed, in order
    heldout_loss_source: float                 # mean token cross-entropy on the held-out rows (nats)
    heldout_loss: float                        # the same, of the written folder read back from disk
    quantized_modules: int                     # Linear layers the written config's quantization covers


class PretrainResult(WorkerResult):
    resumed_from: int
    parameters: int
    layer_spec: str
    input_parity: InputParity | None           # an input with probe logits, reproduced by the loaded model
    iteration: int
    checkpoint: str
    output: str
    padded_vocab_size: int
    layout: dict[str, int]                     # tensor/pipeline/data parallel (and virtual pipeline) sizes
    reload_param_max_abs_diff: float | None
    reload_logits_max_abs_diff: float | None
    loss_first: float | None
    heldout_before: list[float | None] | None  # [step, loss, perplexity]
    heldout_after: list[float | None] | None
    train_time_s: float
    peak_tflops_per_rank: float
    peak_tflops_source: str
    consumed_samples: int
    memory: dict[str, float]                   # peak_mem_mib, rank<n>_peak_mem_mib, peak_gpu_allocated_mib, ...
    expert_tokens: list[list[float]] | None = None  # MoE: tokens routed to each expert, [layer][expert], whole run


class PretrainProbeResult(WorkerResult):
    """The batch finder's probe run: training steps only, then every rank's peak memory."""

    probe_steps: int
    micro_batch_size: int
    memory: dict[str, float]


def result(facts: WorkerResult) -> None:
    emit("result", **facts.model_dump(mode="json"))


# ---- failures: causes baton's own code finds in a rank, announced before the rank exits ---------------------------
# Only INFRASTRUCTURE is retried (flows/step_retries.py failure_class); everything else fails the stage at once.
class EngineCause(StrEnum):
    """Why an engine's processes failed: from a rank's `failure` event, else read from the engine's log lines."""

    INFRASTRUCTURE = "infrastructure"
    TIMEOUT = "timeout"
    OUT_OF_MEMORY = "out of memory"
    DISK_FULL = "disk full"
    NON_FINITE_LOSS = "non-finite loss"
    ERROR = "error"


class FailureEvent(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cause: EngineCause
    detail: str                                # the rank's one line: what it found, where


def failure(cause: EngineCause, detail: str) -> None:
    """Announce a cause this rank found (any rank: the one that found it). One write, so ranks never interleave."""
    line = PREFIX + json.dumps({"kind": "failure", **FailureEvent(cause=cause, detail=detail).model_dump(mode="json")})
    sys.stdout.flush()
    os.write(1, (line + "\n").encode())


@contextlib.contextmanager
def disk_full_exits(partial: Path, rank: int):
    """Around a rank's checkpoint save: on ENOSPC (durable.disk_full_names_the_disk removes the partial folder) the
    rank announces DISK_FULL, prints the disk and its free space in one write, and exits 1: not retried."""
    try:
        with durable.disk_full_names_the_disk(partial):
            yield
    except durable.DiskFullError as e:
        line = f"rank {rank}: {e}; not retried"
        failure(EngineCause.DISK_FULL, line)
        os.write(2, (line + "\n").encode())
        raise SystemExit(1) from None


@contextlib.contextmanager
def causes_announced():
    """Around a worker's main: Python's MemoryError and baton's DiskFullError (a durable write that ran out of space
    outside a checkpoint save) are announced as their cause before they propagate as they would anyway. A refusal
    (conversions.refusal.Refused: a crafted or broken input, an expected failure) prints its one line and exits 1,
    without a traceback of baton's own frames."""
    try:
        yield
    except Refused as e:
        os.write(2, (str(e).replace("\n", " ") + "\n").encode())
        raise SystemExit(1) from None
    except MemoryError as e:
        failure(EngineCause.OUT_OF_MEMORY, f"rank {os.environ.get('RANK', 0)}: MemoryError {e}".rstrip())
        raise
    except durable.DiskFullError as e:
        failure(EngineCause.DISK_FULL, str(e))
        raise


def parse(line: str) -> dict | None:
    if not line.startswith(PREFIX):
        return None
    try:
        event = json.loads(line[len(PREFIX):])
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) and "kind" in event else None
