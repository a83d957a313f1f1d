"""Fault classes (issue 12, item 4), each produced for real by a real process: only a rank killed by a signal or a
lost peer is retried; an OOM kill (a real memory cgroup), a full disk (/dev/full), a non-finite loss and an ordinary
exception fail at once, with their cause in the message."""
from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path

import pytest

from conftest import REPO
from flows import step_retries
from tasks import events, launch

# fast per test: a module-wide fast mark would put the slow engine tests into `make test-fast` too
pytestmark = pytest.mark.reliability


def _fail(code: str, env: dict | None = None) -> launch.LaunchError:
    with pytest.raises(launch.LaunchError) as info:
        launch.run([sys.executable, "-c", code], name="rank", timeout=120, env=env)
    return info.value


@pytest.mark.fast
def test_rank_killed_by_a_signal_is_infrastructure(record_property):
    record_property("fault", "rank SIGKILLed")
    e = _fail("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert step_retries.failure_class(e, step_retries.oom_kills()) == "infrastructure"


@pytest.mark.slow
def test_lost_peer_is_infrastructure(record_property, tmp_path):
    """Two real gloo ranks; rank 1 dies, rank 0 loses its peer mid all_reduce."""
    record_property("fault", "lost peer")
    code = (
        "import os, signal, torch, torch.distributed as dist\n"
        "rank = int(os.environ['RANK'])\n"
        "dist.init_process_group('gloo', init_method='file://%s', rank=rank, world_size=2)\n"
        "dist.barrier()\n"
        "if rank == 1: os.kill(os.getpid(), signal.SIGKILL)\n"
        "dist.all_reduce(torch.ones(1))\n"
    ) % (tmp_path / "rendezvous")
    script = tmp_path / "rank.py"
    script.write_text(code)
    with pytest.raises(launch.LaunchError) as info:
        launch.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                    str(launch_port()), str(script)], name="ranks", timeout=180, env={"OMP_NUM_THREADS": "1"})
    assert step_retries.failure_class(info.value, step_retries.oom_kills()) == "infrastructure", info.value.tail[-10:]


def launch_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.fast
def test_disk_full_is_not_retried(record_property):
    record_property("fault", "ENOSPC in a rank")
    e = _fail("open('/dev/full', 'w').write('x' * 100000)")
    assert step_retries.failure_class(e, step_retries.oom_kills()) == "disk full"


@pytest.mark.fast
def test_a_memory_error_in_a_worker_is_announced_and_decides(record_property):
    """A worker's main runs under events.causes_announced: Python's MemoryError is announced by the rank as
    OUT_OF_MEMORY, and that event decides even when the log's last lines say nothing of memory."""
    record_property("fault", "MemoryError in a rank")
    e = _fail(f"import sys; sys.path.insert(0, {str(REPO)!r})\nfrom tasks import events\n"
              "with events.causes_announced():\n    bytearray(1 << 60)")
    assert [(f.cause, f.detail) for f in e.failures] == [(events.EngineCause.OUT_OF_MEMORY, "rank 0: MemoryError")]
    assert step_retries.failure_class(e) == "out of memory"
    assert step_retries.failure_class(launch.LaunchError("rank", 1, ["(the tail lost to other ranks' lines)"],
                                                        failures=e.failures)) == "out of memory"


@pytest.mark.fast
def test_ordinary_exception_is_not_retried(record_property):
    record_property("fault", "ordinary exception")
    e = _fail("raise ValueError('a bug')")
    assert step_retries.failure_class(e, step_retries.oom_kills()) == "error"


