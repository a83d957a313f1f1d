"""A user's environment class (rlhf.environment) for multi-turn GRPO episodes, one killable child process per
episode (tasks/rlhf/environment_child.py): a call that hangs past its timeout kills that episode's child only, so
the other episodes of the batch keep their state.

The class, in the user's file (checked before launch: tasks/rlhf/checks.py):

    class Quiz:
        def reset(self, prompt, **row):        # an episode starts: the prompt's text and the row's other columns
            self.answer = row["answer"]
            return None                        # or a string: the episode's first message, instead of the prompt's
        def step(self, reply):                 # after each model answer (a turn without a tool call)
            if reply.strip() == self.answer:
                return None, 1.0, True         # (the next user message or None, a reward, done)
            return "Try again.", 0.0, False
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CHILD = Path(__file__).with_name("environment_child.py")


@dataclass(frozen=True)
class EnvironmentCode:
    path: str
    name: str
    source: str


@dataclass(frozen=True)
class Reply:
    """A call's outcome: its value, or why it failed (raised: the message; timed_out: killed)."""

    value: object = None
    raised: str | None = None
    timed_out: bool = False


class EpisodeEnvironment:
    """One episode's instance of the user's class, in its own child process."""

    def __init__(self, code: EnvironmentCode, timeout_s: float):
        """Starts the child and hands it the class (episodes' children start side by side; reset waits for it)."""
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen([sys.executable, "-I", str(CHILD)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=None, text=True, start_new_session=True)
        self._send({"source": code.source, "path": code.path, "name": code.name})

    def reset(self, prompt: str, row: dict) -> Reply:
        """The instance's reset; its value: the episode's first message, or None (the data's prompt)."""
        made = self._answer()
        return made if made.raised or made.timed_out else self._call({"op": "reset", "prompt": prompt, "row": row})

    def step(self, reply: str) -> Reply:
        return self._call({"op": "step", "reply": reply})

    def _call(self, job: dict) -> Reply:
        sent = self._send(job)
        return sent if sent is not None else self._answer()

    def _send(self, job: dict) -> Reply | None:
        if self.proc.poll() is not None:
            return Reply(raised=f"the environment's process exited ({self.proc.returncode})")
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return Reply(raised="the environment's process exited")
        return None

    def _answer(self) -> Reply:
        if self.proc.stdout.closed:
            return Reply(raised="the environment's process was stopped")
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        if not ready:
            self.close()
            return Reply(timed_out=True)
        line = self.proc.stdout.readline()
        if not line:
            return Reply(raised=f"the environment's process exited ({self.proc.wait()})")
        answer = json.loads(line)
        return Reply(raised=answer["raised"]) if "raised" in answer else Reply(answer["ok"])

    def close(self) -> None:
        """The child and anything it started in its process group."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
