"""Verifiable rewards for RL on prompts with answers (rlhf.rewards): each scores one completion of one data row.

Built-ins (0.0 or 1.0, but code_tests: a fraction):
    exact_match   the completion's final answer (extract: last_number | boxed | regex group 1 | full) equals the row's
                  reference (column `answer_field`); numbers compare as numbers ("7.0" = "7")
    regex         the pattern is found in the completion (re.search; anchor it with ^ and $ for a whole-reply format)
    json_schema   the completion, stripped, is JSON that the schema accepts
    length        min_chars <= characters of the stripped completion <= max_chars
    code_tests    the fraction of the row's test cases (column `tests_field`) that the completion's code
                  (its last ```python block, or the whole reply: `code`) passes, run in tasks/rlhf/sandbox.py's
                  sandboxed subprocess (timeout_s, memory_mb, isolation); no code block scores 0
A user function (`kind: function`, `function: path/to/rewards.py:fn`) is called as fn(prompt, completion, **row): prompt
is the text of the row's last user message, completion the generated text, row every other column of the data row
(answer, and any column of its own); it returns a float.

Pure: no torch, no trainer. The worker (tasks/rlhf/worker.py) scores with these, the config check reads the same specs.
A spec is a whole rlhf.rewards entry (tasks.events.RewardSpec): every key present, the defaults are the config's.
"""
from __future__ import annotations

import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from . import sandbox
from conversions.refusal import Refused

NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
BOXED = "\\boxed{"
CODE_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.S | re.I)  # tagged python, or untagged


class RewardError(Refused):
    """A reward could not score a row: the message names the reward and the row."""


# ---- final-answer extraction ----------------------------------------------------------------------------------------
def last_number(text: str) -> str | None:
    found = NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...}, nested braces included; None when there is none or it never closes."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(BOXED)
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len(BOXED):i]
        i += 1
    return None


def regex_group(text: str, pattern: str) -> str | None:
    """Group 1 (or the whole match, for a pattern without groups) of the pattern's last match."""
    matches = list(re.finditer(pattern, text))
    if not matches:
        return None
    last = matches[-1]
    return last.group(1) if last.re.groups else last.group(0)


def extract(text: str, how: str, pattern: str | None = None) -> str | None:
    if how == "last_number":
        return last_number(text)
    if how == "boxed":
        return last_boxed(text)
    if how == "regex":
        return regex_group(text, pattern)
    return text


def same_answer(found: str | None, reference: str) -> bool:
    if found is None:
        return False
    found, reference = found.strip(), str(reference).strip()
    try:
        return math.isclose(float(found.replace(",", "")), float(reference.replace(",", "")), rel_tol=1e-9,
                            abs_tol=1e-9)
    except ValueError:
        return found == reference


# ---- the built-ins --------------------------------------------------------------------------------------------------
def exact_match(completion: str, row: dict, spec: dict) -> float:
    field = spec["answer_field"]
    if field not in row:
        raise KeyError(f"the row has no column {field!r} (answer_field)")
    return float(same_answer(extract(completion, spec["extract"], spec["pattern"]), row[field]))


def regex(completion: str, row: dict, spec: dict) -> float:
    return float(re.search(spec["pattern"], completion) is not None)


def json_schema(completion: str, row: dict, spec: dict) -> float:
    import jsonschema

    try:
        value = json.loads(completion.strip())
    except ValueError:
        return 0.0
    return float(jsonschema.Draft202012Validator(spec["json_schema"]).is_valid(value))


def length(completion: str, row: dict, spec: dict) -> float:
    n = len(completion.strip())
    low, high = spec["min_chars"], spec["max_chars"]
    return float((low is None or n >= low) and (high is None or n <= high))


def code_of(completion: str, how: str) -> str | None:
    """The code to run: the last closed ```python (or untagged) block, or the whole reply; None when there is no
    block (a reply cut off inside its block has none)."""
    if how == "full":
        return completion
    blocks = CODE_BLOCK.findall(completion)
    return blocks[-1] if blocks else None


