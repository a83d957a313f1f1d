"""Collectives get tensors on the device their backend reads. Under NCCL a CPU tensor fails ("No backend type
associated with device type cpu": every ZeRO run on the first GPU machine), and gloo on a CPU machine cannot show it,
so the rule is held two ways: no worker calls torch.distributed's tensor collectives except through
tasks/collectives.py, which places them on the backend's device; and that module reduces correctly over a real gloo
group. The NCCL side runs for real in `make gpu-check`."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / "tasks" / "collectives.py"
# torch.distributed's collectives that take tensors (the *_object ones pick their device from the backend themselves)
TENSOR_COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce", "reduce_scatter",
                      "reduce_scatter_tensor", "broadcast", "all_to_all", "all_to_all_single", "gather", "scatter"}


def _dist_aliases(tree: ast.Module) -> set[str]:
    """Names this module binds to torch.distributed (`import torch.distributed as dist`, `from torch import
    distributed`), plus the dotted spelling."""
    names = {"torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            names |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    return names


def direct_collectives(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    aliases = _dist_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in TENSOR_COLLECTIVES and ast.unparse(node.func.value) in aliases:
            found.append(f"{node.lineno}: {ast.unparse(node.func)}")
    return found


def project_sources() -> list[Path]:
    return [p for top in ("tasks", "flows", "conversions", "benchmarks", "infra") for p in (ROOT / top).rglob("*.py")]


def test_no_worker_calls_a_tensor_collective_directly():
    offenders = [f"{p.relative_to(ROOT)}:{hit}" for p in project_sources() if p != HOME
                 for hit in direct_collectives(p)]
    assert not offenders, "collectives outside tasks/collectives.py (their tensors' device is unchecked):\n" + \
        "\n".join(offenders)


def test_the_scan_finds_the_calls_it_forbids(tmp_path):
    """The scan itself can fail: the line that crashed ZeRO on the GPU, in both spellings."""
    planted = tmp_path / "worker.py"
    planted.write_text(textwrap.dedent("""
        import torch
        import torch.distributed as dist
        stats = torch.zeros(3, dtype=torch.float64)
        dist.all_reduce(stats)
        torch.distributed.broadcast(stats, src=0)
        dist.broadcast_object_list([stats], src=0)
    """))
    assert direct_collectives(planted) == ["5: dist.all_reduce", "6: torch.distributed.broadcast"]


def test_reductions_over_a_real_gloo_group(tmp_path):
    """Two gloo ranks: sums and maxima of per-rank values, computed by hand."""
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT)!r})
        import torch.distributed as dist
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'rendezvous'}", rank=rank, world_size=2)
        from tasks import collectives
        out = {{"device": str(collectives.backend_device()),
               "sum": collectives.sum_over_ranks([1.5 + rank, 10.0 * rank]),
               "max": collectives.max_over_ranks(3.0 - rank),
               "table": collectives.reduce([[rank, 1.0], [2.0 * rank, 0.0]]).tolist()}}
        dist.destroy_process_group()
        print(json.dumps(out))
    """))
    procs = [subprocess.Popen([sys.executable, str(script), str(r)], stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    for out in map(json.loads, outs):
        assert out == {"device": "cpu", "sum": [4.0, 10.0], "max": 3.0, "table": [[1.0, 2.0], [2.0, 0.0]]}
