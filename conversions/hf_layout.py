"""The tensors an HF checkpoint's files hold ↔ the parameters a transformers model holds in memory.

transformers 5 keeps some weights in another layout in memory than on disk: a mixture of experts' per-expert matrices
(`mlp.experts.<e>.{gate,up,down}_proj.weight`, Mixtral's `block_sparse_moe.experts.<e>.w{1,2,3}.weight`) are one 3-D
parameter per layer in memory (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`). Its own from_pretrained and
save_pretrained translate with a list of WeightConverters per architecture (transformers/conversion_mapping.py); this
module applies that same list, one group of tensors at a time, for baton's streaming loader (the finetune worker,
ZeRO-3 gathering one parameter at a time) and streaming writer (ZeRO → HF). Nothing here names an architecture.
Experts merge in the natural order of their index (expert 10 after expert 9), the order transformers sorts them in.
"""
from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


@dataclass
class Group:
    """Checkpoint tensors that together make one or more parameters."""
    first: str                                        # the (first) parameter it makes: transformers' key for it
    sources: list[str] = field(default_factory=list)  # checkpoint names, in the order they are merged
    patterns: list[str] = field(default_factory=list)  # the converter's source pattern each one matched
    converter: object | None = None                   # a transformers WeightConverter; None: the tensor as it is


def model_class(config):
    """The transformers class config.json's `architectures` names (AutoModelForCausalLM's choice without one)."""
    import transformers

    for name in getattr(config, "architectures", None) or []:
        if hasattr(transformers, name):
            return getattr(transformers, name)
    return None


def meta_model(config_dir: Path):
    """The model of config.json on the meta device: its parameter names and shapes, no memory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_dir))
    cls = model_class(config)
    with torch.device("meta"):
        return cls(config) if cls is not None else AutoModelForCausalLM.from_config(config)


def _transforms(model, saving: bool) -> tuple[list, list]:
    """(renamings, converters) as from_pretrained (loading) or save_pretrained (saving: reversed) applies them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming

    if saving:  # as revert_weight_conversion does for a model not loaded by from_pretrained
        found = [t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)]
        found = [t.reverse_transform() for t in found[::-1]]
    else:
        found = get_model_conversion_mapping(model)
    return ([t for t in found if isinstance(t, WeightRenaming)], [t for t in found if isinstance(t, WeightConverter)])


def load_groups(model, names, parameters) -> tuple[list[Group], list[str]]:
    """The checkpoint's tensor names grouped by the parameter(s) they make, and the names that make none."""
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    renamings, converters = _transforms(model, saving=False)
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    known = dict.fromkeys(parameters, True)
    groups: dict[str, Group] = {}
    unmatched = []
    for name in sorted(names, key=dot_natural_key):
        target, pattern = rename_source_key(name, renamings, converters, model.base_model_prefix, known)
        if target not in known and name in known:  # transformers' own fallback: the name was right as it was
            target, pattern = name, None
        if target not in known:
            unmatched.append(name)
            continue
        group = groups.setdefault(target, Group(target, converter=copy.deepcopy(by_pattern[pattern])
                                                if pattern is not None else None))
        group.sources.append(name)
        group.patterns.append(pattern)
    return list(groups.values()), unmatched


def _convert(converter, first: str, members: list[tuple[str, str]], read: Callable[[str], object], model) -> dict:
    conv = copy.deepcopy(converter)
    for name, pattern in members:
        conv.add_tensor(first, name, pattern, lambda name=name: read(name))
    out = conv.convert(first, model=model, config=model.config)
    return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}


def produce(group: Group, read: Callable[[str], object], model) -> dict:
    """{parameter name: tensor} of one group; `read(name)` gives a checkpoint tensor."""
    if group.converter is None:
        if len(group.sources) != 1:
            raise ValueError(f"{group.sources}: several checkpoint tensors for the one parameter {group.first}")
        return {group.first: read(group.sources[0])}
    try:
        return _convert(group.converter, group.first, list(zip(group.sources, group.patterns)), read, model)
    except RuntimeError as e:  # e.g. experts of different shapes do not stack
        raise ValueError(f"{group.first}: the checkpoint's {group.sources[0]} ... ({len(group.sources)} tensors) do "
                         f"not merge into it: {e}") from None


class _SplitOnce:
    """One group's outputs, computed on the first request and handed out one by one (then freed)."""

    def __init__(self, converter, first: str, members: list, readers: dict, model):
        self.args = (converter, first, members, lambda n: readers[n][2](), model)
        self.lock, self.results = threading.Lock(), None

    def take(self, name: str):
        with self.lock:
            if self.results is None:
                self.results = _convert(*self.args)
            return self.results.pop(name)


def file_layout(model, readers: dict) -> dict:
    """Parameters {name: (shape, dtype, read)} → the tensors save_pretrained writes for them, same form: merged
    experts split again, renamed back (Mixtral's `mlp.` → `block_sparse_moe.`). Shapes come from running the same
    operations on meta tensors; each group is read once, when its first output is written."""
    import torch
    from transformers.core_model_loading import apply_converters, apply_renamings, dot_natural_key

    renamings, converters = _transforms(model, saving=True)
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    out, groups = {}, {}
    for name in sorted(readers, key=dot_natural_key):
        target, pattern = apply_converters(name, converters)
        if pattern is None:
            out[apply_renamings(name, renamings)] = readers[name]
        else:
            groups.setdefault(target, (by_pattern[pattern], []))[1].append((name, pattern))
    for first, (converter, members) in groups.items():
        dtype = readers[members[0][0]][1]
        meta = _convert(converter, first, members,
                        lambda n: torch.empty(readers[n][0], dtype=readers[n][1], device="meta"), model)
        once = _SplitOnce(converter, first, members, readers, model)
        for key, t in meta.items():
            out[apply_renamings(key, renamings)] = (torch.Size(t.shape), dtype, lambda key=key, once=once: once.take(key))
    return out
