"""Which engine failures a step retries, and the retry loop: only an infrastructure fault runs the stage's task again,
in the same work dir so the engine resumes; every other cause fails the step at once, named in its one-line error."""
from __future__ import annotations

import os
import time
from pathlib import Path

from prefect import get_run_logger

from flows.chain_planner import Step
from tasks import orchestration
from tasks.events import EngineCause
from tasks.launch import LaunchError
from tasks.registry import STAGES
from tasks.stage import StageContext, StageOutput


# Only an infrastructure fault (a rank or launcher killed by a signal: preemption, a lost node; or a lost peer) is
# retried, in the same work dir, so the engine resumes from its last complete checkpoint. Everything else fails at once
# with its cause: an OOM kill (the same size fails again), a full disk, a non-finite loss, a timeout (a hang), an exit
# code (a bug, bad input). A cause baton's own code finds in a rank (a non-finite loss, ENOSPC in a save, a MemoryError)
# arrives as the rank's failure event (tasks.events.failure); the marks below are for causes from outside it.
# A rank killed by a signal is only text, in torch 2.x too: torchrun then exits 1, and its error file
# (TORCHELASTIC_ERROR_FILE) is a copy of the failed rank's own, which a killed rank never writes.
KILLED_MARKS = ("return code = -9", "exitcode  : -9", "Signal 9 (SIGKILL)", "SIGKILL", "Connection reset by peer",
                "Connection closed by peer")
FATAL_MARKS = {  # what torch, DeepSpeed, transformers and the OS print
    EngineCause.DISK_FULL: ("No space left on device", "ENOSPC"),
    EngineCause.NON_FINITE_LOSS: ("loss is nan", "loss is inf"),
    EngineCause.OUT_OF_MEMORY: ("MemoryError", "OutOfMemoryError", "CUDA out of memory"),
}


def run_with_retries(step: Step, ctx: StageContext, stage_cfg) -> StageOutput:
    """BATON_INFRA_RETRIES (default 2) retries after BATON_INFRA_RETRY_DELAY_S (default 10) seconds."""
    retries = int(os.environ.get("BATON_INFRA_RETRIES", "2"))
    delay = float(os.environ.get("BATON_INFRA_RETRY_DELAY_S", "10"))
    task = STAGES[step.name].load_task()
    if orchestration.lost():  # a Prefect task run first asks the server for its tags' concurrency slots
        task = getattr(task, "fn", task)
    for attempt in range(retries + 1):
        before = oom_kills()
        try:
            return task(ctx, stage_cfg)
        except LaunchError as e:
            cause = failure_class(e, before)
            if cause != EngineCause.INFRASTRUCTURE:
                raise LaunchError(f"{str(e).splitlines()[0]} ({cause}; not retried){cause_line(e, cause)}",
                                  e.returncode, e.tail, timed_out=e.timed_out, failures=e.failures) from None
            if attempt == retries:
                raise
            get_run_logger().warning("%s: infrastructure failure (%s); retry %d of %d in %.0fs, resuming from the last "
                                     "checkpoint in %s", step.label, str(e).splitlines()[0], attempt + 1, retries,
                                     delay, ctx.work_dir)
            time.sleep(delay)
    raise AssertionError("unreachable")


def failure_class(e: LaunchError, oom_kills_before: int | None = None) -> EngineCause:
    """INFRASTRUCTURE (retried) or the cause that fails the stage at once: TIMEOUT, OUT_OF_MEMORY (an OOM kill or a
    MemoryError), DISK_FULL, NON_FINITE_LOSS, ERROR."""
    if e.timed_out:
        return EngineCause.TIMEOUT
    if e.failures:  # the first rank that found its cause said so: nothing to guess from text
        return e.failures[0].cause
    text = "\n".join(e.tail)
    for cause, marks in FATAL_MARKS.items():  # first: a rank's real cause beats its peers' "connection closed"
        if any(m in text for m in marks):
            return cause
    if oom_kills_before is not None and oom_kills() > oom_kills_before:
        return EngineCause.OUT_OF_MEMORY
    rc = e.returncode
    if (rc is not None and (rc < 0 or rc >= 128)) or any(m in text for m in KILLED_MARKS):
        return EngineCause.INFRASTRUCTURE
    return EngineCause.ERROR


def cause_line(e: LaunchError, cause: EngineCause) -> str:
    """': <the line that names the cause>': the announcing rank's own (its failure event), else the engine's line
    with the most of the cause's marks (the first of those), so the stage's one-line error says it; '' when none
    does."""
    announced = [f.detail for f in e.failures if f.cause == cause]
    if announced:
        return f": {announced[0].strip()[:600]}"
    marks = FATAL_MARKS.get(cause, ())
    hits = [(sum(m in line for m in marks), -i, line) for i, line in enumerate(e.tail)]
    best = max(hits, default=(0, 0, ""))
    return f": {best[2].strip()[:600]}" if best[0] else ""


def oom_kills() -> int:
    """OOM kills so far in this process's memory cgroup and every cgroup below it (v1 memory.oom_control or v2
    memory.events); 0 where the kernel does not say."""
    root = _memory_cgroup()
    total = 0
    if root is None:
        return 0
    for dirpath, _dirs, files in os.walk(root):
        for name in ("memory.events", "memory.oom_control"):
            if name in files:
                try:
                    for line in Path(dirpath, name).read_text().splitlines():
                        key, _, value = line.partition(" ")
                        if key == "oom_kill":
                            total += int(value)
                except (OSError, ValueError):
                    pass
    return total


def _memory_cgroup() -> Path | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    v2 = [line for line in lines if line.startswith("0::")]
    return Path("/sys/fs/cgroup") / v2[0][3:].lstrip("/") if v2 else None
