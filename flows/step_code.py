"""What code a step runs, for its cache key: every project file reachable from the stage's task module, followed
statically (no hand-kept list), each with the sha256 of its bytes.

A file reaches another through
- an `import` / `from … import` of a project module (inside functions too: workers import lazily), which also runs the
  packages' `__init__.py` on the way;
- a bare `import x` of a file beside it (a worker script's folder is on its sys.path: `import mcore_model`);
- a string naming a project module (`"tasks.rlhf.task:run_rlhf"`, `python -m tasks.distributed.node`);
- a string naming a `.py` file beside it or under the project root (a program it launches: `worker.py`,
  `tasks/serve/lm_eval_worker.py`, `sandbox_child.py`).
A plug-in stage's own package (BATON_STAGES) counts as project code, from the folder it is imported from.
Reaching too far costs a re-run; missing a file serves a stale step, so a reference that might run counts.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel

from conversions.manifest import MANIFEST_NAME, sha256_file
from tasks.paths import CONTENTS_KEY, Contents

PACKAGES = ("flows", "tasks", "conversions")  # the project's own code; everything else is an installed library


@functools.lru_cache(maxsize=None)
def plugin_base(top: str) -> Path | None:
    """The folder a plug-in stage's top-level package is imported from (None: not a plug-in's)."""
    from tasks.registry import PLUGIN_PACKAGES

    spec = importlib.util.find_spec(top) if top in PLUGIN_PACKAGES else None
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin).resolve()
    return origin.parent.parent if spec.submodule_search_locations else origin.parent


def _anchor(root: Path, path: Path) -> Path:
    """What `path` is named relative to: the folder of the plug-in package it belongs to, or the project root."""
    from tasks.registry import PLUGIN_PACKAGES

    for top in PLUGIN_PACKAGES:
        base = plugin_base(top)
        if base is not None and (path.is_relative_to(base / top) or path == base / f"{top}.py"):
            return base
    return root


def module_file(root: Path, dotted: str) -> Path | None:
    """The file of project module `dotted` under root (a module or a package's __init__.py), or of a plug-in stage's
    package; None if neither."""
    parts = dotted.split(".")
    if not all(p.isidentifier() for p in parts):
        return None
    if parts[0] not in PACKAGES:
        root = plugin_base(parts[0])
        if root is None:
            return None
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _with_packages(root: Path, dotted: str) -> list[Path]:
    """Importing a.b.c runs a/__init__.py and a/b/__init__.py before a/b/c.py."""
    parts = dotted.split(".")
    found = (module_file(root, ".".join(parts[:i])) for i in range(1, len(parts) + 1))
    return [f for f in found if f is not None]


def _imported_names(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The dotted names an import statement may load: `from a import b` loads a, and a.b when b is a module."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:  # relative: from the importing module's package, `level` steps up
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(p for p in [*up, base] if p)
    return [base, *(f"{base}.{a.name}" for a in node.names)]


def _string_references(root: Path, here: Path, text: str) -> list[Path]:
    if text.endswith(".py") and "\n" not in text:
        for candidate in (here.parent / text, root / text):
            if candidate.is_file() and candidate.resolve().is_relative_to(root.resolve()):
                return [candidate]
        return []
    module = text.split(":")[0]
    return _with_packages(root, module) if "." in module else []


def _package_of(root: Path, path: Path) -> str:
    parts = path.relative_to(_anchor(root, path)).with_suffix("").parts
    return ".".join(parts[:-1])


@functools.lru_cache(maxsize=4096)
def _references(root: Path, path: Path, _mtime_ns: int) -> tuple[Path, ...]:
    """The project files `path` refers to (cached per version of the file)."""
    found: list[Path] = []
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for name in _imported_names(node, _package_of(root, path)):
                found += _with_packages(root, name)
                beside = path.parent / f"{name}.py"
                if "." not in name and beside.is_file():
                    found.append(beside)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += _string_references(root, path, node.value)
    return tuple(found)


def closure(root: Path, modules: Iterable[str]) -> dict[str, str]:
    """{path relative to root: sha256 of its bytes} of every project file the given modules reach, sorted."""
    root = root.resolve()
    pending = [f for m in modules for f in _with_packages(root, m)]
    seen: set[Path] = set()
    while pending:
        path = pending.pop().resolve()
        if path in seen:
            continue
        seen.add(path)
        pending += _references(root, path, path.stat().st_mtime_ns)
    return {p.relative_to(_anchor(root, p)).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(seen)}


# ---- the user's files a step runs or reads: the config keys marked with tasks.paths.contents(...) -----------------
def _folder_digest(folder: Path, listing_only: bool) -> str:
    """Every file under folder, by relative path: its bytes, or (listing_only) its size and modification time."""
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        st = f.stat()
        h.update(f.relative_to(folder).as_posix().encode() + b"\0")
        h.update(f"{st.st_size}:{st.st_mtime_ns}".encode() if listing_only else sha256_file(f).encode())
    return h.hexdigest()


def contents_digest(kind: Contents, value) -> str:
    """The digest of what a marked key's path holds; 'missing' when it is not there (its stage's checks refuse that
    before launch)."""
    text = str(value)
    path = Path(text.rpartition(":")[0] if kind == Contents.FUNCTION else text).expanduser()
    if kind in (Contents.FILE, Contents.FUNCTION):
        return sha256_file(path) if path.is_file() else "missing"
    if not path.is_dir():
        return "missing"
    if kind == Contents.CHECKPOINT and (path / MANIFEST_NAME).is_file():
        return sha256_file(path / MANIFEST_NAME)
    return _folder_digest(path, listing_only=kind == Contents.CHECKPOINT)


def _marked_kind(info) -> Contents | None:
    extra = info.json_schema_extra
    return Contents(extra[CONTENTS_KEY]) if isinstance(extra, dict) and CONTENTS_KEY in extra else None


def user_files(node, key: str) -> dict[str, str]:
    """{config key: digest} of every set key under `node` (a config model) whose path its step runs or reads."""
    if isinstance(node, BaseModel):
        found = {}
        for name, info in type(node).model_fields.items():
            value, sub = getattr(node, name), f"{key}.{name}"
            kind = _marked_kind(info)
            found |= ({sub: contents_digest(kind, value)} if value else {}) if kind else user_files(value, sub)
        return found
    if isinstance(node, (list, tuple)):
        return {k: v for i, item in enumerate(node) for k, v in user_files(item, f"{key}[{i}]").items()}
    if isinstance(node, dict):
        return {k: v for name, item in node.items() for k, v in user_files(item, f"{key}.{name}").items()}
    return {}
