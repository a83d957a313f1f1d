"""DeepSpeed ZeRO supervised fine-tuning, one process per rank.

    deepspeed --num_gpus N tasks/finetune/worker.py --spec <work_dir>/finetune_spec.json     (or torchrun)

The recipe, top to bottom: read the spec and the DeepSpeed JSON config; build the model (inside zero.Init for ZeRO-3)
and load the input HF weights; tokenize the canonical conversations with the checkpoint's chat template (loss on every
assistant turn and its closing eos only; over-long ones dropped or truncated, counted); score the held-out set (loss
on answer tokens, and exact match of the final reply when that is the gate's metric); resume from the newest complete
checkpoint; train, saving a checkpoint every N steps (a tag counts only once every rank finished writing it); score
again; write the probe logits of the in-memory model. Rank 0 prints @@baton events (metrics, checkpoints, the result).
"""
from __future__ import annotations

import json
import math
import os
import resource
import shutil
import time
from pathlib import Path


T_START = time.time()

import deepspeed  # noqa: E402  (imports dominate start-up on small CPUs: timed below)
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoTokenizer

from conversions import durable, hf, hf_layout, probe, sealed
from tasks import chat, collectives, events, resuming

KIND = resuming.CheckpointKind.DEEPSPEED
COMPLETE = KIND.marker
IGNORE = chat.IGNORE


# ---- main: the recipe; the phases follow in the order it runs them ---------------------------------------------------
def main() -> None:
    spec = events.read_typed_spec(events.FinetuneSpec)  # (and --local_rank, which the deepspeed launcher passes)
    ds_config = json.loads(spec.ds_config.read_text())
    timings = {"imports_s": time.time() - T_START}
    rank, world = init_process(spec, timings)
    stage = ds_config["zero_optimization"]["stage"]
    facts = {"world_size": world, "zero_stage": stage}
    tok, train, heldout, held_ids, counts = load_data(spec)
    engine = build_engine(spec, ds_config, stage, timings)
    if spec.probe:  # the batch finder: only the training steps; every rank's peak is in the metric events
        train_steps(engine, tok, train, spec, ds_config, 0, rank, world, facts)
        dist.barrier()
        return
    n_examples = sum(map(len, train)) if spec.packing else len(train)
    start, opening = start_step(engine, tok, heldout, held_ids, spec, facts, rank, timings, counts, n_examples)
    t_train = time.time()
    train_steps(engine, tok, train, spec, ds_config, start, rank, world, facts)
    if start >= spec.steps and rank == 0:
        print(f"rank 0: checkpoint at step {start} already complete; nothing to train", flush=True)
    timings["train_s"] = time.time() - t_train
    finish(engine, tok, heldout, held_ids, spec, stage, rank, timings, opening)


def init_process(spec: events.FinetuneSpec, timings: dict) -> tuple[int, int]:
    t = time.time()
    deepspeed.init_distributed(dist_backend="nccl" if spec.device == "cuda" else "gloo")
    timings["init_distributed_s"] = time.time() - t
    if spec.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.manual_seed(spec.seed)
    return dist.get_rank(), dist.get_world_size()


def load_data(spec: events.FinetuneSpec):
    """The tokenizer, the encoded training examples (over-long ones dropped or truncated, counted), the held-out rows
    and their encodings."""
    input_dir, data_dir = spec.input, spec.data_dir
    tok = AutoTokenizer.from_pretrained(str(input_dir))
    if not tok.chat_template and spec.chat_template:  # model.chat_template, for an input without one
        tok.chat_template = spec.chat_template.read_text(encoding="utf-8")
    train_rows = read_jsonl(data_dir / "sft" / "train.jsonl")
    heldout = read_jsonl(data_dir / "sft" / "heldout.jsonl")
    train, length_counts = encode_rows(tok, train_rows, spec.max_seq_length, spec.overlong, "sft/train.jsonl")
    held_ids, _ = encode_rows(tok, heldout, spec.max_seq_length, "truncate", "sft/heldout.jsonl")
    if not train:
        raise SystemExit(f"no training example fits in max_seq_length {spec.max_seq_length} "
                         f"({length_counts['overlong_dropped']} dropped as over-long)")
    if spec.packing:  # a training sample is then a window of examples
        windows = pack(train, spec.max_seq_length)
        length_counts.update(packed_windows=len(windows), packed_fill=round(
            sum(len(x) for x, _ in train) / (len(windows) * spec.max_seq_length), 4))
        train = windows
    return tok, train, heldout, held_ids, length_counts


