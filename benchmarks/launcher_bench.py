"""What baton's launcher costs per training step, apart from any engine: a worker prints N steps of one plain line,
one metric event (6 values) and one progress event as fast as it can; `tasks.streaming.launch_streaming` reads them
(engine.log, event parsing, the step logger) with and without the MLflow sink (a real SQLite store in a temporary
BATON_HOME). Reported: this process's CPU time per step (getrusage: the reader and the sink's sender thread).

    .venv/bin/python benchmarks/launcher_bench.py [STEPS]
"""
from __future__ import annotations

import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
CHILD = """import sys
from tasks import events
n = int(sys.argv[1])
for i in range(1, n + 1):
    print(f"iteration {i}: a plain log line of the engine", flush=True)
    events.metric(i, {events.TRAIN_LOSS: 2.0, events.TRAIN_LR: 1e-3, events.TRAIN_GRAD_NORM: 1.0,
                      events.TOKENS_PER_S: 1000.0, events.STEP_TIME_S: 0.5, events.MFU: 0.1})
    events.progress(i, n)
"""


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(steps: int) -> None:
    home = Path(tempfile.mkdtemp(prefix="launcher-bench-"))
    os.environ["BATON_HOME"] = str(home)
    from tasks import streaming, tracking
    from tasks.stage import StageContext

    c = tracking.client()
    cmd = [sys.executable, "-c", CHILD, str(steps)]
    try:
        _measure(c, cmd, home, steps, streaming, StageContext)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _measure(c, cmd, home: Path, steps: int, streaming, StageContext) -> None:
    from tasks import tracking

    warm = StageContext(stage="pretrain", run_id="bench", run_dir=home, work_dir=home / "warm", model={}, seed=0)
    streaming.launch_streaming(warm, cmd[:-1] + ["10"], name="pretrain", env={"PYTHONPATH": str(REPO)}, timeout=None)
    for sink in (False, True):  # after a warm-up launch (the first one imports Prefect's logger)
        run = c.create_run(tracking.experiment_id(c, "launcher-bench")).info.run_id if sink else None
        ctx = StageContext(stage="pretrain", run_id="bench", run_dir=home, work_dir=home / "w", model={}, seed=0,
                           mlflow_run_id=run)
        c0, t0 = cpu_s(), time.perf_counter()
        streaming.launch_streaming(ctx, cmd, name="pretrain", env={"PYTHONPATH": str(REPO)}, timeout=None)
        cpu = cpu_s() - c0
        print(f"MLflow sink {'on ' if sink else 'off'}: {steps} steps in {time.perf_counter() - t0:.2f} s, reader CPU "
              f"{cpu:.2f} s = {cpu / steps * 1e3:.2f} ms per step (3 lines, 6 metrics)", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
