"""Paths a config names, checked before anything launches (untrusted configs: a deployment's parameters, a shared
YAML). Values that become folder or file names (`name`, `tracking.registered_model`, a run id) are plain names: no
`..`, no separator, no NUL. Folders the run writes into stay absolute and free of `..`. Paths the run only reads
(data files, lm-eval tasks, a runtime's python or checkout, `--from`) may be anywhere, but must exist
as what they are meant to be. Each problem is one line naming its key."""
from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path, PurePath

from tasks.problems import ConfigProblem

PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
LOCAL_KINDS = ("local", "venv")


class Contents(StrEnum):
    """What a config key's path holds that its step runs or reads, so the step's cache key digests it (the key says
    so once, `json_schema_extra=contents(...)`; flows/step_code.py finds every marked key)."""

    FILE = "file"                # a file: its bytes
    FUNCTION = "function"        # 'path/to/file.py:fn': the file's bytes
    FOLDER = "folder"            # every file under it (an lm-eval task folder: YAML, data, `!function` Python)
    CHECKPOINT = "checkpoint"    # a checkpoint folder: its manifest (every file's sha256), else each file's size and time


CONTENTS_KEY = "baton_contents"


def contents(kind: Contents) -> dict:
    """A config field's json_schema_extra: the field names a path whose contents its step runs or reads."""
    return {CONTENTS_KEY: kind.value}


def name_problem(value: str) -> str | None:
    """Why `value` cannot name a folder or file (None when it can)."""
    if PLAIN_NAME.match(value or "") and value not in (".", ".."):
        return None
    return f"{value!r} is not a plain name: letters, digits, '.', '_' and '-' only (it names folders and files)"


def check_run_id(run_id: str) -> str:
    """A run id names a folder under BATON_HOME/runs: one plain name, never a path (`../..`)."""
    problem = name_problem(run_id)
    if problem:
        raise ValueError(f"run_id {problem}")
    return run_id


def plain_name(value: str) -> str:
    """A pydantic field validator body: the value, or ValueError naming the rule."""
    problem = name_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _strings(obj, key: str = ""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(v, f"{key}.{k}" if key else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _strings(v, f"{key}[{i}]")
    elif isinstance(obj, str):
        yield key, obj


def nul_errors(dumped: dict) -> list[ConfigProblem]:
    """A NUL byte truncates a path in the OS and splits a log line: refused in every value."""
    return [ConfigProblem(key, f"{key}: contains a NUL byte") for key, value in _strings(dumped) if "\0" in value]


def wandering_errors(key: str, value: str | None) -> list[ConfigProblem]:
    """A folder the run writes into (its own checks want it absolute): without `..`, so it cannot wander."""
    if value and ".." in PurePath(value).parts:
        return [ConfigProblem(key, f"{key}: {value!r} contains '..' (give the folder itself)")]
    return []


def read_errors(key: str, value, kind: str) -> list[ConfigProblem]:
    """A path the run reads: must exist as a regular file (`file`) or a folder (`dir`)."""
    if value is None or value == "":
        return []
    p = Path(value)
    ok = p.is_file() if kind == "file" else p.is_dir()
    if ok:
        return []
    what = "a regular file" if kind == "file" else "a folder"
    return [ConfigProblem(key, f"{key}: {value} is not {what}" if p.exists() else
                          f"{key}: {value}: no such {kind.replace('dir', 'folder')}")]


def data_source_errors(data) -> list[ConfigProblem]:
    from tasks.data.config import DATASETS
    from tasks.data.sources import matched_files

    errors = []
    for name in DATASETS:
        for key, src in data.sources(name):
            if src.kind != "files":
                continue
            for split in ("train", "heldout"):
                pattern = getattr(src, split)
                if pattern and not matched_files(pattern):
                    errors.append(ConfigProblem(f"{key}.{split}", f"{key}.{split}: {pattern} matches no file (a "
                                                "file, a folder or a glob)"))
    return errors


def runtime_errors(runtimes: dict) -> list[ConfigProblem]:
    """A runtime's python and checkout, where they are meant to be on this host (cluster kinds: on the nodes)."""
    errors = []
    for name, rt in runtimes.items():
        if rt.kind in LOCAL_KINDS and rt.python:
            errors += read_errors(f"runtimes.{name}.python", rt.python, "file")
        if rt.kind in LOCAL_KINDS and rt.path:
            errors += read_errors(f"runtimes.{name}.path", rt.path, "dir")
    return errors


def config_errors(cfg, host: bool = True) -> list[ConfigProblem]:
    """Every path problem of a PipelineConfig; `host`: also whether what it reads exists on this machine."""
    errors = nul_errors(cfg.model_dump(mode="json"))
    errors += wandering_errors("finetune.zero.nvme_path", cfg.finetune.zero.nvme_path)
    if not host:
        return errors
    return errors + runtime_errors(cfg.runtimes)
