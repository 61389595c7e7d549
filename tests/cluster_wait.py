"""Polling for tests against the real control plane (tests/ is on sys.path under pytest; not a test file)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60.0, interval: float = 0.5) -> Any:
    """Poll `check` until it returns something truthy and return that. An exception counts as "not yet"
    (the objects may not exist yet); on timeout the last value or exception is in the message."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as exc:  # noqa: BLE001 - objects may not exist yet
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")
