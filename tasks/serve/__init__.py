from tasks.serve.config import ServeConfig
from tasks.stage import StageSpec

STAGE = StageSpec(
    name="serve",
    config_model=ServeConfig,
    task="tasks.serve.task:run_serve",
    consumes=lambda cfg: "hf-safetensors",
    produces=lambda cfg: None,
    description="vLLM / SGLang OpenAI-compatible serving, smoke checks, promotion",
)
