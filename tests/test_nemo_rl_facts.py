"""The NeMo-RL facts reader (infra/facts/nemo_rl.py) on small inputs with hand-written expectations, and the facts
file laid out exactly as the reader writes it (so a re-read from the pinned checkout shows only real changes)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("nemo_rl_facts", REPO / "infra" / "facts" / "nemo_rl.py")
facts_reader = importlib.util.module_from_spec(spec)
spec.loader.exec_module(facts_reader)

RECIPE = """\
defaults: null
policy:
  train_micro_batch_size: 4
  max_total_sequence_length: 512
  optimizer:
    kwargs:
      eps: 1e-8
      betas: [0.9, 0.999]
  dynamic_batching:
    train_mb_tokens: ${mul:${policy.max_total_sequence_length}, ${policy.train_micro_batch_size}}
  tokenizer:
    name: ${policy.model_name}
  model_name: Qwen/Qwen2.5-1.5B
grpo:
  seed: null
"""


def test_recipe_keys_are_typed_by_what_they_resolve_to_with_their_text_kept():
    facts_reader.nemo_rl.register_resolvers()
    keys, raw = facts_reader.recipe_keys(RECIPE)
    assert keys == {
        "policy": "dict", "policy.train_micro_batch_size": "int", "policy.max_total_sequence_length": "int",
        "policy.optimizer": "dict", "policy.optimizer.kwargs": "dict",
        "policy.optimizer.kwargs.eps": "float",  # plain YAML would read the string "1e-8"
        "policy.optimizer.kwargs.betas": "list", "policy.dynamic_batching": "dict",
        "policy.dynamic_batching.train_mb_tokens": "int", "policy.tokenizer": "dict", "policy.tokenizer.name": "str",
        "policy.model_name": "str", "grpo": "dict", "grpo.seed": "null"}
    assert raw["policy.dynamic_batching.train_mb_tokens"] == \
        "${mul:${policy.max_total_sequence_length}, ${policy.train_micro_batch_size}}"
    assert raw["policy.optimizer.kwargs.betas"] == [0.9, 0.999]


def test_script_options_are_the_long_flags_argparse_declares():
    script = ("import argparse\np = argparse.ArgumentParser()\np.add_argument('--config', type=str)\n"
              "p.add_argument('-v')\np.add_argument('--dcp-ckpt-path', '-d')\n")
    assert facts_reader.script_options(script) == ["--config", "--dcp-ckpt-path"]
    assert facts_reader.script_options("#!/bin/bash\nsrun ray start\n") == []


def test_resolvers_are_read_from_the_registering_module():
    text = ("def register():\n    OmegaConf.register_new_resolver('add', lambda a, b: a + b)\n"
            "    OmegaConf.register_new_resolver('pow', lambda a, b: a ** b)\n")
    assert facts_reader.registered_resolvers(text) == {"add", "pow"}


def test_the_facts_file_is_laid_out_as_the_reader_writes_it():
    text = facts_reader.FACTS.read_text()
    assert facts_reader.dumps(json.loads(text)) + "\n" == text
