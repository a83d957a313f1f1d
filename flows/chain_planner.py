"""The chain planner: a config becomes an ordered list of steps, its stages plus a convert step wherever two
neighbours' formats differ.

Each step has a fingerprint: a hash of what determines its output (its config, the model, the data, its input's
fingerprint, and the code of the stage). A step whose fingerprint already completed is not re-run; an interrupted one
is resumed in the same work folder, so the engine picks up its latest checkpoint.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from conversions.manifest import Format
from conversions.registry import CONVERTERS, supported
from flows.config import ConfigError, PipelineConfig
from tasks import chat_template
from tasks.registry import DEFAULT_CHAIN, STAGES
from tasks.stage import REPO_ROOT

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

    def to_dict(self) -> dict:
        return asdict(self)


def _short(fmt: str) -> str:
    return {Format.HF_SAFETENSORS: "hf", Format.MEGATRON_DIST: "megatron", Format.DEEPSPEED_ZERO: "zero"}.get(fmt, fmt)


def _convert(src_fmt: str, dst_fmt: str, source_stage: str | None, implicit: bool) -> Step:
    return Step("convert", f"convert-{_short(src_fmt)}-to-{_short(dst_fmt)}", src_fmt, dst_fmt, source_stage, implicit,
                extra={"from_format": src_fmt, "to_format": dst_fmt, "source_stage": source_stage})


CORE_CODE = ("conversions/manifest.py", "conversions/hf.py", "conversions/probe.py", "conversions/verify.py",
             "tasks/events.py", "conversions/chat.py", "tasks/launch.py", "tasks/stage.py", "tasks/gates.py")
STAGE_CODE = {"rlhf": ("tasks/serve/lm_eval_worker.py",), "finetune": ("tasks/serve/lm_eval_worker.py",)}  # gate.metric lm_eval


def _code_digest(*paths: str) -> str:
    h = hashlib.sha256()
    for d in paths:
        p = REPO_ROOT / d
        for f in sorted(p.rglob("*.py")) if p.is_dir() else ([p] if p.exists() else []):
            h.update(f.relative_to(REPO_ROOT).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def build_steps(cfg: PipelineConfig, stages: list[str], input_format: str | None) -> list[Step]:
    steps: list[Step] = []
    current = input_format
    prev_stage = None
    for s in stages:
        spec = STAGES[s]
        scfg = cfg.stage_config(s)
        if s == "data":
            steps.append(Step("data", "data", None, Format.DATASET))
            continue
        if s == "convert":
            target = cfg.convert.to_format
            if current is None:
                raise ConfigError("stages: 'convert' has no checkpoint to convert (no earlier stage, no --from)")
            steps.append(_convert(current, target, prev_stage, implicit=False))
            current, prev_stage = target, "convert"
            continue
        want = spec.consumes(scfg)
        if current is not None and want is not None and current != want:
            steps.append(_convert(current, want, prev_stage, implicit=True))
            current = want
        steps.append(Step(s, s, want, spec.produces(scfg)))
        current = spec.produces(scfg) or current
        prev_stage = s
    if current not in (None, Format.HF_SAFETENSORS, Format.DATASET):
        steps.append(_convert(current, Format.HF_SAFETENSORS, prev_stage, implicit=True))
    labels: dict[str, int] = {}
    for st in steps:  # make labels unique when the same conversion appears twice
        n = labels.get(st.label, 0)
        labels[st.label] = n + 1
        if n:
            st.label = f"{st.label}-{n + 1}"
    return steps


def data_fingerprint(cfg: PipelineConfig, common: str, input_format: str | None, input_fingerprint: str | None) -> str:
    """The data step's config and code, the contents of every file its sources match, and the input checkpoint when
    its tokenizer is used (an HF input and data.tokenizer not 'train')."""
    from tasks.data.digest import file_digests

    from_model = input_format == Format.HF_SAFETENSORS and cfg.data.tokenizer != "train"
    tokenizer_from = [input_fingerprint, chat_template.digest(cfg.model.chat_template)] if from_model else None
    return _hash(["data", cfg.data.model_dump(), cfg.model.vocab_size, cfg.seed, _code_digest("tasks/data"), common,
                  file_digests(cfg.data), tokenizer_from])


def model_facts(cfg: PipelineConfig) -> dict:
    """The model section as fingerprints see it: a template file's contents, not just its path."""
    return {**cfg.model.model_dump(), "chat_template": chat_template.digest(cfg.model.chat_template)}


def fingerprint_steps(cfg: PipelineConfig, steps: list[Step], input_fingerprint: str | None,
                      input_format: str | None = None) -> None:
    common = _code_digest(*CORE_CODE)
    data_fp = data_fingerprint(cfg, common, input_format, input_fingerprint)
    prev = input_fingerprint
    for st in steps:
        if st.name == "data":
            st.fingerprint = data_fp
            continue
        scfg = cfg.stage_config(st.name).model_dump()
        st.input_fingerprint = prev
        code = [f"tasks/{st.name}", *STAGE_CODE.get(st.name, ())]
        if st.name == "convert" and supported(st.consumes, st.produces):
            code.append(CONVERTERS[(st.consumes, st.produces)].split(":")[0].replace(".", "/") + ".py")
        st.fingerprint = _hash([st.name, st.extra, scfg, model_facts(cfg), cfg.seed, data_fp, prev,
                                _code_digest(*code), common])
        if st.produces is not None:
            prev = st.fingerprint


def plan(cfg: PipelineConfig, input_format: str | None = None, input_fingerprint: str | None = None) -> list[Step]:
    """Steps for cfg.stages. The data stage is added (usually cached) when a later stage needs it."""
    stages = list(cfg.stages)
    if "data" not in stages:
        stages = ["data"] + stages
    steps = build_steps(cfg, stages, input_format)
    if "data" not in cfg.stages:
        steps[0].implicit = True
    fingerprint_steps(cfg, steps, input_fingerprint, input_format)
    return steps


def predecessor(cfg: PipelineConfig) -> Step | None:
    """When a run starts mid-chain without --from: the step of the full chain whose output it continues from."""
    listed = [s for s in cfg.stages if s != "data"]
    if not listed:
        return None
    full = build_steps(cfg, DEFAULT_CHAIN, None)
    fingerprint_steps(cfg, full, None)
    if listed[0] == "convert":  # an explicit convert starts from the raw output of the stage before the next one
        nxt = next((s for s in listed if s != "convert"), None)
        end = next((i for i, s in enumerate(full) if s.name == nxt), len(full))
        prior = [s for s in full[:end] if s.name not in ("data", "convert")]
    else:
        idx = next(i for i, s in enumerate(full) if s.name == listed[0])
        prior = [s for s in full[:idx] if s.name != "data"]
    return prior[-1] if prior else None
