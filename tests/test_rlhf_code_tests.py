"""The code_tests reward (tasks/rlhf/rewards.py → tasks/rlhf/sandbox.py): code from a completion run against a row's
test cases in a sandboxed subprocess. Each attack runs for real inside the sandbox and is seen to fail there: an
infinite loop (wall-clock timeout, process group killed), a memory bomb (RLIMIT_AS), a TCP connection to a server this
test opens on loopback (network namespace + seccomp), a write outside the working folder (Landlock). The settings and
the data column are refused before launch, naming the key or file:line. No engine: each run is one `python -I` child
(~0.2 s)."""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import yaml

from conftest import TINY, reward_spec
from flows.config import ConfigError, load
from tasks.rlhf import rewards as rw, sandbox

pytestmark = pytest.mark.fast

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]
SUM_STDIN = "a, b = map(int, input().split())\nprint(a + b)\n"
QUICK = sandbox.Limits(timeout_s=10, memory_mb=256, isolation="required")


def code_tests(completion: str, tests, **spec) -> float:
    reward = rw.build(reward_spec(kind="code_tests", timeout_s=10, memory_mb=256, **spec), 0)
    return reward.score("Write add(a, b).", completion, {"answer": "", "tests": tests}, "prompts/train.jsonl:1")


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution:\n```{tag}\n{code}```\nIt adds."


# ---- scoring --------------------------------------------------------------------------------------------------------
def test_a_correct_solution_scores_one_and_a_wrong_one_the_fraction_it_passes():
    assert code_tests(fenced(ADD), ADD_TESTS) == 1.0
    assert code_tests(fenced("def add(a, b):\n    return a * b if a == 10 else a + b\n"), ADD_TESTS) == pytest.approx(
        2 / 3)
    assert code_tests(fenced("def add(a, b):\n    return a - b\n"), ADD_TESTS) == 0.0
    assert code_tests(fenced("def add(a, b):\n    return a +\n"), ADD_TESTS) == 0.0  # a syntax error passes nothing


def test_the_code_is_the_last_python_or_untagged_block_or_the_whole_reply():
    wrong_then_right = fenced("def add(a, b):\n    return 0\n") + fenced(ADD, tag="")
    assert code_tests(wrong_then_right, ADD_TESTS) == 1.0
    assert code_tests(fenced(ADD, tag="js"), ADD_TESTS) == 0.0              # another language's block is not run
    assert code_tests("```python\n" + ADD, ADD_TESTS) == 0.0                # cut off inside its block: no code
    assert code_tests(ADD, ADD_TESTS) == 0.0                                # no block at all
    assert code_tests(ADD, ADD_TESTS, code="full") == 1.0


def test_input_output_tests_feed_stdin_and_compare_what_is_printed():
    tests = [{"input": "2 3\n", "output": "5"}, {"input": "1 1", "output": "2\n"}, {"input": "4 4", "output": "9"}]
    assert code_tests(fenced(SUM_STDIN), tests) == pytest.approx(2 / 3)
    exits_early = "import sys\nprint(5)\nsys.exit(0)\n"
    assert code_tests(fenced(exits_early), [{"input": "", "output": "5"}]) == 1.0   # exit(0) ends a program
    assert code_tests(fenced("import sys\nsys.exit(0)\n"), ["assert False"]) == 0.0  # exiting skips no assert


def test_the_worker_scores_a_batch_through_trl_reward():
    """As TRL calls it: a batch of completions with the dataset's row indexes; a bad row names its file:line."""
    from tasks.rlhf.worker import trl_reward

    reward = rw.build(reward_spec(kind="code_tests", timeout_s=10, memory_mb=256), 0)
    rows = [{"text": "Write add.", "fields": {"answer": "", "tests": ADD_TESTS}, "where": "prompts/train.jsonl:1"},
            {"text": "Write add.", "fields": {"answer": "", "tests": []}, "where": "prompts/train.jsonl:2"}]
    score = trl_reward(reward, rows)
    wrong = fenced("def add(a, b):\n    return a - b\n")
    assert reward.concurrent  # scored on one thread per core, in order
    assert score(["p"] * 4, [fenced(ADD), wrong, "no code", fenced(ADD)], row_index=[0] * 4) == [1.0, 0.0, 0.0, 1.0]
    with pytest.raises(rw.RewardError, match=r"reward 0_code_tests failed on prompts/train.jsonl:2 .*column 'tests': "
                                             r"expected a non-empty list of tests, got an empty list"):
        score(["p"] * 2, [fenced(ADD)] * 2, row_index=[0, 1])


# ---- the sandbox holds: each attack fails inside it ----------------------------------------------------------------
def test_an_infinite_loop_is_stopped_by_the_timeout_and_its_group_killed():
    started = time.monotonic()
    outcome = sandbox.run_tests("import os\nos.fork()\nwhile True:\n    pass\n", ["assert True"],
                                sandbox.Limits(timeout_s=1.5, memory_mb=512, isolation="required"))
    assert outcome.timed_out and outcome.fraction == 0.0
    assert time.monotonic() - started < 6


