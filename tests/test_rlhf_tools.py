"""Multi-turn GRPO episodes with tools (rlhf.tools): the config refused before launch, the tool-call parser, each way
an episode ends on real turns (the tiny tokenizer, the real calculator and the python tool in the real sandbox), and
one short GRPO stage run with tools on the arithmetic task (TRL, tiny model)."""
from __future__ import annotations

import json

import pytest

from tasks.rlhf import tools as t
from tasks.rlhf.tools import EpisodeEnd
from tasks.rlhf import episodes as ep
from tasks.rlhf.config import RlhfConfig
from test_rlhf_rewards import config_with, grpo

CALC = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
PY = '<tool_call>{"name": "python", "arguments": {"code": "%s"}}</tool_call>'


# ---- the config: refused before launch, one message naming the key --------------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("rlhf, key, words", [
    ({**grpo([{"kind": "exact_match"}]), "tools": ["calculator", "calculator"]}, "rlhf.tools", "listed twice"),
    ({**grpo([{"kind": "exact_match"}]), "tools": ["shell"]}, "rlhf.tools", "calculator"),
    ({**grpo([]), "tools": ["calculator"]}, "rlhf.tools", "no reward is set"),
    ({**grpo([{"kind": "exact_match"}]), "max_turns": 3}, "rlhf.max_turns", "only used with rlhf.tools"),
    ({**grpo([{"kind": "exact_match"}]), "tool_timeout_s": 2}, "rlhf.tool_timeout_s", "only used with rlhf.tools"),
    ({**grpo([{"kind": "exact_match"}]), "tools": ["calculator"], "max_turns": 1}, "rlhf.max_turns", "at least 2"),
    ({**grpo([{"kind": "exact_match"}]), "tools": ["calculator"], "tool_timeout_s": 0}, "rlhf.tool_timeout_s", "0"),
    ({"algorithm": "dpo", "tools": ["calculator"]}, "rlhf.tools", "only used by algorithm grpo"),
    ({**grpo([{"kind": "exact_match"}]), "tools": ["calculator"], "backend": "nemo_rl"}, "rlhf.tools",
     "NeMo-RL's math environment has no tools"),
])
def test_tool_settings_that_cannot_run_are_refused_naming_the_key(tmp_path, rlhf, key, words):
    from flows.config import ConfigError, load

    prompts = {"kind": "synthetic"} if rlhf.get("algorithm") == "grpo" else None
    with pytest.raises(ConfigError) as e:
        load(config_with(tmp_path, rlhf, prompts=prompts))
    assert key in str(e.value) and words in str(e.value), str(e.value)


@pytest.mark.fast
def test_a_grpo_run_with_both_tools_loads(tmp_path):
    from flows.config import load

    cfg = load(config_with(tmp_path, {**grpo([{"kind": "exact_match"}]), "tools": ["calculator", "python"],
                                      "max_turns": 3, "tool_timeout_s": 2}, prompts={"kind": "synthetic"}))
    assert cfg.rlhf.tools == ["calculator", "python"] and cfg.rlhf.max_turns == 3


# ---- the parser and the tools -----------------------------------------------------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("text, call, problem", [
    ("7", None, None),
    ("the sum is " + CALC % "3+4", t.ToolCall("calculator", {"expression": "3+4"}), None),
    (PY % "print(2)", t.ToolCall("python", {"code": "print(2)"}), None),
    ('<tool_call>{"name": "calculator"', None, "not closed"),
    ("<tool_call>{name: calculator}</tool_call>", None, "not JSON"),
    ('<tool_call>["calculator"]</tool_call>', None, '{"name"'),
    ('<tool_call>{"name": "shell", "arguments": {"cmd": "ls"}}</tool_call>', None, "unknown tool 'shell'"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": 7}}</tool_call>', None, "string arguments"),
    ('<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>', None, "unknown tool 'python'"),
])
def test_the_parser_reads_one_tool_call_or_says_why_not(text, call, problem):
    tools = ("calculator",) if "python" in text and "print" not in text else t.BUILT_IN
    parsed = t.parse_tool_call(text, tools)
    assert parsed.call == call
    assert (parsed.problem is None) if problem is None else (problem in parsed.problem), parsed


