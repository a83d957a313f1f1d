"""Pretrain stage: check the inputs, launch the Megatron-Core worker under torchrun, then package its final checkpoint
(tokenizer, probe logits, manifest) and gate it: L0 integrity + L1 exact reload."""
from __future__ import annotations

import os
import shutil
import statistics
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from conversions import durable, folder, manifest as mf, megatron, probe, sealed, verify
from conversions.manifest import Format
from conversions.megatron import architecture as checkpoint_architecture, padded_vocab_size
from conversions.refusal import Refused
from tasks.pretrain.config import PretrainConfig, expert_tensor_parallel, resolved_device
from tasks import events
from tasks.distributed import Launch, LaunchConfigError, engine_command, stage_runtime
from tasks.stage import StageContext, StageOutput, training_engine_env

WORKER = Path(__file__).with_name("worker.py")
SEAL = sealed.MARKERS[Format.MEGATRON_DIST]
INPUT_COPY = "input"  # in the work dir: an input checkpoint's weights as baton rewrote them for Megatron
SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "tie_word_embeddings")


class PretrainInputError(Refused):
    pass


def tokenizer_vocab(tok_dir: Path) -> int:
    """len(tokenizer) as transformers counts it (added tokens included), read with `tokenizers` alone."""
    from tokenizers import Tokenizer

    if not (tok_dir / "tokenizer.json").exists():
        raise PretrainInputError(f"{tok_dir}: no tokenizer.json (the data stage writes one)")
    return Tokenizer.from_file(str(tok_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


def experts(arch: dict) -> tuple[int, int, int] | None:
    """A mixture of experts' shape as an input must match it: experts, top-k, one expert's FFN width (None: dense)."""
    moe = megatron.moe(arch)
    return None if moe is None else (moe["num_experts"], moe["top_k"], megatron.expert_ffn(arch))


def check_data(ctx: StageContext) -> int:
    """The data stage's output is complete; returns its tokenizer's vocabulary size."""
    if ctx.data_dir is None or not (ctx.data_dir / "tokenizer").exists():
        raise PretrainInputError(f"pretrain needs the data stage's output (tokenizer/, pretrain/*.jsonl); got {ctx.data_dir}")
    for split in ("train", "heldout"):
        if not (ctx.data_dir / "pretrain" / f"{split}.jsonl").exists():
            raise PretrainInputError(f"{ctx.data_dir}/pretrain/{split}.jsonl: missing")
    return tokenizer_vocab(ctx.data_dir / "tokenizer")


def build_spec(ctx: StageContext, cfg: PretrainConfig, vocab: int | None = None,
               probe: bool = False) -> events.PretrainSpec:
    """Everything the worker needs, resolved and checked here so that bad input fails before anything launches.
    `vocab`: the tokenizer's size when the data lives elsewhere (a cluster volume); else read from ctx.data_dir.
    probe: the batch finder's run (training steps only)."""
    vocab = check_data(ctx) if vocab is None else vocab
    arch = {**ctx.architecture(), "vocab_size": vocab}
    tp = cfg.tensor_parallel
    if ctx.input is not None:
        if ctx.input_format not in (None, Format.MEGATRON_DIST):
            raise PretrainInputError(f"pretrain reads {Format.MEGATRON_DIST} checkpoints, not {ctx.input_format}")
        src = checkpoint_architecture(ctx.input)
        # a mixture of experts has no dense MLP: its width is the experts' (an HF Mixtral states only that one)
        keys = [k for k in SHAPE_KEYS if not (k == "ffn_hidden_size" and experts(src) and experts(arch))]
        diff = {k: (src.get(k), arch.get(k)) for k in keys if k in src and src.get(k) != arch.get(k)}
        if megatron.family(src) != megatron.family(arch):  # Qwen2's q/k/v biases have no place in a Llama, nor back
            diff["arch"] = (megatron.family(src), megatron.family(arch))
        if experts(src) != experts(arch):  # a dense MLP, or other experts, have no place in the model's layers
            diff["moe (experts, top-k, expert ffn)"] = (experts(src), experts(arch))
        if diff:
            raise PretrainInputError(f"input {ctx.input}: architecture differs from model: "
                                     + ", ".join(f"{k} {a} (input) vs {b} (model)" for k, (a, b) in diff.items()))
        if src["vocab_size"] != vocab:
            raise PretrainInputError(f"input {ctx.input}: vocabulary {src['vocab_size']} differs from the tokenizer's "
                                     f"{vocab}")
        padded = int(src.get("padded_vocab_size") or src["vocab_size"])
        if padded % tp:
            raise PretrainInputError(f"input {ctx.input}: its {padded} embedding rows are not divisible by "
                                     f"tensor_parallel {tp}")
    else:
        rows = cfg.vocab_size or vocab
        if rows < vocab:
            raise PretrainInputError(f"pretrain.vocab_size {rows} is smaller than the tokenizer's vocabulary ({vocab})")
        padded = padded_vocab_size(rows, cfg.make_vocab_size_divisible_by, tp)
    return events.PretrainSpec(
        config=training_spec(cfg), architecture=arch, padded_vocab_size=padded,
        seq_length=cfg.max_seq_length or ctx.model["seq_length"], seed=ctx.seed, device=resolved_device(cfg),
        data_dir=ctx.data_dir, work_dir=ctx.work_dir, input=ctx.input, probe=probe)


def training_spec(cfg: PretrainConfig) -> events.PretrainTraining:
    """The config's values the worker reads, under their config names; the global batch resolved."""
    read = set(events.PretrainTraining.model_fields) - {"global_batch_size", "expert_tensor_parallel"}
    return events.PretrainTraining(**cfg.model_dump(include=read), global_batch_size=cfg.global_batch(),
                                   expert_tensor_parallel=expert_tensor_parallel(cfg))


def loadable_input(ctx: StageContext) -> tuple[Path, str | None]:
    """The folder Megatron loads the input's weights from, and why it is not the input itself: the input when this
    BATON_HOME sealed it (a baton pretrain output, an HF import), else a copy baton writes (and seals) from the tensors
    its own reader parsed. Megatron's loader unpickles `.metadata` with plain pickle: a folder baton did not write never
    reaches it, and the worker loads nothing whose seal does not verify."""
    why = sealed.problem(ctx.input, SEAL)
    if why is None:
        return ctx.input, None
    final, partial = ctx.work_dir / INPUT_COPY, ctx.work_dir / f"{INPUT_COPY}.partial"
    for old in (final, partial):
        shutil.rmtree(old, ignore_errors=True)
    megatron.rewrite(ctx.input, partial)
    sealed.seal(partial, SEAL, rewritten_from=str(ctx.input))
    durable.publish_dir(partial, final)
    return final, why


def command(ctx: StageContext, cfg: PretrainConfig, spec_path: Path) -> list[str]:
    """torchrun on nnodes × nproc_per_node ranks, on the `main` runtime's target (local, slurm or ray)."""
    launch = Launch(python=ctx.python("main"), script=str(WORKER), args=("--spec", str(spec_path)),
                    nnodes=cfg.nnodes, nproc_per_node=cfg.nproc_per_node, launcher="torchrun", master_port=0)
    try:
        return engine_command(launch, stage_runtime(ctx), ctx.work_dir)
    except LaunchConfigError as e:
        raise PretrainInputError(f"pretrain: {e}") from None


def package(ctx: StageContext, cfg: PretrainConfig, spec: events.PretrainSpec, r: events.PretrainResult) -> Path:
    """checkpoint.partial (dist checkpoint + probe logits, from the worker) + tokenizer + manifest → checkpoint."""
    partial, out = ctx.work_dir / "checkpoint.partial", ctx.work_dir / "checkpoint"
    folder.copy_tree(ctx.data_dir / "tokenizer", partial / "tokenizer")
    arch = {**spec.architecture, "padded_vocab_size": spec.padded_vocab_size,
            "kv_channels": spec.architecture["hidden_size"] // spec.architecture["num_attention_heads"]}
    data_m = mf.read(ctx.data_dir)
    m = mf.build(
        partial, format=Format.MEGATRON_DIST, stage=ctx.stage, architecture=arch,
        engine={"name": "megatron-core", "layer_spec": r.layer_spec, **mf.engine_versions("megatron-core", "torch")},
        parameter_count=r.parameters, dtype=cfg.torch_dtype(),
        parent=mf.parent_ref(ctx.input) if ctx.input is not None else None,
        extra={"layout": r.layout, "iteration": r.iteration, "consumed_samples": r.consumed_samples,
               "sharded_backend": "torch_dist", "optimizer_state": True,
               "distributed_optimizer": cfg.distributed_optimizer, "seq_length": spec.seq_length,
               "data_digest": mf.digest_of(data_m) if data_m else None},
        tokenizer_dir=partial / "tokenizer",
    )
    mf.write(partial, m)
    if out.exists():
        shutil.rmtree(out)
    os.replace(partial, out)
    return out


def gate(out: Path, r: events.PretrainResult, dtype: str = "float32") -> dict:
    checks = verify.integrity(out)
    # a run whose weights diverged can keep a finite training loss to its end (measured: lr 1e12, loss 6.30 every
    # step, held-out perplexity nan); this names it, where the reload check alone would only say "None"
    checks += verify.finite_weights(out)
    p, l = r.reload_param_max_abs_diff, r.reload_logits_max_abs_diff
    exact = p == 0.0 and l == 0.0
    checks.append(verify.check("L1.reload", exact, f"fresh model loaded from the dist checkpoint: max |Δparam| {p}, "
                                                  f"max |Δprobe logit| {l} (must be exactly 0)"))
    if ip := r.input_parity:  # the input's own probe logits, reproduced by the loaded Megatron model
        lim = probe.THRESHOLDS[dtype]
        ok = ip.max_abs_diff <= lim["max_abs_diff"] and ip.top1_agreement >= lim["top1_agreement"]
        checks.append(verify.check("L2.input_parity", ok, f"input loaded into Megatron vs {ip.reference}: max "
                                   f"|Δlogit| {ip.max_abs_diff:.3g} (≤ {lim['max_abs_diff']:g}), top-1 agreement "
                                   f"{ip.top1_agreement:.3f} [{dtype}]"))
    checks.append(verify.check("probe_logits", (out / "probe_logits.safetensors").exists(),
                               "engine logits on the probe batch for the conversion's L2 parity"))
    return verify.report(checks)


def backend(cfg: PretrainConfig, device: str) -> str:
    vp = f"(VP{cfg.virtual_pipeline_parallel} interleaved)" if cfg.virtual_pipeline_parallel else ""
    fp8 = f" fp8 {cfg.fp8}" if cfg.fp8 != "none" else ""
    etp = expert_tensor_parallel(cfg)
    ep = f"×EP{cfg.expert_parallel}" if cfg.expert_parallel > 1 else ""
    ep += f"(ETP{etp})" if cfg.expert_parallel > 1 and etp != cfg.tensor_parallel else ""
    return f"TP{cfg.tensor_parallel}×PP{cfg.pipeline_parallel}{vp}×DP{cfg.data_parallel()}{ep} {device}{fp8}"


def engine_env(device: str) -> dict:
    return training_engine_env(device)


def expert_summary(counts: list[list[float]] | None) -> tuple[dict, dict]:
    """(summary metrics, summary extras) of a mixture's tokens per expert over the run: its load imbalance (the
    busiest expert over the mean, worst layer), how many experts got no token, with a warning naming them, and the
    counts per layer (1-based, as Megatron numbers them)."""
    if not counts:
        return {}, {}
    idle = [f"layer {i} expert {e}" for i, layer in enumerate(counts, 1) for e, n in enumerate(layer) if n == 0]
    imbalance = max(max(layer) / (sum(layer) / len(layer)) for layer in counts if sum(layer) > 0)
    extra = {"expert_tokens": {f"layer_{i}": [int(n) for n in layer] for i, layer in enumerate(counts, 1)}}
    if idle:
        extra["expert_warning"] = f"{len(idle)} expert(s) got no token in training: {', '.join(idle)}"
    return {"expert_load_imbalance": imbalance, "idle_experts": len(idle)}, extra


def expert_load_plot(counts: list[list[float]], path: Path) -> Path:
    """The run's tokens per expert as each layer's share (rows: layers, columns: experts; 1/E in every cell is an even
    spread), beside the step-by-step train/expert_load_imbalance MLflow already plots."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shares = [[n / sum(layer) if sum(layer) else 0.0 for n in layer] for layer in counts]
    layers, experts = len(shares), len(shares[0])
    fig, ax = plt.subplots(figsize=(min(2 + 0.5 * experts, 16), min(1.5 + 0.4 * layers, 12)), dpi=100)
    im = ax.imshow(shares, cmap="viridis", vmin=0.0, aspect="auto")
    if layers * experts <= 256:  # the numbers themselves while they fit in the cells
        for i, row in enumerate(shares):
            for e, v in enumerate(row):
                ax.text(e, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                        color="w" if v < 0.6 * max(row) else "k")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_yticks(range(layers), [str(i) for i in range(1, layers + 1)])
    ax.set_title(f"tokens per expert, share of the layer's (even: {1 / experts:.2f})", fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return durable.write_bytes(path, buf.getvalue())


def _median(values):
    return statistics.median(values) if values else None


@task(name="pretrain", cache_policy=NO_CACHE)
def run_pretrain(ctx: StageContext, cfg: PretrainConfig) -> StageOutput:
    spec = build_spec(ctx, cfg)
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    rewritten = None
    if ctx.input is not None:
        loaded, rewritten = loadable_input(ctx)
        spec = spec.model_copy(update={"input": loaded})
    spec_path = events.write_spec(ctx.work_dir / "worker_spec.json", spec)
    res = ctx.launch(command(ctx, cfg, spec_path), name="pretrain", timeout=cfg.timeout_s,
                     env=engine_env(spec.device))
    r = res.result(events.PretrainResult)
    out = package(ctx, cfg, spec, r)
    train = [e for e in res.metrics() if events.TRAIN_LOSS in e]
    before, after = r.heldout_before, r.heldout_after
    expert_metrics, expert_extra = expert_summary(r.expert_tokens)
    plots = [expert_load_plot(r.expert_tokens, ctx.work_dir / "expert_load.png")] if r.expert_tokens else []
    return StageOutput(
        output=out, engine="megatron-core",
        backend=backend(cfg, spec.device),
        gate=gate(out, r, cfg.torch_dtype()),
        metrics={"loss_first": r.loss_first, "loss_last": train[-1][events.TRAIN_LOSS] if train else None,
                 "heldout_loss": after[1] if after else None, "heldout_ppl": after[2] if after else None,
                 "tokens_per_s": _median([e[events.TOKENS_PER_S] for e in train]),
                 "mfu": _median([e[events.MFU] for e in train]), "peak_tflops_per_rank": r.peak_tflops_per_rank,
                 "train_time_s": r.train_time_s, "iteration": r.iteration, "resumed_from_step": r.resumed_from,
                 **r.memory, **expert_metrics},
        eval={"metric": "heldout_ppl", "before": before[2] if before else None, "after": after[2] if after else None},
        extra={"layout": r.layout, "padded_vocab_size": spec.padded_vocab_size, "fp8": cfg.fp8,
               "peak_tflops_source": r.peak_tflops_source, "layer_spec": r.layer_spec, **expert_extra,
               **({"input_rewritten": f"{ctx.input}: not sealed by this BATON_HOME ({rewritten}); Megatron loaded "
                                      f"baton's rewrite of its weights, {spec.input}"} if rewritten else {})},
        artifacts=plots,
    )
