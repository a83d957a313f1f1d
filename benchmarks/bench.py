"""`make bench`: conversion and verification cost, measured side by side in one run (not part of `make test`).

    .venv/bin/python benchmarks/bench.py [--sizes S,M,L] [--reps 3] [--work DIR]

1. Checkpoints, written by the engines' own save paths and kept in --work for later runs: DeepSpeed ZeRO-2 and ZeRO-3
   (2 CPU ranks, engine.save_checkpoint), Megatron-Core dist checkpoints at TP1 and TP2×PP2 (the pretrain stage's task
   body, one training step; TP2×PP2 runs 4 gloo ranks on however many cores there are).
2. Conversion, contenders alternating inside each repetition: the read-bandwidth ceiling on the same files (cold:
   fsync + posix_fadvise(DONTNEED) first; warm), baton's converter cold and warm, and a load-everything converter
   (DeepSpeed's zero_to_fp32 for ZeRO; torch DCP's dcp_to_torch_save for Megatron). Each converter runs in a fresh
   process; its peak RSS is its own ru_maxrss.
3. L0 hashing of the largest checkpoint's files: read bandwidth vs the old serial 1 MiB sha256 loop vs the streamed,
   parallel `manifest.sha256_files`, and a second pass that this run's digests let skip.
Results: benchmarks/results/bench.json + bench.md, the docs' performance table (docs/performance.md), an MLflow run in `baton-benchmarks`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
RESULTS = REPO / "benchmarks" / "results"
PERFORMANCE_PAGE = REPO / "docs" / "performance.md"  # its table between the bench markers
VOCAB = 32000
# Llama-shaped sizes: (layers, hidden, heads, KV groups, FFN) with a 32k vocabulary, untied embeddings
SIZES = {"S": (8, 512, 8, 4, 1408), "M": (12, 768, 12, 4, 2048), "L": (24, 1024, 16, 8, 2816)}
FORMATS = ("zero2", "megatron-tp1", "zero3", "megatron-tp2pp2", "zero3-moe", "megatron-ep2-moe")
# the -moe formats: each MLP a mixture of 4 experts (top-2) half the size's FFN wide (a token's compute as dense);
# ZeRO-3 writes an HF Mixtral's engine state, Megatron EP 2 on 2 ranks its experts' grid
MOE = {"experts": 4, "top_k": 2}
# TP, PP, EP of each Megatron format
MEGATRON_LAYOUTS = {"megatron-tp1": (1, 1, 1), "megatron-tp2pp2": (2, 2, 1), "megatron-ep2-moe": (1, 1, 2)}


# ---- 1. checkpoints ------------------------------------------------------------------------------------------------
def zero_checkpoint(work: Path, size: str, stage: int, moe: bool = False) -> Path:
    import zero_convert_bench as zb

    layers, hidden, heads, groups, ffn = SIZES[size]
    out = work / (f"{size}-zero{stage}" + ("-moe" if moe else ""))
    if not (out / "latest").exists():
        zb.build_at(out, {"hidden": hidden, "layers": layers, "ffn": ffn // 2 if moe else ffn, "heads": heads,
                          "kv_heads": groups, "vocab": VOCAB, "stage": stage, **(MOE if moe else {})})
    return out


def megatron_checkpoint(work: Path, size: str, tp: int, pp: int, ep: int = 1) -> Path:
    """The pretrain stage's own task body for one step: its worker saves the dist checkpoint (weights + optimizer)."""
    layers, hidden, heads, groups, ffn = SIZES[size]
    name = f"{size}-megatron-tp{tp}" + (f"pp{pp}" if pp > 1 else "") + (f"ep{ep}-moe" if ep > 1 else "")
    d = work / name
    if (d / "checkpoint" / "baton_manifest.json").exists():
        return d / "checkpoint"
    from flows.config import load
    from gpu_check import make_data
    from tasks.pretrain.task import run_pretrain
    from tasks.stage import StageContext

    moe = [f"model.moe.num_experts={MOE['experts']}", f"model.moe.top_k={MOE['top_k']}",
           f"model.moe.expert_ffn_hidden_size={ffn // 2}", f"pretrain.expert_parallel={ep}"] if ep > 1 else []
    cfg = load(REPO / "configs" / "tiny.yaml", [
        f"model.num_layers={layers}", f"model.hidden_size={hidden}", f"model.num_attention_heads={heads}",
        f"model.num_query_groups={groups}", f"model.ffn_hidden_size={ffn}", "data.pretrain_docs=300",
        "pretrain.steps=2", "pretrain.warmup_steps=1", "pretrain.micro_batch_size=1", "pretrain.global_batch_size=2",
        "pretrain.checkpoint_every=2", "pretrain.eval_interval=2", "pretrain.eval_iters=1",
        f"pretrain.vocab_size={VOCAB}", f"pretrain.tensor_parallel={tp}", f"pretrain.nproc_per_node={tp * ep}", *moe],
        stages=["data", "pretrain"])
    # more ranks than cores is refused for training runs; for one step that only writes the layout, allow it
    cfg.pretrain.global_batch_size = 1 if pp > 1 else 2
    cfg.pretrain.pipeline_parallel, cfg.pretrain.nproc_per_node = pp, tp * pp * ep
    data = work / "data"
    if not (data / "baton_manifest.json").exists():
        make_data(work, cfg)
    ctx = StageContext(stage="pretrain", run_id="bench", run_dir=d, work_dir=d, model=cfg.model.model_dump(), seed=0,
                       data_dir=data)
    out = run_pretrain.fn(ctx, cfg.pretrain).output
    shutil.rmtree(d / "checkpoints", ignore_errors=True)  # the hard-linked copy in checkpoint/ is what we convert
    return out


