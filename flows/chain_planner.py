"""The chain planner: a config becomes an ordered list of steps, its stages plus a convert step wherever two
neighbours' formats differ.

Each step has a fingerprint: the digest of its facts, what determines its output (its resolved config, the code it
runs: every project file its stage's task module reaches, found by flows.step_code; the engines it runs on: each
runtime's lock digest or the interpreter configured instead; the user files the config names
that it runs or reads: a reward function, a chat template, a task folder; its input's fingerprint and the data's). A step
whose fingerprint already completed is not re-run; an interrupted one is resumed in the same work folder, so the engine
picks up its latest checkpoint. When a step does run, `why_run` says why: what changed since the last completed run of
the same step under the same config name (the run index keeps its facts).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from conversions.manifest import Format
from flows import step_code
from flows.config import ConfigError, PipelineConfig
from tasks import chat_template
from tasks.registry import CHAIN_ORDER, CONVERT_STAGE, DATA_STAGE, STAGES
from tasks.runtimes import engine_facts
from tasks.stage import REPO_ROOT, Reason, StageRole, Status, Why

@dataclass
class Step:
    name: str                        # stage name ("convert" for conversions)
    label: str                       # unique within the run, e.g. "pretrain", "convert-megatron-to-hf"
    consumes: str | None
    produces: str | None
    source_stage: str | None = None  # convert: the stage whose output it converts
    implicit: bool = False           # added by the planner (conversion, or the data the stages need)
    fingerprint: str = ""
    input_fingerprint: str | None = None
    extra: dict = field(default_factory=dict)
    facts: dict = field(default_factory=dict)  # what the fingerprint digests: config, code, files, input (chain_planner)
    reads_side_of: str | None = None  # the earlier step whose first side output is its input (not the relay's)

    def to_dict(self) -> dict:
        return asdict(self)


def _short(fmt: str) -> str:
    return {Format.HF_SAFETENSORS: "hf", Format.MEGATRON_DIST: "megatron", Format.DEEPSPEED_ZERO: "zero"}.get(fmt, fmt)


def _convert(src_fmt: str, dst_fmt: str, source_stage: str | None, implicit: bool) -> Step:
    return Step(CONVERT_STAGE, f"{CONVERT_STAGE}-{_short(src_fmt)}-to-{_short(dst_fmt)}", src_fmt, dst_fmt, source_stage,
                implicit, extra={"from_format": src_fmt, "to_format": dst_fmt, "source_stage": source_stage})


def _role(stage: str) -> StageRole:
    return STAGES[stage].role


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def build_steps(cfg: PipelineConfig, stages: list[str], input_format: str | None) -> list[Step]:
    steps: list[Step] = []
    current = input_format
    prev_stage = None
    sides: dict[str, str] = {}  # format -> the latest step writing side outputs of it
    for s in stages:
        spec = STAGES[s]
        scfg = cfg.stage_config(s)
        if spec.role == StageRole.DATA:
            steps.append(Step(s, s, None, spec.produces(scfg)))
            continue
        if spec.role == StageRole.CONVERT:
            target = spec.produces(scfg)
            if current is None:
                raise ConfigError(f"stages: '{s}' has no checkpoint to convert (no earlier stage, no --from)")
            steps.append(_convert(current, target, prev_stage, implicit=False))
            current, prev_stage = target, s
            continue
        want = spec.consumes(scfg)
        side_of = sides.get(want) if want != current else None
        if side_of is None and current is not None and want is not None and current != want:
            steps.append(_convert(current, want, prev_stage, implicit=True))
            current = want
        steps.append(Step(s, s, want, spec.produces(scfg), reads_side_of=side_of))
        current = spec.produces(scfg) or current
        prev_stage = s
        if (side := spec.side_format(scfg)) is not None:
            sides[side] = s
    if current not in (None, Format.HF_SAFETENSORS, Format.DATASET):
        steps.append(_convert(current, Format.HF_SAFETENSORS, prev_stage, implicit=True))
    labels: dict[str, int] = {}
    for st in steps:  # make labels unique when the same conversion appears twice
        n = labels.get(st.label, 0)
        labels[st.label] = n + 1
        if n:
            st.label = f"{st.label}-{n + 1}"
    return steps


def flat(obj, key: str = "") -> dict:
    """A config as {dotted key: value} (`rlhf.lr`, `data.sft[1].train`), so a change names its key."""
    if isinstance(obj, dict) and obj:
        return {k: v for name, item in obj.items() for k, v in flat(item, f"{key}.{name}" if key else str(name)).items()}
    if isinstance(obj, (list, tuple)) and obj:
        return {k: v for i, item in enumerate(obj) for k, v in flat(item, f"{key}[{i}]").items()}
    return {key: obj}


def stage_code(name: str, root: Path) -> dict[str, str]:
    """{file: sha256} of the code a stage's step runs: the project files its task module reaches (flows.step_code)."""
    return step_code.closure(root, [STAGES[name].task.split(":")[0]])


def _template_file(cfg: PipelineConfig) -> dict:
    """The chat template as fingerprints see it: its text (the value, or the file it names), not its path."""
    return {chat_template.KEY: chat_template.digest(cfg.model.chat_template)} if cfg.model.chat_template else {}


