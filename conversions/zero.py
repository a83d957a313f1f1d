"""DeepSpeed ZeRO-1/2/3 checkpoint → Hugging Face safetensors, streaming.

DeepSpeed's own `zero_to_fp32` opens every optimizer file at once and (ZeRO-1/2) concatenates all fp32 partitions,
so it needs about twice the fp32 model in RAM. Here each parameter is assembled on its own from byte ranges of the
partition files (read lazily, see torch_lazy) and written straight into a pre-planned safetensors shard, so peak
memory stays near the largest tensor. The values are the same fp32 master weights DeepSpeed's converter produces,
bit for bit (tested against it). A mixture of experts from transformers 5 holds each layer's experts as one 3-D
parameter in memory, so in the checkpoint; the HF folder gets them per expert again, under the names from_pretrained
and the servers read (hf_layout: transformers' own conversion mapping, reversed as save_pretrained does), where
DeepSpeed's converter keeps the engine's names.

Layout (DeepSpeed 0.1x): `<root>/latest` names the tag; `<root>/<tag>/` holds
  - `mp_rank_00_model_states.pt` (ZeRO-1/2) or `zero_pp_rank_<r>_mp_rank_00_model_states.pt` (ZeRO-3):
    param_shapes (one ordered {name: shape} per optimizer group), buffer_names + module (buffers), shared_params,
    frozen_param_shapes / frozen_param_fragments (parameters without gradients);
  - `[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`: optimizer_state_dict with zero_stage, partition_count and
    the rank's fp32 partitions: `single_partition_of_fp32_groups` (ZeRO-1/2: group flat split into equal contiguous
    slices, one per rank) or `fp32_flat_groups` (ZeRO-3: every parameter split into ceil(numel/world) slices, rank r's
    slices concatenated in parameter order across groups).
"""
from __future__ import annotations

import json
import math
import re
import resource
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import hf, hf_layout, manifest as mf, safetensors_stream, torch_lazy
from .refusal import Refused
from .torch_lazy import LazyTensor

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
_RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_(model|optim)_states\.pt$")


class ZeroCheckpointError(Refused):
    pass


@dataclass
class ZeroCheckpoint:
    dir: Path
    tag: str
    stage: int
    world_size: int
    param_shapes: list[dict]                     # per optimizer group, ordered name -> shape
    flat_groups: list[list[LazyTensor]]          # [rank][group] fp32 partition
    paddings: list[list[int]] | None             # ZeRO-1/2: padding after each parameter, per group
    buffers: dict[str, LazyTensor] = field(default_factory=dict)
    shared: dict[str, str] = field(default_factory=dict)        # name -> the parameter it shares storage with
    frozen_shapes: dict[str, torch.Size] = field(default_factory=dict)
    frozen_fragments: list[dict[str, LazyTensor]] = field(default_factory=list)  # [rank] (ZeRO-3) or [0] (1/2)


def resolve_tag(root: Path, tag: str | None = None) -> str:
    if tag:
        return tag
    latest = Path(root) / "latest"
    if not latest.exists():
        raise ZeroCheckpointError(f"{root}: no 'latest' file naming the checkpoint tag (pass a tag)")
    return latest.read_text().strip()


def _rank_files(tag_dir: Path, kind: str) -> list[Path]:
    found: dict[int, Path] = {}
    for p in tag_dir.iterdir():
        m = _RANK_FILE.search(p.name)
        if m and m.group(3) == kind:
            if int(m.group(2)) != 0:
                raise ZeroCheckpointError(f"{p.name}: model-parallel (mp_rank > 0) checkpoints are not supported")
            found[int(m.group(1))] = p
    return [found[r] for r in sorted(found)]


def open_checkpoint(root: Path, tag: str | None = None) -> ZeroCheckpoint:
    root = Path(root)
    tag = resolve_tag(root, tag)
    tag_dir = root / tag
    if not tag_dir.is_dir():
        raise ZeroCheckpointError(f"{tag_dir}: checkpoint tag folder missing")
    optim_files = _rank_files(tag_dir, "optim")
    if not optim_files:
        raise ZeroCheckpointError(f"{tag_dir}: no *_optim_states.pt files (not a ZeRO checkpoint)")
    optim = [torch_lazy.load(p)["optimizer_state_dict"] for p in optim_files]
    try:
        stage = int(optim[0].get("zero_stage"))
    except (TypeError, ValueError):
        stage = None
    if stage not in (1, 2, 3):
        raise ZeroCheckpointError(f"{optim_files[0]}: unknown zero_stage {stage!r}")
    world = optim[0]["partition_count"]
    world = max(world) if isinstance(world, (list, tuple)) else world
    if world != len(optim_files):
        raise ZeroCheckpointError(f"{tag_dir}: partition_count {world} but {len(optim_files)} optimizer files "
                                  "(a rank's save is missing or an old one was left behind)")
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    flat_groups = [o[key] for o in optim]
    if stage == 3:
        model_files = _rank_files(tag_dir, "model")
    else:
        model_files = [tag_dir / "mp_rank_00_model_states.pt"]
    if not model_files or not model_files[0].exists():
        raise ZeroCheckpointError(f"{tag_dir}: model states file missing")
    states = [torch_lazy.load(p) for p in model_files]
    first = states[0]
    buffer_names = set(first.get("buffer_names") or [])
    return ZeroCheckpoint(
        dir=tag_dir, tag=tag, stage=stage, world_size=world,
        param_shapes=list(first["param_shapes"]),
        flat_groups=flat_groups,
        paddings=optim[0].get("param_alignment_paddings") if stage < 3 else None,
        buffers={k: v for k, v in (first.get("module") or {}).items() if k in buffer_names},
        shared=dict(first.get("shared_params") or {}),
        frozen_shapes=dict(first.get("frozen_param_shapes") or {}),
        frozen_fragments=[dict(s.get("frozen_param_fragments") or {}) for s in states],
    )


