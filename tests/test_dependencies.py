"""One source of truth for dependencies: pyproject.toml's extras say what the runtimes in infra/runtimes/ install.
main's extra is exactly main.txt; a serving runtime's extra names what its .txt or .post.sh asks for, pin for pin."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parent.parent
RUNTIMES = REPO / "infra" / "runtimes"


def extras() -> dict[str, list[str]]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def requirements(path: Path) -> list[str]:
    """The requirement lines of a pip requirements file, comments and blanks dropped."""
    return [r for line in path.read_text().splitlines() if (r := line.split("#", 1)[0].strip())]


def installed_by_post_script(name: str) -> set[str]:
    """The `name==version` pins a runtime's post-install script passes to pip."""
    script = RUNTIMES / f"{name}.post.sh"
    return set(re.findall(r"[A-Za-z0-9_.\[\]-]+==[A-Za-z0-9_.+-]+", script.read_text())) if script.exists() else set()


def test_every_extra_is_a_runtime_and_every_runtime_an_extra():
    assert set(extras()) == {p.stem for p in RUNTIMES.glob("*.txt")}


def test_the_main_extra_is_exactly_main_txt():
    assert extras()["main"] == requirements(RUNTIMES / "main.txt")


@pytest.mark.parametrize("name", ["vllm", "sglang", "llamacpp", "llmcompressor"])
def test_a_serving_extra_asks_for_what_its_runtime_installs(name):
    installed = set(requirements(RUNTIMES / f"{name}.txt")) | installed_by_post_script(name)
    missing = [r for r in extras()[name] if r not in installed]
    assert not missing, f"pyproject's {name} extra names {missing}, which infra/runtimes/{name}.* does not install"


def test_the_check_sees_drift():
    """The comparison can fail: main.txt less one line, or a pin changed, is not the extra."""
    main = requirements(RUNTIMES / "main.txt")
    assert "gguf==0.19.0" in main and any(r.startswith("pytest-xdist") for r in main)
    assert extras()["main"] != main[:-1] and extras()["main"] != [r.replace("==", ">=") for r in main]
