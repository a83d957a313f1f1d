"""Two real hosts on one machine: network namespaces joined by a veth pair, with a real Slurm or Ray cluster on them.

Each namespace is a host with its own address (10.<n>.0.1 and 10.<n>.0.2, which exist only inside the namespaces made
here); processes started in one reach the other only over the veth pair, as across machines. Teardown kills every
process left in either namespace (`ip netns pids`), then deletes the namespaces. Needs root and `ip`; Slurm
(slurm-wlm + munge) is installed with apt-get when missing.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STAGE_SCRIPT = Path(__file__).with_name("multinode_stage.py")


def sh(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True, **kw)


def require_namespaces() -> None:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("nsenter"):
        pytest.skip("multi-node tests need root, iproute2 (ip) and nsenter to make network namespaces")


def require_slurm() -> None:
    """Install Debian's Slurm and munge when missing (idempotent; CI runs as root with apt)."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "salloc")):
        return
    if not shutil.which("apt-get"):
        pytest.skip("Slurm (slurmctld, slurmd, munged) is not installed and apt-get is unavailable")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if sh("apt-get", "install", "-y", "slurm-wlm", "munge", check=False, env=env).returncode:
        sh("apt-get", "update", env=env)
        sh("apt-get", "install", "-y", "slurm-wlm", "munge", env=env)


