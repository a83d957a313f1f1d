"""The serve step's check of the input model, before the stages before it run (rlhf and finetune keep the
architecture): the engine must run its attention on this device and load its architecture."""
from __future__ import annotations

from pathlib import Path


def check_input(pipeline, step, config: dict, input_path: Path) -> str | None:
    from tasks.runtimes import RuntimeMissing
    from tasks.serve.architectures import RegistryUnreadable, unservable
    from tasks.serve.engines import vllm_cpu_head_dim_problem

    serve = pipeline.stage_config(step.name)
    if serve.engine == "llamacpp":
        return None  # it serves the GGUF file an earlier stage wrote: that stage's converter decides what it reads
    if problem := vllm_cpu_head_dim_problem(serve, config):
        return f"serve.engine {serve.engine} on serve.device cpu: {problem}"
    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    try:
        problem = unservable(serve.engines(), archs, pipeline.engine_runtimes())
    except RuntimeMissing:
        return None  # the serve stage's runtime check says so (and `baton doctor` before it)
    except RegistryUnreadable as e:
        problem = str(e)
    return f"stage '{step.label}' (serve.engine {serve.engine}): {problem}" if problem else None
