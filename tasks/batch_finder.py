"""The batch-size finder: the largest micro-batch that fits, found by real probes ("start small and grow it").

Doubles the micro-batch from 1 until a probe fails (GPU: out of memory; CPU: peak RSS above the budget less the margin),
then bisects between the last size that fit and the first that did not. Each probe is a fresh process running a few
real training steps of the stage's model (tasks/finetune/batch_probe.py).
"""
from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

PROBE = Path(__file__).resolve().parent / "finetune" / "batch_probe.py"


def largest_fitting(fits: Callable[[int], bool], limit: int = 4096) -> int:
    """Largest m in [1, limit] with fits(m), assuming fits is monotone (0 when even 1 does not fit)."""
    good, bad, m = 0, None, 1
    while m <= limit:
        if not fits(m):
            bad = m
            break
        good, m = m, m * 2
    if good == 0:
        return 0
    hi = bad if bad is not None else limit + 1
    while hi - good > 1:
        mid = (good + hi) // 2
        if fits(mid):
            good = mid
        else:
            hi = mid
    return good


@dataclass
class Prober:
    """One probe process in the stage's runtime (`python`); remembers every measurement."""
    python: str
    arch: dict
    seq: int
    device: str = "cpu"
    steps: int = 2
    env: dict | None = None
    measured: dict = field(default_factory=dict)      # micro-batch -> probe result
    _proc: subprocess.Popen | None = None

    def start(self) -> None:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(self.arch, f)
        self._arch_file = Path(f.name)
        self._proc = subprocess.Popen(
            [self.python, str(PROBE), "--arch", f.name, "--seq", str(self.seq), "--steps", str(self.steps),
             "--device", self.device], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.env)
        self._read()  # {"ready": true} once torch is imported

    def _read(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"batch probe process exited {self._proc.wait()}")
        return json.loads(line)

    def run(self, micro: int) -> dict:
        if micro not in self.measured:
            if self._proc is None:
                self.start()
            self._proc.stdin.write(f"{micro}\n")
            self._proc.stdin.flush()
            self.measured[micro] = self._read()
        return self.measured[micro]

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()
            self._proc.wait(timeout=60)
            self._arch_file.unlink(missing_ok=True)
            self._proc = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def find(prober: Prober, budget_mb: float | None, margin: float = 0.1, limit: int = 4096) -> int:
    """The largest micro-batch whose probe stays within budget × (1 - margin) MiB (CPU), or does not run out of
    memory with `margin` of the device left (GPU: budget_mb is the device's memory)."""
    allowed = budget_mb * (1 - margin) if budget_mb else None

    def fits(m: int) -> bool:
        r = prober.run(m)
        if r["oom"]:
            return False
        peak = r["gpu_peak_mb"] if prober.device == "cuda" else r["peak_rss_mb"]
        return allowed is None or peak <= allowed

    return largest_fitting(fits, limit)