def _read_concat(parts: list[LazyTensor], start: int, out: torch.Tensor) -> None:
    """Fill out with elements [start, start + out.numel()) of the concatenation of the 1-D parts."""
    need, pos, base = out.numel(), 0, 0
    for part in parts:
        n = part.numel()
        lo = max(start + pos, base)
        hi = min(start + need, base + n)
        if lo < hi:
            part.read_flat_into(out[pos:pos + hi - lo], lo - base, hi - lo)
            pos += hi - lo
        base += n
        if pos == need:
            return
    raise ZeroCheckpointError(f"partitions end before element {start + need}")


def _numel(shape) -> int:
    return math.prod(shape)


def _trainable_readers(ck: ZeroCheckpoint) -> dict[str, tuple[torch.Size, Callable[[], torch.Tensor]]]:
    readers: dict[str, tuple[torch.Size, Callable[[], torch.Tensor]]] = {}
    if ck.stage <= 2:
        for g, shapes in enumerate(ck.param_shapes):
            parts = [ck.flat_groups[r][g] for r in range(ck.world_size)]
            pads = ck.paddings[g] if ck.paddings is not None else [0] * len(shapes)
            if len(pads) != len(shapes):
                raise ZeroCheckpointError(f"group {g}: {len(pads)} alignment paddings for {len(shapes)} parameters")
            offset = 0
            for (name, shape), pad in zip(shapes.items(), pads):
                def read(parts=parts, offset=offset, shape=shape):
                    out = torch.empty(_numel(shape), dtype=parts[0].dtype)
                    _read_concat(parts, offset, out)
                    return out.view(shape)
                readers[name] = (torch.Size(shape), read)
                offset += _numel(shape) + pad
            align = 2 * ck.world_size  # ZeRO-1/2 pad each group flat to a multiple of 2 * world size
            avail = sum(p.numel() for p in parts)
            if align * math.ceil(offset / align) != align * math.ceil(avail / align):
                raise ZeroCheckpointError(f"group {g}: parameters use {offset} elements, partitions hold {avail}")
        return readers
    ranks = ck.flat_groups
    offset = 0
    for shapes in ck.param_shapes:
        for name, shape in shapes.items():
            numel = _numel(shape)
            per_rank = math.ceil(numel / ck.world_size)

            def read(offset=offset, shape=shape, numel=numel, per_rank=per_rank):
                out = torch.empty(numel, dtype=ranks[0][0].dtype)
                for r in range(ck.world_size):
                    lo = r * per_rank
                    if lo < numel:
                        _read_concat(ranks[r], offset, out[lo:min(numel, lo + per_rank)])
                return out.view(shape)
            readers[name] = (torch.Size(shape), read)
            offset += per_rank
    avail = sum(p.numel() for p in ranks[0])
    if offset != avail:
        raise ZeroCheckpointError(f"ZeRO-3 parameters use {offset} elements per rank, partitions hold {avail}")
    return readers


def _frozen_readers(ck: ZeroCheckpoint) -> dict[str, tuple[torch.Size, Callable[[], torch.Tensor]]]:
    readers = {}
    for name, shape in ck.frozen_shapes.items():
        if ck.stage <= 2:
            frag = ck.frozen_fragments[0][name]
            readers[name] = (torch.Size(shape), lambda frag=frag, shape=shape: frag.load().view(shape))
        else:
            frags = [f[name] for f in ck.frozen_fragments]

            def read(frags=frags, shape=shape):
                out = torch.empty(_numel(shape), dtype=frags[0].dtype)
                _read_concat(frags, 0, out)
                return out.view(shape)
            readers[name] = (torch.Size(shape), read)
    return readers


