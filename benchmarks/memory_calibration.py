"""Check `baton plan`'s CPU memory estimate against the peak RSS of real runs (Megatron TP/PP, DeepSpeed ZeRO-1/2/3,
TRL DPO at two micro-batches).

    .venv/bin/python benchmarks/memory_calibration.py OUT_DIR [--only NAME,...]

Each configuration runs the real stage worker for a few steps on CPU (the same spec and command the pipeline builds),
reads every rank's peak RSS from the worker's own result (ru_maxrss), and prints measured vs predicted per rank with
the residual. Results go to OUT_DIR/calibration.json (appended as they finish).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tasks import events  # noqa: E402
from flows.config import ModelConfig  # noqa: E402
from tasks import memory_plan as mp  # noqa: E402

SIZES = {  # A: the tiny default (~0.3M parameters); B: ~12M, where model states weigh as much as the runtime
    "A": {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 344,
          "seq_length": 128, "vocab_size": 512, "tie_word_embeddings": False},
    "B": {"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "num_query_groups": 4,
          "ffn_hidden_size": 1376, "seq_length": 128, "vocab_size": 512, "tie_word_embeddings": False},
}
SIZES = {k: ModelConfig(**v).model_dump() for k, v in SIZES.items()}  # every key the workers read
RUNS = [  # name, stage, size, stage overrides
    ("pretrain-A-tp1", "pretrain", "A", {}),
    ("pretrain-A-tp2", "pretrain", "A", {"tensor_parallel": 2, "nproc_per_node": 2}),
    ("pretrain-A-pp2", "pretrain", "A", {"pipeline_parallel": 2, "nproc_per_node": 2}),
    ("pretrain-B-tp1", "pretrain", "B", {}),
    ("pretrain-B-tp2", "pretrain", "B", {"tensor_parallel": 2, "nproc_per_node": 2}),
    ("pretrain-B-pp2", "pretrain", "B", {"pipeline_parallel": 2, "nproc_per_node": 2}),
    ("finetune-A-zero1", "finetune", "A", {"zero": {"stage": 1}}),
    ("finetune-A-zero2", "finetune", "A", {"zero": {"stage": 2}}),
    ("finetune-A-zero3", "finetune", "A", {"zero": {"stage": 3}}),
    ("finetune-B-zero1", "finetune", "B", {"zero": {"stage": 1}}),
    ("finetune-B-zero2", "finetune", "B", {"zero": {"stage": 2}}),
    ("finetune-B-zero3", "finetune", "B", {"zero": {"stage": 3}}),
    ("rlhf-A-mb8", "rlhf", "A", {}),
    ("rlhf-A-mb16", "rlhf", "A", {"micro_batch_size": 16}),
    ("rlhf-A-mb32", "rlhf", "A", {"micro_batch_size": 32}),
    ("rlhf-B-mb8", "rlhf", "B", {}),
    ("rlhf-B-mb16", "rlhf", "B", {"micro_batch_size": 16}),
    ("rlhf-B-mb32", "rlhf", "B", {"micro_batch_size": 32}),
]
PRETRAIN = {"steps": 3, "warmup_steps": 1, "micro_batch_size": 8, "global_batch_size": 16, "eval_interval": 100,
            "eval_iters": 1, "checkpoint_every": 100, "device": "cpu"}
FINETUNE = {"steps": 3, "warmup_steps": 1, "micro_batch_size": 8, "nproc_per_node": 2, "checkpoint_every": 100,
            "eval_max_new_tokens": 4, "launcher": "torchrun", "device": "cpu"}
RLHF = {"steps": 3, "micro_batch_size": 8, "backend": "trl", "algorithm": "dpo", "checkpoint_every": 100,
        "device": "cpu"}  # DPO with TRL on one CPU process (the tiny config's rlhf), a copied reference model


def data_dir(root: Path) -> Path:
    from conversions import manifest as mf
    from tasks.data.config import DataConfig
    from tasks.data.task import write_data
    from tasks.stage import StageContext

    out = root / "data"
    if (out / mf.MANIFEST_NAME).exists():
        return out
    ctx = StageContext(stage="data", run_id="calibration", run_dir=out, work_dir=out, model=SIZES["A"], seed=0)
    write_data(ctx, DataConfig(pretrain_docs=600, preference_pairs=200, sft_examples=200))  # DPO: 32-pair batches
    mf.write(out, mf.build(out, format="dataset", stage="data", tokenizer_dir=out / "tokenizer"))
    return out


def hf_input(root: Path, size: str, data: Path) -> Path:
    """A random-init HF Llama of this size with the data stage's tokenizer (finetune's input)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from conversions import hf

    dest = root / f"hf-{size}"
    if (dest / "config.json").exists():
        return dest
    tok = AutoTokenizer.from_pretrained(str(data / "tokenizer"))
    config = hf.llama_config(SIZES[size], vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(dest), safe_serialization=True)
    tok.save_pretrained(str(dest))
    return dest


