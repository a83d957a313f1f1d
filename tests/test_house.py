"""House rules the code keeps: small functions, imports one way (flows → tasks → conversions), no import cycle, and a
layout that says where things live (flows/ holds the flows and what they run on; the `baton` command is flows/cli/)."""
from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.fast
PACKAGES = ("flows", "tasks", "conversions")
MAX_FUNCTION_LINES = 80


@functools.cache
def _modules() -> tuple[tuple[Path, ast.Module], ...]:
    return tuple((f, ast.parse(f.read_text())) for pkg in PACKAGES for f in sorted((REPO / pkg).rglob("*.py")))


def test_no_function_is_longer_than_the_limit():
    long = [f"{f.relative_to(REPO)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for f, tree in _modules() for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, "split these into named steps:\n" + "\n".join(long)


def _imported_packages(tree) -> set[str]:
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            names.add(n.module.split(".")[0])
    return names


def test_imports_go_one_way():
    allowed = {"flows": {"flows", "tasks", "conversions"}, "tasks": {"tasks", "conversions"}, "conversions": {"conversions"}}
    wrong = []
    for f, tree in _modules():
        pkg = f.relative_to(REPO).parts[0]
        for used in _imported_packages(tree) & set(PACKAGES):
            if used not in allowed[pkg]:
                wrong.append(f"{f.relative_to(REPO)} imports {used}")
    assert not wrong, "\n".join(wrong)


def test_conversions_never_import_prefect_or_mlflow():
    bad = [str(f.relative_to(REPO)) for f, tree in _modules()
           if f.relative_to(REPO).parts[0] == "conversions" and _imported_packages(tree) & {"prefect", "mlflow"}]
    assert not bad, bad


def _module_name(f: Path) -> str:
    parts = f.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_time_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported: none inside a function (they run when it is
    called, the usual way out of a cycle) and none under `if TYPE_CHECKING:` (they never run)."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            pending.extend(node.orelse)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))


def _imported_modules(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, known: set[str]) -> set[str]:
    """Our modules an import statement loads: `from pkg import sub` names the submodule when there is one."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names} & known
    base = node.module or ""
    if node.level:
        anchor = importer.split(".")[: len(importer.split(".")) - node.level + is_package]
        base = ".".join(anchor + ([base] if base else []))
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names} & known


def _import_graph() -> dict[str, set[str]]:
    trees = {_module_name(f): (f, tree) for f, tree in _modules()}
    known = set(trees)
    return {name: set().union(*(_imported_modules(n, name, f.name == "__init__.py", known)
                                 for n in _import_time_imports(tree))) - {name}
            for name, (f, tree) in trees.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a path that ends where it starts, or [] (depth-first, sorted for a stable answer)."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str]:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return []
        path.append(module)
        for imported in sorted(graph[module]):
            if cycle := visit(imported):
                return cycle
        path.pop()
        done.add(module)
        return []

    for module in sorted(graph):
        if cycle := visit(module):
            return cycle
    return []


def test_the_import_graph_has_no_cycle():
    graph = _import_graph()
    assert graph["flows.step_runner"] >= {"tasks.launch", "flows.step_gate"}, "the graph lost the imports it is made of"
    cycle = _find_cycle(graph)
    assert not cycle, "import cycle at import time: " + " → ".join(cycle)


def _all_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at import time or inside a function (a lazy import is still a dependency)."""
    return (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))


def _dependency_graph() -> dict[str, set[str]]:
    trees = {_module_name(f): (f, tree) for f, tree in _modules()}
    known = set(trees)
    return {name: set().union(*(_imported_modules(n, name, f.name == "__init__.py", known)
                                 for n in _all_imports(tree))) - {name}
            for name, (f, tree) in trees.items()}


def _in_cli(module: str) -> bool:
    return module == "flows.cli" or module.startswith("flows.cli.")


def _defines_a_flow(tree: ast.Module) -> bool:
    """`@flow`, `@flow(...)` or `flow(...)(fn)`: Prefect's decorator applied somewhere in the module."""
    return any((isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "flow")
               or (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and any(isinstance(d, ast.Name) and d.id == "flow" for d in n.decorator_list))
               for n in ast.walk(tree))


