"""Slurm: one node launcher per node through `srun`, from inside an allocation or from a generated sbatch script.

Outside an allocation, `python -m tasks.distributed.slurm --spec-json SLURM_JOB_SPEC` (a SlurmJobSpec) writes
`<work_dir>/slurm/job.sbatch`, submits it with `sbatch --wait`, streams its log while it runs, exits with the job's
exit code, and `scancel`s the job when it is itself terminated (Prefect cancellation, timeout). submitit is not used:
it pickles a Python callable and writes one log per task, while a stage needs a plain command whose rank-0 lines
stream back unchanged (they carry the worker's events).
"""
from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tasks import events
from tasks.distributed import NODE_MODULE, Launch, NodeSpec, SlurmJobSpec
from tasks.distributed.node import die_with_parent


def srun_command(launch: Launch, runtime: dict) -> list[str]:
    """srun: one task per node, each running `tasks.distributed.node` (which starts that node's launcher)."""
    image = ["--container-image", runtime["image"]] if runtime.get("image") else []  # pyxis/enroot, when installed
    return ["srun", "--nodes", str(launch.nnodes), "--ntasks-per-node", "1", "--kill-on-bad-exit=1", *image,
            *runtime.get("srun_args", []), launch.python, "-m", NODE_MODULE,
            *events.inline_spec_args(NodeSpec(launch=launch, placement=None))]


def sbatch_script(launch: Launch, runtime: dict, log: Path) -> str:
    lines = ["#!/bin/bash", f"#SBATCH --nodes={launch.nnodes}", "#SBATCH --ntasks-per-node=1",
             "#SBATCH --job-name=baton", f"#SBATCH --output={log}",
             *(f"#SBATCH {a}" for a in runtime.get("sbatch_args", [])),
             "set -eo pipefail", "exec " + shlex.join(srun_command(launch, runtime))]
    return "\n".join(lines) + "\n"


def submit_command(launch: Launch, runtime: dict, work_dir: Path) -> list[str]:
    spec = SlurmJobSpec(launch=launch, runtime=runtime, work_dir=work_dir)
    return [launch.python, "-m", "tasks.distributed.slurm", *events.inline_spec_args(spec)]


def stream_file(path: Path, done: threading.Event) -> None:
    """Print the file's lines as they are written, until done is set and the file is drained."""
    pos = 0
    while True:
        finished = done.is_set()
        if path.exists():
            with path.open("r", errors="replace") as f:
                f.seek(pos)
                chunk = f.read()
                complete = chunk[:chunk.rfind("\n") + 1] if not finished else chunk
                pos += len(complete.encode())
            if complete:
                sys.stdout.write(complete if complete.endswith("\n") else complete + "\n")
                sys.stdout.flush()
        if finished:
            return
        time.sleep(0.5)


def submit_and_follow(script: Path, log: Path) -> int:
    # sbatch --wait dies with us: left alone it would poll slurmctld for a job nobody follows any more
    sbatch = subprocess.Popen(["sbatch", "--wait", "--parsable", str(script)], stdout=subprocess.PIPE, text=True,
                              preexec_fn=die_with_parent)
    job_id = (sbatch.stdout.readline().strip().split(";") or [""])[0]
    print(f"submitted Slurm job {job_id}: {script}", flush=True)

    def cancel(signum, frame):
        print(f"cancelling Slurm job {job_id}", flush=True)
        subprocess.run(["scancel", job_id], check=False)
        if sbatch.poll() is None:
            sbatch.terminate()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, cancel)
    done = threading.Event()
    tail = threading.Thread(target=stream_file, args=(log, done), daemon=True)
    tail.start()
    rc = sbatch.wait()
    done.set()
    tail.join(timeout=30)
    return rc


def main(spec: SlurmJobSpec) -> int:
    folder = spec.work_dir / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "job.log"
    log.unlink(missing_ok=True)
    script = folder / "job.sbatch"
    script.write_text(sbatch_script(spec.launch, spec.runtime, log))
    return submit_and_follow(script, log)


if __name__ == "__main__":
    sys.exit(main(events.read_typed_spec(SlurmJobSpec)))
