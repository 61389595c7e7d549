"""SGLang 0.5.23 on SIGTERM (a scaled-down, evicted or spot-noticed sampler pod), run from its own code:
TokenizerManager's SignalHandler.sigterm_handler and sigterm_watchdog, the coroutine that drains and shuts
down. What the router and the pod's grace period rely on (docs/router.md, "Replicas that come and go"):

- the handler only marks the manager exiting (its /health and /health_generate then answer 503:
  test_contract_health_generate.py), so the router's probe takes the replica out of rotation;
- the watchdog waits while any request is held (`rid_to_state`), polling every 5 s, and only then asks
  the schedulers to shut down (ShutdownReq), kills the rest of its process tree and stops the HTTP
  server: the requests in flight are answered, never cut.

The manager is an object with the attributes the two functions read; the process-tree kill and the
scheduler listing are recorded instead of run (they would act on this test's own process), and the 5 s
poll is the recording sleep below, which ends the held request at its second poll."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest
from sglang.srt.managers import tokenizer_manager as tm_module
from sglang.srt.managers.io_struct import ShutdownReq
from sglang.srt.managers.tokenizer_manager import ServerStatus, SignalHandler, TokenizerManager


class _Manager(types.SimpleNamespace):
    """The attributes SignalHandler.sigterm_handler and TokenizerManager.sigterm_watchdog read."""


@pytest.fixture
def manager(monkeypatch: pytest.MonkeyPatch) -> tuple[_Manager, list[tuple[Any, ...]]]:
    events: list[tuple[Any, ...]] = []
    manager = _Manager(
        gracefully_exit=False,
        rid_to_state={"held-request": object()},
        server_status=ServerStatus.Up,
        _subprocess_watchdog=None,
        asyncio_tasks=set(),
    )
    manager._dispatch_to_scheduler = lambda obj: events.append(("dispatch", type(obj)))
    manager._server_stop_hook = lambda: events.append(("server stopped",))
    manager.force_exit_handler = lambda: events.append(("force exit",))
    real_sleep = asyncio.sleep

    async def recorded_sleep(seconds: float) -> None:
        events.append(("sleep", seconds, manager.gracefully_exit, len(manager.rid_to_state)))
        if manager.gracefully_exit and sum(e[0] == "sleep" and e[2] for e in events) == 2:
            manager.rid_to_state.clear()  # the held request is answered during the second drain poll
        await real_sleep(0)

    monkeypatch.setattr(
        tm_module, "asyncio", types.SimpleNamespace(sleep=recorded_sleep, current_task=asyncio.current_task)
    )
    monkeypatch.setattr(tm_module, "collect_scheduler_processes", lambda: [])
    monkeypatch.setattr(
        tm_module,
        "kill_process_tree",
        lambda pid, include_parent=True, **kw: events.append(("kill tree", include_parent)),
    )
    return manager, events


async def test_sigterm_drains_every_held_request_before_sglang_shuts_down(manager) -> None:
    manager, events = manager
    watchdog = asyncio.ensure_future(TokenizerManager.sigterm_watchdog(manager))
    while not events:  # the watchdog polls before any signal
        await asyncio.sleep(0)
    SignalHandler(manager).sigterm_handler()  # what the event loop runs on SIGTERM
    assert manager.gracefully_exit is True  # /health, /health_generate: 503 from here on
    await asyncio.wait_for(watchdog, timeout=10)
    drain = [e for e in events if e[0] != "sleep" or e[2]]  # from the signal on
    assert drain == [
        ("sleep", 5, True, 1),  # one request held: it waits
        ("sleep", 5, True, 1),  # still held; answered during this poll
        ("dispatch", ShutdownReq),  # none left: the schedulers are asked to shut down
        ("kill tree", False),  # what is left of its children, never itself
        ("server stopped",),
    ], events
    assert all(e[1] == 5 for e in events if e[0] == "sleep")  # SGLang's 5 s poll, within the pod's 60 s grace


async def test_sigterm_on_an_unhealthy_engine_exits_without_draining(manager) -> None:
    """The one case that does not wait: a failed health check (the engine cannot answer what it holds)."""
    manager, events = manager
    manager.server_status = ServerStatus.UnHealthy
    manager.dump_requests_before_crash = lambda: events.append(("dump",))
    watchdog = asyncio.ensure_future(TokenizerManager.sigterm_watchdog(manager))
    while not events:
        await asyncio.sleep(0)
    SignalHandler(manager).sigterm_handler()
    await asyncio.wait_for(watchdog, timeout=10)
    after = [e for e in events if e[0] != "sleep" or e[2]]
    assert after == [
        ("dump",),
        ("force exit",),
        ("dispatch", ShutdownReq),
        ("kill tree", False),
        ("server stopped",),
    ]
    assert manager.rid_to_state  # the held request was not waited for