def command_for(name: str, stage: str, size: str, overrides: dict, root: Path, data: Path):
    """(command, environment, stage config) exactly as the stage task builds them."""
    from tasks.stage import StageContext

    work = root / name
    work.mkdir(parents=True, exist_ok=True)
    if stage == "pretrain":
        from tasks.pretrain.config import PretrainConfig
        from tasks import events
        from tasks.pretrain.task import build_spec, command

        cfg = PretrainConfig(**{**PRETRAIN, **overrides})
        ctx = StageContext(stage=stage, run_id=name, run_dir=work, work_dir=work, model=SIZES[size], seed=0,
                           data_dir=data)
        spec_path = events.write_spec(work / "worker_spec.json", build_spec(ctx, cfg))
        env = ctx.worker_env(OMP_NUM_THREADS=1, TORCHDYNAMO_DISABLE=1)
        return command(ctx, cfg, spec_path), env, cfg
    if stage == "rlhf":
        from tasks import chat_template
        from tasks.rlhf.config import RlhfConfig
        from tasks.rlhf.task import check_inputs, worker_command

        cfg = RlhfConfig(**{**RLHF, **overrides})
        ctx = StageContext(stage=stage, run_id=name, run_dir=work, work_dir=work, model=SIZES[size], seed=0,
                           data_dir=data, input=hf_input(root, size, data), input_format="hf-safetensors")
        check_inputs(ctx, cfg)
        cmd = worker_command(ctx, cfg, work / "checkpoint.partial", chat_template.for_input(ctx))
        return cmd, ctx.worker_env(OMP_NUM_THREADS=1), cfg  # as run_trl launches it
    from tasks.finetune.config import FinetuneConfig
    from tasks.finetune.task import prepare

    cfg = FinetuneConfig(**{**FINETUNE, **overrides})
    ctx = StageContext(stage=stage, run_id=name, run_dir=work, work_dir=work, model=SIZES[size], seed=0,
                       data_dir=data, input=hf_input(root, size, data), input_format="hf-safetensors")
    cmd, env, _, _ = prepare(ctx, cfg)
    return cmd, ctx.worker_env(**env), cfg


def measured_peaks(cmd: list[str], env: dict, log: Path, timeout: float = 900) -> dict:
    """Run the worker; the peaks from its events (the last ones carrying [perf/]rank<N>_peak_mem_mib; the pretrain
    worker's result carries them in its `memory`)."""
    found: dict = {}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        t0 = time.time()
        for line in proc.stdout:
            f.write(line)
            ev = events.parse(line.rstrip("\n"))
            if ev:
                fields = {**ev, **(ev.get("memory") or {})}
                found.update({k: v for k, v in fields.items() if k.endswith("peak_mem_mib")})
            if time.time() - t0 > timeout:
                proc.kill()
        rc = proc.wait()
    if rc != 0:
        raise RuntimeError(f"worker exited {rc}; see {log}")
    return found


def predicted_mb(stage: str, size: str, cfg) -> float:
    m = SIZES[size]
    shape = mp.Shape(m["num_layers"], m["hidden_size"], m["num_attention_heads"], m["num_query_groups"],
                     m["ffn_hidden_size"], m["vocab_size"], m["tie_word_embeddings"])
    layout = mp.layout_of_stage(stage, cfg, "cpu")
    seq = cfg.max_seq_length or m["seq_length"]
    return mp.breakdown(shape, layout, seq, "fp32", "cpu").total() / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", default="")
    ap.add_argument("--fit", action="store_true", help="fit the CPU constants on the stored results; run nothing")
    a = ap.parse_args()
    if a.fit:
        results = json.loads((a.out / "calibration.json").read_text())
        fit(results)
        report(results, a.out)
        return
    a.out.mkdir(parents=True, exist_ok=True)
    data = data_dir(a.out)
    results_path = a.out / "calibration.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    only = set(filter(None, a.only.split(",")))
    for name, stage, size, overrides in RUNS:
        if (only and name not in only) or (not only and name in results):
            continue
        cmd, env, cfg = command_for(name, stage, size, overrides, a.out, data)
        t0 = time.time()
        peaks = measured_peaks(cmd, env, a.out / f"{name}.log")
        ranks = [v for k, v in peaks.items() if re.search(r"rank\d+_peak_mem_mib$", k)]
        ranks = ranks or [peaks["peak_mem_mib"]]  # TRL on one process reports its own (rank 0's) peak
        results[name] = {"stage": stage, "size": size, "measured_mb_max": max(ranks), "measured_mb_ranks": ranks,
                         "seconds": round(time.time() - t0, 1)}
        results_path.write_text(json.dumps(results, indent=2))
        print(name, results[name], flush=True)
    report(results, a.out)


