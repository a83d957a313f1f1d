"""Training checkpoints with megatron.core.dist_checkpointing (torch_dist): model, optimizer, LR schedule, RNG and
data position. Written to `iter_NNNNNNN.partial/` and renamed when every rank has finished, so a directory named
`iter_NNNNNNN` is always complete; the newest one is where a re-run resumes. Part of the pretrain worker program."""
from __future__ import annotations

import json
import os
import queue
import random
import shutil
from pathlib import Path

import numpy
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from conversions import durable, sealed
from conversions.megatron import ARCH_KEY
from tasks import events, resuming

KIND = resuming.CheckpointKind.MEGATRON
# Written last inside a checkpoint: what a resume needs to know without torch.
STATE_FILE = KIND.marker
PREFIX = KIND.prefix


def layout() -> dict:
    out = {"tensor_parallel": ps.get_tensor_model_parallel_world_size(),
           "pipeline_parallel": ps.get_pipeline_model_parallel_world_size(),
           "data_parallel": ps.get_data_parallel_world_size()}
    vp = ps.get_virtual_pipeline_model_parallel_world_size()
    if vp is not None:
        out["virtual_pipeline_parallel"] = vp
    ep = ps.get_expert_model_parallel_world_size()
    if ep > 1:
        out["expert_parallel"] = ep
    return out


def _rng_object() -> ShardedObject:
    state = {"random": random.getstate(), "numpy": numpy.random.get_state(), "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
             "tracker": get_cuda_rng_tracker().get_states()}
    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
             ps.get_data_parallel_world_size())
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank())
    return ShardedObject("rng_state", state, shape, offset, replica_id=0)


def _restore_rng(state: dict) -> None:
    random.setstate(state["random"])
    numpy.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def model_state(chunks: list) -> dict:
    """Megatron-LM's naming: `model` for one chunk, `model0`, `model1`, … for the interleaved schedule's chunks. The
    sharded keys inside are global (layers at their global index), so any TP/PP/VP layout reads any other's."""
    return {name: chunk.sharded_state_dict() for name, chunk in zip(model_state_names(chunks), chunks)}


def weights_only(sharded: dict) -> dict:
    """A chunk's sharded state without `_extra_state` entries (Transformer Engine / fp8 metadata, not weights):
    what a weights-only checkpoint such as an HF import provides."""
    return {k: v for k, v in sharded.items() if not k.endswith("_extra_state")}


# The distributed optimizer's only format this megatron-core saves with torch_dist (its default,
# fully_sharded_model_space, fails: "ShardedTensor.flattened_range is not supported"). It reshards over DP only.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _prime_adam_state(optimizer) -> None:
    """A fresh torch Adam has no per-parameter state, and the distributed optimizer's load path reads `step` from
    it (assert len(steps) == 1): create the state, step included, before building the state dict to load into."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        opt.init_state_fn(opt.optimizer, opt.config)
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                opt.optimizer.state[p].setdefault("step", torch.tensor(0.0))


def _restore_adam_steps(optimizer, loaded: dict) -> None:
    """After a distributed-optimizer (dp_reshardable) load with torch Adam (no Apex/TE), every parameter's `step`
    is one shared tensor holding the placeholder we loaded into (0): Adam's bias correction would restart, and the
    shared tensor would advance once per parameter. Give each parameter its own step, the saved iteration count,
    as an uninterrupted run has."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [loaded] if len(opts) == 1 else [loaded[i] for i in range(len(opts))]  # how ChainedOptimizer nests them
    for opt, sd in zip(opts, states):
        if not isinstance(opt, DistributedOptimizer):
            continue  # the plain optimizer keeps its per-parameter steps in the checkpoint
        steps = {g.get("step") for g in sd["optimizer"]["param_groups"]}
        if len(steps) != 1 or None in steps:
            raise RuntimeError(f"distributed optimizer checkpoint: expected one saved Adam step, found {steps}")
        step = float(steps.pop())
        for state in opt.optimizer.state.values():
            state["step"] = torch.tensor(step)