@pytest.mark.fast
@pytest.mark.parametrize("expression, result", [("3+4", "7"), ("7/2", "3.5"), ("2**10", "1024"), ("-(3*4)%5", "3"),
                                                ("6/3", "2")])
def test_the_calculator_does_arithmetic(expression, result):
    assert t.calculator(expression) == result


@pytest.mark.fast
@pytest.mark.parametrize("expression", ["1/0", "9**9**9", "__import__('os')", "x+1", "(1,2)", "3+"])
def test_the_calculator_refuses_everything_else(expression):
    with pytest.raises(t.ToolRaised):
        t.calculator(expression)


# ---- each way an episode ends, on real turns -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tasks.data.tokenizer import train_tokenizer

    texts = ["the sum is 3+4=7 and 12*3=36", 'calculator expression arguments name code print tool_call "{}"'] * 20
    return train_tokenizer(texts, 400, tmp_path_factory.mktemp("tok"))


def runner(tok, max_turns=4, max_tokens=200, timeout_s=1.0, environment=None) -> ep.EpisodeRunner:
    return ep.EpisodeRunner(tok, ep.Limits(t.BUILT_IN, max_turns, max_tokens, timeout_s, environment))


def turn(tok, text: str, closed: bool = True) -> list[int]:
    return tok(text + ("<|im_end|>" if closed else ""), add_special_tokens=False)["input_ids"]


def play(tok, texts: list[str], **limits) -> ep.Episode:
    """Feed the model turns in order (as if generated) until the episode ends; with an environment, its instance
    is reset first (the row: 3+4= → 7) and stopped after."""
    r, e = runner(tok, **limits), ep.Episode(tok("<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n")["input_ids"])
    try:
        if r.limits.environment is not None:
            r.reset_environments([e], [("3+4=", {"answer": "7"}, [{"role": "user", "content": "3+4="}])])
        for text in texts:
            if e.end is not None:
                return e
            r.take_turn(e, turn(tok, text, closed=not text.endswith("...")))
        if e.end is not None:
            return e
    finally:
        if e.environment is not None:
            e.environment.close()
    raise AssertionError("the episode did not end")


@pytest.mark.fast
def test_an_answer_without_a_tool_call_finishes_the_episode(tok):
    e = play(tok, ["7"])
    assert e.end is EpisodeEnd.FINISHED and e.turns == 1 and e.tool_calls == 0 and e.reply == "7"


@pytest.mark.fast
def test_a_tool_result_becomes_a_masked_tool_turn_and_the_model_answers_after_it(tok):
    e = play(tok, [CALC % "3+4", "it is 7"])
    assert e.end is EpisodeEnd.FINISHED and e.turns == 2 and e.tool_calls == 1 and e.reply == "it is 7"
    first, tool_ids = turn(tok, CALC % "3+4"), tok(ep.tool_turn_text(tok, "7"), add_special_tokens=False)["input_ids"]
    assert e.ids == first + tool_ids + turn(tok, "it is 7")  # nothing lost: every model and tool token, in order
    assert e.mask == [1] * len(first) + [0] * len(tool_ids) + [1] * len(turn(tok, "it is 7"))
    assert tok.decode(tool_ids) == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.fast
def test_the_python_tool_prints_its_result_into_the_episode(tok):
    e = play(tok, [PY % "print(6*7)", "42"])
    assert e.end is EpisodeEnd.FINISHED and "tool\n42\n" in tok.decode([i for i, m in zip(e.ids, e.mask) if not m])


