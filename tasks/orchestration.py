"""The Prefect server as something a run can lose (the stack stopped, its host gone): Prefect's client retries are
bounded, and once a call finds the server gone the run goes on without it. The steps run as plain calls instead of
subflows, nothing more is sent there (no retries, no logs), and what the server never got is listed in the run
folder (summary.json: ORCHESTRATION_LOST), like tasks/tracking.py's MISSING for MLflow.

No Prefect import at module level: flows/cli sets CLIENT_DEFAULTS before Prefect reads its settings.
"""
from __future__ import annotations

import logging
import os

ORCHESTRATION_LOST = "orchestration_lost"  # summary.json (the run and each step): what the Prefect server never got
STAGE_SUBFLOW = "the stage's subflow"  # it could not start: the step ran as a plain call
STAGE_SUBFLOW_END = "the end of the stage's subflow"  # the step ran in it, its final state never arrived
RUN_END = ["the run's end", "the summary artifact"]  # the pipeline flow run's final state and its summary artifact

# Prefect's default (5 retries, backoff 2, 4, ... 32 s) holds every call to a gone server over a minute, and a stage
# subflow's end makes two. 2 retries ride out a blip (a reset connection, a 503) in about 6 s; the environment wins.
CLIENT_DEFAULTS = {"PREFECT_CLIENT_MAX_RETRIES": "2"}

OUTAGE_STATUS = (502, 503, 504)  # the server (or a proxy before it) is there but cannot answer

_lost: list[str] = []  # what this process found the server gone at, in order
_retries_before: list[int] = []  # Prefect's client retries before the loss (reset() puts them back)


def set_client_defaults() -> None:
    """Before Prefect is imported (it reads its settings once)."""
    for key, value in CLIENT_DEFAULTS.items():
        os.environ.setdefault(key, value)


def api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or "Prefect's temporary server"


def is_outage(e: BaseException) -> bool:
    """The Prefect server could not be reached or could not answer (by the exception's type and HTTP status, never its
    text): a refused, reset or timed-out connection, or a 502/503/504 after Prefect's own retries."""
    import httpx

    if isinstance(e, httpx.TransportError):
        return True
    return isinstance(e, httpx.HTTPStatusError) and e.response.status_code in OUTAGE_STATUS


def lost() -> bool:
    return bool(_lost)


def mark_lost(what: str, error: BaseException) -> None:
    """The server is gone: from now on this process sends it nothing it can go without. Calls Prefect still makes
    (a flow run's end) are not retried, and the run's logs stay local (run.log, each step's log), not queued for a
    server that will not take them."""
    first = not _lost
    _lost.append(what)
    if not first:
        return
    from prefect.context import get_settings_context

    client_settings = get_settings_context().settings.client  # what Prefect's clients read at each call
    _retries_before[:] = [client_settings.max_retries]
    client_settings.max_retries = 0
    _keep_logs_local()
    _drop_new_events()
    logging.getLogger("baton.orchestration").warning("Prefect server %s unreachable (%s) at %s; the run goes on "
                                                     "without it", api_url(), type(error).__name__, what)


class _NotToTheServer(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def _api_log_handlers() -> set:
    from prefect.logging.handlers import APILogHandler

    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    return {h for lg in loggers for h in lg.handlers if isinstance(h, APILogHandler)}


def _keep_logs_local() -> None:
    for handler in _api_log_handlers():
        handler.addFilter(_NotToTheServer())


def _drop_new_events() -> None:
    """Prefect's events client tries each event ten times (seconds each) against a gone server."""
    from prefect.events.clients import NullEventsClient
    from prefect.events.worker import EventsWorker

    EventsWorker.set_client_override(NullEventsClient)


def reset() -> None:
    """A new run in this process (a test runs several) starts with the server counted as there."""
    if not _lost:
        return
    from prefect.context import get_settings_context
    from prefect.events.worker import EventsWorker

    _lost.clear()
    get_settings_context().settings.client.max_retries = _retries_before[0]
    EventsWorker.set_client_override(None)
    for handler in _api_log_handlers():
        for f in [f for f in handler.filters if isinstance(f, _NotToTheServer)]:
            handler.removeFilter(f)

