from tasks.finetune.config import FinetuneConfig, validate
from tasks.stage import StageSpec

STAGE = StageSpec(
    name="finetune",
    trains=True,
    config_model=FinetuneConfig,
    task="tasks.finetune.task:run_finetune",
    consumes=lambda cfg: "hf-safetensors",
    produces=lambda cfg: "deepspeed-zero",
    validate=validate,
    description="DeepSpeed ZeRO supervised fine-tuning",
)