@pytest.mark.fast
@pytest.mark.parametrize("texts, end, limits", [
    (['<tool_call>{"name": "calculator", "arguments": {}}</tool_call>'], EpisodeEnd.MALFORMED_TOOL_CALL, {}),
    (["<tool_call>not json</tool_call>"], EpisodeEnd.MALFORMED_TOOL_CALL, {}),
    ([CALC % "1/0"], EpisodeEnd.TOOL_RAISED, {}),
    ([PY % "raise KeyError(3)"], EpisodeEnd.TOOL_RAISED, {}),
    ([PY % "while True: pass"], EpisodeEnd.TOOL_TIMED_OUT, {"timeout_s": 0.5}),
    ([CALC % "1+1", CALC % "2+2"], EpisodeEnd.MAX_TURNS, {"max_turns": 2}),
    (["3+4 is ..."], EpisodeEnd.LENGTH, {}),  # the turn hit the token budget before its end-of-turn token
    ([CALC % "1+1"], EpisodeEnd.LENGTH, {"max_tokens": 40}),  # no room left after the tool turn
])
def test_each_way_an_episode_ends_is_named(tok, texts, end, limits):
    e = play(tok, texts, **limits)
    assert e.end is end, (e.end, e.reply)
    assert len(e.ids) == len(e.mask) and e.turns == len(texts)


@pytest.mark.fast
def test_episode_summaries_count_every_end(tok):
    played = [play(tok, ["7"]), play(tok, [CALC % "1/0"]), play(tok, [CALC % "1+1", "2"])]
    s = ep.summary(played)
    assert s["episodes"] == 3 and s["tool_calls"] == 2 and s["turns_per_episode"] == 4 / 3
    assert s["ends"] == {**{end.value: 0 for end in EpisodeEnd}, "finished": 2, "tool_raised": 1}
    assert ep.add_up(s, s)["ends"]["finished"] == 4 and ep.add_up({}, s) == s


@pytest.mark.fast
def test_a_resumed_run_counts_the_episodes_of_the_steps_before_its_checkpoint(tok, tmp_path):
    """Attempt 1 plays two steps and checkpoints; attempt 2 starts with empty totals, reads them from the checkpoint
    (as worker.train does) and plays a third: its summary is that of all three steps."""
    steps = [[play(tok, ["7"])], [play(tok, [CALC % "1/0"])], [play(tok, [CALC % "1+1", "2"])]]
    first: dict = {}
    for step in steps[:2]:
        first.update(ep.add_up(dict(first), ep.summary(step)))
    ep.save_totals(tmp_path, first)
    resumed = ep.load_totals(tmp_path)
    resumed.update(ep.add_up(dict(resumed), ep.summary(steps[2])))
    assert resumed == ep.summary([e for step in steps for e in step])
    assert ep.load_totals(tmp_path / "no-episodes") == {}


# ---- a user's environment, in a child process per episode ----------------------------------------------------------
QUIZ = """
import time

class Quiz:
    def reset(self, prompt, **row):
        print("reset", prompt)          # a print goes to stderr, not into the channel
        if row["answer"] in ("0", "2", "4", "6", "8"):
            raise ValueError("no quiz for even sums")  # (the GRPO run below: episodes that end before their first turn)
        self.answer = row["answer"]

    def step(self, reply):
        if reply == "hang":
            time.sleep(60)
        if reply == "boom":
            raise KeyError(reply)
        if reply == "odd":
            return "a", "b"
        if reply.strip() == self.answer:
            return None, 1.0, True
        return "Try again.", 0.25, False

class Opener:  # reset's first message: the row's `first` column, or None (the data's prompt)
    def reset(self, prompt, **row):
        return row.get("first")

    def step(self, reply):
        return None, 1.0, True

class BadOpener:
    def reset(self, prompt, **row):
        return ["not", "a", "message"]

    def step(self, reply):
        return None, 1.0, True

class Broken:
    def __init__(self):
        raise RuntimeError("no")
    def reset(self, prompt, **row):
        pass
    def step(self, reply):
        pass
"""


@pytest.fixture(scope="module")
def quiz(tmp_path_factory):
    from tasks.rlhf.environment import EnvironmentCode

    path = tmp_path_factory.mktemp("env") / "quiz.py"
    path.write_text(QUIZ)
    return lambda name="Quiz": EnvironmentCode(str(path), name, QUIZ)


