"""One contract for the programs baton launches: a typed spec file in (tasks/events.py ProgramSpec), never flags with
defaults of their own. The serve supervisor's `--restarts` once defaulted to 0 where serve.restarts says 2, and the
health timeout's 600 s was written three times; a spec model with no defaults cannot drift from the config."""
from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from conftest import REPO
from tasks import events

pytestmark = pytest.mark.fast
FOLDERS = ("tasks", "conversions")
SUPERVISOR = REPO / "tasks/serve/supervisor.py"


def launched_programs() -> list:
    """Every module under tasks/ and conversions/ that runs as a program of its own (`if __name__ == "__main__"`)."""
    return sorted(p for folder in FOLDERS for p in (REPO / folder).rglob("*.py")
                  if '__name__ == "__main__"' in p.read_text())


def parsers_in(path) -> list[int]:
    """Lines that build a command-line parser of their own (argparse.ArgumentParser or ArgumentParser)."""
    return [n.lineno for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
            and getattr(n.func, "attr", getattr(n.func, "id", None)) == "ArgumentParser"]


def test_no_launched_program_parses_flags_of_its_own():
    programs = launched_programs()
    assert REPO / "tasks/serve/supervisor.py" in programs and REPO / "tasks/serve/lm_eval_worker.py" in programs
    own = {str(p.relative_to(REPO)): lines for p in programs if (lines := parsers_in(p))}
    assert own == {}, f"these programs take flags with defaults of their own, not a spec (tasks/events.py): {own}"


def test_the_scan_finds_a_parser(tmp_path):
    planted = tmp_path / "worker.py"
    planted.write_text("import argparse\nap = argparse.ArgumentParser()\nap.add_argument('--restarts', default=0)\n")
    assert parsers_in(planted) == [2]


def all_specs(cls=events.ProgramSpec) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *all_specs(sub))]


def test_program_specs_default_nothing():
    """Every value a launched program reads comes from a config model, where the defaults live."""
    specs = all_specs()
    assert {s.__name__ for s in specs} >= {"SupervisorSpec", "LmEvalSpec", "LmEvalServer", "LmEvalLocal",
                                           "SglProgramSpec", "ConvertSpec", "FinetuneSpec"}
    defaulted = {f"{s.__name__}.{name}" for s in specs for name, f in s.model_fields.items() if not f.is_required()}
    assert defaulted == set()


def test_the_supervisor_refuses_a_spec_naming_the_field(tmp_path):
    """The same model validates the spec on the reader's side: a field another baton version wrote (or a typo in a
    hand-edited spec) ends the supervisor at once with the file and the field, before any engine starts."""
    good = events.SupervisorSpec(name="vllm", log=tmp_path / "s.log", state=tmp_path / "s.json",
                                 url="http://127.0.0.1:9", restarts=2, health_timeout_s=600.0,
                                 cmd=[sys.executable, "-c", "pass"])
    spec = json.loads(good.model_dump_json())
    spec["restart"] = spec.pop("restarts")
    path = tmp_path / "spec.json"
    events.write_spec(path, spec)
    r = subprocess.run([sys.executable, str(SUPERVISOR), "--spec", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == f"{path}: not a valid SupervisorSpec (restarts, restart)"
    assert not (tmp_path / "s.log").exists()
