"""User-facing flows, one per stage, for deployments: each takes its stage's pydantic config as a parameter, so the
Prefect UI's "Run" form is typed and validated field by field, exactly like the YAML section of `baton run`.

Each runs the composite pipeline's body in its own flow run (stage subflows, conversions, gates, MLflow runs tagged
with this flow run's id), restricted to its stage; the data stage it needs is added and usually comes from cache.
"""
from __future__ import annotations

from prefect import flow

from flows.config import ConfigError, ModelConfig, PipelineConfig, TrackingConfig
from flows.pipeline import pipeline
from tasks.convert.config import ConvertConfig
from tasks.data.config import DataConfig
from tasks.export.config import ExportConfig
from tasks.finetune.config import FinetuneConfig
from tasks.pretrain.config import PretrainConfig
from tasks.registry import DATA_STAGE
from tasks.rlhf.config import RlhfConfig
from tasks.serve.config import ServeConfig


def run_stage(stage: str, stage_config, *, model: ModelConfig, data: DataConfig, tracking: TrackingConfig, seed: int,
              from_ref: str | None, use_cache: bool) -> dict:
    sections = {"model": model, "data": data, "tracking": tracking, "seed": seed}
    if stage != DATA_STAGE:
        sections[stage] = stage_config
    cfg = PipelineConfig(name=f"{stage}-flow", stages=[stage], **sections)
    errors = cfg.validate_stages()
    if errors:
        raise ConfigError("invalid parameters:\n" + "\n".join(f"  {e}" for e in errors))
    return pipeline.fn(cfg, from_ref=from_ref, use_cache=use_cache)


@flow(name="baton-data", log_prints=True)
def data_flow(data: DataConfig = DataConfig(), model: ModelConfig = ModelConfig(),
              tracking: TrackingConfig = TrackingConfig(), seed: int = 0, use_cache: bool = True) -> dict:
    """Build the datasets and the tokenizer (a new `data.revision` marks new data for scheduled retraining)."""
    return run_stage("data", data, model=model, data=data, tracking=tracking, seed=seed, from_ref=None,
                     use_cache=use_cache)


@flow(name="baton-pretrain", log_prints=True)
def pretrain_flow(pretrain: PretrainConfig = PretrainConfig(), model: ModelConfig = ModelConfig(),
                  data: DataConfig = DataConfig(), tracking: TrackingConfig = TrackingConfig(), seed: int = 0,
                  from_ref: str | None = None, use_cache: bool = True) -> dict:
    """Megatron-Core pretraining from scratch (or from a Megatron checkpoint), then conversion to HF."""
    return run_stage("pretrain", pretrain, model=model, data=data, tracking=tracking, seed=seed, from_ref=from_ref,
                     use_cache=use_cache)


@flow(name="baton-rlhf", log_prints=True)
def rlhf_flow(rlhf: RlhfConfig = RlhfConfig(), from_ref: str | None = None, model: ModelConfig = ModelConfig(),
              data: DataConfig = DataConfig(), tracking: TrackingConfig = TrackingConfig(), seed: int = 0,
              use_cache: bool = True) -> dict:
    """Preference optimisation of an HF checkpoint (folder or name@alias; default: the last pretrain output)."""
    return run_stage("rlhf", rlhf, model=model, data=data, tracking=tracking, seed=seed, from_ref=from_ref,
                     use_cache=use_cache)


@flow(name="baton-finetune", log_prints=True)
def finetune_flow(finetune: FinetuneConfig = FinetuneConfig(), from_ref: str | None = None,
                  model: ModelConfig = ModelConfig(), data: DataConfig = DataConfig(),
                  tracking: TrackingConfig = TrackingConfig(), seed: int = 0, use_cache: bool = True) -> dict:
    """DeepSpeed ZeRO fine-tuning of an HF checkpoint, then conversion back to HF."""
    return run_stage("finetune", finetune, model=model, data=data, tracking=tracking, seed=seed, from_ref=from_ref,
                     use_cache=use_cache)


@flow(name="baton-export", log_prints=True)
def export_flow(export: ExportConfig = ExportConfig(), from_ref: str | None = None, model: ModelConfig = ModelConfig(),
                data: DataConfig = DataConfig(), tracking: TrackingConfig = TrackingConfig(), seed: int = 0,
                use_cache: bool = True) -> dict:
    """GGUF files for llama.cpp / Ollama of an HF checkpoint (folder or name@alias), each gated against it and
    registered as its own model version (`<model>-gguf-file@<type>`)."""
    return run_stage("export", export, model=model, data=data, tracking=tracking, seed=seed, from_ref=from_ref,
                     use_cache=use_cache)


@flow(name="baton-serve", log_prints=True)
def serve_flow(serve: ServeConfig = ServeConfig(), from_ref: str | None = None, model: ModelConfig = ModelConfig(),
               data: DataConfig = DataConfig(), tracking: TrackingConfig = TrackingConfig(), seed: int = 0) -> dict:
    """Serve an HF checkpoint with vLLM / SGLang, smoke-test it and promote it to `champion`."""
    return run_stage("serve", serve, model=model, data=data, tracking=tracking, seed=seed, from_ref=from_ref,
                     use_cache=False)


@flow(name="baton-convert", log_prints=True)
def convert_flow(source: str, convert: ConvertConfig = ConvertConfig(), model: ModelConfig = ModelConfig(),
                 data: DataConfig = DataConfig(), tracking: TrackingConfig = TrackingConfig(), seed: int = 0,
                 use_cache: bool = True) -> dict:
    """Convert a checkpoint (folder with a manifest, or name@alias) to `convert.to_format`, through its gate."""
    return run_stage("convert", convert, model=model, data=data, tracking=tracking, seed=seed, from_ref=source,
                     use_cache=use_cache)