def checkpoint_files(src: Path) -> list[Path]:
    return sorted(p for p in src.rglob("*") if p.is_file())


def parameters(hf_dir: Path) -> tuple[int, int]:
    """(parameter count, largest tensor bytes) of an HF folder, from the safetensors headers alone."""
    from conversions import hf

    count, largest = 0, 0
    for f in hf.safetensors_files(hf_dir):
        for name, info in hf.read_header(f).items():
            if name == "__metadata__":
                continue
            n = math.prod(info["shape"])
            count += n
            largest = max(largest, info["data_offsets"][1] - info["data_offsets"][0])
    return count, largest


# ---- 2. measurements -----------------------------------------------------------------------------------------------
def drop_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(files: list[Path]) -> float:
    buf = bytearray(8 << 20)
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - t0


def write_bytes(folder: Path, nbytes: int) -> float:
    """Seconds to write nbytes into a new file of folder (into the page cache, as a converter's output is), 8 MiB at
    a time: the write side of a conversion's I/O ceiling."""
    folder.mkdir(parents=True, exist_ok=True)
    buf, path = os.urandom(8 << 20), folder / "write-ceiling.bin"
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(nbytes // len(buf)):
            f.write(buf)
        f.write(buf[: nbytes % len(buf)])
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


CONVERTERS = {
    "baton-zero": "from conversions import zero; zero.to_hf(SRC, DST, max_shard_bytes=500 << 20)",
    "baton-megatron": "from conversions import megatron; megatron.to_hf(SRC, DST, max_shard_bytes=500 << 20)",
    "deepspeed": ("from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict as c; "
                  "c(str(SRC), str(DST), safe_serialization=True, max_shard_size='500MB')"),
    "dcp-naive": ("from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as c; DST.mkdir(); "
                  "c(str(SRC), str(DST / 'all.pt'))"),
}
# What each baton converter imports before its first byte (after torch): its fixed start-up, measured apart so the
# converter's own work can be set against the read bandwidth too.
IMPORT_FLOORS = {
    "baton-zero": "from conversions import zero; import safetensors.torch",
    "baton-megatron": ("from transformers import AutoTokenizer, GenerationConfig, LlamaConfig; "
                       "from conversions import megatron"),
    # a mixture's experts are regrouped by transformers' own conversion mapping on a meta model (conversions/hf_layout)
    "baton-zero-moe": ("from conversions import zero, hf_layout; import safetensors.torch; "
                       "from transformers import AutoConfig, AutoModelForCausalLM, MixtralForCausalLM; "
                       "from transformers.conversion_mapping import get_model_conversion_mapping"),
}
CONTENDERS = {**CONVERTERS, **{f"imports-{name}": code for name, code in IMPORT_FLOORS.items()}}


def run_converter(which: str, src: Path, dst: Path) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    code = ("import json, resource, sys, time; from pathlib import Path; SRC, DST = Path(sys.argv[1]), Path(sys.argv[2]);"
            " import torch; t0 = time.perf_counter(); " + CONTENDERS[which] + "; print('@@bench ' + json.dumps({'seconds': "
            "time.perf_counter() - t0, 'rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "
            "'dcp': 'torch.distributed.checkpoint' in sys.modules}))")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    p = subprocess.run([sys.executable, "-c", code, str(src), str(dst)], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{which} on {src} failed:\n{(p.stdout + p.stderr)[-3000:]}")
    return json.loads(next(l for l in p.stdout.splitlines() if l.startswith("@@bench "))[8:])


def import_floor(fmt: str) -> str:
    ours = "baton-megatron" if fmt.startswith("megatron") else "baton-zero"
    return f"imports-{ours}-moe" if f"imports-{ours}-moe" in CONTENDERS and fmt.endswith("-moe") else f"imports-{ours}"


def measure_conversion(fmt: str, src: Path, work: Path, reps: int) -> dict:
    files = checkpoint_files(src)
    total = sum(f.stat().st_size for f in files)
    ours = "baton-megatron" if fmt.startswith("megatron") else "baton-zero"
    theirs = "dcp-naive" if fmt.startswith("megatron") else "deepspeed"
    keys = ("read_cold", "read_warm", "write", "baton_cold", "baton_warm", "imports", theirs)
    samples: dict[str, list] = {k: [] for k in keys}
    out = work / "out"
    for _ in range(reps):  # contenders alternate inside each repetition
        drop_cache(files)
        samples["read_cold"].append({"seconds": read_all(files)})
        drop_cache(files)
        samples["baton_cold"].append(run_converter(ours, src, out / "baton"))
        out_bytes = sum(f.stat().st_size for f in (out / "baton").glob("*.safetensors"))
        samples["write"].append({"seconds": write_bytes(out / "write", out_bytes)})
        samples["read_warm"].append({"seconds": read_all(files)})
        samples["baton_warm"].append(run_converter(ours, src, out / "baton"))
        samples["imports"].append(run_converter(import_floor(fmt), src, out / "imports"))
        samples[theirs].append(run_converter(theirs, src, out / theirs))
    params, largest = parameters(out / "baton")
    shutil.rmtree(out, ignore_errors=True)
    return summarize(fmt, samples, params=params, largest=largest, files_bytes=total, needed_bytes=out_bytes,
                     other=theirs)


def stats(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def summarize(fmt: str, samples: dict, *, params: int, largest: int, files_bytes: int, needed_bytes: int,
              other: str) -> dict:
    """GB/s of each reader; a converter's 'fraction' is the time the ceiling needs for the bytes it must read (the
    fp32 weights, = the output) over the converter's time."""
    r: dict = {"format": fmt, "parameters": params, "checkpoint_bytes": files_bytes, "weight_bytes": needed_bytes,
               "largest_tensor_mb": round(largest / 2**20, 1), "other": other}
    for key in ("read_cold", "read_warm"):
        s = [x["seconds"] for x in samples[key]]
        r[key] = {"seconds": stats(s), "gb_per_s": round(files_bytes / 1e9 / statistics.median(s), 3)}
    for key in ("baton_cold", "baton_warm", other):
        s = [x["seconds"] for x in samples[key]]
        rss = [x["rss_mb"] for x in samples[key]]
        ceiling = r["read_cold" if key == "baton_cold" else "read_warm"]["gb_per_s"]
        r[key] = {"seconds": stats(s), "peak_rss_mb": stats(rss),
                  "gb_per_s": round(needed_bytes / 1e9 / statistics.median(s), 3),
                  "fraction_of_read_bandwidth": round(needed_bytes / 1e9 / ceiling / statistics.median(s), 3),
                  "rss_over_largest_tensor": round(statistics.median(rss) / (largest / 2**20), 2),
                  "rss_target_mb": round(1.5 * largest / 2**20 + 300, 1)}
        if all("dcp" in x for x in samples[key]):  # whether the converter imported torch.distributed.checkpoint
            r[key]["imported_dcp"] = any(x["dcp"] for x in samples[key])
    if samples.get("imports"):
        r["imports"] = {"seconds": stats([x["seconds"] for x in samples["imports"]]),
                        "peak_rss_mb": stats([x["rss_mb"] for x in samples["imports"]])}
    if samples.get("write"):  # the output must be written too: the I/O ceiling is reading plus writing its bytes
        s = [x["seconds"] for x in samples["write"]]
        r["write"] = {"seconds": stats(s), "gb_per_s": round(needed_bytes / 1e9 / statistics.median(s), 3)}
    derive_ceilings(r)
    return r


def derive_ceilings(r: dict) -> None:
    """The warm converter's fractions of the read + write ceiling, and of both ceilings after its imports. When its
    imports take ≥ 90% of its time, what is left is within the noise of two medians: not judged (None)."""
    bw, needed = r["baton_warm"], r["weight_bytes"]
    total = bw["seconds"]["median"]
    read_s = needed / 1e9 / r["read_warm"]["gb_per_s"]
    write_s = r["write"]["seconds"]["median"] if "write" in r else None
    work = total - r["imports"]["seconds"]["median"] if "imports" in r else total
    work = work if work > 0.1 * total else None
    bw["work_seconds"] = round(work, 3) if work else None
    bw["work_fraction_of_read_bandwidth"] = round(read_s / work, 3) if work else None
    bw["fraction_of_io_ceiling"] = round((read_s + write_s) / total, 3) if write_s is not None else None
    bw["work_fraction_of_io_ceiling"] = round((read_s + write_s) / work, 3) if work and write_s is not None else None


def hashing(src: Path, reps: int) -> dict:
    from conversions import manifest as mf

    files = checkpoint_files(src)
    total = sum(f.stat().st_size for f in files)
    old = lambda: [_serial_sha256(f) for f in files]  # noqa: E731 - the loop this run replaced
    new = lambda: mf.sha256_files(files, reuse=False)  # noqa: E731
    samples: dict[str, list] = {k: [] for k in ("read_warm", "serial_1mib", "parallel_streamed", "reused")}
    for _ in range(reps):
        samples["read_warm"].append(read_all(files))
        samples["serial_1mib"].append(_timed(old))
        samples["parallel_streamed"].append(_timed(new))
        mf.sha256_files(files)  # this run's digests; the next pass skips the reads
        samples["reused"].append(_timed(lambda: mf.sha256_files(files)))
    return {"files": len(files), "bytes": total, "threads": mf.HASH_THREADS,
            **{k: {"seconds": stats(v), "gb_per_s": round(total / 1e9 / statistics.median(v), 3)}
               for k, v in samples.items()}}


def _serial_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def exponent(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log(y) over log(x): 1.0 is linear growth."""
    if len(points) < 2:
        return None
    xs, ys = [math.log(x) for x, _ in points], [math.log(y) for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return round(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs), 2)


# ---- 3. report -----------------------------------------------------------------------------------------------------
def machine() -> dict:
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor())
    mem = next(int(l.split()[1]) for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal"))
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem / 2**20, 1), "python": platform.python_version(),
            "load_average_at_start": os.getloadavg(), "kernel": platform.release(),
            "note": "medians and ratios are the figures to quote"}


def markdown(res: dict) -> str:
    m = res["machine"]
    took = (f" It took {res['wall_s'] / 60:.0f} min, of which {res.get('checkpoint_writing_s', 0) / 60:.0f} min "
            "writing the checkpoints (kept for later runs)." if res.get("wall_s") else "")
    lines = [f"Measured by `make bench` on {m['cpu']} ({m['cores']} cores, {m['memory_gib']} GiB; load "
             f"{m['load_average_at_start'][0]:.1f} at start), {res['reps']} repetitions, medians.{took}", "",
             "| checkpoint | params | files GB | read cold / warm GB/s | write GB/s | baton cold / warm s | of which "
             "imports s | baton GB/s (warm) | of read bandwidth: end to end / after imports | of read + write: end to "
             "end / after imports | baton peak RSS MB (× largest tensor; imports alone) | load-everything s / RSS MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in res["conversions"]:
        o, bw, bc = c[c["other"]], c["baton_warm"], c["baton_cold"]
        lines.append(
            f"| {c['size']} {c['format']} | {c['parameters'] / 1e6:.0f}M | {c['checkpoint_bytes'] / 1e9:.2f} | "
            f"{c['read_cold']['gb_per_s']:.2f} / {c['read_warm']['gb_per_s']:.2f} | "
            f"{c['write']['gb_per_s'] if 'write' in c else '–'} | {bc['seconds']['median']:.2f} / "
            f"{bw['seconds']['median']:.2f} | {_imports(c, 'seconds', '{:.2f}')}{_dcp(c)} | {bw['gb_per_s']:.2f} | "
            f"{bw['fraction_of_read_bandwidth']:.0%} / {_pct(bw.get('work_fraction_of_read_bandwidth'))} | "
            f"{_pct(bw.get('fraction_of_io_ceiling'))} / {_pct(bw.get('work_fraction_of_io_ceiling'))} | "
            f"{bw['peak_rss_mb']['median']:.0f} ({bw['rss_over_largest_tensor']:.1f}×; "
            f"{_imports(c, 'peak_rss_mb', '{:.0f}')}) | "
            f"{c['other']} {o['seconds']['median']:.2f} / {o['peak_rss_mb']['median']:.0f} |")
    added = [c for c in res["conversions"] if c.get("added")]
    if added:
        lines += ["", "Measured apart from the rest (`bench.py --add`): " + "; ".join(
            f"{c['size']} {c['format']} at {c['added']['at']} (load {c['added']['load']:.1f}, {c['added']['reps']} "
            "repetitions)" for c in added) + "."]
    lines += ["", targets(res["conversions"])]
    lines += ["", "Growth with size (fitted exponent of baton's warm time and peak RSS over parameters; 1.0 = linear):",
              ", ".join(f"{f}: time {e['time']}, RSS {e['rss']}" for f, e in res["exponents"].items()) + "."]
    h = res.get("hashing")
    if h:
        lines += ["", f"L0 hashing of {h['files']} files, {h['bytes'] / 1e9:.2f} GB (warm): read "
                  f"{h['read_warm']['gb_per_s']:.2f} GB/s; serial 1 MiB sha256 {h['serial_1mib']['gb_per_s']:.2f} "
                  f"GB/s; streamed over {h['threads']} threads {h['parallel_streamed']['gb_per_s']:.2f} GB/s; "
                  f"already hashed in this run {h['reused']['seconds']['median'] * 1e3:.1f} ms."]
    o = res.get("overhead")
    if o:
        lines += ["", *overhead_lines(o)]
    return "\n".join(lines) + "\n"


def _imports(c: dict, key: str, fmt: str) -> str:
    return fmt.format(c["imports"][key]["median"]) if "imports" in c else "–"


def _dcp(c: dict) -> str:
    """Megatron rows: whether the converter imported torch.distributed.checkpoint (baton's own torch_dist reader does
    not; its loader would unpickle `.metadata` with plain pickle)."""
    imported = c["baton_warm"].get("imported_dcp")
    if not c["format"].startswith("megatron") or imported is None:
        return ""
    return " (imports torch.distributed.checkpoint)" if imported else " (no torch.distributed.checkpoint)"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.0%}"


def targets(conversions: list[dict]) -> str:
    """The issue's targets: ≥ 70% of the read bandwidth, peak RSS ≤ 1.5 × the largest tensor + 300 MB (warm runs)."""
    slow = [f"{c['size']} {c['format']} {c['baton_warm']['fraction_of_read_bandwidth']:.0%}" for c in conversions
            if c["baton_warm"]["fraction_of_read_bandwidth"] < 0.7]
    fat = [f"{c['size']} {c['format']} {c['baton_warm']['peak_rss_mb']['median']:.0f} > "
           f"{c['baton_warm']['rss_target_mb']:.0f} MB" for c in conversions
           if c["baton_warm"]["peak_rss_mb"]["median"] > c["baton_warm"]["rss_target_mb"]]
    slow_work = [f"{c['size']} {c['format']} {c['baton_warm']['work_fraction_of_read_bandwidth']:.0%}"
                 for c in conversions if (c["baton_warm"].get("work_fraction_of_read_bandwidth") or 1) < 0.7]
    slow_io = [f"{c['size']} {c['format']} {c['baton_warm']['work_fraction_of_io_ceiling']:.0%}"
               for c in conversions if (c["baton_warm"].get("work_fraction_of_io_ceiling") or 1) < 0.7]
    fat_work = [f"{c['size']} {c['format']}" for c in conversions if "imports" in c and
                c["baton_warm"]["peak_rss_mb"]["median"] - c["imports"]["peak_rss_mb"]["median"]
                > c["baton_warm"]["rss_target_mb"]]
    unjudged = [f"{c['size']} {c['format']}" for c in conversions if "imports" in c
                and c["baton_warm"].get("work_seconds") is None]
    not_judged = f" (not judged: {', '.join(unjudged)}, whose imports take ≥ 90% of the time)" if unjudged else ""
    return (f"Targets: ≥ 70% of the warm read bandwidth — end to end "
            f"{'met by all' if not slow else 'missed by ' + ', '.join(slow)}; after the converter's imports "
            f"{'met by all' if not slow_work else 'missed by ' + ', '.join(slow_work)}{not_judged}; of the read + write "
            f"ceiling after the imports {'met by all' if not slow_io else 'missed by ' + ', '.join(slow_io)}. "
            f"Peak RSS ≤ 1.5 × largest "
            f"tensor + 300 MB — {'met by all' if not fat else 'missed by ' + ', '.join(fat)}; above the imports' own "
            f"RSS {'met by all' if not fat_work else 'missed by ' + ', '.join(fat_work)}.")


def _m(v: dict | None, fmt: str = "{:.2f}") -> str:
    """median (min–max) of a stats dict from overhead_bench.stats; '–' when it was not measured."""
    if not v:
        return "–"
    if v["n"] == 1 or v["min"] == v["max"]:
        return fmt.format(v["median"])
    return f"{fmt.format(v['median'])} ({fmt.format(v['min'])}–{fmt.format(v['max'])})"


def overhead_lines(o: dict) -> list[str]:
    """The orchestration table: `baton run` vs the bare workers (benchmarks/overhead_bench.py)."""
    if "pipeline" not in o:  # a result of the earlier one-repetition layout
        return [f"Orchestration: an earlier result ({o.get('note', 'no note')}); rerun benchmarks/overhead_bench.py."]
    p, lp, m = o["pipeline"], o["long_pretrain"], o.get("machine_at_start", {})
    pct = lambda v: _m(v and {k: (x * 100 if k != "n" else x) for k, x in v.items()}, "{:+.1f}%")  # noqa: E731
    out = [f"Orchestration (benchmarks/overhead_bench.py, profile {o['profile']}, {m.get('cores', '?')} cores, "
           f"load {'/'.join(f'{x:.1f}' for x in m.get('load_average', []))} at start): `baton run` data → pretrain "
           f"→ rlhf → finetune ({p['steps']['pretrain']}/{p['steps']['rlhf']}/{p['steps']['finetune']} steps, "
           f"{p['reps']} repetition(s)) took {_m(p['baton_wall_s'], '{:.0f}')} s: Prefect/MLflow start-up "
           f"{_m(p['startup_s'], '{:.0f}')} s, steps {_m(p['steps_total_s'], '{:.0f}')} s (the data stage and "
           f"two conversions with gates included), flow bookkeeping {_m(p['flow_bookkeeping_s'], '{:.0f}')} s. "
           f"Training steps {_m(p['training_stages_ratio'])}× their bare workers; whole run "
           f"{_m(p['whole_run_ratio'])}× the three bare workers. Median (min–max); per-step overhead = (engine wall "
           f"under baton − bare worker wall) / steps, over the bare median step time; target ≤ "
           f"{o['verdict']['target']:.0%}.", "",
           "| stage | steps | `baton run` step s | engine under baton s | bare worker s | step ratio | stage "
           "bookkeeping s | per-step overhead | median step time baton / bare s |",
           "|---|---|---|---|---|---|---|---|---|"]
    rows = [(n, p["steps"][n], v) for n, v in p["stages"].items()]
    rows.append((f"pretrain ×{_scale(o)} (alternating, {lp['reps']} reps)", lp["steps"], lp))
    for name, steps, v in rows:
        out.append(f"| {name} | {steps} | {_m(v['baton_step_s'], '{:.1f}')} | {_m(v['baton_engine_s'], '{:.1f}')} | "
                   f"{_m(v['bare_worker_s'], '{:.1f}')} | {_m(v['ratio'])} | {_m(v['stage_bookkeeping_s'], '{:.1f}')}"
                   f" | {pct(v['per_step_overhead'])} | {_m(v['median_step_time_baton_s'], '{:.3f}')} / "
                   f"{_m(v['median_step_time_bare_s'], '{:.3f}')} |")
    missed = [f"{n} (step time ×{v['step_time_ratio']:.2f}" + (f", per-step overhead {v['per_step_overhead']:+.1%})"
                                                              if v["overhead_judged"] else ")")
              for n, v in o["verdict"]["stages"].items() if not v["met"]]
    out += ["", f"Per-step overhead ≤ {o['verdict']['target']:.0%} (judged on the median step-time ratio of every stage "
                "and the long run's per-step overhead): "
            + ("met by every stage." if not missed else "missed by " + ", ".join(missed) + ".")]
    out += verification_lines(p)
    if o.get("note"):
        out += ["", f"Note: {o['note']}."]
    return out


def verification_lines(p: dict) -> list[str]:
    """What each gate's levels cost inside its step, from the pipeline run's first repetition (conversions carry it)."""
    facts = (p.get("facts") or [{}])[0]
    timed = facts.get("verification_s") or {}
    if not timed:
        return []
    parts = [f"{label} {', '.join(f'{k} {v:.1f}' for k, v in levels.items())} s of its {facts['steps_s'][label]:.0f} s"
             for label, levels in timed.items()]
    return ["", "Verification inside the pipeline's steps (gate levels, seconds): " + "; ".join(parts) + "."]


def _scale(o: dict) -> int:
    return o["long_pretrain"]["steps"] // o["pipeline"]["steps"]["pretrain"]


def update_readme(table: str) -> None:
    """The table between the bench markers of the docs' performance page (appended when the markers are missing)."""
    text = PERFORMANCE_PAGE.read_text()
    begin, end = "<!-- bench:begin -->", "<!-- bench:end -->"
    block = f"{begin}\n{table}{end}"
    text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S) \
        if begin in text else f"{text.rstrip()}\n\n{block}\n"
    PERFORMANCE_PAGE.write_text(text)


def perf_name(conv: dict, key: str, quantity: str) -> str:
    """`perf/<size>_<format>_<measurement>_<quantity>` (the metric scheme of tasks/events.py)."""
    from tasks import events

    return events.checked("perf/" + re.sub(r"[^a-z0-9]+", "_", f"{conv['size']}_{conv['format']}_{key}_{quantity}".lower()))


def log_mlflow(res: dict) -> str | None:
    from tasks import tracking

    c = tracking.client()
    run = c.create_run(tracking.experiment_id(c, "baton-benchmarks"), run_name="bench", tags={"benchmark": "bench"})
    rid = run.info.run_id
    for conv in res["conversions"]:
        for key in ("read_cold", "read_warm", "write"):
            if key in conv:
                c.log_metric(rid, perf_name(conv, key, "bytes_per_s"), conv[key]["gb_per_s"] * 1e9)
        for key in ("baton_cold", "baton_warm", conv["other"]):
            c.log_metric(rid, perf_name(conv, key, "s"), conv[key]["seconds"]["median"])
            c.log_metric(rid, perf_name(conv, key, "peak_rss_mib"), conv[key]["peak_rss_mb"]["median"])
    c.log_dict(rid, res, "bench.json")
    c.set_terminated(rid)
    return rid


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="S,M", help=f"of {','.join(SIZES)} (L: ~320M parameters)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--overhead", action=argparse.BooleanOptionalAction, default=True,
                    help="also `baton run` vs the bare workers (the long pretraining run --reps times, alternating)")
    ap.add_argument("--overhead-profile", choices=("quick", "full"), default="quick",
                    help="quick: one pipeline repetition (~15 min here); full: --reps of them, more fine-tuning steps")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("BATON_CACHE", Path.home() / ".cache" / "baton"))
                    / "bench")
    ap.add_argument("--overhead-from", type=Path, default=None,
                    help="use this overhead_bench.py result (JSON) instead of measuring the overhead again")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from bench.json (+ --overhead-from)")
    ap.add_argument("--prepare", action="store_true", help="only write the checkpoints (kept in --work)")
    ap.add_argument("--add", action="store_true",
                    help="measure only --formats and keep the other rows, hashing and overhead of bench.json (the "
                         "added rows say when and at which load they were measured)")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.prepare:
        for size in args.sizes.split(","):
            for fmt in args.formats.split(","):
                print(f"[bench] {size} {fmt}: {make(args.work, size, fmt)}", flush=True)
        return 0
    if args.report_only:
        res = json.loads((RESULTS / "bench.json").read_text())
        for conv in res["conversions"]:
            derive_ceilings(conv)
    else:
        sizes, formats = args.sizes.split(","), args.formats.split(",")
        if args.add:
            res = json.loads((RESULTS / "bench.json").read_text())
            res["conversions"] = [c for c in res["conversions"] if c["format"] not in formats]
        else:
            res = {"machine": machine(), "reps": args.reps, "conversions": [],
                   "started": time.strftime("%FT%TZ", time.gmtime())}
            res["hashing"] = hashing(timed_make(res, args.work, sizes[-1], formats[0]), args.reps)
            publish(res)
        for fmt in formats:  # one format at all sizes before the next: a run cut short still has its exponents
            for size in sizes:
                src = timed_make({} if args.add else res, args.work, size, fmt)  # added: not the run's writing time
                print(f"[bench] {size} {fmt}: {src}", flush=True)
                added = {"added": {"at": time.strftime("%FT%H:%MZ", time.gmtime()), "load": os.getloadavg()[0],
                                   "reps": args.reps}} if args.add else {}
                res["conversions"].append({"size": size, **measure_conversion(fmt, src, args.work, args.reps),
                                           **added})
                publish(res)
    if args.overhead_from:
        res["overhead"] = {**json.loads(args.overhead_from.read_text()), "source": str(args.overhead_from.name)}
    elif args.overhead and not args.report_only and not args.add:
        import overhead_bench

        res["overhead"] = overhead_bench.run(args.work / "overhead", reps=args.reps,
                                             quick=args.overhead_profile == "quick")
    if not args.add:
        res["finished"] = time.strftime("%FT%TZ", time.gmtime())
    if not args.report_only and not args.add:
        res["wall_s"] = round(time.perf_counter() - started, 1)
    table = publish(res)
    try:
        res["mlflow_run_id"] = log_mlflow(res)
        (RESULTS / "bench.json").write_text(json.dumps(res, indent=2) + "\n")
    except Exception as e:  # noqa: BLE001 - the numbers are on disk either way
        print(f"MLflow logging failed: {e}", file=sys.stderr)
    print(table)
    return 0


