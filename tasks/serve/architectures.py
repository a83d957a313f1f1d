"""Which model architectures a serving engine can load, as the engine itself answers: its model registry, asked in its
own runtime. A runtime folder is named by its requirements digest, so the answer is kept inside it (read once per
runtime build, not per run) and a rebuilt engine is asked again.

    served_architectures("vllm") -> frozenset({"LlamaForCausalLM", "Gemma3ForCausalLM", ...})
    unservable(["vllm", "sglang"], ["FooForCausalLM"]) -> "architectures ['FooForCausalLM']: not in ... registry"
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conversions import durable
from tasks.runtimes import python_for
from tasks.serve.engines import RUNTIME

CACHE_FILE = "baton-served-architectures.json"
REGISTRY = {"vllm": "vllm.model_executor.models.registry", "sglang": "sglang.srt.models.registry"}
ASK = "import json, sys; from {module} import ModelRegistry; json.dump(sorted(ModelRegistry.get_supported_archs()), sys.stdout)"
ENV = {"sglang": {"SGLANG_USE_CPU_ENGINE": "1"}}  # its registry imports every model module; the CPU build needs it


class RegistryUnreadable(RuntimeError):
    pass


def _cache_path(python: str) -> Path:
    return Path(python).parent.parent / CACHE_FILE  # baton's runtime <name>-<digest>/bin/python -> <name>-<digest>/


def _cached(path: Path, engine: str, python: str) -> frozenset[str] | None:
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if kept.get("engine") != engine or kept.get("python") != python or not isinstance(kept.get("architectures"), list):
        return None
    return frozenset(kept["architectures"])


def _ask(engine: str, python: str) -> frozenset[str]:
    import os

    try:
        out = subprocess.run([python, "-c", ASK.format(module=REGISTRY[engine])], capture_output=True, text=True,
                             timeout=600, env={**os.environ, **ENV.get(engine, {})})
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RegistryUnreadable(f"{engine}: its model registry could not be read with {python}: {e}") from e
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RegistryUnreadable(f"{engine}: reading its model registry ({REGISTRY[engine]}) failed: {tail[0]}")
    return frozenset(json.loads(out.stdout))


_ASKED: dict[tuple[str, str], frozenset[str]] = {}


def served_architectures(engine: str, runtimes: dict | None = None) -> frozenset[str]:
    """The architectures (config.json `architectures` names) the engine's runtime lists as loadable."""
    python = python_for(RUNTIME[engine], runtimes)
    if ((runtimes or {}).get(RUNTIME[engine]) or {}).get("python"):
        # a python the user configured: nothing tells when it changes, and its folder is not baton's to write into
        if (engine, python) not in _ASKED:
            _ASKED[engine, python] = _ask(engine, python)
        return _ASKED[engine, python]
    path = _cache_path(python)
    found = _cached(path, engine, python)
    if found is None:
        found = _ask(engine, python)
        try:
            durable.write_json(path, {"engine": engine, "python": python, "architectures": sorted(found)})
        except OSError:
            pass  # a runtime folder mounted read-only: the engine is asked again next time
    return found


def unservable(engines: list[str], architectures: list[str], runtimes: dict | None = None) -> str | None:
    """Why the engines cannot load a model declaring these architectures, or None. Raises RuntimeMissing when an
    engine's runtime is not built, RegistryUnreadable when its registry cannot be read."""
    if not architectures:
        return "config.json declares no architectures: no engine can tell which model class to load"
    refusing = [e for e in engines if not set(architectures) & served_architectures(e, runtimes)]
    if not refusing:
        return None
    return (f"architectures {architectures}: not in the model registry of {' or '.join(refusing)} (read from its "
            "runtime); serve it with an engine that lists it (serve.engine) or use a model architecture it lists")


if __name__ == "__main__":  # `make runtimes`: read each serving engine's registry once, as part of building it
    for name in REGISTRY:
        print(f"[runtimes] {name}: {len(served_architectures(name))} architectures in its model registry")
