"""The run config: one YAML file, validated into PipelineConfig before anything launches.

Unknown keys and wrong values fail with one message naming the key; `--set a.b=c` overrides are validated the same way.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BeforeValidator, Field, create_model, SecretStr, ValidationError, field_validator, model_validator

from conversions.refusal import Refused
from tasks import chat_template, paths, secrets
from tasks.convert.config import ConvertConfig
from tasks.data.config import DataConfig
from tasks.export.config import ExportConfig
from tasks.finetune.config import FinetuneConfig
from tasks.pretrain.config import PretrainConfig
from tasks.problems import ConfigProblem
from tasks.registry import CHAIN_ORDER, CONVERT_STAGE, DEFAULT_CHAIN, PLUGINS, STAGES
from tasks.rlhf.config import RlhfConfig
from tasks.serve.config import ServeConfig
from tasks.stage import StrictModel, error_key


class ConfigError(Refused):
    """A config problem, reported before anything launches."""


class MoeConfig(StrictModel):
    """A mixture of experts in every layer's MLP. Megatron's and HF's names for each key: conversions.hf.MOE_NAMES."""

    num_experts: int = Field(..., ge=2, description="routed experts per layer")
    top_k: int = Field(2, ge=1, description="experts each token is routed to")
    expert_ffn_hidden_size: int | None = Field(
        None, ge=1, description="inner size of one expert's SwiGLU MLP (default: model.ffn_hidden_size)")
    shared_expert_ffn_hidden_size: int = Field(
        0, ge=0, description="inner size of a shared expert every token goes through, beside the routed ones (0: none)")
    aux_loss_coef: float = Field(0.001, ge=0, description="weight of the router's load-balancing loss in the loss")

    @model_validator(mode="after")
    def _top_k_within_experts(self):
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} is more than num_experts {self.num_experts}")
        return self

    def expert_ffn(self, model: "ModelConfig") -> int:
        return self.expert_ffn_hidden_size or model.ffn_hidden_size


class ModelConfig(StrictModel):
    """Decoder architecture, shared by every engine: a Llama-style decoder, Qwen2's (the same with q/k/v biases) or
    Qwen3's (per-head q/k norms)."""

    arch: Literal["llama", "qwen2", "qwen3"] = Field(
        "llama", description="architecture family: llama (a Llama-style decoder, what Megatron pretrains and exports "
                             "as LlamaForCausalLM, with model.moe as MixtralForCausalLM), qwen2 (the same with q/k/v "
                             "biases: Qwen2ForCausalLM) or qwen3 (per-head q/k RMSNorm: Qwen3ForCausalLM, with "
                             "model.moe Qwen3MoeForCausalLM); a run --from an HF model needs its family here")
    num_layers: int = Field(4, ge=1, description="transformer layers")
    hidden_size: int = Field(128, ge=8, description="width of the hidden states")
    num_attention_heads: int = Field(4, ge=1, description="attention (query) heads")
    num_query_groups: int = Field(2, ge=1, description="key/value heads (GQA groups); divides num_attention_heads")
    ffn_hidden_size: int = Field(344, ge=1, description="inner size of the SwiGLU MLP")
    seq_length: int = Field(128, ge=8, description="longest sequence the model takes (tokens)")
    vocab_size: int = Field(512, ge=300, description="tokenizer vocabulary size the data stage trains")
    tie_word_embeddings: bool = Field(False, description="the output layer (lm_head) shares the input embedding")
    rope_theta: float = Field(10000.0, description="RoPE base frequency")
    norm_eps: float = Field(1e-5, description="RMSNorm epsilon")
    init_std: float = Field(0.02, description="standard deviation of the random weight initialisation")
    moe: MoeConfig | None = Field(
        None, description="a mixture of experts (unset: a dense MLP): Megatron pretrains it (pretrain.expert_parallel) "
                          "and exports it as an HF Mixtral (Qwen3-MoE with arch qwen3); an HF MoE runs --from through "
                          "rlhf and finetune; `baton plan` counts its total and active parameters (docs/moe.md)")
    chat_template: str | None = Field(
        None, description="a Jinja chat template, or a path to a template file, used when the input HF checkpoint has "
                          "none: written into the tokenizer the data, rlhf and finetune stages use and their outputs")

    @field_validator("chat_template")
    @classmethod
    def _template_renders(cls, value: str | None) -> str | None:
        if value is not None:
            chat_template.check(value)
        return value

    @model_validator(mode="after")
    def _shapes(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not divisible by num_query_groups "
                             f"{self.num_query_groups}")
        return self


