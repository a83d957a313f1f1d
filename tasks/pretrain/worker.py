"""Megatron-Core GPT pretraining: the program torchrun starts on every rank (`nproc = TP × PP × DP`).

    python -m torch.distributed.run --nproc-per-node N tasks/pretrain/worker.py --spec SPEC.json

Reads top to bottom as the recipe: process groups → data (indexed dataset, GPTDataset) → model (GPTModel, Megatron
DDP, optimizer, LR schedule) → resume from the newest checkpoint in the work dir, or start from an input checkpoint,
or from scratch → train with get_forward_backward_func() (1F1B when PP > 1), evaluating on held-out data and saving
every N steps → final checkpoint, probe logits, and the L1 check (reload into a fresh model is exact).
Only rank 0 prints events. The spec (JSON) is written by tasks/pretrain/task.py.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import shutil
import sys
import time
import warnings
from functools import partial
from pathlib import Path

from tasks import events


def main() -> None:
    spec = events.read_typed_spec(events.PretrainSpec)  # written by tasks/pretrain/task.py
    # megatron's notices, repeated by every rank: deprecations, Apex/TE absent (expected here), cuda-graph defaults
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*(not installed|Falling back).*")
    warnings.filterwarnings("ignore", message=r"full scope is deprecated.*")
    on_gpu = spec.device == "cuda"
    if not on_gpu:
        import megatron_cpu  # beside this file; must patch torch before megatron.core is imported

        megatron_cpu.apply()
    Run(spec, on_gpu).main()


class Run:
    def __init__(self, spec: events.PretrainSpec, on_gpu: bool):
        import torch
        import torch.distributed as dist

        self.spec, self.cfg, self.arch = spec, spec.config, spec.architecture
        self.on_gpu = on_gpu
        self.work = spec.work_dir
        self.ckpt_root = self.work / "checkpoints"
        if on_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        dist.init_process_group("nccl" if on_gpu else "gloo")
        self.rank = dist.get_rank()

    # ---- small helpers ---------------------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def events(self):
        from tasks import events

        return events

    def to_rank0(self, values: list[float], owner: bool):
        """Sum a few numbers held by the `owner` ranks over the whole world (they reach rank 0 that way)."""
        from tasks import collectives

        return collectives.sum_over_ranks(values if owner else [0.0] * len(values))

    # ---- the recipe ------------------------------------------------------------------------------------------
    def main(self) -> None:
        self.init_parallel()
        self.init_data()
        n_params, impl = self.init_model()
        if self.spec.probe:
            return self.probe_memory()
        start, state = self.starting_point(n_params, impl)
        peak, peak_src = self.train(start, state)
        self.finish(self.cfg.steps, state, peak, peak_src)

    def init_parallel(self) -> None:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        cfg, spec = self.cfg, self.spec
        tp, pp, vp = cfg.tensor_parallel, cfg.pipeline_parallel, cfg.virtual_pipeline_parallel
        ep = cfg.expert_parallel
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     virtual_pipeline_model_parallel_size=vp, expert_model_parallel_size=ep)
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.is_last = ps.is_pipeline_last_stage()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        torch.manual_seed(spec.seed)
        model_parallel_cuda_manual_seed(spec.seed)
        experts = f" EP={ep} ({cfg.moe_token_dispatcher} dispatcher)" if self.arch.get("moe") else ""
        self.log(f"world {dist.get_world_size()}: TP={tp} PP={pp}{f' (VP={vp}, interleaved)' if vp else ''} "
                 f"DP={self.dp}{experts}, device {self.device.type}, {cfg.precision}, fp8 {cfg.fp8}, seq "
                 f"{spec.seq_length}, micro {cfg.micro_batch_size}, global {cfg.global_batch_size}, "
                 f"{cfg.steps} steps")

    def init_data(self) -> None:
        import mcore_data as data

        cfg, spec = self.cfg, self.spec
        self.tokenizer = data.HFTokenizer(spec.data_dir / "tokenizer")
        prefixes = data.prepare(spec.data_dir, self.work / "data", self.tokenizer)
        gbs, mbs = cfg.global_batch_size, cfg.micro_batch_size
        self.num_micro = gbs // (mbs * self.dp)
        self.train_ds, self.heldout_ds = data.build_datasets(
            prefixes, self.tokenizer, spec.seq_length, spec.seed, train_samples=cfg.steps * gbs,
            eval_samples=cfg.eval_iters * gbs, cache_dir=self.work / "data" / "cache")

    def init_model(self) -> tuple[float, str]:
        """This rank's model chunks (one, or VP with the interleaved schedule), their DDP wrappers, optimizer, LR."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        import expert_load as el
        import mcore_model as mm

        cfg, arch = self.cfg, self.arch
        experts = (arch.get("moe") or {}).get("num_experts")
        self.spec_layers, impl = mm.layer_spec(cfg.transformer_impl, self.on_gpu, cfg.attention, experts,
                                               qk_norm=mm.has_qk_norm(arch))
        self.tconfig = mm.transformer_config(arch, cfg, self.on_gpu)
        self.padded_vocab = self.spec.padded_vocab_size
        # the config as built: the optimizer then hangs its own functions (and through them process groups) on
        # tconfig, which a later model build cannot copy (an MoE layer deep-copies its config for the experts' width)
        self.build_config = copy.deepcopy(self.tconfig)
        self.chunks = self.new_model(self.tconfig)
        self.expert_load = el.ExpertLoad(self.chunks, arch["num_layers"], experts) if experts else None
        self.ddps = mm.wrap_ddp(mm.in_precision(self.chunks, self.tconfig), self.tconfig, cfg)
        self.optimizer, self.scheduler = mm.optimizer_and_scheduler(self.ddps, self.tconfig, cfg)
        self.fb = get_forward_backward_func()
        n_params = self.parameter_count()
        self.log(f"GPTModel ({impl} layer spec): {int(n_params):,} parameters over TP×PP×EP, "
                 f"{len(self.chunks)} chunk(s) per rank, vocab {arch['vocab_size']} padded to {self.padded_vocab}")
        return n_params, impl

    def parameter_count(self) -> float:
        """Every parameter once: the replicated ones from data-parallel rank 0, the experts (split over the expert
        parallel ranks, which Megatron marks `allreduce=False`) from expert-data-parallel rank 0 of each EP group."""
        from megatron.core import parallel_state as ps

        params = [p for chunk in self.chunks for p in chunk.parameters()]
        dense = sum(p.numel() for p in params if getattr(p, "allreduce", True))
        experts = sum(p.numel() for p in params if not getattr(p, "allreduce", True))
        dense, = self.to_rank0([float(dense)], owner=self.dp_rank == 0)
        experts, = self.to_rank0([float(experts)], owner=ps.get_expert_data_parallel_rank() == 0)
        return dense + experts

    def starting_point(self, n_params: float, impl: str) -> tuple[int, dict]:
        """Our own newest checkpoint, else the input's weights, else the random init."""
        import mcore_checkpoint as ckpt

        ckpt.clean_partials(self.ckpt_root)
        state = {"loss_first": None, "heldout": [], "train_time_s": 0.0, "expert_tokens": None}
        self.opening = {"resumed_from": 0, "parameters": int(n_params), "layer_spec": impl, "input_parity": None}
        start = 0
        last = ckpt.newest_verified(self.ckpt_root)
        if last is not None:
            info = ckpt.resume(last, self.chunks, self.optimizer, self.scheduler, self.arch)
            start = info["iteration"]
            state.update({k: info[k] for k in state if k in info})
            self.log(f"resumed from {last.name} (iteration {start}, layout {info.get('layout')})")
        elif self.spec.input is not None:
            ckpt.load_input(self.spec.input, self.chunks)
            self.optimizer.reload_model_params()
            self.log(f"initialised from the weights of {self.spec.input}")
            self.check_input_parity(self.spec.input)
        self.opening["resumed_from"] = start
        if self.rank == 0:
            self.events().started(start)
        return start, state

    def train(self, start: int, state: dict) -> tuple[float, str]:
        import torch.distributed as dist

        import mcore_model as mm

        cfg, spec = self.cfg, self.spec
        steps = cfg.steps
        peak, peak_src = mm.peak_tflops(cfg, self.on_gpu)
        world = dist.get_world_size()
        fpt = mm.flops_per_token(self.arch, self.padded_vocab, spec.seq_length)
        tokens_per_step = cfg.global_batch_size * spec.seq_length
        self.log(f"MFU against {peak} TFLOP/s per rank ({peak_src}) × {world} ranks; "
                 f"{fpt / 1e6:.2f} MFLOP per token")
        if start == 0:
            self.evaluate(0, state)
        profiled = cfg.profile_steps
        for it in range(start, steps):  # a re-run after the last step skips straight to finish()
            t0 = time.time()
            with self.profiling(it + 1 in profiled, it + 1):
                loss, grad_norm, aux_loss = self.train_step(it)
            experts = self.expert_load_of_step(state)
            step_time = time.time() - t0
            state["train_time_s"] += step_time
            step = it + 1
            if state["loss_first"] is None:
                state["loss_first"] = loss
            tps = tokens_per_step / step_time
            if self.rank == 0:
                ev = self.events()
                ev.metric(step, {ev.TRAIN_LOSS: loss, ev.TRAIN_LR: self.optimizer.param_groups[0]["lr"],
                                 ev.TRAIN_GRAD_NORM: grad_norm, ev.TOKENS_PER_S: tps, ev.STEP_TIME_S: step_time,
                                 ev.MFU: fpt * tps / (peak * 1e12 * world),
                                 **({ev.TRAIN_ROUTER_AUX_LOSS: aux_loss} if aux_loss is not None else {}),
                                 **experts})
                self.events().progress(step, steps)
            if step % cfg.eval_interval == 0 or step == steps:
                self.evaluate(step, state)
            if step % cfg.checkpoint_every == 0 or step == steps:
                self.save(step, state)
        return peak, peak_src

    @contextlib.contextmanager
    def profiling(self, wanted: bool, step: int):
        """torch.profiler around one training step (`pretrain.profile_steps`): every operator's time, CPU and GPU,
        as a table in profile-step<N>-rank<R>.txt in the stage folder: where the step's time goes."""
        if not wanted:
            yield
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_gpu else [])
        with profile(activities=activities) as prof:
            yield
            if self.on_gpu:
                torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total" if self.on_gpu else "self_cpu_time_total",
                                          row_limit=40, max_name_column_width=80)
        path = self.work / f"profile-step{step}-rank{self.rank}.txt"
        from conversions import durable

        durable.write_bytes(path, (table + "\n").encode())
        self.log(f"step {step} profiled: {path}")

    def new_model(self, config) -> list:
        import mcore_model as mm

        chunks = mm.gpt_chunks(config, self.spec_layers, self.arch, self.padded_vocab, self.spec.seq_length)
        mm.experts_apart(chunks)
        return [chunk.to(self.device) for chunk in chunks]

    def schedule(self, step_func, batches, num_micro: int, seq_length: int, micro_batch_size: int,
                 forward_only: bool):
        """One pass of the pipeline schedule over every chunk; each chunk reads its own copy of the micro batches
        (the interleaved schedule runs them in its own order; only the first and last stage use the data)."""
        iterators = [batches() for _ in self.ddps]
        return self.fb(forward_step_func=step_func, data_iterator=iterators if len(iterators) > 1 else iterators[0],
                       model=self.ddps, num_microbatches=num_micro, seq_length=seq_length,
                       micro_batch_size=micro_batch_size, forward_only=forward_only)

    # ---- one step ----------------------------------------------------------------------------------------------
    def forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return output, partial(self.loss_func, batch["loss_mask"])

    @staticmethod
    def loss_func(loss_mask, per_token_loss):
        import torch

        mask = loss_mask.reshape(-1).float()
        total = torch.sum(per_token_loss.float().reshape(-1) * mask)
        tokens = mask.sum().to(torch.int)
        # the schedule divides `total` in place by tokens and micro batches: report copies
        return total, tokens, {"lm loss": torch.stack([total.detach().clone(), tokens.detach().float()])}

    def batches(self, ds, step: int):
        import mcore_data as data

        cfg = self.cfg
        for m in range(self.num_micro):
            idx = data.microbatch_indices(step, m, cfg.micro_batch_size, self.dp, self.dp_rank,
                                          cfg.global_batch_size)
            yield data.batch(ds, idx, self.device)

    def reduce_loss(self, reduced: list[dict]) -> float:
        owner = self.is_last and self.tp_rank == 0
        total, tokens = 0.0, 0.0
        if owner:
            for r in reduced:
                total += float(r["lm loss"][0])
                tokens += float(r["lm loss"][1])
        total, tokens = self.to_rank0([total, tokens], owner)
        return total / max(tokens, 1.0)

    def train_step(self, it: int) -> tuple[float, float, float | None]:
        """One optimizer step: (language-model loss, gradient norm, the routers' load-balancing loss or None)."""
        import mcore_model as mm

        for ddp in self.ddps:
            ddp.train()
            ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        reduced = self.schedule(self.forward_step, lambda: self.batches(self.train_ds, it), self.num_micro,
                                self.spec.seq_length, self.cfg.micro_batch_size, forward_only=False)
        scale = self.optimizer.get_loss_scale().item()
        ok, grad_norm, _ = self.optimizer.step()
        if not ok and scale > mm.MIN_LOSS_SCALE:
            # fp16's dynamic loss scale overflowed: Megatron skipped the update and lowered the scale, as designed
            self.log(f"step {it + 1}: fp16 loss scale {scale:g} overflowed; update skipped, scale lowered")
        elif not ok:
            why = f"rank {self.rank}: optimizer step {it + 1} failed (non-finite gradients); not retried"
            self.events().failure(self.events().EngineCause.NON_FINITE_LOSS, why)
            raise RuntimeError(why)
        else:
            self.scheduler.step(increment=1)
        return self.reduce_loss(reduced), float(grad_norm or 0.0), self.router_aux_loss()

    def router_aux_loss(self) -> float | None:
        """The load-balancing loss Megatron's routers recorded in this step's forward passes (before its coefficient;
        the mean over MoE layers and micro batches, averaged over data-parallel ranks as Megatron-LM logs it), then
        forgotten. None for a dense model or a zero coefficient (nothing recorded). A collective: every rank calls."""
        from megatron.core.transformer.moe import moe_utils

        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        if "load_balancing_loss" not in tracker:
            return None
        moe_utils.reduce_aux_losses_tracker_across_ranks(["load_balancing_loss"])
        per_layer = tracker["load_balancing_loss"]["values"] / self.num_micro
        moe_utils.clear_aux_losses_tracker()
        return float(per_layer.sum()) / self.arch["num_layers"]

    def expert_load_of_step(self, state: dict) -> dict:
        """The step's tokens per expert (every rank's routers, summed: a collective) added to the run's count in
        `state` (saved with each checkpoint), and its load imbalance as a metric; nothing for a dense model."""
        import expert_load as el

        if self.expert_load is None:
            return {}
        counts = self.expert_load.take_step(lambda values: self.to_rank0(values, owner=True))
        state["expert_tokens"] = el.add(state["expert_tokens"], counts)
        return {self.events().TRAIN_EXPERT_LOAD_IMBALANCE: el.imbalance(counts)}

    def evaluate(self, step: int, state: dict) -> None:
        import torch

        for ddp in self.ddps:
            ddp.eval()
        total = []
        with torch.no_grad():
            for i in range(self.cfg.eval_iters):
                total += self.schedule(self.forward_step, lambda: self.batches(self.heldout_ds, i), self.num_micro,
                                       self.spec.seq_length, self.cfg.micro_batch_size, forward_only=True)
        loss = self.reduce_loss(total)
        ppl = math.exp(min(loss, 50.0))
        state["heldout"].append([step, loss, ppl])
        if self.rank == 0:
            ev = self.events()
            ev.metric(step, {ev.HELDOUT_LOSS: loss, ev.HELDOUT_PPL: ppl})
        self.log(f"step {step}: held-out loss {loss:.4f}, perplexity {ppl:.2f}")

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def save(self, step: int, state: dict) -> None:
        import mcore_checkpoint as ckpt

        t0 = time.time()
        extra = {"layout": ckpt.layout(), "consumed_samples": step * self.cfg.global_batch_size}
        sd = ckpt.full_state(self.chunks, self.optimizer, self.scheduler, step, self.arch_for_checkpoint(),
                             extra, loading=False)
        path = ckpt.save(self.ckpt_root, step, sd, {**extra, **state}, self.cfg.keep_checkpoints)
        self.log(f"saved {path.name} in {time.time() - t0:.1f}s")

    def arch_for_checkpoint(self) -> dict:
        return {**self.arch, "padded_vocab_size": self.padded_vocab,
                "kv_channels": self.arch["hidden_size"] // self.arch["num_attention_heads"]}

    # ---- the end: output folder, probe logits, L1 -----------------------------------------------------------------
    def probe_logits(self, chunks: list):
        """Logits of the model (its chunks on this rank) on the fixed probe batch, gathered over TP, padded vocab
        rows dropped (last stage). The interleaved schedule needs at least PP micro batches: the probe is repeated
        and the first one's logits kept."""
        import torch
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        from conversions import probe

        ids = probe.probe_input_ids(self.arch["vocab_size"]).to(self.device)
        positions = torch.arange(ids.shape[1], device=self.device).unsqueeze(0).expand_as(ids)

        def step(data_iterator, m):
            next(data_iterator)
            return m(ids, positions, None), None  # no loss function: the schedule hands back the logits

        repeats = self.cfg.pipeline_parallel if len(chunks) > 1 else 1
        for chunk in chunks:
            chunk.eval()
        with torch.no_grad():
            out = self.fb(forward_step_func=step, data_iterator=[iter([None] * repeats) for _ in chunks]
                          if len(chunks) > 1 else iter([None]), model=chunks, num_microbatches=repeats,
                          seq_length=ids.shape[1], micro_batch_size=ids.shape[0], forward_only=True)
        if not self.is_last:
            return ids, None
        logits = gather_from_tensor_model_parallel_region(out[0])
        return ids, logits[..., : self.arch["vocab_size"]].float().cpu()

    def check_input_parity(self, src: Path) -> None:
        """L2 for the input: when it carries probe logits (its engine's, or the HF model's for an HF import), the
        loaded Megatron model must reproduce them."""
        from conversions import probe

        ref = src / probe.PROBE_FILE
        if not ref.exists():
            return
        ref_ids, ref_logits = probe.load_reference(ref)
        ids, logits = self.probe_logits(self.ddps)
        owner = logits is not None and self.tp_rank == 0 and self.dp_rank == 0
        diff, agree = 0.0, 0.0
        if owner:
            if not (ids.cpu().equal(ref_ids) and logits.shape == ref_logits.shape):
                raise RuntimeError(f"{ref}: probe inputs or vocabulary differ from this model's")
            res = probe.compare_logits(logits, ref_logits, probe.DTYPE_OF_PRECISION[self.cfg.precision])
            diff, agree = res["max_abs_diff"], res["top1_agreement"]
        diff, agree = self.to_rank0([diff, agree], owner)
        self.log(f"input parity vs {ref}: max |Δlogit| {diff:.3g}, top-1 agreement {agree:.3f}")
        self.opening["input_parity"] = {"max_abs_diff": diff, "top1_agreement": agree, "reference": str(ref)}

    def finish(self, steps: int, state: dict, peak: float, peak_src: str) -> None:
        import torch
        import torch.distributed as dist

        import mcore_checkpoint as ckpt
        import mcore_model as mm
        from conversions import probe

        final = ckpt.newest_complete(self.ckpt_root)
        out = self.work / "checkpoint.partial"
        if self.rank == 0:
            shutil.rmtree(out, ignore_errors=True)
            for f in final.rglob("*"):
                if f.is_file():  # the seal too: the convert step checks it before reading a byte
                    dest = out / f.relative_to(final)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    try:
                        os.link(f, dest)  # same file system: no copy of the weights
                    except OSError:
                        shutil.copy2(f, dest)
        dist.barrier()

        ids, logits = self.probe_logits(self.ddps)
        writer = self.is_last and self.tp_rank == 0 and self.dp_rank == 0
        if writer:
            probe.save_reference(out, ids.cpu(), logits, source=f"megatron-core GPTModel, iteration {steps}")

        # L1: a fresh model loaded from the checkpoint must equal the trained one, weights and logits
        fresh = self.new_model(self.build_config)
        fresh_models = mm.in_precision(fresh, self.build_config)  # cast before loading: the checkpoint holds that dtype
        ckpt.load_weights(final, fresh)
        param_diff = 0.0
        for chunk, trained_chunk in zip(fresh, self.chunks):
            trained = dict(trained_chunk.named_parameters())
            for name, p in chunk.named_parameters():
                param_diff = max(param_diff, (p.detach().float() - trained[name].detach().float()).abs().max().item())
        _, fresh_logits = self.probe_logits(fresh_models)
        logit_diff = (fresh_logits - logits).abs().max().item() if writer else 0.0
        param_diff = self.max_all(param_diff)
        logit_diff = self.max_all(logit_diff)
        dist.barrier()
        heldout = state["heldout"]
        memory = self.memory_peaks()
        self.log(f"L1 reload of {final.name}: max |Δparam| {param_diff:g}, max |Δlogit| {logit_diff:g}")
        if self.rank == 0:
            ev = self.events()
            ev.result(ev.PretrainResult(
                **self.opening, iteration=steps, checkpoint=str(final), output=str(out),
                padded_vocab_size=self.padded_vocab, layout=ckpt.layout(), reload_param_max_abs_diff=param_diff,
                reload_logits_max_abs_diff=logit_diff, loss_first=state["loss_first"],
                heldout_before=heldout[0] if heldout else None, heldout_after=heldout[-1] if heldout else None,
                train_time_s=state["train_time_s"], peak_tflops_per_rank=peak, peak_tflops_source=peak_src,
                consumed_samples=steps * self.cfg.global_batch_size, memory=memory,
                expert_tokens=state["expert_tokens"]))
        dist.barrier()
        dist.destroy_process_group()

    def probe_memory(self) -> None:
        """The batch finder's run: only the training steps at this micro-batch (no evaluation, no checkpoint), then
        every rank's peak memory, as the full run reports it."""
        import torch.distributed as dist

        for it in range(self.cfg.steps):
            loss, _, _ = self.train_step(it)
            self.log(f"probe step {it + 1}: loss {loss:.4f}")
        memory = self.memory_peaks()
        if self.rank == 0:
            ev = self.events()
            ev.result(ev.PretrainProbeResult(probe_steps=self.cfg.steps,
                                             micro_batch_size=self.cfg.micro_batch_size, memory=memory))
        dist.barrier()
        dist.destroy_process_group()

    def memory_peaks(self) -> dict:
        """Every rank's peak memory in MiB (collective): process RSS, and on GPU allocated and reserved."""
        import resource

        import torch
        import torch.distributed as dist

        from tasks import collectives

        world, rank = dist.get_world_size(), dist.get_rank()
        own = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if self.on_gpu:
            own.update(gpu_allocated=torch.cuda.max_memory_allocated() / 2**20,
                       gpu_reserved=torch.cuda.max_memory_reserved() / 2**20)
        kinds = list(own)
        t = collectives.reduce([[own[kind] if r == rank else 0.0 for r in range(world)] for kind in kinds])
        name = {"rss": "peak_mem_mib", "gpu_allocated": "peak_gpu_allocated_mib", "gpu_reserved": "peak_gpu_reserved_mib"}
        out = {}
        for i, kind in enumerate(kinds):
            values = t[i].tolist()
            out[name[kind]] = max(values)
            out.update({f"rank{r}_{name[kind]}": v for r, v in enumerate(values)})
        return out

    def max_all(self, value: float) -> float:
        from tasks import collectives

        return collectives.max_over_ranks(value)


if __name__ == "__main__":
    with events.causes_announced():
        sys.exit(main())