def full_state(chunks: list, optimizer, scheduler, iteration: int, arch: dict, extra: dict, *, loading: bool,
               with_rng: bool = True) -> dict:
    model_sd = model_state(chunks)
    if loading:
        _prime_adam_state(optimizer)
    sd = {
        **model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=OPTIMIZER_METADATA),
        "scheduler": scheduler.state_dict(),
        "iteration": iteration,
        ARCH_KEY: arch,
        "baton": extra,
    }
    if with_rng:
        sd["rng_state"] = _rng_object()
    return sd


def newest_verified(root: Path) -> Path | None:
    """Where this attempt resumes (tasks/resuming.py): rank 0 verifies, removes and reports the rejected and
    unfinished checkpoints; every rank loads the one it chose."""
    return resuming.agreed_resume_point(root, KIND)


def newest_complete(root: Path) -> Path | None:
    """The newest checkpoint whose save finished (the convert step verifies its bytes before reading one)."""
    done = resuming.complete(root, KIND)
    return done[-1] if done else None


def _in_process_results_queue() -> None:
    """Our saves are synchronous, so the write results never leave this process: a plain queue stands in for the
    multiprocessing Manager megatron would spawn for them (several seconds per launch on a small machine)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is None:
        filesystem_async._results_queue = queue.Queue()


def save(root: Path, iteration: int, state: dict, info: dict, keep: int) -> Path:
    _in_process_results_queue()
    final = KIND.folder(root, iteration)
    tmp = root / f"{final.name}.partial"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    with events.disk_full_exits(tmp, dist.get_rank()):
        dist_checkpointing.save(state, str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        with events.disk_full_exits(tmp, dist.get_rank()):
            durable.sync_tree(tmp)
            sealed.seal(tmp, STATE_FILE, iteration=iteration, **info)  # last: the checkpoint exists from here
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        durable.fsync_dir(root)
        resuming.remove_older_than_kept(root, KIND, keep)
    dist.barrier()
    return final


def read_info(ckpt: Path) -> dict:
    return json.loads((ckpt / STATE_FILE).read_text())


def resume(ckpt: Path, chunks: list, optimizer, scheduler, arch: dict) -> dict:
    """Load everything saved at ckpt into the live objects; RNG only when the TP/PP/DP layout is unchanged."""
    info = read_info(ckpt)
    same_layout = info.get("layout") == layout()
    sd = full_state(chunks, optimizer, scheduler, info["iteration"], arch, {}, loading=True, with_rng=same_layout)
    loaded = dist_checkpointing.load(sd, str(ckpt))
    for name, chunk in zip(model_state_names(chunks), chunks):
        chunk.load_state_dict(loaded[name])
    with torch.no_grad():
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_steps(optimizer, loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
    if same_layout:
        _restore_rng(loaded["rng_state"])
    return info


def model_state_names(chunks: list) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def load_weights(ckpt: Path, chunks: list) -> None:
    """Model weights only (an input checkpoint: another run's output or an HF import), into any TP/PP/VP layout."""
    sharded = {name: weights_only(sd) for name, sd in model_state(chunks).items()}
    loaded = dist_checkpointing.load(sharded, str(ckpt))
    for (name, want), chunk in zip(sharded.items(), chunks):
        weights = {k: loaded[name][k] for k in want}  # load() also returns the checkpoint's common entries
        missing, unexpected = chunk.load_state_dict(weights, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"{ckpt}: weights do not fit the model (missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]})")


def load_input(ckpt: Path, chunks: list) -> None:
    """An input checkpoint's weights, only from a folder this BATON_HOME sealed (the task rewrites any other):
    dist_checkpointing unpickles `.metadata` with plain pickle, so it reads nothing baton did not write."""
    why = sealed.problem(ckpt, STATE_FILE)
    if why:
        raise RuntimeError(f"input {ckpt}: {why}; Megatron loads only checkpoints baton wrote, not loading it")
    load_weights(ckpt, chunks)


def clean_partials(root: Path) -> None:
    """Leftovers of a save that was interrupted (rank 0, before training starts)."""
    if dist.get_rank() == 0 and root.exists():
        for p in root.glob(f"{PREFIX}*.partial"):
            shutil.rmtree(p, ignore_errors=True)
    dist.barrier()