def build_engine(spec: events.FinetuneSpec, ds_config: dict, stage: int, timings: dict):
    t = time.time()
    model = build_model(spec.input, ds_config, zero3=stage == 3 and spec.zero_init)
    if spec.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec.lora["enabled"]:
        model = add_lora(model, spec.lora)
    groups = param_groups(model, ds_config["optimizer"]["params"]["weight_decay"])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config)
    timings["model_and_engine_s"] = time.time() - t
    return engine


def start_step(engine, tok, heldout: list, held_ids: list, spec: events.FinetuneSpec, facts: dict, rank: int, timings: dict,
               counts: dict, n_train: int) -> tuple[int, dict]:
    """Score the input, resume from the newest complete checkpoint, announce where training starts. Returns that
    step and the facts the result reports about the start."""
    stage, world = facts["zero_stage"], facts["world_size"]
    t = time.time()
    before, _ = evaluate(engine, tok, heldout, held_ids, spec, stage == 3)
    timings["eval_before_s"] = time.time() - t
    ckpt_dir = spec.output
    start = resume(engine, ckpt_dir, facts)
    if start > spec.steps:
        raise SystemExit(f"{ckpt_dir}: the checkpoint at step {start} is past steps={spec.steps} "
                         "(start in a fresh work dir)")
    if rank == 0:
        print(f"rank 0: {n_train} training examples, {len(heldout)} held out; before {before}; {counts}; "
              f"ZeRO-{stage}, {world} ranks, starting at step {start}; start-up "
              + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()), flush=True)
        events.started(start)
    opening = dict(before=before, resumed_from=start, train_examples=n_train, world_size=world, zero_stage=stage,
                   **counts)
    return start, opening


def train_steps(engine, tok, train: list, spec: events.FinetuneSpec, ds_config: dict, start: int, rank: int, world: int,
                facts: dict) -> None:
    """Steps start..steps: each rank's micro batches at their global sample positions; metrics; checkpoints."""
    steps, mb, ga = spec.steps, ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    ckpt_dir, dev, order_cache = spec.output, engine.device, {}
    moe = {"output_router_logits": True} if router_aux_loss(engine.module.config) else {}
    engine.train()
    for step in range(start, steps):
        t0 = time.time()
        loss_sum, aux_sum, tokens = 0.0, 0.0, 0
        for micro in range(ga):
            position = ((step * ga + micro) * world + rank) * mb
            picked = [train[i] for i in sample_ids(len(train), spec.seed, position, mb, order_cache)]
            if spec.packing:
                batch, real = collate_packed(picked, tok.pad_token_id, spec.max_seq_length)
            else:
                batch, real = collate(picked, tok.pad_token_id)
            tokens += real
            out = engine(**{k: v.to(dev) if torch.is_tensor(v) else v for k, v in batch.items()}, **moe)
            engine.backward(out.loss)
            engine.step()
            stop_if_not_finite(out.loss.item(), rank, step + 1, micro)
            loss_sum += out.loss.item()
            aux_sum += out.aux_loss.item() if moe else 0.0
        done = step + 1
        if done % spec.log_every == 0 or done == steps:
            report_step(engine, done, steps, loss_sum / ga, aux_sum / ga if moe else None, tokens,
                        time.time() - t0, spec.device, rank, world)
        if not spec.probe and (done % spec.checkpoint_every == 0 or done == steps):
            save(engine, ckpt_dir, done, spec.keep_checkpoints, rank, facts)


