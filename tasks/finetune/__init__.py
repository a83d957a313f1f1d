from conversions.manifest import Format
from tasks.finetune.config import FinetuneConfig, validate
from tasks.stage import StageSpec

STAGE = StageSpec(
    name="finetune",
    trains=True,
    config_model=FinetuneConfig,
    task="tasks.finetune.task:run_finetune",
    consumes=lambda cfg: Format.HF_SAFETENSORS,
    produces=lambda cfg: Format.DEEPSPEED_ZERO,
    validate=validate,
    description="DeepSpeed ZeRO supervised fine-tuning",
)
