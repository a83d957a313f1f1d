"""GGUF export: llama.cpp's own converter in the llamacpp runtime (worker.py), then the gate in
conversions.gguf_export before anything is published. A relay stage (task.py: `export:` in a run config, after
finetune) and a command on any HF checkpoint (`baton export`, run.py)."""
from conversions.manifest import Format
from tasks.export.config import ExportConfig
from tasks.stage import StageSpec

STAGE = StageSpec(
    name="export",
    config_model=ExportConfig,
    task="tasks.export.task:run_export",
    consumes=lambda cfg: Format.HF_SAFETENSORS,
    produces=lambda cfg: None,  # the GGUF files are side outputs: the next stage reads the HF checkpoint
    side_format=lambda cfg: Format.GGUF_FILE,  # ... unless it consumes GGUF: then the first type's file
    runtimes=lambda cfg: {"main", "llamacpp"},  # the converter; the gate reads both files in the main runtime
    smoke=lambda cfg: {"types": cfg.types[:1], "max_logit_rms": {k: v for k, v in cfg.max_logit_rms.items()
                                                                  if k in cfg.types[:1]}},
    description="GGUF files for llama.cpp / Ollama (llama.cpp's converter), gated against the HF checkpoint",
)