def router_aux_loss(config) -> bool:
    """A mixture of experts whose config defines a load-balancing loss: its forward adds it to the loss (times
    router_aux_loss_coef) when asked for the router logits, which transformers' configs leave off by default."""
    return hasattr(config, "output_router_logits") and (getattr(config, "router_aux_loss_coef", 0) or 0) > 0


def report_step(engine, done: int, steps: int, loss: float, aux: float | None, tokens: int, step_time: float,
                device: str, rank: int, world: int) -> None:
    """`loss` includes the router's auxiliary loss times its coefficient; `aux` is that loss alone (None: no
    router)."""
    own_memory = [peak_memory_mib(device) if r == rank else 0.0 for r in range(world)]
    loss_sum, token_sum, aux_sum, *memory = collectives.sum_over_ranks([loss, tokens, aux or 0.0, *own_memory])
    if rank == 0:
        mem = {f"perf/rank{r}_peak_mem_mib": memory[r] for r in range(world)}
        router = {events.TRAIN_ROUTER_AUX_LOSS: aux_sum / world} if aux is not None else {}
        events.metric(done, {events.TRAIN_LOSS: loss_sum / world, events.TRAIN_LR: engine.get_lr()[0],
                             events.TOKENS_PER_S: token_sum / step_time, events.STEP_TIME_S: step_time,
                             events.PEAK_MEM_MIB: max(mem.values()), **router, **mem})
        events.progress(done, steps)


def finish(engine, tok, heldout: list, held_ids: list, spec: events.FinetuneSpec, stage: int, rank: int, timings: dict,
           opening: dict) -> None:
    """Score again, write the in-memory model's probe logits (and the LoRA config the converter merges with), then
    the run's one result: `opening` (what start_step measured) and what this measures."""
    ckpt_dir, dev, device = spec.output, engine.device, spec.device
    after, samples = evaluate(engine, tok, heldout, held_ids, spec, stage == 3)
    ids, logits = probe_logits(engine.module, engine.module.config.vocab_size, dev)
    final_tag = resuming.complete(ckpt_dir, KIND)[-1].name
    if rank == 0:
        probe.save_reference(ckpt_dir, ids, logits, source=f"deepspeed ZeRO-{stage} engine, {final_tag}")
        if spec.lora["enabled"]:  # how the converter merges the adapters (r, lora_alpha, ...)
            engine.module.peft_config["default"].save_pretrained(str(ckpt_dir))
        events.result(events.FinetuneResult(
            **opening, after=after, samples=samples, tag=final_tag, steps=spec.steps, timings=timings,
            peak_mem_mib=peak_memory_mib(device), peak_reserved_mib=peak_reserved_mib(device)))
    dist.barrier()


# ---- data ------------------------------------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def encode_rows(tok, rows: list[dict], max_len: int, overlong: str, where: str = "sft") -> tuple[list, dict]:
    """Canonical conversations → (ids, labels), every assistant turn learned; over-long ones dropped or truncated.
    A row whose reply the template cannot train as served (chat.TemplateError) ends the run, named by `where`:line."""
    out, counts = [], {"overlong_dropped": 0, "overlong_truncated": 0}
    for line, r in enumerate(rows, start=1):
        try:
            e = chat.encode(tok, r["messages"], max_len, overlong)
        except chat.TemplateError as err:
            raise SystemExit(f"{where}:{line}: {err}") from None
        if e is None:
            counts["overlong_dropped"] += 1
        else:
            counts["overlong_truncated"] += e.truncated
            out.append((e.ids, e.labels))
    return out, counts