@pytest.mark.fast
def test_the_environment_answers_with_a_user_turn_until_the_model_is_right(tok, quiz):
    e = play(tok, ["6", "7"], environment=quiz())
    assert e.end is EpisodeEnd.FINISHED and e.turns == 2 and e.environment_reward == 1.25 and e.reply == "7"
    user_ids = tok(ep.tool_turn_text(tok, "Try again.", "user"), add_special_tokens=False)["input_ids"]
    assert e.ids == turn(tok, "6") + user_ids + turn(tok, "7")
    assert e.mask == [1] * len(turn(tok, "6")) + [0] * len(user_ids) + [1] * len(turn(tok, "7"))


@pytest.mark.fast
@pytest.mark.parametrize("texts, end, limits", [
    (["boom"], EpisodeEnd.ENVIRONMENT_RAISED, {}),
    (["odd"], EpisodeEnd.ENVIRONMENT_RAISED, {}),  # step returned two things, not (message, reward, done)
    (["hang"], EpisodeEnd.ENVIRONMENT_TIMED_OUT, {"timeout_s": 0.5}),
    (["1", "2"], EpisodeEnd.MAX_TURNS, {"max_turns": 2}),
    ([CALC % "1/0"], EpisodeEnd.TOOL_RAISED, {}),  # tools still work beside an environment
])
def test_each_way_an_environment_episode_ends_is_named(tok, quiz, texts, end, limits):
    e = play(tok, texts, environment=quiz(), **limits)
    assert e.end is end, (e.end, e.reply)


@pytest.mark.fast
def test_a_hung_environment_call_kills_that_episodes_process_only(quiz):
    from tasks.rlhf.environment import EpisodeEnvironment

    hung, other = EpisodeEnvironment(quiz(), 0.5), EpisodeEnvironment(quiz(), 0.5)
    try:
        assert hung.reset("3+4=", {"answer": "7"}).value is None and other.reset("3+4=", {"answer": "7"}).value is None
        assert hung.step("hang").timed_out and hung.proc.poll() is not None  # killed at once, not at the end
        assert other.step("7").value == [None, 1.0, True]  # the other episode's instance kept its state
    finally:
        hung.close()
        other.close()


@pytest.mark.fast
def test_an_environment_that_cannot_be_made_ends_its_episode_before_any_turn(tok, quiz):
    e = play(tok, ["7"], environment=quiz("Broken"))
    assert e.end is EpisodeEnd.ENVIRONMENT_RAISED and e.turns == 0


@pytest.mark.fast
def test_resets_first_message_takes_the_place_of_the_prompts_user_message(tok, quiz):
    """Opener's reset returns the row's `first` (or None): the episode's prompt is rendered again with it as the user
    message, after the system message; a reset that returns something else ends the episode, naming the class."""
    r = runner(tok, environment=quiz("Opener"))
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+4="}]
    rendered = ep.first_message_prompt(tok, messages, "3+4=")
    rows = [("3+4=", {"first": "What is 3+4?"}, messages), ("3+4=", {}, messages)]
    played = [ep.Episode(tok(rendered)["input_ids"]) for _ in rows]
    try:
        r.reset_environments(played, rows)
    finally:
        for e in played:
            e.environment.close()
    assert [e.end for e in played] == [None, None]
    assert played[0].prompt_ids == tok("<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\nWhat is 3+4?<|im_end|>\n"
                                       "<|im_start|>assistant\n")["input_ids"]
    assert played[1].prompt_ids == tok(rendered)["input_ids"]  # None: the data's prompt, untouched

    from tasks.rlhf.environment import EpisodeEnvironment

    bad = EpisodeEnvironment(quiz("BadOpener"), 1.0)
    try:
        raised = bad.reset("3+4=", {}).raised
    finally:
        bad.close()
    assert "quiz.py:BadOpener: reset must return the episode's first message (a string) or None, got list" in raised
    assert play(tok, ["7"], environment=quiz("BadOpener")).end is EpisodeEnd.ENVIRONMENT_RAISED


