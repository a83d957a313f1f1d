"""`baton doctor`: the environment and the resolved config, checked against the causes large runs are known to die of.

Each finding has a severity (error: the run would fail or is refused; warning: it may), the cause in one sentence and
the fix (a config key or a command). `baton run` refuses to launch while any error stands. Every probe is real: the
runtime's own python is asked what it has, ports are bound, file systems are measured.
"""
from __future__ import annotations

import functools
import json
import os
import platform
import shlex
import socket
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from conversions.home import home_path
from tasks import memory_plan as mp
from tasks.problems import Finding
from tasks.finetune.advice import deepspeed_without_num_gpus
from tasks.registry import STAGES, TRAINING_STAGES

SHM_PER_RANK_MB = 66          # DeepSpeed's CPU shm all-reduce buffer per rank (measured; tasks/finetune/engine_env.py)


@dataclass
class Probe:
    """Where the environment checks look; tests point them at real small file systems."""
    shm_dir: Path = Path("/dev/shm")
    home: Path | None = None                  # BATON_HOME (checkpoints land here); default from the environment
    launch_command: str | None = None         # a user's own launch line to lint (e.g. a deepspeed command)
    runtime_facts: dict = field(default_factory=lambda: _FACTS)   # python path -> facts (one probe per process)


_FACTS: dict = {}


# ---- runtime facts (asked of the runtime's own python) ---------------------------------------------------------------
FACTS_SCRIPT = r"""
import importlib.metadata as md, importlib.util as u, json, os, glob
def v(n):
    try: return md.version(n)
    except md.PackageNotFoundError: return None
spec = u.find_spec("sgl_kernel")
libs = []
if spec and spec.submodule_search_locations:
    for d in spec.submodule_search_locations:
        libs += glob.glob(os.path.join(d, "**", "*.so"), recursive=True)
print(json.dumps({"psutil": u.find_spec("psutil") is not None, "torch": v("torch"), "torchvision": v("torchvision"),
                  "sgl_kernel": v("sgl-kernel") or v("sgl_kernel"), "sgl_kernel_libs": libs}))
"""


def runtime_facts(python: str, probe: Probe) -> dict | None:
    if python not in probe.runtime_facts:
        try:
            out = subprocess.run([python, "-c", FACTS_SCRIPT], capture_output=True, text=True, timeout=60)
            probe.runtime_facts[python] = json.loads(out.stdout) if out.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
            probe.runtime_facts[python] = None
    return probe.runtime_facts[python]


def runtimes_in_use(cfg) -> dict[str, str]:
    """Runtime name -> python for the configured stages (runtimes that are not built are the stages' own error)."""
    from tasks.runtimes import RuntimeMissing

    names = set().union(*(STAGES[s].runtimes(cfg.stage_config(s)) for s in cfg.stages))
    rt = {k: v.model_dump(mode="json") for k, v in cfg.runtimes.items()}  # env stays masked: not needed here
    out = {}
    for name in sorted(names):
        if (rt.get(name) or {}).get("kind", "venv") != "venv":
            continue  # its python lives on the cluster's nodes or in an image, not here
        try:
            out[name] = _python_for(name, json.dumps(rt.get(name) or {}, sort_keys=True))
        except RuntimeMissing:
            continue
    return out


@functools.lru_cache(maxsize=None)
def _python_for(name: str, spec_json: str) -> str:
    from tasks.runtimes import python_for  # asks infra/runtimes/build.py where the runtime lives: once per process

    return python_for(name, {name: json.loads(spec_json)})


def check_runtimes(cfg, probe: Probe) -> list[Finding]:
    found = []
    for name, python in runtimes_in_use(cfg).items():
        facts = runtime_facts(python, probe)
        if facts is None:
            found.append(Finding("error", "runtime", f"runtime '{name}' ({python}) does not start",
                                 f"make runtimes, or set runtimes.{name}.python to a working interpreter"))
            continue
        found += missing_modules(cfg, name, python, facts)
        found += torchvision_mismatch(name, python, facts) + sgl_kernel_arch(name, python, facts)
    return found


def missing_modules(cfg, name: str, python: str, facts: dict) -> list[Finding]:
    """What a stage declares its runtime must have (StageSpec.runtime_needs), missing from this runtime."""
    return [Finding("error", f"{module}_missing", f"runtime '{name}' has no {module}, {why}",
                    f"{python} -m pip install {module}")
            for s in cfg.stages if name in STAGES[s].runtimes(cfg.stage_config(s))
            for module, why in STAGES[s].runtime_needs if not facts.get(module)]


