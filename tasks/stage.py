"""What every stage plugs into: its spec (config model, formats, Prefect task), the context it runs in, its output.

A stage module `tasks/<name>/__init__.py` exposes `STAGE = StageSpec(...)`. Config models are imported eagerly (cheap,
so bad configs fail in well under a second); the Prefect task is imported only when the stage runs.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Callable, ClassVar, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Tag, model_validator
from pydantic_core import PydanticCustomError

from conversions import sealed
from tasks.problems import ConfigProblem

REPO_ROOT = Path(__file__).resolve().parent.parent


# Every worker process (training engines, converters, servers): offline hubs, no advisory chatter, unbuffered output.
WORKER_QUIET_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
                    "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def training_engine_env(device: str) -> dict:
    """What a training or conversion engine adds: one OpenMP thread per rank (the ranks share the cores; servers keep
    theirs), and on CPU no TorchDynamo (compiling costs more than it saves there)."""
    return {"OMP_NUM_THREADS": "1", **({"TORCHDYNAMO_DISABLE": "1"} if device == "cpu" else {})}


class Status(StrEnum):
    """A step's (and a run's) state in summary.json, the run index and the terminal view."""

    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    CACHED = "cached"         # an identical earlier step's output reused
    FAILED = "failed"
    CANCELLED = "cancelled"   # stopped from outside: Prefect's cancel, a SIGTERM, Ctrl-C
    SKIPPED = "skipped"       # not run: an earlier step failed or was cancelled
    CRASHED = "crashed"       # the run's process died; found and recorded by a later run


class Failure(StrEnum):
    """Why a stage failed (its summary entry's `failure`): what the terminal shows and what retraining decides on."""

    REFUSED = "refused"   # something the user handed us was refused (conversions.refusal.Refused): its one line
    GATE = "gate"         # the stage ran and its gate said no: the checks that failed
    NO_ROOM = "no room"   # not started: not enough free disk for what it would write
    ENGINE = "engine"     # the engine's processes failed: their cause and the log tail
    BUG = "bug"           # an exception inside baton: the traceback, in the step log


class Why(StrEnum):
    """Why a step ran or was reused: its summary entry's `reason`, the terminal's line, `baton config`."""

    CACHED = "cached"                   # an identical earlier step's output reused
    NEW = "new"                         # no earlier completed run of this step under this config name
    CODE = "code changed"               # a file the step's code reaches (detail: the files)
    CONFIG = "config changed"           # (detail: the keys)
    ENGINE = "engine changed"           # a runtime's pinned packages or configured interpreter (detail: runtimes)
    FILE = "file changed"               # a file or folder the config names, that the step runs or reads (detail: keys)
    INPUT = "input changed"             # the input checkpoint or the data (detail: which)
    RESUMED = "resumed"                 # an earlier attempt of this very step did not finish: its work folder continues
    OUTPUT_CHANGED = "output changed"   # the earlier output is gone or no longer verifies
    CACHE_OFF = "cache off"             # baton run --no-cache
    ALWAYS_RUNS = "always runs"         # a stage with side effects (serving) is never reused


@dataclass(frozen=True)
class Reason:
    why: Why
    detail: tuple[str, ...] = ()

    def text(self) -> str:
        return f"{self.why} ({', '.join(self.detail)})" if self.detail else str(self.why)

    def to_dict(self) -> dict:
        return {"why": self.why.value, "detail": list(self.detail)}

    @classmethod
    def from_dict(cls, d: dict) -> "Reason":
        return cls(Why(d["why"]), tuple(d.get("detail") or ()))


def reasons_text(reasons: list[dict]) -> str:
    """A summary entry's `reason` list as one phrase: 'code changed (tasks/rlhf/rewards.py); config changed (rlhf.lr)'."""
    return "; ".join(Reason.from_dict(r).text() for r in reasons or [])


class StrictModel(BaseModel):
    """Config models reject unknown keys and re-validate on assignment (so --set overrides are checked too).
    `renamed` maps keys a model used to accept to their new names: an old key fails with "renamed to …"."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    renamed: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_renamed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old in data:
                if old in cls.renamed:
                    raise PydanticCustomError("renamed", "{old}: renamed to {new}",
                                              {"old": old, "new": cls.renamed[old]})
        return data


UNION_TAGS = ("<one>", "<list>")  # what pydantic puts in an error's loc for a one_or_list field: left out of keys


def one_or_list(model: type[BaseModel]):
    """A config field that takes one `model` or a list of them (e.g. data.sft: one source, or several mixed)."""
    return Annotated[Union[Annotated[model, Tag(UNION_TAGS[0])], Annotated[list[model], Tag(UNION_TAGS[1])]],
                     Discriminator(lambda v: UNION_TAGS[1] if isinstance(v, list) else UNION_TAGS[0])]


def error_key(loc: tuple) -> str:
    """A pydantic error location as the config key a user writes: `data.sft[1].columns`."""
    key = ""
    for part in loc:
        if part in UNION_TAGS:
            continue
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
    return key


class StageRole(StrEnum):
    """What a stage is to the chain planner, so the planner asks the stage rather than naming it."""

    DATA = "data"           # builds the datasets every later stage reads; added to a chain that lacks it
    CONVERT = "convert"     # converts a checkpoint between formats; inserted where two neighbours' formats differ
    MODEL = "model"         # reads and/or writes a checkpoint (training, serving)


@dataclass(frozen=True)
class StageSpec:
    name: str
    config_model: type[StrictModel]
    task: str                                   # "module:function", a Prefect task taking (ctx, cfg)
    consumes: Callable[[Any], str | None]       # checkpoint format the stage reads (None: no checkpoint input)
    produces: Callable[[Any], str | None]       # checkpoint format it writes (None: no checkpoint)
    # format of the checkpoints it writes beside the relay (StageOutput.side_outputs; None: none): a later stage that
    # consumes this format, where the relay carries another, reads the first of them
    side_format: Callable[[Any], str | None] = lambda cfg: None
    input_required: bool = True                 # False: runs without an input checkpoint (e.g. pretrain from scratch)
    validate: Callable[[Any, Any], list[ConfigProblem]] = lambda cfg, pipeline: []  # found before anything launches
    validate_host: Callable[[Any, Any], list[ConfigProblem]] = lambda cfg, pipeline: []  # what this machine lacks
    validate_layout: Callable[[Any, Any], list[ConfigProblem]] = lambda cfg, pipeline: []  # a layout no hardware runs
    # ^ a subset of `validate`, asked by `baton plan` too (it skips the rest: it plans for other hardware)
    cacheable: bool = True                      # False: side effects (serving, promotion) make every run count
    trains: bool = False                        # a training stage: optimizer states in its checkpoints, memory and disk plans
    role: StageRole = StageRole.MODEL
    description: str = ""
    # What the pipeline and `baton doctor` ask a stage instead of naming it (defaults: nothing to say):
    chat: bool = False                          # renders conversations with the model's chat template (transformers)
    check_input: Callable[[Any, Any, dict, Path], str | None] = lambda pipeline, step, hf_config, path: None
    # ^ the input HF model's config.json against this step, before anything launches: a problem or None
    runtimes: Callable[[Any], set[str]] = lambda cfg: {"main"}  # the runtimes its processes run on
    runtime_needs: tuple[tuple[str, str], ...] = ()  # (module its runtime must have, why): checked by `baton doctor`
    ports: Callable[[Any], list[tuple[str, str, int]]] = lambda cfg: []  # (key, host, port) it binds on this host
    advice: Callable[[Any], list] = lambda cfg: []  # its `baton doctor` findings (tasks.problems.Finding)
    smoke: Callable[[Any], dict] = lambda cfg: {}  # its keys at smoke size, beyond the training stages' shared ones
    batch_probe: str = ""                       # "module:function" (ctx, cfg, micro) -> (cmd, env, port): `baton batch`
    after: str | None = None                    # a plug-in stage: the stage it follows in the chain order
    memory: Any = None                          # a training stage's tasks.memory_model.MemoryModel: plans, disk

    def load_task(self):
        return self.load(self.task)

    @staticmethod
    def load(ref: str):
        """A "module:function" reference's function (imported when the stage needs it, not when it registers)."""
        mod, fn = ref.split(":")
        return getattr(importlib.import_module(mod), fn)


@dataclass
class StageContext:
    """Everything a stage task needs, as plain data (it crosses Prefect task boundaries)."""

    stage: str
    run_id: str
    run_dir: Path
    work_dir: Path                              # this stage's own folder: outputs and engine checkpoints
    model: dict                                 # architecture (pipeline `model:` section)
    seed: int
    data_dir: Path | None = None                # the data stage's output
    input: Path | None = None                   # input checkpoint folder
    input_format: str | None = None
    runtimes: dict = field(default_factory=dict)
    mlflow_run_id: str | None = None
    tracking: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)   # e.g. convert: from/to formats, source stage

    def architecture(self) -> dict:
        """The model section as manifests record it: without model.chat_template (a tokenizer matter)."""
        return {k: v for k, v in self.model.items() if k != "chat_template"}

    def python(self, runtime: str = "main") -> str:
        from tasks.runtimes import python_for

        return python_for(runtime, self.runtimes)

    def worker_env(self, **more) -> dict:
        """Environment for worker processes: this checkout importable (workers import `conversions`), quiet hubs."""
        env = {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            **WORKER_QUIET_ENV,
            sealed.KEY_ENV: str(sealed.ensure_key()),  # the path only: workers seal and check their checkpoints
        }
        env.update({k: str(v) for k, v in more.items()})
        return env

    def runtime_env(self, runtime: str = "main") -> dict:
        """The `runtimes.<name>.env` the user set for this runtime (tokens included: the process needs them)."""
        return {k: str(v) for k, v in ((self.runtimes or {}).get(runtime) or {}).get("env", {}).items()}

    def launch(self, cmd: list[str], *, name: str | None = None, env: dict | None = None, timeout: float | None = None,
               cwd: Path | None = None, runtime: str = "main"):
        """Run a worker command on `runtime` with that runtime's env: logs stream to Prefect and <work_dir>/engine.log,
        metrics to this stage's MLflow run."""
        from tasks.streaming import launch_streaming

        return launch_streaming(self, cmd, name=name or self.stage,
                                env=self.worker_env(**{**self.runtime_env(runtime), **(env or {})}),
                                timeout=timeout, cwd=cwd)


@dataclass
class StageOutput:
    output: Path | None                         # checkpoint folder (with a manifest) or None
    engine: str
    backend: str = ""
    gate: dict = field(default_factory=lambda: {"passed": True, "checks": []})
    metrics: dict = field(default_factory=dict)  # summary metrics: loss_first, loss_last, ...
    eval: dict | None = None                     # {"metric", "before", "after"}
    history: dict = field(default_factory=dict)  # metric name -> [(step, value)] for plots
    extra: dict = field(default_factory=dict)
    # Checkpoints written beside the relay, by variant (export: one GGUF folder per type, each with its manifest): each
    # registered as its own model version (alias: the variant) once the gate passed, checked again before a reuse. The
    # next stage still reads `output`, or this stage's input when that is None.
    side_outputs: dict[str, Path] = field(default_factory=dict)
    # Files for people beside the metrics (e.g. a plot of a mixture's expert load): logged to the stage's MLflow run.
    artifacts: list[Path] = field(default_factory=list)