class TrackingConfig(StrictModel):
    experiment: str = Field("baton", description="MLflow experiment of the pipeline's runs")
    registered_model: str = Field("baton-tiny", description="MLflow registered model the gated checkpoints become "
                                                            "versions of (aliases candidate, champion)")
    upload_weights: bool = Field(False, description="also upload checkpoint weights as MLflow artifacts")

    _plain = field_validator("registered_model")(classmethod(lambda cls, v: paths.plain_name(v)))


# an env value from YAML may be a number (`OMP_NUM_THREADS: 1`): the process gets its text
EnvValue = Annotated[SecretStr, BeforeValidator(lambda v: str(v) if isinstance(v, (int, float)) else v)]


class RuntimeConfig(StrictModel):
    """Where an engine runs (README: Going multi-node). Training stages run `nnodes × nproc_per_node` ranks through
    tasks/distributed on: `local` (alias `venv`: this host), `slurm` (srun inside an allocation, else a submitted
    sbatch job) or `ray` (a Ray cluster at `address`). The python path must exist on every node (shared filesystem or
    the container image). `container`: NeMo-RL's container (runtimes.nemo_rl)."""

    kind: Literal["local", "venv", "slurm", "ray", "container"] = Field(
        "venv", description="local (alias venv): this host; slurm: srun in an allocation, else sbatch; ray: a Ray "
                            "cluster at address; container: NeMo-RL's container")
    python: str | None = Field(None, description="use this interpreter instead of the cached runtime")
    path: str | None = Field(None, description="an engine checkout (e.g. NeMo-RL) the runtime runs from")
    image: str | None = Field(None, description="the container image (slurm: pyxis --container-image)")
    nodes: int = Field(1, ge=1, description="NeMo-RL's cluster.num_nodes (training stages use their own nnodes)")
    srun_args: list[str] = Field(default_factory=list, description="slurm: extra srun flags (e.g. --partition=gpu)")
    sbatch_args: list[str] = Field(default_factory=list, description="slurm outside an allocation: extra #SBATCH lines")
    address: str | None = Field(None, description="ray: the cluster address (host:6379, ray://host:10001, or auto)")
    resources_per_node: dict[str, float] = Field(default_factory=lambda: {"CPU": 1},
                                                 description="ray: one placement-group bundle per node")
    # Values are secrets (tokens live here): Prefect's stored parameters, MLflow params, config.yaml and `baton config`
    # show '**********'; engine_spec() reveals them.
    env: dict[str, EnvValue] = Field(default_factory=dict, description="environment set on every node (GLOO/NCCL_"
                                     "SOCKET_IFNAME are found alone); values are secrets, shown as '**********'")

    def engine_spec(self) -> dict:
        """Plain data for the stage that launches an engine, env values revealed (it never crosses a Prefect
        parameter, a log or a tracking call)."""
        return {**self.model_dump(), "env": {k: v.get_secret_value() for k, v in self.env.items()}}

    @field_validator("srun_args", "sbatch_args")
    @classmethod
    def _one_line_each(cls, args: list[str]) -> list[str]:
        """Each becomes an srun argument or a whole `#SBATCH` line: a newline would start a script line of its own."""
        for a in args:
            if any(ord(ch) < 32 or ord(ch) == 127 for ch in a):
                raise ValueError(f"{a!r} holds a control character (a newline would inject a line into the job script)")
        return args

    @model_validator(mode="after")
    def _ray_needs_address(self):
        if self.kind == "ray" and not self.address:
            raise ValueError("kind ray needs address (e.g. ray-head:6379, or auto inside the cluster)")
        return self


