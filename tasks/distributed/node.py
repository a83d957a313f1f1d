"""One node's part of a multi-node launch: `python -m tasks.distributed.node --spec-json NODE_SPEC` (a NodeSpec).

Started once per node (by srun, or by a Ray task). It finds this node's rank and the first node's address (given in the
spec, or read from Slurm), sets GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the interface that reaches the first node,
runs the node's launcher (torchrun or deepspeed), forwards SIGTERM/SIGINT to its process tree, removes the run's
DeepSpeed shm segments, and exits with the launcher's code.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from tasks import events
from tasks.distributed import Launch, NodeSpec, deepspeed_hostfile, node_command
from tasks.distributed.net import remove_shm_segments, socket_ifname_env


def die_with_parent() -> None:
    """PR_SET_PDEATHSIG: the launcher gets SIGTERM if this process is killed outright (Ray force-cancel, SIGKILL)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def slurm_hostnames(nodelist: str) -> list[str]:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()


def slurm_node_address(name: str) -> str:
    """The address slurm.conf gives the node (NodeAddr), else what its name resolves to."""
    out = subprocess.run(["scontrol", "show", "node", "-o", name], capture_output=True, text=True)
    for token in out.stdout.split():
        if token.startswith("NodeAddr=") and token[len("NodeAddr="):] not in ("", name):
            return token[len("NodeAddr="):]
    return socket.gethostbyname(name)


def slurm_port() -> int:
    """Every node of a step must agree on the port without talking: derive it from the job and step ids."""
    if os.environ.get("BATON_MASTER_PORT"):
        return int(os.environ["BATON_MASTER_PORT"])
    job, step = int(os.environ.get("SLURM_JOB_ID", "0")), int(os.environ.get("SLURM_STEP_ID", "0") or 0)
    return 20000 + (job * 131 + step * 7) % 20000


def slurm_placement(launch: Launch) -> tuple[int, str, int]:
    """(node rank, first node's address, port) inside a Slurm step: rank 0 is the step's first node."""
    nodes = slurm_hostnames(os.environ.get("SLURM_STEP_NODELIST") or os.environ["SLURM_JOB_NODELIST"])
    me = os.environ.get("SLURMD_NODENAME")
    rank = nodes.index(me) if me in nodes else int(os.environ["SLURM_NODEID"])
    return rank, slurm_node_address(nodes[0]), launch.master_port or slurm_port()


def placement(spec: NodeSpec) -> tuple[int, str, int]:
    if spec.placement is not None:
        return spec.placement.node_rank, spec.placement.master_addr, spec.placement.master_port
    return slurm_placement(spec.launch)


def run_forwarding_signals(cmd: list[str], env: dict) -> int:
    from tasks.launch import kill_tree

    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=die_with_parent)

    def stop(signum, frame):
        kill_tree(proc, grace=10.0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    return proc.wait()


def run_node(spec: NodeSpec) -> int:
    launch = spec.launch
    rank, master, port = placement(spec)
    env = {**os.environ, **launch.node_env(dict(os.environ))}
    if launch.nnodes > 1:
        env.update(socket_ifname_env(master, env))
    print(f"node {rank}/{launch.nnodes} on {socket.gethostname()}: rendezvous {master}:{port}, "
          f"GLOO_SOCKET_IFNAME={env.get('GLOO_SOCKET_IFNAME', '')}", flush=True)
    with tempfile.TemporaryDirectory(prefix="baton-node-") as tmp:
        hostfile = Path(tmp) / "hostfile"
        hostfile.write_text(deepspeed_hostfile(launch))
        cmd = node_command(launch, node_rank=rank, master_addr=master, master_port=port, hostfile=hostfile)
        try:
            return run_forwarding_signals(cmd, env)
        finally:
            remove_shm_segments(port)


if __name__ == "__main__":
    sys.exit(run_node(events.read_typed_spec(NodeSpec)))
