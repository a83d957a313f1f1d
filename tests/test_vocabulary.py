"""One vocabulary: a shared key has the same type and meaning in every training stage, old names are refused with the
new one, and every `baton` command line in the README resolves as written (`baton config`, nothing launched)."""
from __future__ import annotations

import re
import shlex

import pytest

from conftest import REPO, TINY, cli

pytestmark = pytest.mark.fast


def _training_models():
    from tasks.finetune.config import FinetuneConfig
    from tasks.pretrain.config import PretrainConfig
    from tasks.rlhf.config import RlhfConfig

    return {"pretrain": PretrainConfig, "rlhf": RlhfConfig, "finetune": FinetuneConfig}


@pytest.mark.parametrize("stage", ["pretrain", "rlhf", "finetune"])
def test_every_shared_key_has_one_type_in_every_stage(stage):
    from tasks.vocabulary import TrainingConfig

    model = _training_models()[stage]
    assert issubclass(model, TrainingConfig)
    for key, base in TrainingConfig.model_fields.items():
        field = model.model_fields[key]
        assert field.annotation == base.annotation, f"{stage}.{key}: {field.annotation} vs {base.annotation}"
        for c in base.metadata:  # bounds (ge/gt) mean the same everywhere
            assert c in field.metadata, f"{stage}.{key}: lost the bound {c}"


def test_no_stage_keeps_an_old_name_and_every_old_name_points_to_a_real_key():
    from flows.config import PipelineConfig

    for section, info in PipelineConfig.model_fields.items():
        model = info.annotation
        renamed = getattr(model, "renamed", {})
        for old, new in renamed.items():
            assert old not in model.model_fields, f"{section}.{old} is both a key and a renamed key"
            assert new in model.model_fields, f"{section}.{old} is renamed to {new}, which is not a key"


@pytest.mark.parametrize("override, message", [
    ("pretrain.save_interval=5", "pretrain.save_interval: renamed to checkpoint_every"),
    ("pretrain.train_iters=50", "pretrain.train_iters: renamed to steps"),
    ("pretrain.lr_decay_style=cosine", "pretrain.lr_decay_style: renamed to lr_schedule"),
    ("pretrain.clip_grad=1.0", "pretrain.clip_grad: renamed to grad_clip"),
    ("pretrain.seq_length=64", "pretrain.seq_length: renamed to max_seq_length"),
    ("rlhf.learning_rate=1e-4", "rlhf.learning_rate: renamed to lr"),
    ("rlhf.batch_size=4", "rlhf.batch_size: renamed to micro_batch_size"),
    ("rlhf.grad_accum=2", "rlhf.grad_accum: renamed to gradient_accumulation_steps"),
    ("rlhf.nproc=2", "rlhf.nproc: renamed to nproc_per_node"),
    ("rlhf.max_length=64", "rlhf.max_length: renamed to max_seq_length"),
    ("finetune.processes=2", "finetune.processes: renamed to nproc_per_node"),
    ("serve.dtype=float32", "serve.dtype: renamed to precision"),
    ("serve.lm_eval.timeout=60", "serve.lm_eval.timeout: renamed to timeout_s"),
])
def test_an_old_key_is_refused_with_its_new_name(override, message):
    from flows.config import ConfigError, load

    with pytest.raises(ConfigError) as e:
        load(TINY, [override])
    assert message in str(e.value)


def test_batch_sizes_derive_each_other_and_disagreement_is_named():
    from flows.config import ConfigError, load

    cfg = load(TINY, ["finetune.micro_batch_size=4", "finetune.global_batch_size=32"])
    assert cfg.finetune.accumulation() == 4 and cfg.finetune.global_batch() == 32  # 4 × 2 ranks × 4
    cfg = load(TINY, ["finetune.micro_batch_size=4", "finetune.gradient_accumulation_steps=3"])
    assert cfg.finetune.global_batch() == 24
    with pytest.raises(ConfigError, match="disagrees with micro_batch_size"):
        load(TINY, ["finetune.micro_batch_size=4", "finetune.global_batch_size=32",
                    "finetune.gradient_accumulation_steps=3"])


def _readme_baton_commands() -> list[list[str]]:
    """`baton run …` lines of the code blocks of the README and the docs pages (the cheap-to-check ones: everything
    resolves offline)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    blocks = [b for page in pages for b in re.findall(r"```(?:bash)?\n(.*?)```", page.read_text(), flags=re.S)]
    out = []
    for block in blocks:
        for line in block.splitlines():
            line = line.split("  #", 1)[0].strip()
            m = re.match(r"(?:\.venv/bin/)?baton run (.*)", line)
            if m:
                out.append(shlex.split(m.group(1)))
    return out


def test_every_readme_run_command_resolves(baton_home):
    commands = _readme_baton_commands()
    assert len(commands) >= 3
    for args in commands:
        args = [a for a in args if a != "--no-cache"]
        if "--from" in args:  # a folder or a registered model of the reader's; everything else must resolve
            i = args.index("--from")
            args = args[:i] + args[i + 2:]
        r = cli("config", *args, home=baton_home)
        assert r.returncode == 0, f"baton config {' '.join(args)}:\n{r.stderr}"
        assert "# planned steps:" in r.stdout


def test_baton_config_prints_the_plan_and_launches_nothing(baton_home):
    r = cli("config", str(TINY), "--stages", "data,pretrain,convert", "--set", "pretrain.steps=50",
              home=baton_home)
    assert r.returncode == 0, r.stderr
    assert "steps: 50" in r.stdout
    assert re.search(r"convert-megatron-to-hf\s+megatron-dist -> hf-safetensors\s+[0-9a-f]{12}\s+to run", r.stdout)
    assert not (baton_home / "runs").exists()
