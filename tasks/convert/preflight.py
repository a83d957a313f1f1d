"""The convert step's check of the input model, before anything launches: HF → Megatron maps the Llama family and
Qwen2, each as the family the config's model section must name (the pretrain stage builds Megatron's GPT from it)."""
from __future__ import annotations

from pathlib import Path

from conversions.manifest import Format


def check_input(pipeline, step, config: dict, input_path: Path) -> str | None:
    if step.produces != Format.MEGATRON_DIST:
        return None
    from conversions import megatron

    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    where = f"stage '{step.label}': architecture {archs}"
    if not megatron.mapped_architectures(config):
        return f"{where} does not convert to Megatron (baton maps {', '.join(megatron.FROM_HF_ARCHITECTURES)} only)"
    if problem := megatron.from_hf_problem(config):
        return f"stage '{step.label}': {problem}"
    family = megatron.hf_family(config)
    if family != pipeline.model.arch:
        return (f"{where} is the {family} family, the config's model.arch is {pipeline.model.arch} (set "
                f"model.arch: {family})")
    return None
