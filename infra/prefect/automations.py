"""Create (or update) the stack's automations on the Prefect server at PREFECT_API_URL. Run by `make up`.

"Crash zombie flows" (the recipe in Prefect's docs, "detect zombie flows"): a flow run that stopped sending heartbeats
(its machine died, its process was SIGKILLed) without reaching a terminal state is marked Crashed, so the UI never
shows it Running forever. Runs send a heartbeat every PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds (the stack's worker
sets 30); the trigger fires after ZOMBIE_AFTER_S seconds without one.
"""
from __future__ import annotations

import os
from datetime import timedelta

from prefect.automations import Automation
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification

ZOMBIE_NAME = "Crash zombie flows"
ZOMBIE_AFTER_S = int(os.environ.get("BATON_ZOMBIE_AFTER_S", 90))


def crash_zombie_flows() -> Automation:
    return Automation(
        name=ZOMBIE_NAME,
        description="Mark flow runs Crashed when their heartbeats stop before a terminal state.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                    "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=ZOMBIE_AFTER_S),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message="Flow run marked as crashed due to missing heartbeats.")],
    )


def ensure(automation: Automation) -> str:
    try:
        existing = Automation.read(name=automation.name)
    except ValueError:  # not found
        existing = None
    if existing is None:
        return f"created {automation.create().name}"
    automation.id = existing.id
    automation.update()
    return f"updated {automation.name}"


if __name__ == "__main__":
    print(f"[automations] {ensure(crash_zombie_flows())}")
