"""A problem a config check finds before anything launches: one message for people, naming the key at fault, and that
key (with any other keys the problem is about) as data, so a tool such as `baton doctor` never reads it back out of the
sentence."""
from __future__ import annotations

from dataclasses import dataclass


class ConfigProblem(str):
    """The message itself (a str: callers print, join and compare messages as before), plus `key`, the setting to
    change, and `involves`, the other settings it conflicts with (e.g. `model.num_attention_heads`)."""

    key: str
    involves: tuple[str, ...]

    def __new__(cls, key: str, message: str, involves: tuple[str, ...] = ()) -> ConfigProblem:
        if not message.startswith(key):
            raise ValueError(f"a config problem's message names its key first: {key!r} vs {message!r}")
        self = super().__new__(cls, message)
        self.key, self.involves = key, tuple(involves)
        return self

    def __getnewargs__(self) -> tuple:  # pickling and copying rebuild it from all three
        return self.key, str(self), self.involves


@dataclass
class Finding:
    """One `baton doctor` finding: error (the run would fail or is refused) or warning (it may), its cause in one
    sentence and the fix (a config key or a command). Stages declare their own (StageSpec.advice)."""

    severity: str              # error | warning
    check: str
    cause: str
    fix: str

    def line(self) -> str:
        return f"{self.severity.upper():<7} {self.check}: {self.cause}\n        fix: {self.fix}"