def sample_ids(n: int, seed: int, position: int, count: int, cache: dict) -> list[int]:
    """Examples at global positions [position, position+count) of an endless sequence of seeded epoch shuffles.
    A pure function of the position, so a resumed run sees exactly the batches an uninterrupted one would."""
    out = []
    for pos in range(position, position + count):
        epoch, i = divmod(pos, n)
        if epoch not in cache:
            cache[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
        out.append(cache[epoch][i])
    return out


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[dict, int]:
    """One padded row per example: (the model's inputs, the number of real tokens)."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (x, y) in enumerate(examples):
        ids[i, :len(x)] = torch.tensor(x)
        labels[i, :len(y)] = torch.tensor(y)
        mask[i, :len(x)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}, int(mask.sum())


def pack(examples: list[tuple[list[int], list[int]]], max_len: int) -> list[list[tuple[list[int], list[int]]]]:
    """Examples in order into windows of at most max_len tokens (first fit: a window closes when the next example
    does not fit). Every example already fits alone (encode_rows dropped or truncated the longer ones)."""
    windows, current, used = [], [], 0
    for ex in examples:
        if current and used + len(ex[0]) > max_len:
            windows.append(current)
            current, used = [], 0
        current.append(ex)
        used += len(ex[0])
    return windows + ([current] if current else [])


def collate_packed(windows: list[list[tuple[list[int], list[int]]]], pad_id: int, max_len: int) -> tuple[dict, int]:
    """One row per window, no attention across its examples: position ids restart at each example and no 2-D mask is
    passed, which transformers reads as packed sequences (a block-diagonal causal mask; exact on CPU's eager and sdpa
    attention, varlen kernels with flash attention). Each example's first label is ignored, as the shift of an
    unpacked row drops it, so the loss is over the same tokens as unpacked; the tail padding is its own sequence."""
    ids = torch.full((len(windows), max_len), pad_id, dtype=torch.long)
    labels = torch.full((len(windows), max_len), IGNORE, dtype=torch.long)
    positions = torch.zeros((len(windows), max_len), dtype=torch.long)
    tokens = 0
    for row, window in enumerate(windows):
        at = 0
        for x, y in window:
            ids[row, at:at + len(x)] = torch.tensor(x)
            labels[row, at + 1:at + len(y)] = torch.tensor(y[1:])
            positions[row, at:at + len(x)] = torch.arange(len(x))
            at += len(x)
        positions[row, at:] = torch.arange(max_len - at)
        tokens += at
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "use_cache": False}, tokens


# ---- model -----------------------------------------------------------------------------------------------------------
def model_class(config):
    """The HF class named by config.json, imported here: importing it inside zero.Init (which patches
    torch.Tensor.__new__) breaks torch._dynamo's import with a signature mismatch."""
    cls = hf_layout.model_class(config)
    if cls is None:
        raise SystemExit(f"config.json architectures {config.architectures} names no transformers class")
    return cls


def build_model(input_dir: Path, ds_config: dict, zero3: bool):
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(str(input_dir))
    cls = model_class(config)
    # Random init is skipped: every weight is loaded below (and HF init cannot index ZeRO-3's empty partitions).
    # Each parameter is partitioned as soon as its module is built (ZeRO-3 with zero.init): no rank ever holds the
    # whole model. Without it (zero3 False here) deepspeed.initialize partitions the fully built model afterwards.
    with deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=zero3), no_init_weights():
        model = cls(config)
        if getattr(config, "tie_word_embeddings", False):
            model.tie_weights()
    load_hf_weights(model, input_dir, zero3)
    return model


