"""Re-read the NeMo-RL facts (tests/fixtures/nemo_rl_recipes.json) from a NeMo-RL source checkout at its pinned commit.

NeMo-RL runs on GPUs only, and its package on the index is an empty placeholder, so baton's tests stand its recipes
in from this facts file. The mechanical facts are re-derived here from the source: each script's `--options`, each
recipe's key paths and types as OmegaConf loads them, and the upstream values the tests use. The hand-read
`declared` entries (keys NeMo-RL's config types accept beyond the recipe) are kept, and each is checked to still be a
field of the file it names. Run it when moving the pin:

    python infra/facts/nemo_rl.py SOURCE [--commit SHA] [--check]

SOURCE is a git directory (bare or not) of NVIDIA-NeMo/RL. `--check` writes nothing and exits 1 on a difference.
"""
from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tasks.rlhf import nemo_rl  # noqa: E402

FACTS = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "nemo_rl_recipes.json"


def show(source: Path, commit: str, path: str) -> str:
    return subprocess.run(["git", "--git-dir", str(git_dir(source)), "show", f"{commit}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def git_dir(source: Path) -> Path:
    return source / ".git" if (source / ".git").exists() else source


def commit_date(source: Path, commit: str) -> str:
    return subprocess.run(["git", "--git-dir", str(git_dir(source)), "log", "-1", "--format=%cd", "--date=short",
                           commit], check=True, capture_output=True, text=True).stdout.strip()


def script_options(text: str) -> list[str]:
    """The long options a script's argparse declares, in order (a shell script declares none)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    return [arg.value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
            for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")]


def type_name(value) -> str:
    if value is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "dict"}[type(value)]


def recipe_keys(text: str) -> tuple[dict[str, str], dict[str, object]]:
    """Every key path with the type of what it resolves to (parents before children), and each key's raw value."""
    loaded = OmegaConf.create(text)  # OmegaConf's own YAML loader: 1e-8 is a float there, a string to plain YAML
    resolved = OmegaConf.to_container(loaded, resolve=True)
    raw = OmegaConf.to_container(loaded, resolve=False)
    keys: dict[str, str] = {}
    values: dict[str, object] = {}

    def walk(node_resolved, node_raw, prefix: str) -> None:
        for key, value in node_resolved.items():
            path = f"{prefix}{key}"
            if key == "defaults" and not prefix:
                continue
            keys[path] = type_name(value)
            values[path] = node_raw[key]
            if isinstance(value, dict):
                walk(value, node_raw[key], f"{path}.")

    walk(resolved, raw, "")
    return keys, values


def declared_field_present(source: Path, commit: str, where: str, key: str) -> bool:
    """A hand-read `declared` entry still holds when its last key part is a field (or a key) in the file named."""
    path = where.split()[0]
    try:
        text = show(source, commit, path)
    except subprocess.CalledProcessError:
        return False
    return key.rsplit(".", 1)[-1] in text


def registered_resolvers(text: str) -> set[str]:
    return {node.args[0].value for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "register_new_resolver"}


def regenerate(source: Path, commit: str, old: dict) -> dict:
    upstream = registered_resolvers(show(source, commit, "nemo_rl/utils/config.py"))
    if upstream != set(nemo_rl.RESOLVERS):
        raise SystemExit(f"NeMo-RL registers the resolvers {sorted(upstream)}; baton's tasks/rlhf/nemo_rl.py "
                         f"RESOLVERS has {sorted(nemo_rl.RESOLVERS)}")
    nemo_rl.register_resolvers()
    new = {"source": dict(old["source"], commit=commit, commit_date=commit_date(source, commit)),
           "scripts": {script: script_options(show(source, commit, script)) for script in old["scripts"]},
           "recipes": {}}
    for name, facts in old["recipes"].items():
        keys, raw = recipe_keys(show(source, commit, facts["file"]))
        gone = [k for k in facts["values"] if k not in raw]
        stale = [k for k, d in facts["declared"].items() if not declared_field_present(source, commit, d["where"], k)]
        if gone or stale:
            raise SystemExit(f"{name}: values no longer in the recipe {gone}; declared keys not found where they "
                             f"were read {stale}: re-read them by hand")
        new["recipes"][name] = dict(facts, keys=keys, values={k: raw[k] for k in facts["values"]})
    return new


def dumps(node, depth: int = 0) -> str:
    """JSON laid out as the facts file is read: one key per line, a list or a declared entry (a dict of scalars
    below the recipes' top level) on one line."""
    scalars_only = isinstance(node, dict) and not any(isinstance(v, (dict, list)) for v in node.values())
    if isinstance(node, list) or (scalars_only and depth >= 4) or not node and isinstance(node, dict):
        return json.dumps(node, ensure_ascii=False)
    if not isinstance(node, dict):
        return json.dumps(node, ensure_ascii=False)
    pad = " " * (depth + 1)
    items = ",\n".join(f"{pad}{json.dumps(k, ensure_ascii=False)}: {dumps(v, depth + 1)}" for k, v in node.items())
    return "{\n" + items + "\n" + " " * depth + "}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("--commit", help="default: the commit the facts file pins")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    old = json.loads(FACTS.read_text())
    new = regenerate(args.source, args.commit or old["source"]["commit"], old)
    text = dumps(new) + "\n"
    if args.check:
        if text != FACTS.read_text():
            print(f"{FACTS} differs from what {args.source} says", file=sys.stderr)
            return 1
        print(f"{FACTS} matches {new['source']['commit']}")
        return 0
    FACTS.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