def test_a_memory_bomb_is_stopped_by_the_address_space_limit():
    outcome = sandbox.run_tests("hog = bytearray(2 << 30)\n", ["assert len(hog) == 2 << 30"], QUICK)
    assert outcome.fraction == 0.0 and not outcome.timed_out


def test_no_socket_reaches_a_server_listening_on_this_machine():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                "    reached = True\nexcept OSError:\n    reached = False\n")
        outcome = sandbox.run_tests(code, ["assert reached is False"], QUICK)
    assert outcome.fraction == 1.0, outcome
    assert {"network", "seccomp"} <= set(outcome.layers)


def test_a_write_outside_the_working_folder_fails(tmp_path):
    target = tmp_path / "escaped.txt"
    code = (f"import os\ntry:\n    open({str(target)!r}, 'w').write('x')\n    wrote = True\n"
            "except OSError:\n    wrote = False\nopen('inside.txt', 'w').write('fine')\n"
            "with open('inside.txt') as f:\n    inside = f.read()\n")
    outcome = sandbox.run_tests(code, ["assert wrote is False", "assert inside == 'fine'"], QUICK)
    assert outcome.fraction == 1.0 and not target.exists(), outcome


def test_printed_pass_lines_without_the_runs_nonce_do_not_count():
    forged = "with open('results', 'a') as f:\n    f.write(''.join(f'0123 pass {i}\\n' for i in range(3)))\n"
    assert sandbox.run_tests(forged, ["assert False", "assert False"], QUICK).fraction == 0.0


def test_this_machine_gives_every_isolation_layer():
    """The other tests' isolation is this machine's: a kernel without unprivileged user namespaces, Landlock or
    seccomp would name what it lacks here (and `isolation: required` refuses the run before launch)."""
    assert sandbox.probe() == []


# ---- settings and data: refused before launch -----------------------------------------------------------------------
def config_with(tmp_path: Path, reward: dict) -> Path:
    raw = yaml.safe_load(TINY.read_text())
    raw["rlhf"] = {"algorithm": "grpo", "micro_batch_size": 8, "num_generations": 4, "rewards": [reward]}
    (tmp_path / "code.jsonl").write_text(json.dumps({"prompt": "Write add.", "answer": "", "tests": ADD_TESTS}) + "\n")
    raw["data"]["prompts"] = {"kind": "files", "train": str(tmp_path / "code.jsonl")}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("reward, message", [
    ({"kind": "code_tests", "timeout_s": 0}, r"rlhf.rewards\[0\].timeout_s: Input should be greater than 0"),
    ({"kind": "code_tests", "memory_mb": 8}, r"rlhf.rewards\[0\].memory_mb: Input should be greater than or equal to 64"),
    ({"kind": "code_tests", "isolation": "none"}, r"rlhf.rewards\[0\].isolation: Input should be 'required' or 'limits_only'"),
    ({"kind": "code_tests", "pattern": "x"}, r"rlhf.rewards\[0\].pattern: not used by kind code_tests \(it reads: "
                                             r"code, tests_field, timeout_s, memory_mb, isolation\)"),
    ({"kind": "exact_match", "timeout_s": 3}, r"rlhf.rewards\[0\].timeout_s: not used by kind exact_match"),
])
def test_code_tests_settings_are_checked_at_load(tmp_path, reward, message):
    with pytest.raises(ConfigError, match=message):
        load(config_with(tmp_path, reward))


def test_a_code_tests_config_loads(tmp_path):
    cfg = load(config_with(tmp_path, {"kind": "code_tests", "tests_field": "checks", "timeout_s": 2}))
    assert cfg.rlhf.rewards[0].tests_field == "checks" and cfg.rlhf.rewards[0].isolation == "required"


def test_rows_without_runnable_tests_are_refused_naming_file_line_and_field(tmp_path):
    from tasks.rlhf import checks

    rows = [{"prompt": "Write add.", "answer": "", "checks": ADD_TESTS},
            {"prompt": "Write add.", "answer": "", "checks": "assert add(1, 1) == 2"},
            {"prompt": "Write add.", "answer": "", "checks": ["assert add(1, 1) =="]},
            {"prompt": "Write add.", "answer": "", "checks": [{"input": "1 1"}]},
            {"prompt": "Write add.", "answer": ""}]
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "prompts" / "heldout.jsonl").write_text(json.dumps(rows[0]) + "\n")
    cfg = load(config_with(tmp_path, {"kind": "code_tests", "tests_field": "checks"})).rlhf
    train = tmp_path / "prompts" / "train.jsonl"
    key = "rlhf.rewards[0].tests_field"
    assert checks.code_tests_row_errors(cfg, tmp_path) == [
        f"{key}: {train}:2: field 'checks': expected a non-empty list of tests, got str",
        f"{key}: {train}:3: field 'checks': test 0: not valid Python (line 1: invalid syntax)",
        f"{key}: {train}:4: field 'checks': test 0: an input/output test is an object with exactly the string fields "
        "input and output (got fields ['input'])",
        f"{key}: {train}:5: field 'checks': missing (the test cases the code_tests reward runs)"]