def torchvision_mismatch(name: str, python: str, facts: dict) -> list[Finding]:
    torch_v, tv = facts.get("torch") or "", facts.get("torchvision") or ""
    if not tv or "+cu" not in tv or "+cu" in torch_v:
        return []
    return [Finding("error", "torchvision_cuda", f"runtime '{name}' pairs a CUDA torchvision ({tv}) with a CPU torch "
                    f"({torch_v}); importing it fails on missing CUDA ops",
                    f"{python} -m pip install torchvision --index-url https://download.pytorch.org/whl/cpu")]


ELF_MACHINES = {62: "x86_64", 183: "aarch64", 21: "ppc64le", 22: "s390x"}


def elf_machine(path: str) -> str | None:
    with open(path, "rb") as f:
        head = f.read(20)
    if head[:4] != b"\x7fELF":
        return None
    return ELF_MACHINES.get(int.from_bytes(head[18:20], "little" if head[5] == 1 else "big"), "other")


def sgl_kernel_arch(name: str, python: str, facts: dict) -> list[Finding]:
    host = platform.machine()
    for lib in facts.get("sgl_kernel_libs") or []:
        arch = elf_machine(lib)
        if arch and arch != host:
            return [Finding("error", "sgl_kernel_arch", f"runtime '{name}': sgl_kernel's {Path(lib).name} is built "
                            f"for {arch}, this machine is {host}; SGLang fails at import",
                            f"{python} -m pip install --force-reinstall sgl-kernel (a wheel for {host}), or the CPU "
                            "stub in infra/sgl_kernel_stub")]
    return []


# ---- launchers and ports ---------------------------------------------------------------------------------------------
def bind_cores_without_numactl(argv: list[str]) -> list[Finding]:
    """deepspeed --bind_cores_to_rank shells out to numactl (FileNotFoundError without it; shared notes)."""
    import shutil

    if "--bind_cores_to_rank" not in argv or shutil.which("numactl"):
        return []
    return [Finding("error", "numactl_missing", "--bind_cores_to_rank runs numactl, which is not installed here",
                    "apt-get install numactl, or drop --bind_cores_to_rank")]


def check_launchers(cfg, probe: Probe) -> list[Finding]:
    found = []
    if probe.launch_command:
        device = "cuda" if _gpus() else "cpu"
        argv = shlex.split(probe.launch_command)
        found += deepspeed_without_num_gpus(argv, device) + bind_cores_without_numactl(argv)
    return found


def _gpus() -> int:
    from tasks.hardware import visible_gpus

    return visible_gpus()