def merge_lora(readers: dict, adapter: dict, prefix: str = "base_model.model.", name: str = "default") -> dict:
    """peft LoRA names → plain HF names, each adapted weight merged in fp32: W + (B @ A) * alpha / r."""
    scale = adapter["lora_alpha"] / (math.sqrt(adapter["r"]) if adapter.get("use_rslora") else adapter["r"])
    out = {}
    for key, (shape, src_dtype, read) in readers.items():
        if f".lora_A.{name}." in key or f".lora_B.{name}." in key:
            continue
        plain = key.removeprefix(prefix).replace(".base_layer.", ".")
        if key.endswith(".base_layer.weight"):
            stem = key[: -len(".base_layer.weight")]
            a, b = readers[f"{stem}.lora_A.{name}.weight"][2], readers[f"{stem}.lora_B.{name}.weight"][2]

            def read(base=read, a=a, b=b):  # peft's own arithmetic: W += (B @ A) * scale, bit for bit
                return base().float().add_((b().float() @ a().float()) * scale)
        out[plain] = (shape, src_dtype, read)
    return out


def planned_tensors(ck: ZeroCheckpoint, dtype: torch.dtype = torch.float32, exclude_frozen: bool = False,
                    lora: dict | None = None, model=None) -> list[safetensors_stream.PlannedTensor]:
    """Every tensor of the consolidated state dict (buffers, frozen and trainable parameters, shared names),
    floating ones cast to dtype, as DeepSpeed's converter defines it; LoRA adapters merged when `lora` (peft's
    adapter_config) is given; in the layout save_pretrained writes for `model` (a meta model of the checkpoint's
    config: merged experts split per expert again) when it is given, else under the engine's parameter names."""
    readers: dict[str, tuple[torch.Size, torch.dtype, Callable[[], torch.Tensor]]] = {}
    for name, t in ck.buffers.items():
        readers[name] = (t.shape, t.dtype if not t.dtype.is_floating_point else torch.float32,
                         lambda t=t: t.load().float() if t.dtype.is_floating_point else t.load())
    if not exclude_frozen:
        readers.update({n: (s, torch.float32, r) for n, (s, r) in _frozen_readers(ck).items()})
    readers.update({n: (s, torch.float32, r) for n, (s, r) in _trainable_readers(ck).items()})
    for name, source in ck.shared.items():
        if source in readers:
            readers[name] = readers[source]
    if lora is not None:
        readers = merge_lora(readers, lora)
    if model is not None:
        readers = hf_layout.file_layout(model, readers)
    plan = []
    for name, (shape, src_dtype, read) in readers.items():
        out_dtype = dtype if src_dtype.is_floating_point else src_dtype

        def produce(read=read, out_dtype=out_dtype):
            t = read()
            return t if t.dtype == out_dtype else t.to(out_dtype)
        plan.append(safetensors_stream.PlannedTensor(name, out_dtype, tuple(shape), produce))
    return plan


def _checkpoint_dtype(src: Path) -> str:
    m = mf.read(src) or {}
    return m.get("dtype") or "float32"


def adapter(src: Path) -> dict | None:
    """The LoRA adapters' config (r, lora_alpha, ...) the finetune worker writes when it trained adapters."""
    path = Path(src) / "adapter_config.json"
    return json.loads(path.read_text()) if path.exists() else None


def to_hf(src: Path, dst: Path, *, max_shard_bytes: int, dtype: str | None = None, tag: str | None = None) -> dict:
    """Write a complete HF folder from a ZeRO checkpoint folder that also holds config.json and tokenizer/."""
    src, dst = Path(src), Path(dst)
    if not (src / "config.json").exists():
        raise ZeroCheckpointError(f"{src}: config.json (the HF architecture) missing beside the ZeRO checkpoint")
    dtype = dtype or _checkpoint_dtype(src)
    if dtype not in DTYPES:
        raise ZeroCheckpointError(f"unsupported output dtype {dtype!r}; one of {sorted(DTYPES)}")
    ck = open_checkpoint(src, tag)
    lora = adapter(src)
    plan = planned_tensors(ck, DTYPES[dtype], lora=lora, model=hf_layout.meta_model(src))
    files = safetensors_stream.write(dst, plan, max_shard_bytes)
    config = json.loads((src / "config.json").read_text())
    for key in ("torch_dtype", "dtype"):
        if key in config:
            config[key] = str(DTYPES[dtype]).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if (src / "generation_config.json").exists():
        shutil.copy2(src / "generation_config.json", dst / "generation_config.json")
    tok_src = src / "tokenizer" if (src / "tokenizer").is_dir() else src
    copied = hf.copy_tokenizer(tok_src, dst)
    return {"zero_stage": ck.stage, "world_size": ck.world_size, "tag": ck.tag, "tensors": len(plan),
            "parameter_count": sum(_numel(t.shape) for t in plan), "dtype": dtype, "shards": len(files),
            "tokenizer_files": copied, "lora_merged": lora is not None,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
