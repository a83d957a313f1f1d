"""Benchmark (not a test): ZeRO-2 → HF conversion of a few-hundred-million-parameter checkpoint, baton's streaming
converter vs DeepSpeed's `convert_zero_checkpoint_to_state_dict`, side by side in one run.

    .venv/bin/python benchmarks/zero_convert_bench.py [--hidden 1024 --layers 16 ...] [--work DIR]

1. DeepSpeed itself writes the checkpoint: 2 CPU ranks (gloo), ZeRO-2 fp32, one optimizer step, save_checkpoint.
2. Each converter runs in a fresh subprocess; the parent samples its RSS (anonymous and file-backed) from /proc and
   the child reports its own ru_maxrss. Page cache is warmed first so both read the same way.
3. The two outputs are compared tensor by tensor (must be identical).
Results: benchmarks/results/zero_convert.json and an MLflow run in experiment `baton-benchmarks`
(MLFLOW_TRACKING_URI, else sqlite under BATON_HOME).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results" / "zero_convert.json"


# ---- 1. the checkpoint, written by DeepSpeed (runs inside the 2-rank job) ------------------------------------------
def make_checkpoint(out: Path, arch: dict) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = model_config(arch)
    model = AutoModelForCausalLM.from_config(config)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 2,
                 "zero_optimization": {"stage": arch.get("stage", 2)}, "steps_per_print": 1 << 30,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    ids = torch.randint(0, arch["vocab"], (1, 16))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(str(out), tag="global_step1")
    dist.barrier()
    if dist.get_rank() == 0:
        config.save_pretrained(str(out))
        print(json.dumps({"parameters": sum(p.numel() for p in model.parameters())}), flush=True)


def model_config(arch: dict):
    """A Llama of arch's shape, or with arch["experts"] a Mixtral whose experts are arch["ffn"] wide (top
    arch["top_k"])."""
    from transformers import LlamaConfig, MixtralConfig

    shape = dict(vocab_size=arch["vocab"], hidden_size=arch["hidden"], intermediate_size=arch["ffn"],
                 num_hidden_layers=arch["layers"], num_attention_heads=arch["heads"],
                 num_key_value_heads=arch["kv_heads"], max_position_embeddings=256, tie_word_embeddings=False)
    if arch.get("experts"):
        return MixtralConfig(**shape, num_local_experts=arch["experts"], num_experts_per_tok=arch["top_k"],
                             architectures=["MixtralForCausalLM"])
    return LlamaConfig(**shape, architectures=["LlamaForCausalLM"])


def build(work: Path, arch: dict) -> tuple[Path, float]:
    return build_at(work / "zero2", arch)


def build_at(out: Path, arch: dict) -> tuple[Path, float]:
    """DeepSpeed writes the checkpoint at `out` (2 CPU ranks; arch["stage"]: the ZeRO stage, default 2)."""
    from tasks.distributed import Launch, engine_command, remove_shm_segments, with_port
    from tasks.finetune import engine_env

    if (out / "latest").exists():
        return out, 0.0
    launch = with_port(Launch(python=sys.executable, script=str(Path(__file__)), launcher="deepspeed", nnodes=1,
                              nproc_per_node=2, master_port=0,
                              args=("--make-checkpoint", str(out), "--arch", json.dumps(arch))))
    port = launch.master_port
    cmd = engine_command(launch)
    env = dict(os.environ, **engine_env.worker_env("cpu"), PYTHONPATH=str(REPO))
    t0 = time.time()
    try:
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    finally:
        remove_shm_segments(port)
    return out, time.time() - t0


# ---- 2. one converter per fresh process ----------------------------------------------------------------------------
def convert(which: str, src: Path, dst: Path, max_shard_bytes: int) -> None:
    t0 = time.time()
    if which == "baton":
        from conversions import zero

        zero.to_hf(src, dst, max_shard_bytes=max_shard_bytes)
    else:
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

        convert_zero_checkpoint_to_state_dict(str(src), str(dst), safe_serialization=True,
                                              max_shard_size=f"{max_shard_bytes // 10**6}MB")
    print("@@result " + json.dumps({"seconds": time.time() - t0,
                                    "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def _status_mb(pid: int) -> dict:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def measure(which: str, src: Path, dst: Path, max_shard_bytes: int) -> dict:
    cmd = [sys.executable, __file__, "--convert", which, str(src), str(dst), "--max-shard-bytes", str(max_shard_bytes)]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[str, float] = {}

    def sample():
        while proc.poll() is None:
            for k, v in _status_mb(proc.pid).items():
                peaks[k] = max(peaks.get(k, 0.0), v)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    t0 = time.time()
    sampler.start()
    output = proc.communicate()[0]
    wall = time.time() - t0
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{which} converter failed:\n{output[-3000:]}")
    child = json.loads(next(l for l in output.splitlines() if l.startswith("@@result "))[len("@@result "):])
    return {"convert_seconds": round(child["seconds"], 2), "process_wall_seconds": round(wall, 2),
            "peak_rss_mb": round(child["ru_maxrss_mb"], 1),
            "sampled_peak_rss_anon_mb": round(peaks.get("RssAnon", 0), 1),
            "sampled_peak_rss_file_mb": round(peaks.get("RssFile", 0), 1)}


# ---- 3. same tensors? ----------------------------------------------------------------------------------------------
def identical(a: Path, b: Path) -> tuple[bool, int]:
    import torch
    from safetensors import safe_open

    from conversions import hf

    def index(root):
        out = {}
        for f in hf.safetensors_files(root):
            for name in hf.read_header(f):
                if name != "__metadata__":
                    out[name] = f
        return out

    ia, ib = index(a), index(b)
    if ia.keys() != ib.keys():
        return False, 0
    for name in ia:  # one tensor at a time
        with safe_open(str(ia[name]), "pt") as fa, safe_open(str(ib[name]), "pt") as fb:
            x, y = fa.get_tensor(name), fb.get_tensor(name)
            if x.dtype != y.dtype or not torch.equal(x, y):
                return False, len(ia)
    return True, len(ia)


def log_mlflow(results: dict) -> str | None:
    from tasks import events, tracking

    c = tracking.client()
    exp = tracking.experiment_id(c, "baton-benchmarks")
    run = c.create_run(exp, run_name="zero_convert", tags={"benchmark": "zero_convert"})
    rid = run.info.run_id
    for k, v in {"parameters": results["parameters"], "checkpoint_gb": results["checkpoint_gb"]}.items():
        c.log_param(rid, k, v)
    for which in ("baton", "deepspeed"):
        for k, v in results[which].items():
            if isinstance(v, (int, float)):
                unit = k.replace("_seconds", "_s").replace("_mb", "_mib")  # the metric scheme of tasks/events.py
                c.log_metric(rid, events.checked(f"perf/{which}_{unit}"), float(v))
    c.log_metric(rid, events.summary_name("identical"), float(results["identical"]))
    c.log_dict(rid, results, "zero_convert.json")
    c.set_terminated(rid)
    return rid


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--make-checkpoint", type=Path)
    ap.add_argument("--convert", nargs=3, metavar=("WHICH", "SRC", "DST"))
    ap.add_argument("--arch", default=None)
    ap.add_argument("--local_rank", type=int)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--max-shard-bytes", type=int, default=500 * 10**6)
    ap.add_argument("--work", type=Path, default=None, help="keep the checkpoint here (default: a temp dir)")
    args = ap.parse_args()
    if args.make_checkpoint:
        return make_checkpoint(args.make_checkpoint, json.loads(args.arch))
    if args.convert:
        which, src, dst = args.convert
        return convert(which, Path(src), Path(dst), args.max_shard_bytes)

    arch = {"hidden": args.hidden, "layers": args.layers, "ffn": args.ffn, "heads": args.heads,
            "kv_heads": args.kv_heads, "vocab": args.vocab}
    with tempfile.TemporaryDirectory(prefix="zero-bench-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        src, build_s = build(work, arch)
        from conversions import zero

        ck = zero.open_checkpoint(src)
        params = sum(int(torch_numel(s)) for g in ck.param_shapes for s in g.values())
        ckpt_bytes = sum(p.stat().st_size for p in (src / ck.tag).iterdir())
        for p in (src / ck.tag).iterdir():  # warm the page cache so both converters read alike
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass
        results = {"parameters": params, "checkpoint_gb": round(ckpt_bytes / 1e9, 3), "zero_stage": ck.stage,
                   "world_size": ck.world_size, "fp32_model_gb": round(params * 4 / 1e9, 3), "arch": arch,
                   "build_seconds": round(build_s, 1), "max_shard_bytes": args.max_shard_bytes,
                   "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
        for which in ("baton", "deepspeed"):
            r = measure(which, src, work / f"hf-{which}", args.max_shard_bytes)
            r["params_per_s"] = round(params / r["convert_seconds"])
            r["output_mb_per_s"] = round(params * 4 / 1e6 / r["convert_seconds"], 1)
            results[which] = r
            print(which, json.dumps(r), flush=True)
        same, n = identical(work / "hf-baton", work / "hf-deepspeed")
        results.update(identical=same, tensors=n,
                       rss_ratio_deepspeed_over_baton=round(results["deepspeed"]["peak_rss_mb"]
                                                            / results["baton"]["peak_rss_mb"], 2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    try:
        results["mlflow_run_id"] = log_mlflow(results)
    except Exception as e:  # the numbers are on disk either way
        print(f"MLflow logging failed: {e}", file=sys.stderr)
    print(json.dumps(results, indent=2))


def torch_numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


if __name__ == "__main__":
    main()