StageName = Literal[tuple(STAGES)]  # the registered stages (plug-ins included)


class PipelineConfig(StrictModel):
    name: str = Field("tiny", description="the config's name: Prefect flow runs are `<name>-<run id>`, tagged "
                                          "config:<name>")
    seed: int = Field(0, description="random seed of every stage, part of every step's fingerprint")
    stages: list[StageName] = Field(default_factory=lambda: list(DEFAULT_CHAIN),
                                    description="the stages to run, in chain order; convert steps are inserted where "
                                                "two neighbours' checkpoint formats differ")
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    pretrain: PretrainConfig = PretrainConfig()
    rlhf: RlhfConfig = RlhfConfig()
    finetune: FinetuneConfig = FinetuneConfig()
    export: ExportConfig = ExportConfig()
    convert: ConvertConfig = ConvertConfig()
    serve: ServeConfig = ServeConfig()
    tracking: TrackingConfig = TrackingConfig()
    runtimes: dict[str, RuntimeConfig] = Field(default_factory=dict)
    smoke: bool = Field(False, description="set by `baton run --smoke`: a few steps per stage on its smallest layout; "
                                           "quality gates (eval.*, L3.generation) are reported but do not fail the stage")
    require_smoke: bool = Field(False, description="a full run refuses to start without a passing smoke run of the "
                                                   "same config (same fingerprint)")

    _plain = field_validator("name")(classmethod(lambda cls, v: paths.plain_name(v)))

    @model_validator(mode="after")
    def _stage_order(self):
        order = CHAIN_ORDER
        named = [s for s in self.stages if s != CONVERT_STAGE]
        if len(set(named)) != len(named):
            raise ValueError(f"stages {self.stages}: a stage is listed twice")
        idx = [order.index(s) for s in named]
        if idx != sorted(idx):
            raise ValueError(f"stages {self.stages}: must follow the order {order}")
        return self

    def engine_runtimes(self) -> dict[str, dict]:
        """Every runtime as plain data for the stage tasks, secrets revealed (see RuntimeConfig.engine_spec)."""
        return {k: v.engine_spec() for k, v in self.runtimes.items()}

    def stage_config(self, name: str):
        return getattr(self, name)

    def formats_before(self, name: str) -> set[str]:
        """The checkpoint formats the stages listed before `name` write, on the relay or beside it."""
        before = self.stages[:self.stages.index(name)] if name in self.stages else []
        return {fmt for s in before for fmt in (STAGES[s].produces(self.stage_config(s)),
                                                STAGES[s].side_format(self.stage_config(s))) if fmt}

    def writers(self, fmt: str) -> list[str]:
        """The registered stages that write `fmt` (on the relay or beside it) as this config sets them."""
        return [s for s in CHAIN_ORDER if fmt in (STAGES[s].produces(self.stage_config(s)),
                                                  STAGES[s].side_format(self.stage_config(s)))]

    def validate_stages(self, host: bool = True) -> list[ConfigProblem]:
        """Cross-field checks each stage declares (e.g. heads divisible by TP), run before anything launches; `host`:
        also what this machine must have to launch it (False when the stages run elsewhere, e.g. `baton k8s`)."""
        errors = paths.config_errors(self, host) + secrets.command_line_errors(self)
        for name in self.stages:
            errors += STAGES[name].validate(self.stage_config(name), self)
            if host:
                errors += STAGES[name].validate_host(self.stage_config(name), self)
        return errors


if PLUGINS:  # a plug-in stage's section beside the built-in ones (`example: {...}` in a run config)
    PipelineConfig = create_model("PipelineConfig", __base__=PipelineConfig, __module__=__name__,  # noqa: F811
                                  **{s.name: (s.config_model, s.config_model()) for s in PLUGINS})


# Keys that decide what program a run launches or what code it imports, beyond the engines baton picks: a runtime's
# interpreter, checkout, image, environment (PYTHONPATH...) and cluster; extra engine flags (vLLM's --worker-cls imports
# any class); lm-eval task folders (`!function` imports the Python beside them); NeMo-RL overrides (Hydra `_target_`).
LAUNCH_KEYS = ("runtimes", "serve.engine_args", "serve.lm_eval.include_path", "rlhf.nemo_rl.overrides")
ALLOW_LAUNCH_PARAMETERS = "BATON_ALLOW_LAUNCH_PARAMETERS"


