from conversions.manifest import Format
from tasks.finetune.advice import advice, ports
from tasks.finetune.config import FinetuneConfig, validate
from tasks.gates import lm_eval_path_errors
from tasks.memory_model import MemoryModel, Parallelism
from tasks.stage import StageSpec


def layout_keys(layout) -> dict:
    """A planned layout as this stage's config keys."""
    return {"activation_checkpointing": layout.recompute == "full",
            "zero": {"stage": layout.zero_stage, "offload_optimizer": "cpu" if layout.offload_optimizer else "none",
                     "offload_params": "cpu" if layout.offload_params else "none"}}


STAGE = StageSpec(
    name="finetune",
    trains=True,
    memory=MemoryModel("deepspeed", Parallelism.ZERO, recomputes=("none", "full"), config_keys=layout_keys),
    config_model=FinetuneConfig,
    task="tasks.finetune.task:run_finetune",
    consumes=lambda cfg: Format.HF_SAFETENSORS,
    produces=lambda cfg: Format.DEEPSPEED_ZERO,
    validate=validate,
    validate_host=lambda cfg, pipeline: lm_eval_path_errors(cfg.gate, "finetune"),
    chat=True,
    batch_probe="tasks.finetune.batch_probe:probe",
    advice=advice,
    ports=ports,
    description="DeepSpeed ZeRO supervised fine-tuning",
)