def load_hf_weights(model, input_dir: Path, zero3: bool) -> None:
    """Copy the input checkpoint into the model group by group (memory mapped; ZeRO-3: gathered one group at a time).
    A group is one tensor, or those transformers merges into one parameter (a layer's experts; hf_layout)."""
    params = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    with hf.TensorReader(input_dir) as read:
        groups, unmatched = hf_layout.load_groups(model, read.names, params)
        unmatched = [n for n in unmatched if not (tied and n.endswith("lm_head.weight"))]
        if unmatched:
            raise KeyError(f"{input_dir}: tensor {unmatched[0]} has no parameter in {type(model).__name__}"
                           + (f" (and {len(unmatched) - 1} more)" if len(unmatched) > 1 else ""))
        loaded = set()
        for group in groups:
            tensors = hf_layout.produce(group, read, model)
            copy_into(params, tensors, zero3, input_dir)
            loaded.update(tensors)
    missing = sorted(set(params) - loaded)
    if missing:
        raise KeyError(f"{input_dir}: no weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def copy_into(params: dict, tensors: dict, zero3: bool, input_dir: Path) -> None:
    """Each tensor into its parameter, shapes checked first (copy_ would broadcast a wrong one silently)."""
    for name, tensor in tensors.items():
        p = params[name]
        shape = tuple(p.ds_shape) if zero3 and hasattr(p, "ds_shape") else tuple(p.shape)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{input_dir}: {name} has shape {tuple(tensor.shape)} in the checkpoint, "
                             f"{shape} in the model")
        if zero3:
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if dist.get_rank() == 0:
                    p.data.copy_(tensor)
        else:
            with torch.no_grad():
                p.copy_(tensor)


def add_lora(model, lora: dict):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0,
                                            target_modules=lora["target_modules"], bias="none"))


def param_groups(model, weight_decay: float) -> list[dict]:
    """Matrices decay, vectors (norms, biases) do not: two optimizer groups."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [g for g in ({"params": decay, "weight_decay": weight_decay},
                        {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


# ---- evaluation ------------------------------------------------------------------------------------------------------
@torch.no_grad()
def heldout_exact_match(model, tok, rows: list[dict], max_new_tokens: int, synced: bool,
                        device) -> tuple[float, list]:
    """Greedy decode each held-out conversation's final reply; exact string match. Prompts of equal length are
    batched (no padding, so positions match training). Every rank runs the same calls (ZeRO-3 gathers inside)."""
    was_training = model.training
    model.eval()
    by_len: dict[int, list[int]] = {}
    prompts = [tok(chat.prompt_text(tok, r["messages"][:-1]), add_special_tokens=False)["input_ids"] for r in rows]
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    outputs: dict[int, str] = {}
    for length in sorted(by_len):
        idx = by_len[length]
        ids = torch.tensor([prompts[i] for i in idx], device=device)
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                             synced_gpus=synced)
        for j, i in enumerate(idx):
            outputs[i] = tok.decode(gen[j, length:].tolist(), skip_special_tokens=True).strip()
    model.train(was_training)
    answers = [r["messages"][-1]["content"].strip() for r in rows]
    hits = [outputs[i] == answers[i] for i in range(len(rows))]
    samples = [{"prompt": rows[i]["messages"][-2]["content"], "answer": answers[i], "output": outputs[i]}
               for i in range(min(3, len(rows)))]
    return sum(hits) / max(1, len(rows)), samples


@torch.no_grad()
def heldout_loss(model, examples: list, pad_id: int, batch: int, device) -> float:
    """Mean cross-entropy per learned (answer) token over the held-out conversations. Every rank runs it."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for k in range(0, len(examples), batch):
        b = {key: v.to(device) for key, v in collate(examples[k:k + batch], pad_id)[0].items()}
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1].float()
        labels = b["labels"][:, 1:]
        total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                   ignore_index=IGNORE, reduction="sum").item()
        count += int((labels != IGNORE).sum())
    model.train(was_training)
    return total / max(count, 1)