def code_tests(completion: str, row: dict, spec: dict) -> float:
    field = spec["tests_field"]
    if field not in row:
        raise KeyError(f"the row has no column {field!r} (tests_field)")
    if problem := sandbox.tests_problem(row[field]):
        raise ValueError(f"column {field!r}: {problem}")
    code = code_of(completion, spec["code"])
    if code is None:
        return 0.0
    limits = sandbox.Limits(timeout_s=spec["timeout_s"], memory_mb=spec["memory_mb"], isolation=spec["isolation"])
    return sandbox.run_tests(code, row[field], limits).fraction


BUILT_INS: dict[str, Callable[[str, dict, dict], float]] = {
    "exact_match": exact_match, "regex": regex, "json_schema": json_schema, "length": length,
    "code_tests": code_tests}


# ---- one reward, any kind, scoring rows ------------------------------------------------------------------------------
def user_function(source: str, path: str, name: str) -> Callable:
    """The function `name` of a rewards file whose text the stage read (and checked) once: compiled from that text,
    so what was checked is what runs."""
    namespace: dict = {"__name__": f"baton_rewards_{re.sub(r'[^A-Za-z0-9_]', '_', name)}", "__file__": path}
    exec(compile(source, path, "exec"), namespace)
    fn = namespace.get(name)
    if not callable(fn):
        raise RewardError(f"{path}: {name} is not a function after running the file")
    return fn


def last_user_text(prompt: list[dict]) -> str:
    return next(m["content"] for m in reversed(prompt) if m["role"] == "user")


@dataclass
class Reward:
    """One configured reward: its name (as TRL logs it), weight, and how it scores (prompt, completion, row)."""

    name: str
    weight: float
    score_one: Callable[[str, str, dict], float]
    concurrent: bool = False  # its completions may be scored at once (code_tests: each waits on its own subprocess)

    def score(self, prompt: str, completion: str, row: dict, where: str) -> float:
        try:
            value = self.score_one(prompt, completion, row)
            value = float(value)
        except Exception as e:  # a user function's own error: say which reward and which row
            raise RewardError(f"reward {self.name} failed on {where} (prompt {prompt[:60]!r}, completion "
                              f"{completion[:60]!r}): {type(e).__name__}: {e}") from e
        if math.isnan(value):
            raise RewardError(f"reward {self.name} returned NaN on {where} (prompt {prompt[:60]!r})")
        return value

    def score_many(self, items: list[tuple[str, str, dict, str]]) -> list[float]:
        """score() of each (prompt, completion, row, where), in order; a concurrent reward's on one thread per core
        (the first failing item, in order, is the error raised)."""
        if not self.concurrent or len(items) < 2:
            return [self.score(*item) for item in items]
        with ThreadPoolExecutor(max_workers=min(len(items), os.cpu_count() or 1)) as pool:
            return list(pool.map(lambda item: self.score(*item), items))


def build(spec: dict, index: int) -> Reward:
    """A reward from its spec (the rlhf.rewards entry, a user function with the text of its file)."""
    kind = spec["kind"]
    if kind == "function":
        fn = user_function(spec["source"], spec["path"], spec["name"])
        return Reward(f"{index}_{spec['name']}", spec["weight"],
                      lambda prompt, completion, row: fn(prompt, completion, **row))
    check = BUILT_INS[kind]
    return Reward(f"{index}_{kind}", spec["weight"], lambda prompt, completion, row: check(completion, row, spec),
                  concurrent=kind == "code_tests")


def row_fields(row: dict) -> dict:
    """What a reward sees of a canonical prompts row besides the prompt: the answer and every other column."""
    return {k: v for k, v in row.items() if k != "prompt"}


def solved(scores: list[float]) -> bool:
    """Every reward gave its full mark (1.0: the built-ins' pass; a user function's solved)."""
    return all(s >= 1.0 for s in scores)
