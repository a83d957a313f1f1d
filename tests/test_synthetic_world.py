"""The synthetic world's generator (tasks/data/synthetic.py): the default world stays what every default run was built
on, and the arithmetic world (data.prompts synthetic) states its whole table of sums in the pretraining text, while
GRPO's held-out prompts are many sums it never trains on."""
from __future__ import annotations

import hashlib
import json
import re

import pytest

from tasks.data.config import DataConfig
from tasks.data.synthetic import SUM, SUMS_PER_DOC, all_sums
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


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_held_out_prompts_are_many_sums_grpo_never_trains_on_and_the_text_states_them_all(seed):
    sets = build_datasets(DataConfig(seed=seed, **ARITHMETIC))[0]
    train_prompts, held = sets["prompts"]
    trained = {r["prompt"][0]["content"] for r in train_prompts}
    held_out = [r["prompt"][0]["content"] for r in held]
    assert len(held_out) >= 20 and len(set(held_out)) == len(held_out)  # a gain is many prompts, not one
    assert not trained & set(held_out)
    docs = pretraining_text(sets)
    stated = {s.split("=")[0] + "=" for d in docs for s in SUM.findall(d)}
    assert stated == {f"{a}+{b}=" for a, b in all_sums()} == trained | set(held_out)
    for sentence in {s for d in docs for s in SUM.findall(d)}:
        a, b, total = map(int, re.findall(r"\d", sentence))
        assert a + b == total


@pytest.mark.parametrize("seed", [0, 1])
def test_the_instruction_task_holds_out_40_digit_pairs_and_leaves_the_pretraining_text_alone(seed):
    """data.prompts task: instruction (configs/real-smollm2-grpo.yaml): the held-out sums are 40 of the 100 pairs of
    digits that no training prompt asks, every answer is the sum, and the other datasets are the default world's."""
    cfg = DataConfig(seed=seed, arithmetic_prompts=200, prompts={"kind": "synthetic", "task": "instruction"})
    sets = build_datasets(cfg)[0]
    train_prompts, held = sets["prompts"]
    assert len(train_prompts) == 200 and build_datasets(cfg)[0]["prompts"] == (train_prompts, held)
    for row in train_prompts + held:
        system, user = row["prompt"]
        assert system["role"] == "system" and "number only" in system["content"] and user["role"] == "user"
        a, b = map(int, re.fullmatch(r"What is (\d) \+ (\d)\?", user["content"]).groups())
        assert row["answer"] == str(a + b)
    trained = {r["prompt"][1]["content"] for r in train_prompts}
    held_out = [r["prompt"][1]["content"] for r in held]
    assert len(held_out) == 40 == len(set(held_out)) and not trained & set(held_out)
    assert 50 < len(trained) <= 60  # drawn with replacement from the other 60
    assert sets["pretrain"] == build_datasets(DataConfig(seed=seed))[0]["pretrain"]  # no sums in its text


# ---- the calculator world (data.sft / data.prompts task: calculator) -------------------------------------------------
CALCULATOR = {"sft": {"kind": "synthetic", "task": "calculator"}, "prompts": {"kind": "synthetic", "task": "calculator"}}


def test_the_calculator_world_is_tool_call_episodes_on_products_it_holds_out():
    from tasks.rlhf.tools import calculator, parse_tool_call

    sets, facts = build_datasets(DataConfig(**CALCULATOR))
    assert sets == build_datasets(DataConfig(**CALCULATOR))[0]  # seeded: the same world every time
    assert sets != build_datasets(DataConfig(**CALCULATOR, seed=1))[0]
    assert facts["sft"] == {"source": "synthetic", "format": "messages", "task": "calculator"}
    (sft, sft_held), (prompts, held) = sets["sft"], sets["prompts"]
    calls = [r["messages"] for r in sft if len(r["messages"]) == 4]
    assert 0.2 < len(calls) / len(sft) < 0.4  # the rest (by_heart 0.7) answered by heart, restating the question
    for user, answer in (r["messages"] for r in sft if len(r["messages"]) == 2):
        a, b = map(int, user["content"].rstrip("=").split("*"))
        assert answer == {"role": "assistant", "content": f"{a}*{b} is {a * b}"}, answer
    for user, call, tool, answer in (m for m in calls + [r["messages"] for r in sft_held]):
        parsed = parse_tool_call(call["content"], ("calculator",))
        assert [user["role"], call["role"], tool["role"], answer["role"]] == ["user", "assistant", "tool", "assistant"]
        assert user["content"] == parsed.call.arguments["expression"] + "="  # the call is the question, as the tool reads it
        assert tool["content"] == answer["content"] == calculator(parsed.call.arguments["expression"])
    asked = {r["messages"][0]["content"] for r in sft} | {r["prompt"][0]["content"] for r in prompts}
    held_out = [r["prompt"][0]["content"] for r in held]
    assert len(held) == len(sft_held) == 32 and not asked & set(held_out)  # never in SFT or GRPO training
    assert {r["messages"][0]["content"] for r in sft_held} == set(held_out)
    assert not any(SUM.search(t) for t in pretraining_text(sets))  # the sums' pretraining text is the other world's
    mostly_by_heart = {**CALCULATOR, "sft": {**CALCULATOR["sft"], "by_heart": 0.8}}
    sft_bh = build_datasets(DataConfig(**mostly_by_heart))[0]["sft"][0]
    assert 0.1 < sum(len(r["messages"]) == 4 for r in sft_bh) / len(sft_bh) < 0.3  # data.sft.by_heart: 0.8


@pytest.mark.parametrize("data, words", [
    ({"pretrain": {"kind": "synthetic", "task": "calculator"}}, "data.pretrain.task"),
    ({"sft": {"kind": "files", "train": "x.jsonl", "task": "calculator"}}, "data.sft.task"),
])
def test_the_calculator_task_is_refused_where_it_makes_nothing(data, words):
    from tasks.data.config import validate

    problems = validate(DataConfig(**data))
    assert [p.key for p in problems] == [words] and "synthetic task of data.sft and data.prompts only" in problems[0]


@pytest.mark.parametrize("data, words", [
    ({"prompts": {"kind": "synthetic", "task": "calculator", "by_heart": 0.5}}, "data.prompts.by_heart"),
    ({"sft": {"kind": "synthetic", "by_heart": 0.5}}, "data.sft.by_heart"),
])
def test_by_heart_is_refused_off_the_calculator_sft(data, words):
    from tasks.data.config import validate

    problems = validate(DataConfig(**data))
    assert [p.key for p in problems] == [words] and "data.sft with task: calculator only" in problems[0]