def test_nothing_outside_the_cli_imports_it():
    graph = _dependency_graph()
    wrong = [f"{m} imports {', '.join(sorted(filter(_in_cli, used)))}" for m, used in sorted(graph.items())
             if not _in_cli(m) and any(map(_in_cli, used))]
    assert not wrong, "the CLI sits on top: only flows/cli may import flows.cli\n" + "\n".join(wrong)


def test_every_module_directly_under_flows_is_a_flow_or_run_by_one():
    """flows/ holds the Prefect flows and the code they run on; a module only the CLI uses belongs in flows/cli/."""
    graph = _dependency_graph()
    direct = {_module_name(f): tree for f, tree in _modules()
              if f.parent == REPO / "flows" and f.name != "__init__.py"}
    flows_ = {m for m, tree in direct.items() if _defines_a_flow(tree)}
    assert {"flows.pipeline", "flows.retrain", "flows.stage_flows", "flows.step_runner"} <= flows_, flows_
    reached, pending = set(flows_), list(flows_)
    while pending:
        for used in graph[pending.pop()] - reached:
            reached.add(used)
            pending.append(used)
    cli_only = sorted(set(direct) - reached)
    assert not cli_only, "neither a flow nor imported by one (move them into flows/cli/): " + ", ".join(cli_only)


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _missing_modules(node: ast.ImportFrom | ast.Import, importer: str, is_package: bool,
                     trees: dict[str, ast.Module], packages: set[str]) -> list[str]:
    """What an import of ours names that is in no file: a module path left behind by a move."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] in PACKAGES and a.name not in trees]
    base = node.module or ""
    if node.level:
        anchor = importer.split(".")[: len(importer.split(".")) - node.level + is_package]
        base = ".".join(anchor + ([base] if base else []))
    if base.split(".")[0] not in PACKAGES:
        return []
    if base not in trees:
        return [base]
    if base not in packages:
        return []
    return [f"{base}.{a.name}" for a in node.names
            if f"{base}.{a.name}" not in trees and a.name not in _top_level_names(trees[base])]


def test_every_import_of_ours_names_a_module_that_exists():
    """Catches a stale path after a move (`flows.stages`, `flows.plan`): lazy imports included, which only fail when
    their function runs."""
    files = {_module_name(f): (f, tree) for f, tree in _modules()}
    trees = {name: tree for name, (f, tree) in files.items()}
    packages = {name for name, (f, tree) in files.items() if f.name == "__init__.py"}
    missing = [f"{f.relative_to(REPO)}:{n.lineno} {gone}" for name, (f, tree) in sorted(files.items())
               for n in _all_imports(tree) for gone in _missing_modules(n, name, f.name == "__init__.py", trees, packages)]
    assert not missing, "\n".join(missing)


def _spelled_stage_sets() -> list[str]:
    """Where a tuple, list or set literal spells the training stages (it should come from tasks.registry)."""
    training = {"pretrain", "rlhf", "finetune"}
    found = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) == 3:
                values = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                if values == training:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_the_training_stages_and_their_disk_bytes_have_one_home():
    """The training-stage set is an attribute of each stage's spec (tasks.registry.TRAINING_STAGES); the bytes a
    checkpoint holds per parameter are one function (tasks.memory_plan), used by doctor and the stages' own check."""
    from flows.cli import doctor
    from flows import step_runner
    from tasks import memory_plan
    from tasks.registry import STAGES, TRAINING_STAGES

    assert set(TRAINING_STAGES) == {name for name, spec in STAGES.items() if spec.trains} == {"pretrain", "rlhf",
                                                                                              "finetune"}
    assert _spelled_stage_sets() == []
    assert doctor.TRAINING_STAGES is step_runner.TRAINING_STAGES is TRAINING_STAGES
    assert doctor.mp is step_runner.mp is memory_plan
    for path, tree in _modules():  # no other table of bytes per parameter
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict) and {k.value for k in node.keys if isinstance(k, ast.Constant)} >= {
                    "pretrain", "finetune"} and all(isinstance(v, ast.Constant) and isinstance(v.value, int)
                                                    for v in node.values):
                raise AssertionError(f"a per-stage number table at {path.relative_to(REPO)}:{node.lineno}")


