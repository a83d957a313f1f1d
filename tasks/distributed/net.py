"""Network facts a launcher needs: a free port, the interface that reaches another node, stale shm segments."""
from __future__ import annotations

import os
import socket
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the one free-port helper of the repo)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def source_address(peer: str) -> str:
    """The local address the kernel routes from to reach peer (what `ip route get PEER` names as src)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(peer), 9))  # UDP connect sends nothing; it only picks the route
        return s.getsockname()[0]


def interface_to(peer: str) -> str | None:
    """The name of the interface whose address routes to peer, e.g. `eth0`, `ib0`, `veth1`; None if unknown."""
    import psutil

    try:
        src = source_address(peer)
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == src for a in addrs):
            return name
    return None


def socket_ifname_env(master_addr: str, env: dict | None = None) -> dict:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME for the interface that reaches the first node. gloo otherwise binds to
    whatever the hostname resolves to (often 127.0.0.1) and fails across hosts; values already set win."""
    env = env or {}
    name = interface_to(master_addr)
    if not name:
        return {}
    return {k: name for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if not env.get(k)}


def remove_shm_segments(port: int, shm_dir: Path = Path("/dev/shm")) -> list[str]:
    """DeepSpeed's CPU shm all-reduce leaves a 66 MB segment per rank in /dev/shm, named by master address and port,
    and never unlinks it (a RAM leak per run, and a stale segment if the port comes back). Remove this run's."""
    removed = []
    for p in shm_dir.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        try:
            p.unlink()
            removed.append(p.name)
        except OSError:
            pass
    return removed
