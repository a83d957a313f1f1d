"""One launch module for every training stage: the engine command for `nnodes × nproc_per_node` ranks.

A stage describes what to start (`Launch`: python, script, args, layout, launcher `torchrun` or `deepspeed`);
`engine_command(launch, runtime, work_dir)` returns the one command the stage runs (through `ctx.launch`, which streams
its lines and owns its process tree), for the runtime's kind:
- `local` (alias `venv`): the launcher on this host on a free port; with nnodes > 1, this host is one node of a
  rendezvous the caller set up (MASTER_ADDR, MASTER_PORT, NODE_RANK);
- `slurm`: inside an allocation, `srun` starts `tasks.distributed.node` once per node, which runs that node's launcher
  with a static rendezvous on the first node; outside one, `tasks.distributed.slurm` submits a generated sbatch script
  and follows it (log streamed, exit code, scancel on cancellation);
- `ray`: `tasks.distributed.ray_driver` places one Ray task per node (STRICT_SPREAD) against `runtime.address`.
On every node, GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name the interface that routes to the first node.
Each of those three programs takes one typed spec below (NodeSpec, SlurmJobSpec, RayDriverSpec) with `--spec-json`:
the nodes need not share a filesystem with the host that starts them, so the spec travels on the command line.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from conversions.refusal import Refused
from tasks.events import ProgramSpec, inline_spec_args
from tasks.distributed.net import free_port, interface_to, remove_shm_segments  # noqa: F401 (the repo's helpers)

LOCAL_KINDS = ("local", "venv")
NODE_MODULE = "tasks.distributed.node"


class LaunchConfigError(Refused):
    pass


@dataclass(frozen=True)
class Launch:
    """What one training stage starts on every node. The layout, the launcher and the port come from the stage's
    config (TrainingConfig.nnodes, nproc_per_node; finetune.launcher, finetune.master_port), so none has a default
    here: the stage spells every one (pretrain and rlhf: torchrun on a free port)."""

    python: str
    script: str
    nnodes: int
    nproc_per_node: int
    launcher: Literal["torchrun", "deepspeed"]
    master_port: int                             # 0: a free port, picked where the first node can see it
    args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)      # set on every node (values travel on command lines: no secrets)
    inherit: tuple[str, ...] = ()                # names only: every node takes these from the launching process's
    #                                              env (the runtime's env holds tokens; a command line is public)

    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def node_env(self, parent: dict) -> dict:
        """What a node sets: the inherited names' values from `parent` (this launch's environment), then env."""
        return {**{k: parent[k] for k in self.inherit if k in parent}, **{k: str(v) for k, v in self.env.items()}}


class NodePlacement(ProgramSpec):
    """Where one node stands in a launch its starter placed (Ray: the bundle index and the first bundle's address)."""

    node_rank: int
    master_addr: str
    master_port: int


class NodeSpec(ProgramSpec):
    """tasks/distributed/node.py, once per node. placement None: inside a Slurm step, read from Slurm."""

    launch: Launch
    placement: NodePlacement | None


class SlurmJobSpec(ProgramSpec):
    """tasks/distributed/slurm.py outside an allocation: the sbatch job it writes under work_dir, submits, follows."""

    launch: Launch
    runtime: dict                                # the runtime's engine spec (image, srun_args, sbatch_args), env out
    work_dir: Path


class RayDriverSpec(ProgramSpec):
    """tasks/distributed/ray_driver.py: one Ray task per node against the cluster at address."""

    launch: Launch
    address: str
    resources_per_node: dict[str, float]         # one placement-group bundle per node


def torchrun_args(launch: Launch, *, node_rank: int, master_addr: str, master_port: int) -> list[str]:
    return [launch.python, "-m", "torch.distributed.run", "--nnodes", str(launch.nnodes), "--node-rank",
            str(node_rank), "--nproc-per-node", str(launch.nproc_per_node), "--master-addr", master_addr,
            "--master-port", str(master_port), launch.script, *launch.args]


def deepspeed_args(launch: Launch, *, node_rank: int, master_addr: str, master_port: int,
                   hostfile: Path | None = None) -> list[str]:
    """The `deepspeed` launcher. One node: --num_gpus is required even on CPU, or it starts a single process. Several:
    a hostfile of `node<i> slots=<nproc>` lines gives the layout, and --no_ssh starts only this node's ranks."""
    cmd = [launch.python, "-m", "deepspeed.launcher.runner"]
    if launch.nnodes == 1:
        cmd += ["--num_gpus", str(launch.nproc_per_node)]
    else:
        if hostfile is None:
            raise LaunchConfigError("the deepspeed launcher needs a hostfile for several nodes")
        cmd += ["--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node_rank), "--master_addr", master_addr]
    return cmd + ["--master_port", str(master_port), launch.script, *launch.args]


def deepspeed_hostfile(launch: Launch) -> str:
    return "".join(f"node{i} slots={launch.nproc_per_node}\n" for i in range(launch.nnodes))


def node_command(launch: Launch, *, node_rank: int, master_addr: str, master_port: int,
                 hostfile: Path | None = None) -> list[str]:
    """This node's launcher command (torchrun or deepspeed) for a static rendezvous at master_addr:master_port."""
    where = dict(node_rank=node_rank, master_addr=master_addr, master_port=master_port)
    if launch.launcher == "deepspeed":
        return deepspeed_args(launch, hostfile=hostfile, **where)
    return torchrun_args(launch, **where)


def runtime_kind(runtime: dict | None) -> str:
    kind = (runtime or {}).get("kind") or "local"
    return "local" if kind in LOCAL_KINDS else kind


def with_port(launch: Launch) -> Launch:
    return launch if launch.master_port else replace(launch, master_port=free_port())


def local_command(launch: Launch) -> list[str]:
    if launch.nnodes == 1:
        return node_command(launch, node_rank=0, master_addr="127.0.0.1", master_port=launch.master_port)
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise LaunchConfigError(f"nnodes {launch.nnodes} on a local runtime: set {', '.join(missing)} (and NODE_RANK) "
                                "for the rendezvous, or use runtimes.main.kind slurm or ray")
    rank = os.environ.get("NODE_RANK", os.environ.get("SLURM_NODEID", "0"))
    return node_command(launch, node_rank=int(rank), master_addr=os.environ["MASTER_ADDR"],
                        master_port=int(os.environ["MASTER_PORT"]))


def engine_command(launch: Launch, runtime: dict | None = None, work_dir: Path | None = None) -> list[str]:
    """The one command a stage runs for this launch on this runtime (see the module docstring)."""
    from tasks.distributed import slurm

    runtime = {**(runtime or {})}
    kind = runtime_kind(runtime)
    # the runtime's env reaches the launching process (StageContext.launch); nodes inherit it by name
    launch = replace(launch, inherit=tuple(sorted(set(runtime.pop("env", None) or {}) - set(launch.env))))
    if kind == "local":
        return local_command(with_port(launch))
    if kind == "slurm":
        if os.environ.get("SLURM_JOB_ID"):
            return slurm.srun_command(with_port(launch), runtime)
        return slurm.submit_command(launch, runtime, work_dir or Path.cwd())
    if kind == "ray":
        if not runtime.get("address"):
            raise LaunchConfigError("runtimes.main.kind ray needs runtimes.main.address (e.g. ray-head:6379 or auto)")
        spec = RayDriverSpec(launch=launch, address=runtime["address"],
                             resources_per_node=runtime.get("resources_per_node") or {"CPU": 1})
        return [launch.python, "-m", "tasks.distributed.ray_driver", *inline_spec_args(spec)]
    raise LaunchConfigError(f"runtime kind {kind!r}: run the stage's container image with your cluster's launcher "
                            "(README: Going multi-node)")


def stage_runtime(ctx, name: str = "main") -> dict:
    return dict((ctx.runtimes or {}).get(name) or {})
