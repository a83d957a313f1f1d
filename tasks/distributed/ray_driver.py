"""Ray: one task per node in a STRICT_SPREAD placement group, each running that node's launcher.

`python -m tasks.distributed.ray_driver --spec-json RAY_DRIVER_SPEC` (a RayDriverSpec) connects to `address` (a Ray
cluster, or KubeRay's head service), reserves one bundle per node on distinct nodes, asks bundle 0 for its address and
a free port (bundle order is not node order), then starts `tasks.distributed.node` with node rank = bundle index in
every bundle. Each task streams its lines back (node 0 unchanged: it carries rank 0's events; others prefixed), the
driver exits with the first failing code, and SIGTERM/SIGINT cancel every task (whose process trees are killed) and
free the placement group.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tasks import events
from tasks.distributed import NODE_MODULE, Launch, NodePlacement, NodeSpec, RayDriverSpec
from tasks.secrets import is_secret_key

PLACEMENT_TIMEOUT_S = 120.0  # for the cluster to reserve every node's bundle
# what a node's processes need from the stage's environment; the rest (PATH, HOME, ...) is the node's own
FORWARD_PREFIXES = ("PYTHON", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "OMP_", "TORCH", "DS_", "NCCL_", "GLOO_",
                    "BATON_", "CUDA_", "MLFLOW_")


def forwarded_env(launch: Launch) -> dict:
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARD_PREFIXES)}
    env.pop("CUDA_VISIBLE_DEVICES", None)  # each node has its own devices
    return {**env, **launch.node_env(dict(os.environ))}


def split_secrets(env: dict) -> tuple[dict, dict]:
    """(what may go into Ray's runtime_env, the secret values). Ray's agent writes a job's runtime_env to its logs in
    clear, so tokens and passwords travel as an argument of each node's task instead, straight into its launcher's
    environment."""
    secret = {k: v for k, v in env.items() if is_secret_key(k)}
    return {k: v for k, v in env.items() if k not in secret}, secret


@ray.remote(num_cpus=0)
def node_address(want_port: bool) -> tuple[str, int]:
    from tasks.distributed.net import free_port

    ip = ray.util.get_node_ip_address()
    return ip, free_port(ip) if want_port else 0


@ray.remote(num_cpus=0)
def run_node(cmd: list[str], secret_env: dict | None = None):
    """Run this node's launcher and yield its output lines, then {"returncode": rc}; cancelling kills its tree."""
    import subprocess

    from tasks.distributed.node import die_with_parent
    from tasks.launch import kill_tree

    proc = subprocess.Popen(cmd, env={**os.environ, **(secret_env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1,
                            errors="replace", start_new_session=True, preexec_fn=die_with_parent)
    try:
        for line in proc.stdout:
            yield line.rstrip("\n")
        yield {"returncode": proc.wait()}
    finally:
        if proc.poll() is None:
            kill_tree(proc, grace=10.0)


def rendezvous(pg, n: int, port: int) -> tuple[str, int]:
    probes = [node_address.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=i)).remote(i == 0 and not port) for i in range(n)]
    found = ray.get(probes)
    if len({ip for ip, _ in found}) < n:
        print(f"warning: bundles share addresses {found}", flush=True)
    return found[0][0], port or found[0][1]


def follow(gen, rank: int, codes: dict, lock: threading.Lock) -> None:
    prefix = "" if rank == 0 else f"[node {rank}] "
    try:
        for ref in gen:
            item = ray.get(ref)
            if isinstance(item, dict):
                codes[rank] = item["returncode"]
                continue
            with lock:
                sys.stdout.write(prefix + item + "\n")
                sys.stdout.flush()
    except Exception as e:  # a cancelled or failed task
        codes.setdefault(rank, 1)
        with lock:
            print(f"{prefix}node task ended: {type(e).__name__}: {e}", flush=True)


def follow_all(gens: list, stopping: threading.Event, grace: float = 20.0) -> dict:
    """Stream every node's lines until all end (or, once cancelling, until grace seconds have passed)."""
    codes: dict = {}
    lock = threading.Lock()
    threads = [threading.Thread(target=follow, args=(g, r, codes, lock), daemon=True) for r, g in enumerate(gens)]
    for t in threads:
        t.start()
    deadline = None
    while any(t.is_alive() for t in threads):
        if stopping.is_set():
            deadline = deadline or time.time() + grace
            if time.time() > deadline:
                break
        threads[0].join(timeout=0.5)  # short joins keep the main thread responsive to SIGTERM
        threads.sort(key=lambda t: not t.is_alive())
    return codes


def start_nodes(launch: Launch, pg, master: str, port: int, secret_env: dict) -> list:
    gens = []
    for rank in range(launch.nnodes):
        spec = NodeSpec(launch=launch, placement=NodePlacement(node_rank=rank, master_addr=master, master_port=port))
        cmd = [launch.python, "-m", NODE_MODULE, *events.inline_spec_args(spec)]
        gens.append(run_node.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=rank)).remote(cmd, secret_env))
    return gens


def main(spec: RayDriverSpec) -> int:
    launch = spec.launch
    plain, secret_env = split_secrets(forwarded_env(launch))
    ray.init(address=spec.address, runtime_env={"env_vars": plain}, log_to_driver=False)
    pg = placement_group([dict(spec.resources_per_node)] * launch.nnodes, strategy="STRICT_SPREAD")
    gens: list = []
    stopping = threading.Event()

    def cancel(signum, frame):
        print(f"cancelling {len(gens)} Ray node tasks", flush=True)
        stopping.set()
        for g in gens:
            ray.cancel(g)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, cancel)
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        master, port = rendezvous(pg, launch.nnodes, launch.master_port)
        print(f"Ray placement group of {launch.nnodes} nodes; rendezvous {master}:{port}", flush=True)
        gens += start_nodes(launch, pg, master, port, secret_env)
        codes = follow_all(gens, stopping)
        if stopping.is_set():
            return 143
        return next((c for c in codes.values() if c), 0) if len(codes) == launch.nnodes else 1
    finally:
        remove_placement_group(pg)
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main(events.read_typed_spec(RayDriverSpec)))