def publish(res: dict) -> str:
    """bench.json, bench.md and the docs' performance table, rewritten after every measurement."""
    formats = sorted({c["format"] for c in res["conversions"]})
    res["exponents"] = {f: {"time": exponent([(c["parameters"], c["baton_warm"]["seconds"]["median"])
                                              for c in res["conversions"] if c["format"] == f]),
                            "rss": exponent([(c["parameters"], c["baton_warm"]["peak_rss_mb"]["median"])
                                             for c in res["conversions"] if c["format"] == f])} for f in formats}
    table = markdown(res)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / "bench.md").write_text(table)
    update_readme(table)
    return table


def timed_make(res: dict, work: Path, size: str, fmt: str) -> Path:
    """make() in a child process (`--prepare`), its time (~0 when the checkpoint was kept from an earlier run) added to
    res["checkpoint_writing_s"]. Not in this process: a converter's peak RSS (ru_maxrss) starts at the RSS of the
    process it was forked from, and the pretrain stage writing a Megatron checkpoint in-process leaves this one
    hundreds of MB larger (measured: megatron-ep2-moe S 672 MB written in the same run, 291 MB kept)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--prepare", "--sizes", size, "--formats", fmt,
                    "--work", str(work)], check=True)
    res["checkpoint_writing_s"] = round(res.get("checkpoint_writing_s", 0) + time.perf_counter() - t0, 1)
    return make(work, size, fmt)  # kept: returns the folder at once


def make(work: Path, size: str, fmt: str) -> Path:
    if fmt.startswith("zero"):
        return zero_checkpoint(work, size, int(fmt.removesuffix("-moe")[-1]), moe=fmt.endswith("-moe"))
    return megatron_checkpoint(work, size, *MEGATRON_LAYOUTS[fmt])


if __name__ == "__main__":
    sys.exit(main())
