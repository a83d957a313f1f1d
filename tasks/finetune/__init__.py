from tasks.finetune.config import FinetuneConfig
from tasks.stage import StageSpec

STAGE = StageSpec(
    name="finetune",
    config_model=FinetuneConfig,
    task="tasks.finetune.task:run_finetune",
    consumes=lambda cfg: "hf-safetensors",
    produces=lambda cfg: "deepspeed-zero",
    description="DeepSpeed ZeRO supervised fine-tuning",
)