def _setting(cfg: PipelineConfig, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def launch_parameter_error(cfg: PipelineConfig) -> str | None:
    """Why a deployment run refuses this config (None: it sets no launch-shaping key, or the worker's environment has
    BATON_ALLOW_LAUNCH_PARAMETERS=1). Whoever may start a flow run with parameters is not thereby allowed to choose the
    program the work pool's worker runs: only whoever starts that worker is."""
    if os.environ.get(ALLOW_LAUNCH_PARAMETERS) == "1":
        return None
    given = [f"runtimes.{name}" for name in cfg.runtimes]
    given += [k for k in LAUNCH_KEYS[1:] if _setting(cfg, k) not in (None, {}, [])]
    if not given:
        return None
    return (f"parameters set {', '.join(given)}: these decide what program the run launches, and a deployment run "
            "does not take them from its parameters (the work pool's owner allows it by starting the worker with "
            f"{ALLOW_LAUNCH_PARAMETERS}=1 in its environment)")


def _format_error(e: ValidationError, prefix: str = "") -> str:
    lines = []
    for err in e.errors():
        key = error_key(err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "renamed":
            key = ".".join(filter(None, [key if err["loc"] else "", err["ctx"]["old"]]))
            msg = f"renamed to {err['ctx']['new']}"
        elif "input" in err and not isinstance(err["input"], (dict, list)):
            msg += f" (got {err['input']!r})"
        lines.append(f"{prefix}{key}: {msg}")
    return "\n".join(lines)


def _parse_value(text: str):
    return yaml.safe_load(text) if text != "" else ""


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value (e.g. pretrain.steps=20)")
        key, value = item.split("=", 1)
        parts = re.sub(r"\[(\d+)\]", r".\1", key.strip()).split(".")  # data.sft[1].train == data.sft.1.train
        node = raw
        for p in parts[:-1]:
            node = _section(node, p, key)
        try:
            parsed = _parse_value(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {key}: not a YAML value: {str(e).splitlines()[0]}") from None
        except RecursionError:
            raise ConfigError(f"--set {key}: nested too deeply to be a config value") from None
        if isinstance(node, list):
            node[_list_index(node, parts[-1], key)] = parsed
        else:
            node[parts[-1]] = parsed
    return raw


def _list_index(node: list, part: str, key: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"--set {key}: {part} is not an index of that list (0..{len(node) - 1})")
    return int(part)


def _section(node, part: str, key: str):
    """One step down an override's key: a mapping's section (made if absent) or a list's item (a list of sources)."""
    if isinstance(node, list):
        node = node[_list_index(node, part, key)]
    else:
        node = node.setdefault(part, {})
    if not isinstance(node, (dict, list)):
        raise ConfigError(f"--set {key}: {part} is not a section")
    return node


def load(path: str | Path | None, overrides: list[str] | None = None, stages: list[str] | None = None,
         host: bool = True, check_stages: bool = True) -> PipelineConfig:
    """The validated config. `host=False` skips the checks against this machine (the cluster's nodes host the ranks);
    `check_stages=False` skips the stages' cross-field checks too (planning for other hardware)."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"{p}: no such config file")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: invalid YAML: {e}") from e
        except RecursionError:  # a crafted file nests lists thousands deep
            raise ConfigError(f"{p}: nested too deeply to be a config") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: expected a mapping at the top level")
    raw = apply_overrides(raw, overrides or [])
    if stages is not None:
        raw["stages"] = stages
    try:
        cfg = PipelineConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"invalid config {path or ''}:\n" + _format_error(e, "  ")) from None
    errors = cfg.validate_stages(host) if check_stages else []
    if errors:
        raise ConfigError(f"invalid config {path or ''}:\n" + "\n".join(f"  {e}" for e in errors))
    return cfg