@pytest.mark.fast
@pytest.mark.parametrize("env, words", [
    ("{tmp}/missing.py:Quiz", "no such file"),
    ("{tmp}/quiz.py:Nope", "defines no class 'Nope'"),
    ("{tmp}/half.py:Half", "defines no step"),
    ("{tmp}/quiz.py", "is not 'path/to/env.py:ClassName'"),
])
def test_an_environment_that_cannot_run_is_refused_naming_the_key(tmp_path, env, words):
    from flows.config import ConfigError, load

    (tmp_path / "quiz.py").write_text(QUIZ)
    (tmp_path / "half.py").write_text("class Half:\n    def reset(self, prompt, **row):\n        pass\n")
    rlhf = {**grpo([{"kind": "exact_match"}]), "environment": env.format(tmp=tmp_path)}
    with pytest.raises(ConfigError) as e:
        load(config_with(tmp_path, rlhf, prompts={"kind": "synthetic"}))
    assert "rlhf.environment" in str(e.value) and words in str(e.value), str(e.value)


# ---- a real GRPO stage run with tools ---------------------------------------------------------------------------------
def test_grpo_with_tools_runs_episodes_and_reports_how_they_ended(tmp_path, tiny_config, data_dir, hf_checkpoint):
    """The random-init tiny model has never seen a tool call, so (measured) it calls none: every episode ends by
    answering or by running out of tokens. What this shows is the plumbing: episodes through TRL's rollout_func (with
    a user environment in a child process per episode), the ends counted per step and in the summary, the
    environment's reward beside the built-in one, the held-out reward measured on greedy episodes before and
    after. Killed after its first step's checkpoint, the rerun resumes there and its summary still counts both steps'
    episodes (carried in the checkpoint)."""
    from test_rlhf_trl import _kill_after_checkpoint, prompts_data, run_stage

    data = prompts_data(data_dir, tmp_path / "data")
    (tmp_path / "quiz.py").write_text(QUIZ)
    cfg = RlhfConfig(algorithm="grpo", steps=STEPS, micro_batch_size=8, num_generations=4, max_completion_length=4,
                     lr=1e-3, beta=0.0, loss_type="dr_grpo", scale_rewards="none", checkpoint_every=1,
                     timeout_s=600, rewards=[{"kind": "exact_match"}], tools=["calculator", "python"], max_turns=3,
                     tool_timeout_s=2, environment=f"{tmp_path}/quiz.py:Quiz")
    (tmp_path / "run").mkdir()
    assert _kill_after_checkpoint(tmp_path / "run", lambda: run_stage(tmp_path / "run", tiny_config, data,
                                                                      hf_checkpoint, cfg), step=1) is not None
    out = run_stage(tmp_path / "run", tiny_config, data, hf_checkpoint, cfg)
    m = out.metrics
    assert m["resumed_from_step"] == 1, m
    ends = {end.value: m[f"episode_end_{end.value}"] for end in EpisodeEnd}
    assert m["episodes_trained"] == STEPS * 8 == sum(ends.values()), m
    assert 0 < ends["environment_raised"] < m["episodes_trained"], ends  # reset raised on the even sums' rows
    assert 0 < m["turns_per_episode"] <= 3 and m["tool_calls"] >= 0
    held = out.extra["episodes"]
    assert held["heldout_before"]["episodes"] == held["heldout_after"]["episodes"] == 22, held
    assert out.eval["metric"] == "heldout_reward" and out.gate["passed"] is not None
    log = (tmp_path / "run" / "engine.log").read_text()
    logged = [json.loads(line[len("@@baton "):]) for line in log.splitlines() if line.startswith("@@baton ")]
    steps = [e for e in logged if e["kind"] == "metric" and "train/episodes_finished" in e]
    assert len(steps) == STEPS and all(0 <= e["train/episodes_length"] <= 1 for e in steps), steps
    assert all("train/rewards_environment_reward_mean" in e for e in steps)  # the environment's reward, beside
    print(f"tools: heldout_reward {out.eval['before']:.3f} → {out.eval['after']:.3f}; training ends {ends}; tool calls "
          f"{m['tool_calls']} training, {m['heldout_tool_calls_before']} → {m['heldout_tool_calls_after']} held out")


STEPS = 2
