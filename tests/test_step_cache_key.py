"""A step's cache key follows the code it runs (its import closure, found from the source) and the user files it runs:
an edit to the rlhf reward code or a user's reward file re-runs rlhf and says why; an edit to docs or a test keeps
every step cached. Planning only (fingerprints over a copy of the project tree): no engine starts."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from flows.chain_planner import changes, plan
from flows.config import load
from flows.runs import Index
from flows.step_code import PACKAGES
from tasks.runtimes import runtime_dir
from tasks.stage import Reason, Why

pytestmark = pytest.mark.fast
GRPO = REPO / "configs" / "tiny-grpo.yaml"


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A BATON_HOME of its own (planning keeps its file-digest cache there); no MLflow store needed."""
    monkeypatch.setenv("BATON_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """The project's code, its runtimes' pinned requirements, one docs page and one test, copied: what the edits below
    change."""
    root = tmp_path_factory.mktemp("tree")
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "infra" / "runtimes", root / "infra" / "runtimes")
    for page in ("docs/getting-started.md", "tests/test_config.py"):
        (root / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / page, root / page)
    return root


def _edited(path: Path):
    """Append a line to path; put the bytes back afterwards (the module's tree is shared by the tests)."""
    class Edit:
        def __enter__(self):
            self.before = path.read_bytes()
            path.write_bytes(self.before + b"\n# edited\n")

        def __exit__(self, *exc):
            path.write_bytes(self.before)
    return Edit()


def _plan(cfg, root: Path) -> dict:
    return {s.label: s for s in plan(cfg, root=root)}


def _grpo_with_reward_file(tmp_path: Path) -> tuple[Path, Path]:
    reward = tmp_path / "my_rewards.py"
    reward.write_text("def score(prompt, completion, **row):\n    return float(completion.strip() == row['answer'])\n")
    raw = yaml.safe_load(GRPO.read_text())
    raw["rlhf"]["rewards"].append({"kind": "function", "function": f"{reward}:score"})
    cfg = tmp_path / "grpo-own-reward.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    return cfg, reward


@pytest.mark.parametrize("module, first_changed", [("tasks/rlhf/rewards.py", "rlhf"),
                                                   ("tasks/rlhf/sandbox.py", "rlhf"),
                                                   ("tasks/rlhf/sandbox_child.py", "rlhf"),
                                                   ("tasks/rlhf/environment_child.py", "rlhf"),
                                                   ("conversions/sealed.py", "data")])
def test_an_edit_to_code_a_step_imports_reruns_it_and_names_the_file(tree, home, module, first_changed):
    cfg = load(GRPO)
    before = _plan(cfg, tree)
    with _edited(tree / module):
        after = _plan(cfg, tree)
    labels = list(before)
    first = labels.index(first_changed)
    assert [before[label].fingerprint == after[label].fingerprint for label in labels[:first]] == [True] * first
    assert all(before[label].fingerprint != after[label].fingerprint for label in labels[first:])
    assert changes(before[first_changed].facts, after[first_changed].facts) == [Reason(Why.CODE, (module,))]
    for label in labels[first + 1:]:  # the steps after it re-run, their input changed (sealed.py: their code too)
        assert Why.INPUT in [r.why for r in changes(before[label].facts, after[label].facts)]


def test_an_edit_to_a_docs_page_or_a_test_keeps_every_key(tree, home):
    cfg = load(GRPO)
    before = {label: s.fingerprint for label, s in _plan(cfg, tree).items()}
    with _edited(tree / "docs/getting-started.md"), _edited(tree / "tests/test_config.py"):
        assert {label: s.fingerprint for label, s in _plan(cfg, tree).items()} == before


def test_an_edit_to_the_users_reward_file_reruns_rlhf_only(tmp_path, home):
    cfg_path, reward = _grpo_with_reward_file(tmp_path)
    before = _plan(load(cfg_path), REPO)
    reward.write_text(reward.read_text().replace("==", "!="))
    after = _plan(load(cfg_path), REPO)
    assert [label for label in before if before[label].fingerprint != after[label].fingerprint] == ["rlhf"]
    assert changes(before["rlhf"].facts, after["rlhf"].facts) == [Reason(Why.FILE, ("rlhf.rewards[2].function",))]


def test_a_config_change_names_its_key(home):
    before, after = _plan(load(GRPO), REPO), _plan(load(GRPO, ["rlhf.lr=1e-4"]), REPO)
    assert changes(before["rlhf"].facts, after["rlhf"].facts) == [Reason(Why.CONFIG, ("rlhf.lr",))]


def test_the_index_remembers_the_last_facts_of_a_step_per_config(tmp_path, home):
    index, step = Index(tmp_path), _plan(load(GRPO), REPO)["rlhf"]
    assert index.last("tiny-grpo", "rlhf") is None
    index.put_last("tiny-grpo", "rlhf", step.fingerprint, step.facts)
    assert index.last("tiny-grpo", "rlhf") == {"fingerprint": step.fingerprint, "facts": step.facts}
    assert changes(index.last("tiny-grpo", "rlhf")["facts"], step.facts) == [Reason(Why.NEW)]  # nothing differs


def test_the_runner_and_the_summary_say_what_changed_since_the_last_completed_run(tree, home):
    from flows.cli.view import summary_lines
    from flows.step_cache import why_run

    cfg, index = load(GRPO), Index()
    before = _plan(cfg, tree)["rlhf"]
    index.put_last(cfg.name, "rlhf", before.fingerprint, before.facts)   # what a completed run leaves behind
    with _edited(tree / "tasks/rlhf/rewards.py"):
        after = _plan(cfg, tree)["rlhf"]
    reason = why_run(index, cfg, after, use_cache=True)
    assert reason == [{"why": "code changed", "detail": ["tasks/rlhf/rewards.py"]}]
    assert why_run(index, cfg, after, use_cache=False) == [{"why": "cache off", "detail": []}]
    (row,) = summary_lines({"stages": [{"label": "rlhf", "status": "completed", "seconds": 61, "reason": reason}]})
    assert row.rstrip().endswith("re-ran: code changed (tasks/rlhf/rewards.py)")


def test_an_engine_upgrade_reruns_the_steps_on_that_runtime_and_names_it(tree, home):
    """vLLM's hash lock changes (a new vLLM): only serve re-runs, for `engine changed (vllm)`; a new main lock (torch,
    Megatron-Core, DeepSpeed, TRL) re-runs every step (serve for its new input)."""
    cfg = load(REPO / "configs" / "tiny.yaml")
    before = _plan(cfg, tree)
    with _edited(tree / "infra" / "runtimes" / "vllm.lock"):
        after = _plan(cfg, tree)
    assert [label for label in before if before[label].fingerprint != after[label].fingerprint] == ["serve"]
    assert changes(before["serve"].facts, after["serve"].facts) == [Reason(Why.ENGINE, ("vllm",))]
    with _edited(tree / "infra" / "runtimes" / "main.lock"):
        after = _plan(cfg, tree)
    assert all(before[label].fingerprint != after[label].fingerprint for label in before)
    assert changes(before["data"].facts, after["data"].facts) == [Reason(Why.ENGINE, ("main",))]
    assert [r.why for r in changes(before["serve"].facts, after["serve"].facts)] == [Why.INPUT]  # vLLM's is the same


def test_an_interpreter_configured_for_a_runtime_reruns_its_steps(home):
    python = runtime_dir("sglang") / "bin" / "python"  # the same engine under its own path: the key cannot know that
    before = _plan(load(REPO / "configs" / "tiny.yaml"), REPO)
    after = _plan(load(REPO / "configs" / "tiny.yaml", [f"runtimes.sglang.python={python}"]), REPO)
    assert [label for label in before if before[label].fingerprint != after[label].fingerprint] == ["serve"]
    assert after["serve"].facts["engines"]["sglang"] == f"python={python}"
