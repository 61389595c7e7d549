"""Waiting, bounded, until a condition holds: the tests' one poll (blocking) and its asyncio twin.

Never a bare sleep: each waits on what the test observes and fails naming what it waited for."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any


def wait_for(
    what: str,
    check: Callable[[], Any],
    timeout: float = 60.0,
    interval: float = 0.5,
    running: Sequence[subprocess.Popen] = (),
) -> Any:
    """Poll `check` until it returns something truthy and return that.

    An exception counts as "not yet" (the objects may not exist yet, the server may not listen yet; an
    AssertionError too: the cluster and node tests assert inside their checks what must eventually hold).
    A process of `running` that exited ends the wait at once, with its output. On timeout the last value
    or exception is in the message."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        for proc in running:
            if proc.poll() is not None:
                raise AssertionError(f"{what}: {proc.args!r} exited {proc.returncode}:\n{_output_tail(proc)}")
        try:
            last = check()
        except Exception as exc:  # noqa: BLE001 - not yet
            last = exc
        if last and not isinstance(last, Exception):
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


def _output_tail(proc: subprocess.Popen, chars: int = 3000) -> str:
    """The end of what an exited process wrote to its stdout pipe ("" when it has none)."""
    if proc.stdout is None:
        return ""
    out = proc.stdout.read()
    return (out.decode(errors="replace") if isinstance(out, bytes) else out)[-chars:]


async def eventually(condition: Callable[[], bool | Awaitable[bool]], what: str, bound_s: float) -> None:
    """Wait (at most `bound_s`) until `condition()` holds: a bool, or an awaitable of one; fail naming
    `what` otherwise. The event loop runs meanwhile (the servers under test live in it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if loop.time() > deadline:
            raise AssertionError(f"not within {bound_s} s: {what}")
        await asyncio.sleep(0.02)