@pytest.mark.slow
def test_a_diverging_finetune_stops_at_its_first_non_finite_loss(record_property, tmp_path, monkeypatch, tiny_config,
                                                                 data_dir, hf_checkpoint):
    """The real DeepSpeed worker, one rank, lr 1e12: past the warm-up's first step (lr 0) one update blows the weights
    up and a later step's loss is NaN. The stage stops there, once, naming that step, before any checkpoint."""
    record_property("fault", "non-finite loss")
    monkeypatch.setenv("BATON_INFRA_RETRY_DELAY_S", "0")  # were it retried, the retry would start at once
    error = _run_finetune_into_divergence(tmp_path, tiny_config, data_dir, hf_checkpoint)
    message = str(error).splitlines()[0]
    assert "(non-finite loss; not retried)" in message, message
    # the rank announced the cause it found; its words are not searched for: the same log without the event is an
    # ordinary error, so the event alone decided
    assert [f.cause for f in error.failures] == [events.EngineCause.NON_FINITE_LOSS]
    assert step_retries.failure_class(launch.LaunchError("finetune", error.returncode, error.tail)) == "error"
    named = re.search(r"non-finite loss nan at step (\d+) \(micro-batch 0\)", message)
    assert named, message
    finite_steps = _reported_finite_losses(tmp_path / "engine.log")
    assert len(finite_steps) >= 2, finite_steps  # past the step that blew the weights up
    assert int(named.group(1)) == max(finite_steps) + 1, (message, finite_steps)  # the first step without a loss
    assert _worker_starts(tmp_path / "engine.log") == 1
    assert not (tmp_path / "checkpoint" / "latest").exists()


def _run_finetune_into_divergence(work: Path, tiny_config, data_dir: Path, hf_checkpoint: Path) -> launch.LaunchError:
    from flows.chain_planner import Step
    from tasks.finetune.config import FinetuneConfig
    from tasks.stage import StageContext

    cfg = FinetuneConfig(nproc_per_node=1, steps=6, micro_batch_size=4, max_seq_length=64, lr=1e12, warmup_steps=1,
                         checkpoint_every=6, gate={"metric": "heldout_loss"}, timeout_s=300)
    ctx = StageContext(stage="finetune", run_id="test", run_dir=work, work_dir=work,
                       model=tiny_config.model.model_dump(), seed=0, data_dir=data_dir, input=hf_checkpoint,
                       input_format="hf-safetensors")
    step = Step(name="finetune", label="finetune", consumes="hf-safetensors", produces="deepspeed-zero")
    with pytest.raises(launch.LaunchError) as info:
        step_retries.run_with_retries(step, ctx, cfg)
    return info.value


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["dpo", "grpo"])
def test_a_diverging_rlhf_run_stops_at_its_first_non_finite_step(algorithm, record_property, tmp_path, monkeypatch,
                                                                 tiny_config, data_dir, hf_checkpoint):
    """The real TRL worker, lr 1e12: one Adam step moves every weight by about 1e12, and the logits of the next forward
    are NaN (DPO: its next loss; GRPO: its next rollout's sampling, its own loss and norm staying finite). The stage
    stops at that step, once, announcing the cause, before the step's checkpoint (one is due every step) is saved.
    Without the check, DPO ran to its end and failed its gate on an L1 round trip (NaN != NaN), and GRPO crashed in
    torch.multinomial: an ordinary error."""
    record_property("fault", f"non-finite {algorithm}")
    monkeypatch.setenv("BATON_INFRA_RETRY_DELAY_S", "0")  # were it retried, the retry would start at once
    work = tmp_path / "work"
    work.mkdir()
    error = _run_rlhf_into_divergence(algorithm, work, tiny_config, data_dir, hf_checkpoint)
    message = str(error).splitlines()[0]
    assert "(non-finite loss; not retried)" in message, message
    assert [f.cause for f in error.failures] == [events.EngineCause.NON_FINITE_LOSS]
    named = re.search(r"rank 0: non-finite .+ at step (\d+);", error.failures[0].detail)
    assert named, error.failures[0].detail
    logged = _logged_events(work / "engine.log")
    trained = [e["step"] for e in logged if e["kind"] == "metric" and events.TRAIN_LOSS in e]
    assert trained and int(named.group(1)) == max(trained), (error.failures[0].detail, trained)
    assert [e["kind"] for e in logged].count("start") == 1  # not retried
    assert not (work / "checkpoint").exists() and not (work / "checkpoint.partial").exists()
    assert not list((work / "checkpoint.partial.trl").glob("checkpoint-*")), "no checkpoint of a diverged step"


