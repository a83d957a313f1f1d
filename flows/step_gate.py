"""The gate a step's output passes before it is promoted: the stage's own checks, plus finite weights and the serving
contract against the parent checkpoint. A failed gate fails the step (in a smoke run only quality checks may fail)."""
from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger

from conversions import manifest as mf, verify
from flows.chain_planner import Step
from flows.config import PipelineConfig
from flows.step_entry import StageFailed
from tasks.stage import Failure, StageOutput, Status


def with_finite_check(out: StageOutput) -> None:
    """Every gate also checks that all weights are finite, whatever the stage's own checks were."""
    if not out.output or not out.gate.get("passed") or not (Path(out.output) / mf.MANIFEST_NAME).exists():
        return
    if any(c["name"] == "weights.finite" for c in out.gate.get("checks", [])):
        return
    try:
        checks = verify.finite_weights(Path(out.output))
    except Exception as e:  # unreadable weights are not verified weights
        checks = [verify.check("weights.finite", False, f"{type(e).__name__}: {e}")]
    out.gate = verify.report(out.gate.get("checks", []) + checks, out.gate.get("seconds"))


# What a config can ask a stage to change in the serving contract: model.chat_template renders a new template, and
# the stage that writes it makes the template's end-of-turn token a stop token (tasks.chat.add_end_of_turn_stop).
END_OF_TURN = "model.chat_template: its end-of-turn token stops a reply"
STOP_FIELDS = ("stop_token_ids", "generation_config.eos_token_id")
ASKED_BY = {"chat_template_sha256": "model.chat_template", **dict.fromkeys(STOP_FIELDS, END_OF_TURN)}


def serving_contracts(output) -> tuple[dict | None, dict | None]:
    """(the parent's serving contract, the output's), from the two manifests; None where one is missing."""
    try:
        m = mf.read(Path(output)) if output else None
        parent = mf.read(Path(m["parent"]["path"])) if m and (m.get("parent") or {}).get("path") else None
    except (mf.ManifestError, OSError):
        return None, None
    return (parent or {}).get("serving"), (m or {}).get("serving")


def serving_changes(output) -> list[str]:
    """What the step's output changed in its parent's serving contract (tokenizer, chat template, special tokens,
    stop tokens, generation defaults), from the two manifests."""
    return mf.serving_changes(*serving_contracts(output))


def serving_contract_check(output, cfg: PipelineConfig) -> dict | None:
    """contract.serving: the stage kept its parent's tokenizer, chat template, special tokens, stop tokens and
    generation defaults, or changed only what its config asked for (None: no parent to compare with)."""
    m = None
    try:
        m = mf.read(Path(output)) if output else None
    except mf.ManifestError:
        pass
    if not m or not (m.get("parent") or {}).get("path"):
        return None
    before, after = serving_contracts(output)
    changed = mf.serving_changes(before, after)
    asked = [c for c in changed if _asked_for(c.split(":")[0], cfg, before, after)]
    unasked = [c for c in changed if c not in asked]
    if unasked:
        return verify.check("contract.serving", False, "changed without the config asking: " + "; ".join(unasked))
    if asked:
        return verify.check("contract.serving", True, "changed as the config asks: " + "; ".join(
            f"{c} ({ASKED_BY[c.split(':')[0]]})" for c in asked))
    return verify.check("contract.serving", True, "tokenizer, chat template, special tokens, stop tokens and "
                                                  "generation defaults as in the parent checkpoint")


def _asked_for(field: str, cfg: PipelineConfig, before: dict, after: dict) -> bool:
    if field not in ASKED_BY or cfg.model.chat_template is None:
        return False
    return field not in STOP_FIELDS or _stop_added_with_the_template(before, after)


def _stop_added_with_the_template(before: dict, after: dict) -> bool:
    """The stop tokens only grew, in the stage that gave the checkpoint its (new) chat template."""
    old, new = set(before.get("stop_token_ids") or []), set(after.get("stop_token_ids") or [])
    return old < new and after.get("chat_template_sha256") not in (None, before.get("chat_template_sha256"))


def with_serving_contract_check(out: StageOutput, cfg: PipelineConfig) -> None:
    """Every gate of a stage that derives a checkpoint also checks its serving contract against the parent's."""
    if not out.output or any(c["name"] == "contract.serving" for c in out.gate.get("checks", [])):
        return
    chk = serving_contract_check(out.output, cfg)
    if chk is not None:
        out.gate = verify.report(out.gate.get("checks", []) + [chk], out.gate.get("seconds"))


def apply_gate(out: StageOutput, step: Step, entry: dict, smoke: bool = False) -> None:
    """A failed gate fails the stage; in a smoke run only the quality checks may fail (reported)."""
    from flows.smoke import smoke_gate_passed

    logger = get_run_logger()
    for chk in out.gate.get("checks", []):
        logger.info("gate %s [%s] %s", chk["name"], "ok" if chk["passed"] else "FAIL", chk["detail"])
    if smoke and not out.gate.get("passed") and smoke_gate_passed(out.gate):
        entry["smoke_quality_not_required"] = [c["name"] for c in out.gate["checks"] if not c["passed"]]
        return
    if not out.gate.get("passed"):
        failed = [chk["name"] for chk in out.gate.get("checks", []) if not chk["passed"]]
        entry.update(status=Status.FAILED, error=f"gate failed: {', '.join(failed)}", failure=Failure.GATE)
        raise StageFailed(f"{step.label}: {entry['error']} (checkpoint not promoted)", entry)