def stage_cfg(stage: str, overrides: dict):
    from tasks.finetune.config import FinetuneConfig
    from tasks.pretrain.config import PretrainConfig
    from tasks.rlhf.config import RlhfConfig

    if stage == "rlhf":
        return RlhfConfig(**{**RLHF, **overrides})
    return (PretrainConfig(**{**PRETRAIN, **overrides}) if stage == "pretrain"
            else FinetuneConfig(**{**FINETUNE, **overrides}))


def features(stage: str, size: str, cfg) -> tuple[float, float, float]:
    """(training states and formula buffers MiB, formula activations MiB, parameters per rank / 2**20) of one run."""
    m = SIZES[size]
    shape = mp.Shape(m["num_layers"], m["hidden_size"], m["num_attention_heads"], m["num_query_groups"],
                     m["ffn_hidden_size"], m["vocab_size"], m["tie_word_embeddings"])
    layout = mp.layout_of_stage(stage, cfg, "cpu")
    b = mp.breakdown(shape, layout, cfg.max_seq_length or m["seq_length"], "fp32", "cpu")
    fit = mp.CPU_FIT[mp.engine_of(layout)]
    acts = b.activations / fit["activation_factor"]
    n = b.extra["params_per_rank"]
    formula_buffers = b.buffers - fit["base_mb"] * 2**20 - fit["staging_bytes_per_param"] * n  # e.g. ZeRO-3 gathers
    return (b.weights + b.gradients + b.optimizer + formula_buffers) / 2**20, acts / 2**20, n / 2**20


def fit(results: dict) -> None:
    """Least squares per engine: measured - states = base + factor × activations + staging × params; with the
    leave-one-out residual of each run (its prediction from a fit on the others). DeepSpeed's runs vary the ZeRO
    stage at one micro-batch, so activations and parameters move together there: its activation factor is fixed at
    1 (HF's eager fp32 attention keeps the score matrices the formula counts) and only base and staging are fitted.
    TRL's DPO runs vary the micro-batch at two sizes, so all three are fitted (its factor also carries DPO's two
    sequences per pair, the reference model's forward and TRL's concatenated batch)."""
    import numpy as np

    for engine, stage, factor in (("megatron", "pretrain", None), ("deepspeed", "finetune", 1.0),
                                  ("trl", "rlhf", None)):
        rows = [(name, features(stage, size, stage_cfg(stage, ov)), results[name]["measured_mb_max"])
                for name, st, size, ov in RUNS if st == stage and name in results]
        if factor is None:
            X = np.array([[1.0, f[1], f[2]] for _, f, _ in rows])
            y = np.array([meas - f[0] for _, f, meas in rows])
        else:
            X = np.array([[1.0, f[2]] for _, f, _ in rows])
            y = np.array([meas - f[0] - factor * f[1] for _, f, meas in rows])
        coef = np.linalg.lstsq(X, y, rcond=None)[0]
        base, staging = coef[0], coef[-1]
        print(f"{engine}: base_mb {base:.1f}, activation_factor {factor or coef[1]:.3f}, "
              f"staging_bytes_per_param {staging:.2f}")
        for i, (name, f, meas) in enumerate(rows):
            keep = [j for j in range(len(rows)) if j != i]
            c = np.linalg.lstsq(X[keep], y[keep], rcond=None)[0]
            loo = f[0] + X[i] @ c + (factor * f[1] if factor else 0)
            print(f"  {name}: leave-one-out prediction {loo:.0f} vs {meas:.0f} ({(loo - meas) / meas:+.1%})")


def report(results: dict, out: Path) -> None:
    """Measured vs predicted, with residuals, as a markdown table (predictions from the current formulas)."""
    lines = ["| run | measured MiB (max rank) | predicted MiB | residual |", "|---|---|---|---|"]
    for name, stage, size, overrides in RUNS:
        if name not in results:
            continue
        cfg = stage_cfg(stage, overrides)
        meas, pred = results[name]["measured_mb_max"], predicted_mb(stage, size, cfg)
        lines.append(f"| {name} | {meas:.0f} | {pred:.0f} | {(pred - meas) / meas:+.1%} |")
    text = "\n".join(lines)
    (out / "calibration.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