def port_taken(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def check_ports(cfg) -> list[Finding]:
    wanted = [port for s in cfg.stages for port in STAGES[s].ports(cfg.stage_config(s))]
    if os.environ.get("MASTER_PORT", "").isdigit() and os.environ.get("MASTER_ADDR", "127.0.0.1") in (
            "127.0.0.1", "localhost", socket.gethostname()) and int(os.environ.get("NODE_RANK", "0")) == 0:
        wanted.append(("MASTER_PORT", "127.0.0.1", int(os.environ["MASTER_PORT"])))
    return [Finding("error", "port_in_use", f"{key} {port} is already in use on {host}; the server or rendezvous "
                    "cannot bind it", f"{key}=0 (pick a free port), or stop what holds it (ss -ltnp 'sport = :{port}')")
            for key, host, port in wanted if port_taken(host, port)]


# ---- file systems ----------------------------------------------------------------------------------------------------
def free_bytes(path: Path) -> int:
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def local_ranks(cfg) -> int:
    return max([cfg.stage_config(s).nproc_per_node for s in TRAINING_STAGES if s in cfg.stages] or [1])


def check_shm(cfg, probe: Probe) -> list[Finding]:
    ranks = local_ranks(cfg)
    if ranks < 2:
        return []
    need = ranks * SHM_PER_RANK_MB * 2**20
    free = free_bytes(probe.shm_dir)
    if free >= need:
        return []
    return [Finding("error", "shm_too_small", f"{probe.shm_dir} has {free / 2**20:.0f} MiB free, {ranks} ranks on "
                    f"this node need about {need / 2**20:.0f} MiB ({SHM_PER_RANK_MB} MiB each for the shared-memory "
                    "all-reduce / NCCL)", f"mount -o remount,size={max(1, need // 2**30 + 1)}G {probe.shm_dir} "
                    "(docker: --shm-size), or fewer ranks per node (nproc_per_node)")]


def planned_checkpoint_bytes(cfg) -> int:
    """What the configured training stages hold on disk at the peak (tasks/memory_plan.py, the same numbers each
    stage checks before it starts)."""
    return mp.planned_disk_bytes(cfg, [s for s in TRAINING_STAGES if s in cfg.stages])


def check_disk(cfg, probe: Probe) -> list[Finding]:
    home = Path(probe.home or home_path())
    need, free = planned_checkpoint_bytes(cfg), free_bytes(home)
    if need <= free:
        return []
    return [Finding("error", "disk_for_checkpoints", f"{home} has {free / 2**30:.2f} GiB free; the planned checkpoints "
                    f"need about {need / 2**30:.2f} GiB", "free disk, set BATON_HOME to a larger file system, or "
                    "lower keep_checkpoints in the training stages")]


# ---- the config ------------------------------------------------------------------------------------------------------
def _divisors(n: int, limit: int = 64) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def check_tensor_parallel(cfg) -> list[Finding]:
    m, found = cfg.model, []
    sections = [s for s in ("pretrain", "serve") if s in cfg.stages]
    for s in sections:
        tp = cfg.stage_config(s).tensor_parallel
        bad = [f"{k} {v}" for k, v in (("num_attention_heads", m.num_attention_heads),
                                       ("num_query_groups", m.num_query_groups)) if v % tp]
        if bad:
            ok = [d for d in _divisors(m.num_attention_heads) if m.num_query_groups % d == 0]
            found.append(Finding("error", "tp_heads", f"{s}.tensor_parallel {tp} does not divide model "
                                 f"{' and '.join(bad)}: each TP rank must own whole heads",
                                 f"{s}.tensor_parallel: one of {ok}"))
    return found


def check_stage_keys(cfg) -> list[Finding]:
    """What each configured stage advises about its own keys (StageSpec.advice)."""
    return [f for s in cfg.stages for f in STAGES[s].advice(cfg.stage_config(s))]


HEAD_COUNTS = {"model.num_attention_heads", "model.num_query_groups"}


def check_other_config_errors(cfg) -> list[Finding]:
    """The stages' own pre-launch checks (layouts, batch sizes, ranks vs this machine), as findings."""
    out = []
    for problem in cfg.validate_stages():
        if problem.key.endswith(".tensor_parallel") and HEAD_COUNTS & set(problem.involves):
            continue  # check_tensor_parallel says it with the valid sizes
        out.append(Finding("error", "config", str(problem), f"change {problem.key}"))
    return out


def check_memory(cfg) -> list[Finding]:
    """`baton plan`'s per-rank estimate against the device: over it is an error, and within 1.5× a warning (DeepSpeed's
    estimates run 50-75% low in practice)."""
    from tasks.hardware import gpu_memory_gb, host_memory_gb

    found = []
    for s in (x for x in TRAINING_STAGES if x in cfg.stages):
        sc = cfg.stage_config(s)
        device = sc.resolved_device()
        layout = mp.layout_of_stage(s, sc, device)
        est = mp.breakdown(mp.shape_of_model(cfg.model), layout, sc.max_seq_length or cfg.model.seq_length,
                           sc.precision, device).total()
        if device == "cpu":
            cap, what = host_memory_gb() * mp.GiB / sc.nproc_per_node, "this machine's RAM per rank"
        else:
            cap, what = (gpu_memory_gb() or 0) * mp.GiB, "GPU memory"
        if not cap:
            continue
        buffered = est * (1 + mp.DOCTOR_BUFFER)
        if est > cap or buffered > cap:
            sev = "error" if est > cap else "warning"
            found.append(Finding(sev, "memory_estimate", f"{s}: estimated {est / mp.GiB:.1f} GiB per rank "
                                 f"({layout.describe()}), {buffered / mp.GiB:.1f} GiB with the 50% buffer, against "
                                 f"{cap / mp.GiB:.1f} GiB of {what}", f"baton plan CONFIG --stage {s} --write "
                                 "(a layout that fits), or more ranks / recompute / offload"))
    return found


# ---- all of it -------------------------------------------------------------------------------------------------------
def doctor(cfg, probe: Probe | None = None) -> list[Finding]:
    """Every check; without a config only the environment and the launch line."""
    probe = probe or Probe()
    found = check_launchers(cfg, probe)
    if cfg is None:
        return found
    for check in (check_tensor_parallel, check_other_config_errors, check_stage_keys, check_ports, check_memory):
        found += check(cfg)
    found += check_runtimes(cfg, probe) + check_shm(cfg, probe) + check_disk(cfg, probe)
    return sorted(found, key=lambda f: f.severity != "error")


def format_findings(found: list[Finding]) -> str:
    if not found:
        return "baton doctor: no problems found"
    errors = sum(f.severity == "error" for f in found)
    return "\n".join([f.line() for f in found] + [f"{errors} error(s), {len(found) - errors} warning(s)"])


def as_dicts(found: list[Finding]) -> list[dict]:
    return [asdict(f) for f in found]