def data_facts(cfg: PipelineConfig, root: Path, input_format: str | None, input_fingerprint: str | None) -> dict:
    """The data step's config and code, the contents of every file its sources match, and the input checkpoint when
    its tokenizer is used (an HF input and data.tokenizer not 'train')."""
    from tasks.data.digest import file_digests

    data = cfg.stage_config(DATA_STAGE)
    from_model = input_format == Format.HF_SAFETENSORS and data.tokenizer != "train"
    return {"config": flat({DATA_STAGE: data.model_dump(mode="json"), "model.vocab_size": cfg.model.vocab_size,
                            "seed": cfg.seed}),
            "code": stage_code(DATA_STAGE, root),
            "engines": engine_facts(STAGES[DATA_STAGE].runtimes(data), cfg.engine_runtimes(), root),
            "files": dict(file_digests(data)) | (_template_file(cfg) if from_model else {}),
            "input": {"checkpoint": input_fingerprint if from_model else None}}


def step_facts(cfg: PipelineConfig, st: Step, root: Path, data_fp: str, prev: str | None) -> dict:
    """What determines a step's output: its resolved config, the code it runs, the user files it runs or reads and
    its inputs' fingerprints. The fingerprint is their digest; the summary names what changed between two of them."""
    scfg = cfg.stage_config(st.name)
    config = {st.name: {**scfg.model_dump(mode="json"), **st.extra}, "model": cfg.model.model_dump(mode="json"),
              "seed": cfg.seed}
    return {"config": flat(config),
            "code": stage_code(st.name, root),
            "engines": engine_facts(STAGES[st.name].runtimes(scfg), cfg.engine_runtimes(), root),
            "files": step_code.user_files(scfg, st.name) | _template_file(cfg),
            "input": {"checkpoint": prev, "data": data_fp}}


def fingerprint_steps(cfg: PipelineConfig, steps: list[Step], input_fingerprint: str | None,
                      input_format: str | None = None, root: Path = REPO_ROOT) -> None:
    """Each step's facts and fingerprint; `root`: the project tree whose code the steps run (a test's copy)."""
    data = data_facts(cfg, root, input_format, input_fingerprint)
    data_fp = _hash([DATA_STAGE, data])
    prev = input_fingerprint
    done: dict[str, str] = {}  # label -> fingerprint, for a step that reads an earlier one's side output
    for st in steps:
        if _role(st.name) == StageRole.DATA:
            st.facts, st.fingerprint = data, data_fp
            continue
        st.input_fingerprint = done[st.reads_side_of] if st.reads_side_of else prev
        st.facts = step_facts(cfg, st, root, data_fp, st.input_fingerprint)
        st.fingerprint = done[st.label] = _hash([st.name, st.facts])
        if st.produces is not None:
            prev = st.fingerprint


# ---- why a step runs or is reused -----------------------------------------------------------------------------------
def _changed(old: dict, new: dict) -> tuple[str, ...]:
    return tuple(sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k)))


def changes(old: dict | None, new: dict) -> list[Reason]:
    """What differs between a step's earlier facts and its current ones, one reason per kind of change."""
    if not old:
        return [Reason(Why.NEW)]
    found = [Reason(why, detail) for why, part in ((Why.CODE, "code"), (Why.ENGINE, "engines"), (Why.CONFIG, "config"),
                                                    (Why.FILE, "files"), (Why.INPUT, "input"))
             if (detail := _changed(old.get(part) or {}, new.get(part) or {}))]
    return found or [Reason(Why.NEW)]


def why_run(step: Step, record: dict | None, last_facts: dict | None, use_cache: bool) -> list[Reason]:
    """Why `step` runs rather than being reused. `record`: the index's record of its fingerprint; `last_facts`: those
    of the last completed run of the same step under the same config name."""
    if not STAGES[step.name].cacheable:
        return [Reason(Why.ALWAYS_RUNS)]
    if not use_cache:
        return [Reason(Why.CACHE_OFF)]
    status = (record or {}).get("status")
    if status == Status.COMPLETED:
        return [Reason(Why.OUTPUT_CHANGED)]
    if status in (Status.RUNNING, Status.FAILED, Status.CANCELLED):
        return [Reason(Why.RESUMED)]
    return changes(last_facts, step.facts)


def plan(cfg: PipelineConfig, input_format: str | None = None, input_fingerprint: str | None = None,
         root: Path = REPO_ROOT) -> list[Step]:
    """Steps for cfg.stages. The data stage is added (usually cached) when a later stage needs it."""
    stages = list(cfg.stages)
    if DATA_STAGE not in stages:
        stages = [DATA_STAGE] + stages
    steps = build_steps(cfg, stages, input_format)
    if DATA_STAGE not in cfg.stages:
        steps[0].implicit = True
    fingerprint_steps(cfg, steps, input_fingerprint, input_format, root)
    return steps


def predecessor(cfg: PipelineConfig) -> Step | None:
    """When a run starts mid-chain without --from: the step of the full chain whose output it continues from."""
    listed = [s for s in cfg.stages if _role(s) != StageRole.DATA]
    if not listed:
        return None
    full = build_steps(cfg, CHAIN_ORDER, None)
    fingerprint_steps(cfg, full, None)
    # an explicit convert starts from the raw output of the stage before the next one
    if _role(listed[0]) == StageRole.CONVERT:
        nxt = next((s for s in listed if _role(s) != StageRole.CONVERT), None)
        end = next((i for i, s in enumerate(full) if s.name == nxt), len(full))
        prior = [s for s in full[:end] if _role(s.name) == StageRole.MODEL]
    else:
        idx = next(i for i, s in enumerate(full) if s.name == listed[0])
        prior = [s for s in full[:idx] if _role(s.name) != StageRole.DATA and s.produces is not None]
    return prior[-1] if prior else None