def test_the_workers_share_one_spec_contract():
    """pretrain, rlhf, finetune and convert workers read one typed JSON spec through tasks.events
    (tests/test_program_specs.py; written by their stage task from its config model): no worker declares a flag, so
    none can carry a default of its own."""
    for stage in ("pretrain", "rlhf", "finetune", "convert"):
        path = REPO / "tasks" / stage / "worker.py"
        tree = ast.parse(path.read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
        assert not [n.lineno for n in calls if n.func.attr == "add_argument"], f"{path}: flags of its own"
        assert any(n.func.attr == "read_typed_spec" for n in calls), \
            f"{path}: does not read its spec with events.read_typed_spec"


def test_the_deployments_tiny_model_and_data_are_configs_tiny():
    """prefect.yaml repeats configs/tiny.yaml's model (and the pipeline's data and tracking) because a deployment's
    parameters must be literal: they may not drift from the config file the README runs."""
    import yaml

    tiny = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    assert deployments
    for d in deployments:
        params = d.get("parameters") or {}
        model = params.get("model") or (params.get("config") or {}).get("model")
        assert model == tiny["model"], (d["entrypoint"], model)
        if "config" in params:
            for key in ("name", "seed", "stages", "data", "tracking"):
                assert params["config"][key] == tiny[key], (d["entrypoint"], key)


# Values manifests, plans and MLflow tags on disk already carry: renaming one would orphan every existing checkpoint.
FORMATS_ON_DISK = {"hf-safetensors", "megatron-dist", "deepspeed-zero", "dataset", "gguf-file",
                   "hf-compressed-tensors"}


def _format_literals(tree: ast.Module, formats: set[str]) -> list[int]:
    """Lines where a string literal spells a format. "dataset" is also a plain word: as a dict key or in a tuple of
    key names it names a config key, not a format. Docstrings are prose for people and may name formats."""
    nodes = list(ast.walk(tree))
    docstrings = {id(n.value) for n in nodes if isinstance(n, ast.Expr)}
    key_names = {id(k) for n in nodes if isinstance(n, ast.Dict) for k in n.keys}
    key_names |= {id(e) for n in nodes if isinstance(n, ast.Assign)
                  and isinstance(n.value, (ast.Tuple, ast.List, ast.Set)) for e in n.value.elts}
    distinctive = formats - {"dataset"}
    return [n.lineno for n in nodes
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
            and (any(f in n.value for f in distinctive) or (n.value == "dataset" and id(n) not in key_names))]


def test_checkpoint_formats_have_one_home():
    """The format names live in conversions.manifest.Format alone; code elsewhere names its members."""
    from conversions import manifest as mf

    assert {f.value for f in mf.Format} == FORMATS_ON_DISK
    assert set(mf.FORMATS) == set(mf.Format)
    assert _format_literals(ast.parse('if fmt in (None, "dataset"):\n    x = f"to megatron-dist {y}"'),
                            FORMATS_ON_DISK) == [1, 2]  # the check can see a literal
    enum_home = REPO / "conversions" / "manifest.py"
    found = [f"{f.relative_to(REPO)}:{line}" for f, tree in _modules()
             for line in _format_literals(tree, FORMATS_ON_DISK)
             if not (f == enum_home and _inside_class(tree, "Format", line))]
    assert not found, "spell these as conversions.manifest.Format members:\n" + "\n".join(found)


def _inside_class(tree: ast.Module, name: str, line: int) -> bool:
    return any(isinstance(n, ast.ClassDef) and n.name == name and n.lineno <= line <= n.end_lineno for n in tree.body)


def test_the_rlhf_workers_imports_load_no_prefect_mlflow_or_flows():
    """The rlhf worker runs in the engine's runtime and imports its rewards, sandbox, tools and environments from its
    stage's folder, which runs tasks/rlhf/__init__.py on the way: that must stay free of the orchestration layer."""
    import subprocess
    import sys

    probe = ("import sys, tasks.rlhf.worker; print(sorted({m.split('.')[0] for m in sys.modules} "
             "& {'prefect', 'mlflow', 'flows'}))")
    r = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"
