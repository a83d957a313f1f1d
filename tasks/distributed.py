"""Commands for distributed workers: torchrun on this machine, or across nodes under Slurm.

The runtime named `main` (or the stage's runtime) decides where ranks run:
- `kind: venv` (default): `torchrun --nproc-per-node K` on this host, on a free port;
- `kind: slurm`: `srun --nodes N --ntasks-per-node 1` starts one torchrun per node with a static rendezvous on the first
  node (static is more robust than c10d under Slurm: rank 0 always lands on the first node). GLOO/NCCL socket interfaces
  come from the runtime's `env` when the nodes' hostnames don't resolve to the interface they talk over.
Kubernetes and Ray run the same worker from the container images in infra/docker (see README, "Going multi-node").
"""
from __future__ import annotations

import shlex
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(python: str, script: str, args: list[str], *, nproc_per_node: int, runtime: dict | None = None,
                     master_port: int | None = None) -> list[str]:
    runtime = runtime or {}
    kind = runtime.get("kind", "venv")
    port = master_port or free_port()
    if kind == "venv":
        return [python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc_per_node),
                "--master-addr", "127.0.0.1", "--master-port", str(port), script, *args]
    if kind == "slurm":
        nodes = int(runtime.get("nodes", 1))
        inner = " ".join([
            shlex.quote(python), "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", '"$SLURM_NODEID"',
            "--nproc-per-node", str(nproc_per_node), "--master-addr", '"$BATON_MASTER_ADDR"', "--master-port", str(port),
            shlex.quote(script), *map(shlex.quote, args)])
        head = 'export BATON_MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1); '
        return ["srun", "--nodes", str(nodes), "--ntasks-per-node", "1", "--kill-on-bad-exit=1",
                *runtime.get("srun_args", []), "bash", "-c", head + "exec " + inner]
    raise ValueError(f"runtime kind {kind!r}: run the stage's container image with your cluster's launcher "
                     "(README: Going multi-node)")


def world_size(nproc_per_node: int, runtime: dict | None = None) -> int:
    runtime = runtime or {}
    return nproc_per_node * (int(runtime.get("nodes", 1)) if runtime.get("kind") == "slurm" else 1)
