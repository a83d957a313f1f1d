"""The synthetic world's generator (tasks/data/synthetic.py): the default world stays what every default run was built
on, and the arithmetic world (data.prompts synthetic) states only its training sums in the pretraining text."""
from __future__ import annotations

import hashlib
import json
import re

import pytest

from tasks.data.config import DataConfig
from tasks.data.synthetic import SUM, SUMS_PER_DOC
from tasks.data.task import _texts, build_datasets
from tasks.data.tokenizer import train_tokenizer

pytestmark = pytest.mark.fast

ARITHMETIC = {"prompts": {"kind": "synthetic"}}
# Recorded from main's generator (442f6eb) before the arithmetic world had pretraining text: DataConfig()'s datasets
# (json, sorted keys) and the vocabulary and merges of the tokenizer trained on them (vocab_size 512).
DEFAULT_SETS_SHA256 = "66db0bdd0aebf258bfbc1fb6828b1a07a48db87945c8dbd899b3c3748a01806f"
DEFAULT_TOKENIZER_SHA256 = "e67d2b8a934587e82ef34d68ccd81222546ab4182466e8c034dbd13fa1ce83a6"


def sha256(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def pretraining_text(sets: dict) -> list[str]:
    train, held = sets["pretrain"]
    return [d["text"] for d in train + held]


def held_out_sums_in(docs: list[str], held: list[dict]) -> list[str]:
    """Every held-out prompt ('a+b=') that some document contains."""
    return sorted({r["prompt"][0]["content"] for r in held for d in docs if r["prompt"][0]["content"] in d})


def test_the_default_world_is_the_one_every_default_run_was_built_on(tmp_path):
    sets = build_datasets(DataConfig())[0]
    assert "prompts" not in sets and not any(re.search(r"\d", d) for d in pretraining_text(sets))
    assert sha256(sets) == DEFAULT_SETS_SHA256  # the docs, pairs and examples, so the shared random stream too
    train_tokenizer(_texts(sets), 512, tmp_path)
    model = json.loads((tmp_path / "tokenizer.json").read_text())["model"]
    assert sha256([model["vocab"], model["merges"]]) == DEFAULT_TOKENIZER_SHA256


def test_the_arithmetic_world_is_the_default_one_plus_sentences_of_sums():
    default, arithmetic = build_datasets(DataConfig())[0], build_datasets(DataConfig(**ARITHMETIC))[0]
    assert arithmetic["preference"] == default["preference"] and arithmetic["sft"] == default["sft"]
    docs = pretraining_text(arithmetic)
    assert all(SUMS_PER_DOC[0] <= len(SUM.findall(d)) <= SUMS_PER_DOC[1] for d in docs)
    lines = [line for d in docs for line in d.split("\n")]  # a sum on a line of its own, as in the prompt
    assert all(SUM.fullmatch(line) or not re.search(r"\d", line) for line in lines)
    words_only = [" ".join(line for line in d.split("\n") if not SUM.fullmatch(line)) for d in docs]
    assert words_only == pretraining_text(default)


@pytest.mark.parametrize("seed, heldout_fraction", [(0, 0.15), (1, 0.15), (7, 0.3)])
def test_no_held_out_sum_is_ever_in_the_pretraining_text(seed, heldout_fraction):
    sets = build_datasets(DataConfig(seed=seed, heldout_fraction=heldout_fraction, **ARITHMETIC))[0]
    train_prompts, held = sets["prompts"]
    docs = pretraining_text(sets)
    assert held and held_out_sums_in(docs, held) == []
    stated = {s.split("=")[0] + "=" for d in docs for s in SUM.findall(d)}
    assert stated == {r["prompt"][0]["content"] for r in train_prompts}  # every training sum, and only those
    for sentence in {s for d in docs for s in SUM.findall(d)}:
        a, b, total = map(int, re.findall(r"\d", sentence))
        assert a + b == total
    leaked = held[0]["prompt"][0]["content"]  # the check itself sees a leak where there is one
    assert held_out_sums_in(docs + [f"the cat is an animal .\n{leaked}{held[0]['answer']}"], held) == [leaked]