class Hosts:
    """Two network namespaces `<tag>a`, `<tag>b` joined by a veth pair."""

    def __init__(self):
        n = 100 + os.getpid() % 150
        self.tag = f"bt{os.getpid() % 100000}"
        self.names = [f"{self.tag}a", f"{self.tag}b"]
        self.links = [f"{self.tag}va", f"{self.tag}vb"]
        self.addrs = [f"10.{n}.0.1", f"10.{n}.0.2"]

    def up(self) -> "Hosts":
        for ns in self.names:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
        for ns, link, addr in zip(self.names, self.links, self.addrs):
            sh("ip", "link", "set", link, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", link)
            sh("ip", "-n", ns, "link", "set", link, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        return self

    def reach_from_root(self) -> str:
        """A login host: a third veth pair from this (root) namespace to host 0, and a route to the hosts' network, so
        that processes here (a Prefect worker) reach slurmctld on host 0 as a login node does; host 1 stays unreachable
        from here. The link goes with host 0's namespace. Returns this side's address."""
        n = self.addrs[0].split(".")[1]
        here, there, link = f"10.{n}.1.1", f"10.{n}.1.2", f"{self.tag}vl"
        sh("ip", "link", "add", link, "type", "veth", "peer", "name", f"{self.tag}vh")
        sh("ip", "link", "set", f"{self.tag}vh", "netns", self.names[0])
        sh("ip", "-n", self.names[0], "addr", "add", f"{there}/24", "dev", f"{self.tag}vh")
        sh("ip", "-n", self.names[0], "link", "set", f"{self.tag}vh", "up")
        sh("ip", "addr", "add", f"{here}/24", "dev", link)
        sh("ip", "link", "set", link, "up")
        sh("ip", "route", "add", f"10.{n}.0.0/24", "via", there, "dev", link)
        return here

    def enter(self, i: int) -> list[str]:
        """Prefix that runs a command on host i (nsenter: slurmd refuses `ip netns exec`'s remounted /sys)."""
        return ["nsenter", f"--net=/var/run/netns/{self.names[i]}", "--"]

    def pids(self) -> list[int]:
        found = []
        for ns in self.names:
            out = sh("ip", "netns", "pids", ns, check=False).stdout.split()
            found += [int(p) for p in out if p.isdigit()]
        return found

    def kill_all(self, grace: float = 10.0) -> None:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + wait
            while self.pids() and time.time() < deadline:
                time.sleep(0.2)

    def down(self) -> None:
        self.kill_all()
        for ns in self.names:
            sh("ip", "netns", "del", ns, check=False)


def wait_for(predicate, timeout: float, what: str, poll: float = 0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"{what} not ready after {timeout}s")


SLURM_CONF = """\
ClusterName=baton
SlurmctldHost={host}({head})
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=10
NodeName=n1 NodeAddr={a1} NodeHostname={host} CPUs=2 RealMemory=2000
NodeName=n2 NodeAddr={a2} NodeHostname={host} CPUs=2 RealMemory=2000
PartitionName=debug Nodes=ALL Default=YES OverSubscribe=YES MaxTime=INFINITE State=UP
"""


class Slurm:
    """slurmctld + slurmd n1 on host 0, slurmd n2 on host 1, one munged shared through its socket file."""

    def __init__(self, hosts: Hosts, folder: Path):
        self.hosts, self.dir = hosts, folder
        self.env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}

    def up(self) -> "Slurm":
        d = self.dir
        for sub in ("state", "spool/n1", "spool/n2", "munge"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = d / "munge" / "munge.socket"
        sh("munged", "--force", f"--key-file={key}", f"--socket={sock}", f"--pid-file={d}/munge/munged.pid",
           f"--log-file={d}/munge/munged.log", f"--seed-file={d}/munge/seed")
        (d / "slurm.conf").write_text(SLURM_CONF.format(host=socket.gethostname(), head=self.hosts.addrs[0],
                                                        a1=self.hosts.addrs[0], a2=self.hosts.addrs[1], dir=d,
                                                        munge_socket=sock))
        self.start(0, ["slurmctld", "-D", "-i"])
        self.start(0, ["slurmd", "-D", "-N", "n1"])
        self.start(1, ["slurmd", "-D", "-N", "n2"])
        wait_for(self.nodes_idle, 60, "Slurm nodes n1, n2 idle")
        return self

    def start(self, host: int, cmd: list[str]) -> None:
        log = open(self.dir / f"{cmd[0]}-{host}.out", "a")
        subprocess.Popen(self.hosts.enter(host) + cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)

    def nodes_idle(self) -> bool:
        out = subprocess.run(self.hosts.enter(0) + ["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env,
                             capture_output=True, text=True).stdout.split("\n")
        states = dict(line.split() for line in out if line.strip())
        return states.get("n1") == "idle" and states.get("n2") == "idle"

    def down(self) -> None:
        subprocess.run(self.hosts.enter(0) + ["scancel", "--user=root"], env=self.env, capture_output=True)
        pid_file = self.dir / "munge" / "munged.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
            except (ValueError, ProcessLookupError):
                pass


class Ray:
    """`ray start --head` on host 0, a worker on host 1, one CPU each, session files under our own temp dir."""

    def __init__(self, hosts: Hosts, folder: Path):
        self.hosts, self.dir = hosts, folder
        self.ray = str(Path(sys.executable).with_name("ray"))
        self.address = f"{hosts.addrs[0]}:6379"
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(REPO)}

    def up(self) -> "Ray":
        common = ["--num-cpus", "1", "--disable-usage-stats"]
        sh(*self.hosts.enter(0), self.ray, "start", "--head", "--node-ip-address", self.hosts.addrs[0], "--port",
           "6379", "--include-dashboard=false", f"--temp-dir={self.dir}", *common, env=self.env, timeout=180)
        sh(*self.hosts.enter(1), self.ray, "start", "--address", self.address, "--node-ip-address",
           self.hosts.addrs[1], *common, env=self.env, timeout=180)
        return self


def run_stage(hosts: Hosts, spec: dict, *, via: list[str] | None = None, env: dict | None = None,
              timeout: float = 1500) -> dict:
    """Run one stage task (tests/multinode_stage.py) on host 0, as `baton run` would there; its StageOutput facts."""
    out_file = Path(spec["work_dir"]) / "stage_output.json"
    out_file.unlink(missing_ok=True)
    cmd = hosts.enter(0) + (via or []) + [sys.executable, str(STAGE_SCRIPT), json.dumps(spec)]
    proc = subprocess.run(cmd, env={**(env or os.environ), "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=timeout)
    log = proc.stdout[-6000:] + proc.stderr[-6000:]
    assert proc.returncode == 0 and out_file.exists(), f"stage failed ({proc.returncode}):\n{log}"
    return json.loads(out_file.read_text())


def shm_entries(marker: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").iterdir() if marker in p.name)


TINY = REPO / "configs" / "tiny.yaml"


def stage_spec(stage: str, work: Path, data_dir: Path, *overrides: str, input: Path | None = None,
               runtime: dict | None = None) -> dict:
    """What multinode_stage.py runs: configs/tiny.yaml's stage section with overrides, on the `main` runtime."""
    from flows.config import load

    cfg = load(TINY, list(overrides), stages=["data", stage])
    return {"stage": stage, "work_dir": str(work), "data_dir": str(data_dir), "model": cfg.model.model_dump(),
            "input": str(input) if input else None, "input_format": "hf-safetensors" if input else None,
            "config": cfg.stage_config(stage).model_dump(exclude_unset=True),
            "runtimes": {"main": runtime} if runtime else {}}


def reference_run(base: Path, name: str, hosts: Hosts, spec: dict) -> dict:
    """The single-node run with the same world size, once per session (both cluster modules compare against it)."""
    work = base / f"multinode-reference-{name}"
    done = work / "stage_output.json"
    if done.exists():
        return json.loads(done.read_text())
    work.mkdir(parents=True, exist_ok=True)
    return run_stage(hosts, {**spec, "work_dir": str(work)})


def zero_weights(ckpt: Path) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt))


def hf_weights(folder: Path) -> dict:
    from conversions import hf

    return hf.load_state_dict(folder)


def dist_weights(ckpt: Path) -> dict:
    from conversions.megatron import DistReader

    r = DistReader(ckpt)
    return {k: r.read_full(k) for k, md in r.metadata.state_dict_metadata.items() if hasattr(md, "size")}


def max_abs_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


ENGINE_MARKERS = ("tasks.distributed.node", "torch.distributed.run", "deepspeed.launcher", "/worker.py ")


def engine_processes(hosts: Hosts) -> list[str]:
    """Training processes still alive on either host (node launchers, torchrun/deepspeed, stage workers); the cluster's
    own daemons (whose arguments name Ray's default_worker.py) are not counted."""
    import psutil

    left = []
    for pid in hosts.pids():
        try:
            cmd = " ".join(psutil.Process(pid).cmdline()) + " "
        except psutil.Error:
            continue
        if any(m in cmd for m in ENGINE_MARKERS) and "raylet" not in cmd and "default_worker.py" not in cmd:
            left.append(f"{pid}: {cmd[:160]}")
    return left


def cancel_while_training(hosts: Hosts, spec: dict, *, via: list[str] | None = None, env: dict | None = None) -> float:
    """Start the stage on host 0, SIGTERM it (what Prefect's cancellation delivers) once both hosts train, and return
    the seconds until no training process is left on either host (assert that it happens)."""
    import psutil

    stage = subprocess.Popen(hosts.enter(0) + (via or []) + [sys.executable, str(STAGE_SCRIPT), json.dumps(spec)],
                             env={**(env or os.environ), "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    log = Path(spec["work_dir"]) / "engine.log"
    deadline = time.time() + 600
    while not (log.exists() and '"kind": "metric"' in log.read_text()):  # rank 0 reported a training step
        assert stage.poll() is None and time.time() < deadline, "the stage ended or never trained"
        time.sleep(1)
    ranks = [p for p in engine_processes(hosts) if "worker.py" in p]
    assert len(ranks) >= 2, ranks
    runner = next(p for p in [psutil.Process(stage.pid), *psutil.Process(stage.pid).children(recursive=True)]
                  if str(STAGE_SCRIPT) in " ".join(p.cmdline()))  # the stage process itself (under salloc: its child)
    t0 = time.time()
    runner.send_signal(signal.SIGTERM)
    stage.wait(timeout=120)
    while engine_processes(hosts) and time.time() < t0 + 60:
        time.sleep(0.5)
    left = engine_processes(hosts)
    assert left == [], f"training processes outlived the cancellation: {left}"
    assert stage.returncode != 0
    return time.time() - t0


def two_hosts(with_slurm: bool = False):
    """The module fixture's body: two hosts up, then everything torn down and checked gone."""
    require_namespaces()
    if with_slurm:
        require_slurm()
    hosts = Hosts().up()
    try:
        yield hosts
    finally:
        hosts.kill_all()
        left = hosts.pids()  # (read before the namespaces go: a deleted namespace lists no process)
        hosts.down()
    assert left == [], "processes left in the test's namespaces"
    assert not set(hosts.names) & set(namespaces()), "network namespaces left"
    assert shm_entries(hosts.addrs[0]) == [], "shared-memory segments left by the runs"


def namespaces() -> list[str]:
    """The named network namespaces on this machine (`ip netns list`: "NAME (id: N)" a line)."""
    return [line.split()[0] for line in sh("ip", "netns", "list", check=False).stdout.splitlines() if line.strip()]


def timed(label: str, fn, *args, **kw):
    t0 = time.time()
    out = fn(*args, **kw)
    print(f"{label}: {time.time() - t0:.1f}s")
    return out
