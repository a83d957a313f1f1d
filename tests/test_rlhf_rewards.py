"""RL with verifiable rewards, the cheap parts: prompts-with-answers data validated like the other formats, rlhf.rewards
refused before launch when a reward cannot run, and every built-in reward on real strings (expected values worked
out by hand). The engine run (GRPO on the arithmetic task): tests/test_rlhf_trl.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import TINY, reward_spec
from flows.config import ConfigError, load
from tasks.rlhf import rewards as rw

pytestmark = pytest.mark.fast

MATH = r"""
def close_enough(prompt, completion, **row):
    return 1.0 if row["answer"] in completion else 0.0

def broken(prompt, completion, **row):
    raise ValueError("no digits here")
"""


def config_with(tmp_path: Path, rlhf: dict, prompts: dict | None = None) -> Path:
    raw = yaml.safe_load(TINY.read_text())
    raw["rlhf"] = dict(rlhf)  # (tiny.yaml's rlhf is DPO's: sft_weight would be refused under grpo)
    if prompts is not None:
        raw["data"]["prompts"] = prompts
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def grpo(rewards: list[dict]) -> dict:
    return {"algorithm": "grpo", "micro_batch_size": 8, "num_generations": 4, "rewards": rewards}


# ---- rlhf.rewards: refused before launch, naming the key and the missing thing -----------------------------------
def test_a_grpo_run_with_a_built_in_and_a_user_reward_loads(tmp_path):
    (tmp_path / "rewards.py").write_text(MATH)
    cfg = load(config_with(tmp_path, grpo([{"kind": "exact_match"},
                                           {"kind": "function", "function": f"{tmp_path}/rewards.py:close_enough",
                                            "weight": 0.5}]), prompts={"kind": "synthetic"}))
    assert [r.kind for r in cfg.rlhf.rewards] == ["exact_match", "function"] and cfg.rlhf.rewards[1].weight == 0.5


@pytest.mark.parametrize("function, message", [
    ("{tmp}/missing.py:close_enough", r"rlhf.rewards\[1\].function: {tmp}/missing.py: no such file"),
    ("{tmp}/rewards.py:nowhere", r"rlhf.rewards\[1\].function: {tmp}/rewards.py defines no function 'nowhere' at its "
                                 r"top level \(it defines: close_enough, broken\)"),
    ("{tmp}/rewards.py", r"rlhf.rewards\[1\].function: '{tmp}/rewards.py' is not 'path/to/rewards.py:function_name'"),
    ("{tmp}/bad.py:fn", r"rlhf.rewards\[1\].function: {tmp}/bad.py:2: not valid Python"),
])
def test_a_reward_function_that_cannot_be_found_is_refused_before_launch(tmp_path, function, message):
    (tmp_path / "rewards.py").write_text(MATH)
    (tmp_path / "bad.py").write_text("def fn(prompt, completion, **row):\nreturn 1\n")
    path = config_with(tmp_path, grpo([{"kind": "exact_match"}, {"kind": "function",
                                                                 "function": function.format(tmp=tmp_path)}]),
                       prompts={"kind": "synthetic"})
    with pytest.raises(ConfigError, match=message.format(tmp=tmp_path)):
        load(path)


@pytest.mark.parametrize("reward, message", [
    ({"kind": "regex"}, r"rlhf.rewards\[0\].pattern: required"),
    ({"kind": "regex", "pattern": "(unclosed"}, r"rlhf.rewards\[0\].pattern: '\(unclosed' is not a regular expression"),
    ({"kind": "json_schema", "json_schema": {"type": "thing"}}, r"rlhf.rewards\[0\].json_schema: not a valid JSON "
                                                                 r"Schema"),
    ({"kind": "length"}, r"rlhf.rewards\[0\]: kind length needs min_chars, max_chars or both"),
    ({"kind": "length", "min_chars": 9, "max_chars": 3}, r"min_chars 9 is above max_chars 3"),
    ({"kind": "exact_match", "min_chars": 3}, r"rlhf.rewards\[0\].min_chars: not used by kind exact_match"),
    ({"kind": "exact_match", "pattern": "x(\\d)"}, r"rlhf.rewards\[0\].pattern: only used with extract regex"),
])
def test_a_built_in_reward_missing_what_it_reads_is_refused(tmp_path, reward, message):
    with pytest.raises(ConfigError, match=message):
        load(config_with(tmp_path, grpo([reward]), prompts={"kind": "synthetic"}))


def test_rewards_need_prompts_and_grpo(tmp_path):
    with pytest.raises(ConfigError, match=r"rlhf.rewards: score prompts with reference answers, and data.prompts is "
                                          r"not set"):
        load(config_with(tmp_path, grpo([{"kind": "exact_match"}])))
    with pytest.raises(ConfigError, match=r"rlhf.rewards: only used by algorithm grpo \(algorithm is dpo\)"):
        load(config_with(tmp_path, {"rewards": [{"kind": "exact_match"}]}, prompts={"kind": "synthetic"}))
    with pytest.raises(ConfigError, match=r"rlhf.gate.metric: heldout_reward needs rlhf.rewards"):
        load(config_with(tmp_path, {"gate": {"metric": "heldout_reward"}}))


# ---- prompts with answers: validated like every data format (file:line, field) ------------------------------------
def test_prompt_answer_files_are_validated_row_by_row(tmp_path):
    from tasks.data.config import DataConfig
    from tasks.data.sources import DataError
    from tasks.data.task import build_datasets

    rows = [{"prompt": "2+2=", "answer": 4, "unit": "apples"},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}],
             "answer": "2"},
            {"prompt": "3+3=", "answer": ["6"]}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=rf"data.prompts.train: {tmp_path}/p.jsonl:3: field 'answer': wrong type "
                                        r"\(expected a string or a number, got list\)"):
        build_datasets(DataConfig(prompts={"kind": "files", "train": str(tmp_path / "p.jsonl")}))
    sets, facts = build_datasets(DataConfig(prompts={"kind": "files", "train": str(tmp_path / "p.jsonl")},
                                            max_bad_fraction=0.5, heldout_fraction=0.3))
    train, held = sets["prompts"]
    assert facts["prompts"]["format"] == "prompt_answer" and facts["prompts"]["rows_bad"] == {"wrong_type": 1}
    by_answer = {r["answer"]: r for r in train + held}
    assert by_answer["4"] == {"unit": "apples", "prompt": [{"role": "user", "content": "2+2="}], "answer": "4"}
    assert by_answer["2"]["prompt"][0] == {"role": "system", "content": "Be brief."}


def test_the_arithmetic_task_only_when_asked_and_its_held_out_sums_are_new():
    from tasks.data.config import DataConfig
    from tasks.data.task import build_datasets

    assert "prompts" not in build_datasets(DataConfig())[0]
    train, held = build_datasets(DataConfig(prompts={"kind": "synthetic"}))[0]["prompts"]
    assert len(train) == 400 and held
    seen = {r["prompt"][0]["content"] for r in train}
    for r in held:
        a, b = r["prompt"][0]["content"].rstrip("=").split("+")
        assert r["answer"] == str(int(a) + int(b)) and r["prompt"][0]["content"] not in seen


# ---- the built-in rewards on real replies (values by hand) ---------------------------------------------------------
def score(spec: dict, completion: str, **row) -> float:
    return rw.build(reward_spec(**spec), 0).score("prompt", completion, row, "test:1")


@pytest.mark.parametrize("extract, pattern, completion, answer, expected", [
    ("last_number", None, "3+4 is 7.", "7", 1.0),              # the last number, not the operands
    ("last_number", None, "7 apples... no, 8", "7", 0.0),      # a corrected answer counts as the last one
    ("last_number", None, "in total 1,234 sheep", "1234", 1.0),
    ("last_number", None, "7.0", "7", 1.0),                    # numbers compare as numbers
    ("last_number", None, "-3", "3", 0.0),
    ("last_number", None, "seven", "7", 0.0),
    ("boxed", None, r"so x = \boxed{\frac{1}{2}}.", r"\frac{1}{2}", 1.0),  # nested braces kept
    ("boxed", None, r"\boxed{3}, then \boxed{4}", "4", 1.0),
    ("boxed", None, r"\boxed{3}, then \boxed{4}", "3", 0.0),
    ("boxed", None, r"\boxed{4", "4", 0.0),                    # never closed: no answer
    ("regex", r"Answer: (\w+)", "Answer: cat. Answer: dog", "dog", 1.0),
    ("full", None, "  paris \n", "paris", 1.0),
])
def test_exact_match_extracts_the_final_answer(extract, pattern, completion, answer, expected):
    spec = {"kind": "exact_match", "extract": extract, "pattern": pattern, "answer_field": "answer"}
    assert score(spec, completion, answer=answer) == expected


def test_exact_match_reads_the_configured_answer_column():
    assert score({"kind": "exact_match", "answer_field": "gold"}, "It is 12", gold="12", answer="3") == 1.0


@pytest.mark.parametrize("completion, expected", [("42", 1.0), ("42 apples", 0.0), ("", 0.0)])
def test_the_regex_check(completion, expected):
    assert score({"kind": "regex", "pattern": r"^\d+$"}, completion) == expected


SCHEMA = {"type": "object", "required": ["category"], "properties": {"category": {"enum": ["fruit", "animal"]}}}


@pytest.mark.parametrize("completion, expected", [
    ('{"category": "animal"}', 1.0), (' {"category": "fruit"}\n', 1.0), ('{"category": "car"}', 0.0),
    ("{}", 0.0), ("category: animal", 0.0), ('{"category": "animal"', 0.0)])
def test_the_json_schema_check(completion, expected):
    assert score({"kind": "json_schema", "json_schema": SCHEMA}, completion) == expected


@pytest.mark.parametrize("completion, expected", [("abc", 1.0), ("  ab  ", 1.0), ("a", 0.0), ("abcdef", 0.0)])
def test_the_length_bounds(completion, expected):
    assert score({"kind": "length", "min_chars": 2, "max_chars": 5}, completion) == expected


def test_a_user_function_gets_the_prompt_the_completion_and_the_row():
    spec = {"kind": "function", "weight": 1.0, "path": "/x/rewards.py", "name": "close_enough", "source": MATH}
    reward = rw.build(spec, 3)
    assert reward.name == "3_close_enough"
    assert reward.score("2+2=", "it is 4", {"answer": "4"}, "prompts/train.jsonl:1") == 1.0
    assert reward.score("2+2=", "it is 5", {"answer": "4"}, "prompts/train.jsonl:1") == 0.0


def test_a_reward_that_raises_names_the_row_it_failed_on():
    """Through the worker's TRL reward function: TRL hands it a batch of row indexes, the error names the file:line."""
    from tasks.rlhf.worker import trl_reward

    reward = rw.build({"kind": "function", "weight": 1.0, "path": "/x/rewards.py", "name": "broken", "source": MATH}, 0)
    rows = [{"text": f"{i}+1=", "fields": {"answer": str(i + 1)}, "where": f"prompts/train.jsonl:{i + 1}"}
            for i in range(3)]
    with pytest.raises(rw.RewardError, match=r"reward 0_broken failed on prompts/train.jsonl:3 \(prompt '2\+1=', "
                                             r"completion '3'\): ValueError: no digits here"):
        trl_reward(reward, rows)(["p"], ["3"], row_index=[2])


def test_the_grpo_demo_is_the_tiny_world_with_rewards():
    """configs/tiny-grpo.yaml (`make demo-rl`) keeps configs/tiny.yaml's model, data and pretraining recipe (for more
    steps: the sums in its text take them), adding only the arithmetic prompts and GRPO on built-in rewards (no user
    file to find)."""
    tiny, demo = load(TINY), load(TINY.with_name("tiny-grpo.yaml"))
    schedule = {"steps", "warmup_steps", "checkpoint_every", "eval_interval"}
    assert demo.model == tiny.model and demo.pretrain.steps > tiny.pretrain.steps
    assert demo.pretrain.model_dump(exclude=schedule) == tiny.pretrain.model_dump(exclude=schedule)
    assert demo.data.model_dump(exclude={"prompts"}) == tiny.data.model_dump(exclude={"prompts"})
    assert demo.data.prompts.kind == "synthetic" and demo.rlhf.algorithm == "grpo"
    assert [r.kind for r in demo.rlhf.rewards] == ["exact_match", "regex"]
