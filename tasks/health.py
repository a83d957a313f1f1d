"""The one health poll: wait until a URL answers 200, while the process behind it is still alive."""
from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Callable


class Unhealthy(RuntimeError):
    """The process died first (`exited`) or time ran out."""

    def __init__(self, message: str, exited: bool):
        super().__init__(message)
        self.exited = exited


def wait_http_ok(url: str, timeout: float, alive: Callable[[], bool] = lambda: True, interval: float = 1.0) -> float:
    """Seconds until GET url answered 200. Raises Unhealthy when `alive()` turns false or `timeout` passes."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if not alive():
            raise Unhealthy(f"the process exited before {url} answered", exited=True)
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return time.time() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(interval)
    raise Unhealthy(f"{url} did not answer within {timeout:.0f}s", exited=False)
