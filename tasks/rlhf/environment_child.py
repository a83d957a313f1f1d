"""One episode's environment (rlhf.environment), run by tasks/rlhf/environment.py as `python -I` in a child process
of its own, so a call that hangs is ended by killing it. JSON lines on stdin/stdout:

    first line   {"source": <the file's text>, "path": ..., "name": <the class>}   → {"ok": null}
    then         {"op": "reset", "prompt": ..., "row": {...}}                      → {"ok": <first message or null>}
                 {"op": "step", "reply": ...}                                      → {"ok": [message, reward, done]}

A call that raises answers {"raised": "<type>: <message>"}. What the user's code prints goes to stderr: stdout is the
channel.
"""
from __future__ import annotations

import json
import os
import sys


def answer(channel, obj: dict) -> None:
    channel.write(json.dumps(obj) + "\n")
    channel.flush()


def checked_first_message(result, environment: str) -> str | None:
    """reset's optional first message, checked: a string, or None to keep the data's prompt."""
    if result is not None and not isinstance(result, str):
        raise TypeError(f"{environment}: reset must return the episode's first message (a string) or None, "
                        f"got {type(result).__name__}")
    return result


def checked_step(result) -> list:
    """step's (message or None, reward, done), checked: the parent trusts nothing else."""
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        raise TypeError(f"step must return (message or None, reward, done), got {type(result).__name__}")
    message, reward, done = result
    if message is not None and not isinstance(message, str):
        raise TypeError(f"step's message must be a string or None, got {type(message).__name__}")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise TypeError(f"step's reward must be a number, got {type(reward).__name__}")
    return [message, float(reward), bool(done)]


def main() -> None:
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # the user's prints go to stderr
    sys.stdout = sys.stderr
    lines = iter(sys.stdin)
    first = json.loads(next(lines))
    sys.path.insert(0, os.path.dirname(first["path"]))
    instance = None
    try:
        namespace = {"__name__": "baton_environment", "__file__": first["path"]}
        exec(compile(first["source"], first["path"], "exec"), namespace)
        instance = namespace[first["name"]]()
        answer(channel, {"ok": None})
    except BaseException as e:  # the class cannot even be made: every call of this episode fails the same way
        answer(channel, {"raised": f"{type(e).__name__}: {e}"})
        return
    for line in lines:
        job = json.loads(line)
        try:
            if job["op"] == "reset":
                environment = f"{first['path']}:{first['name']}"
                answer(channel, {"ok": checked_first_message(instance.reset(job["prompt"], **job["row"]), environment)})
            else:
                answer(channel, {"ok": checked_step(instance.step(job["reply"]))})
        except BaseException as e:
            answer(channel, {"raised": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