def _run_rlhf_into_divergence(algorithm: str, work: Path, tiny_config, data_dir: Path,
                              hf_checkpoint: Path) -> launch.LaunchError:
    from flows.chain_planner import Step
    from tasks.rlhf.config import RlhfConfig
    from test_rlhf_trl import make_ctx, prompts_data

    common = dict(algorithm=algorithm, steps=4, micro_batch_size=8, lr=1e12, checkpoint_every=1, timeout_s=300)
    if algorithm == "grpo":  # a reward that differs between a prompt's completions, so the first step has a gradient
        data_dir = prompts_data(data_dir, work.parent / "data")
        cfg = RlhfConfig(**common, num_generations=4, max_completion_length=4, beta=0.0,
                         rewards=[{"kind": "length", "min_chars": 0, "max_chars": 4}])
    else:
        cfg = RlhfConfig(**common)
    step = Step(name="rlhf", label="rlhf", consumes="hf-safetensors", produces="hf-safetensors")
    with pytest.raises(launch.LaunchError) as info:
        step_retries.run_with_retries(step, make_ctx(work, tiny_config, data_dir, hf_checkpoint), cfg)
    return info.value


def _logged_events(engine_log: Path) -> list[dict]:
    return [e for e in map(events.parse, engine_log.read_text().splitlines()) if e]


def _reported_finite_losses(engine_log: Path) -> dict[int, float]:
    """The training loss the worker reported for each step, from its metric events."""
    found = (events.parse(line) for line in engine_log.read_text().splitlines())
    losses = {e["step"]: e[events.TRAIN_LOSS] for e in found if e and e["kind"] == "metric" and events.TRAIN_LOSS in e}
    assert all(math.isfinite(v) for v in losses.values()), losses
    return losses


def _worker_starts(engine_log: Path) -> int:
    """How many times the worker reached training (its rank 0 announces where it starts, once per launch)."""
    return engine_log.read_text().count("training examples")


def _child_memory_cgroup(limit: int) -> Path | None:
    root = step_retries._memory_cgroup()
    if root is None or not root.exists():
        return None
    child = root / f"baton-test-{os.getpid()}"
    try:
        child.mkdir()
        name = "memory.limit_in_bytes" if (child / "memory.limit_in_bytes").exists() else "memory.max"
        (child / name).write_text(str(limit))
    except OSError:
        return None
    return child


@pytest.mark.fast
def test_oom_kill_is_not_retried(record_property):
    """A rank in a 64 MB memory cgroup allocates 400 MB: the kernel's OOM killer SIGKILLs it. Without the cgroup's
    oom_kill counter this would look exactly like a preempted rank."""
    record_property("fault", "OOM kill")
    cg = _child_memory_cgroup(64 << 20)
    if cg is None:
        pytest.skip("cannot create a memory cgroup here")
    try:
        before = step_retries.oom_kills()
        e = _fail(f"import os; open({str(cg / 'cgroup.procs')!r}, 'w').write(str(os.getpid()));"
                  "x = bytearray(400 << 20); x[::4096] = b'1' * len(x[::4096])")
        assert e.returncode in (-9, 137)
        assert step_retries.failure_class(e, before) == "out of memory"
    finally:
        cg.rmdir()


@pytest.mark.fast
def test_timeout_is_not_retried(record_property):
    record_property("fault", "hung rank (timeout)")
    with pytest.raises(launch.LaunchError) as info:
        launch.run([sys.executable, "-c", "import time; time.sleep(60)"], name="rank", timeout=2)
    assert step_retries.failure_class(info.value) == "timeout"