def evaluate(engine, tok, heldout: list[dict], held_ids: list, spec: events.FinetuneSpec, zero3: bool) -> tuple[dict, list]:
    """The gate's metric (and held-out loss, always: it is cheap) of the model as it is now."""
    dev = engine.device
    facts = {"heldout_loss": heldout_loss(engine.module, held_ids, tok.pad_token_id,
                                          spec.eval_batch_size, dev)}
    samples: list = []
    if spec.gate_metric == "exact_match":
        facts["exact_match"], samples = heldout_exact_match(engine.module, tok, heldout, spec.eval_max_new_tokens,
                                                            zero3, dev)
    return facts, samples


@torch.no_grad()
def probe_logits(model, vocab_size: int, device):
    was_training = model.training
    model.eval()
    ids = probe.probe_input_ids(vocab_size)
    logits = model(input_ids=ids.to(device)).logits.float().cpu()
    model.train(was_training)
    return ids, logits


def stop_if_not_finite(loss: float, rank: int, step: int, micro: int) -> None:
    """A diverged run stops here, before it can overwrite good checkpoints (and is not retried)."""
    if not math.isfinite(loss):
        why = (f"rank {rank}: non-finite loss {loss} at step {step} (micro-batch {micro}); lower the lr or check the "
               "data; not retried")
        events.failure(events.EngineCause.NON_FINITE_LOSS, why)
        raise SystemExit(why)


# ---- checkpoints -----------------------------------------------------------------------------------------------------
def save(engine, ckpt_dir: Path, step: int, keep: int, rank: int, facts: dict) -> None:
    tag = KIND.folder(ckpt_dir, step).name
    if rank == 0 and (ckpt_dir / tag).exists():
        shutil.rmtree(ckpt_dir / tag)  # an unfinished save of this step from an interrupted attempt
    dist.barrier()
    with events.disk_full_exits(ckpt_dir / tag, rank):
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"baton_step": step}, save_latest=False)
    dist.barrier()  # every rank's partitions are on disk: only now does the tag count
    if rank == 0:
        with events.disk_full_exits(ckpt_dir / tag, rank):
            durable.sync_tree(ckpt_dir / tag)
            sealed.seal(ckpt_dir / tag, COMPLETE, step=step, **facts)  # last: sizes and sha256 of what is on disk now
        durable.write_text(ckpt_dir / "latest", tag)
        resuming.remove_older_than_kept(ckpt_dir, KIND, keep)
        events.emit("checkpoint", step=step, tag=tag)
    dist.barrier()


def resume(engine, ckpt_dir: Path, facts: dict) -> int:
    """Load the newest complete checkpoint whose contents verify (tasks/resuming.py: rank 0 checks, removes and
    reports the others; every rank loads the one it chose). Returns the step to continue from."""
    dist.barrier()
    chosen = resuming.agreed_resume_point(ckpt_dir, KIND)
    dist.barrier()
    if chosen is None:
        return 0
    tag = chosen.name
    saved = json.loads((ckpt_dir / tag / COMPLETE).read_text())
    for key in ("world_size", "zero_stage"):
        if saved.get(key) != facts[key]:
            raise SystemExit(f"cannot resume {ckpt_dir / tag}: saved with {key}={saved.get(key)}, "
                             f"this run has {key}={facts[key]} (start in a fresh work dir)")
    import deepspeed_compat  # beside this file (the script's folder is on sys.path)

    if deepspeed_compat.params_off_flat_buffers(engine):
        client = deepspeed_compat.load_with_params_on_nvme(engine, ckpt_dir, tag)
    else:
        _, client = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=True,
                                           load_lr_scheduler_states=True)
    if client is None:
        raise SystemExit(f"{ckpt_dir / tag}: DeepSpeed could not load the checkpoint")
    return int(client["baton_step"])


# ---- memory ----------------------------------------------------------------------------------------------------------
def peak_memory_mib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_reserved_mib(device: str) -> float | None:
    """What the CUDA caching allocator held at its peak (allocated + cached blocks); None on CPU."""
    return torch.cuda.max_memory_reserved() / 2**20 if device == "cuda" else None


if __name__ == "__main__":
    with events.causes_announced():
        main()
