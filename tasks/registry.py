"""Every stage baton knows: the built-in ones in the design card's order, then the plug-in stages named in
BATON_STAGES (docs/architecture.md, "How to add a stage")."""
from __future__ import annotations

import importlib
import os

from conversions.refusal import Refused

from tasks import convert, data, export, finetune, pretrain, rlhf, serve
from tasks.stage import StageRole, StageSpec

PLUGINS_ENV = "BATON_STAGES"  # comma-separated importable modules, each exposing STAGE (a StageSpec with `after`)
BUILT_IN = (data.STAGE, pretrain.STAGE, rlhf.STAGE, finetune.STAGE, export.STAGE, serve.STAGE, convert.STAGE)
BUILT_IN_ORDER = ["data", "pretrain", "rlhf", "finetune", "export", "serve"]  # the order listed stages must follow
DEFAULT_CHAIN = ["data", "pretrain", "rlhf", "finetune", "serve"]  # the stages a config without `stages:` runs


class PluginError(Refused):
    """A plug-in stage that cannot be registered: its one line names the module and the check."""


def _plugin(module: str) -> StageSpec:
    try:
        spec = importlib.import_module(module).STAGE
    except (ImportError, AttributeError) as e:
        raise PluginError(f"{PLUGINS_ENV}: {module}: {e}") from None
    if not isinstance(spec, StageSpec):
        raise PluginError(f"{PLUGINS_ENV}: {module}.STAGE is a {type(spec).__name__}, not a tasks.stage.StageSpec")
    return spec


def plugin_stages() -> tuple[StageSpec, ...]:
    return tuple(_plugin(m.strip()) for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip())


def chain_order(built_in: list[str], plugins: tuple[StageSpec, ...]) -> list[str]:
    """The order stages run in: the built-in chain with each plug-in right after the stage it names in `after`."""
    order = list(built_in)
    for spec in plugins:
        if spec.name in order:
            raise PluginError(f"{PLUGINS_ENV}: stage '{spec.name}' is already registered")
        if spec.after not in order:
            raise PluginError(f"{PLUGINS_ENV}: stage '{spec.name}': after={spec.after!r} is not one of {order}")
        order.insert(order.index(spec.after) + 1, spec.name)
    return order


PLUGINS = plugin_stages()
PLUGIN_PACKAGES = frozenset(s.task.split(":")[0].split(".")[0] for s in PLUGINS)  # their code is in the cache key
CHAIN_ORDER = chain_order(BUILT_IN_ORDER, PLUGINS)
STAGES: dict[str, StageSpec] = {s.name: s for s in (*BUILT_IN, *PLUGINS)}
TRAINING_STAGES = tuple(name for name, spec in STAGES.items() if spec.trains)  # pretrain, rlhf, finetune
(DATA_STAGE,) = (name for name, spec in STAGES.items() if spec.role == StageRole.DATA)        # "data"
(CONVERT_STAGE,) = (name for name, spec in STAGES.items() if spec.role == StageRole.CONVERT)  # "convert"
