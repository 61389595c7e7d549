"""The rollout driver while the fleet starts (issue 39 item 8): nothing is dropped before it can serve.

On a fresh dev cluster the trainer dropped 413 prompt groups on HTTP 404 in its first seconds, while the
router could not yet look up the groups' Services ("Temporary failure in name resolution" for ~30 s).
Both are outages now (rlfleet/retries.py): a 404 to /generate comes from an address that does not serve
it yet (every router and engine does), and a router whose groups' names cannot be looked up answers 503
saying so. The driver holds the prompt groups and probes until the fleet answers.

Real parts: the router's HTTP service (router/service.py) whose one group names a Service host, the
project's reference sampler server behind it, the sampler client and the driver in its own thread. The
only fake is the DNS answer, injected at the Router's boundary as in tests/router/test_router_membership.py:
EAI_AGAIN (what getaddrinfo raises while the cluster's DNS does not answer), then the sampler's address.
Before the router, a plain HTTP server on the router's port answers 404 to everything.

Asserted exactly: the 404s and the 503s drop no prompt group; no data position is consumed while the
circuit is open; once the fleet serves, every consumed position produced exactly one complete group."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import pytest
from aiohttp import web
from support.ports import free_port
from support.waits import wait_for
from test_trainer_rollout_outage import MODEL, copy_digit_driver, look_ahead_filled, probes_fail

from rlfleet.retries import ClientRetryPolicy
from rlfleet.router.config import GroupConfig, RouterConfig
from rlfleet.router.service import start_service
from rlfleet.sampler.client import SamplerClient, TurnFailed
from rlfleet.sampler.http_app import start_reference_server
from rlfleet.sampler.protocol import SamplingConfig
from rlfleet.sampler.reference_engine import EngineConfig, ReferenceEngine
from rlfleet.trainer.rollout.driver import PromptGroup

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py
SERVICE = "cpu-bf16.rlfleet-cpu.svc"  # the group's headless Service, as the operator writes it
FAST = ClientRetryPolicy(backoff_initial_s=0.001, backoff_max_s=0.002)


class Dns:
    """The cluster DNS as the router sees it: not answering (EAI_AGAIN) until `up`, then the pod's address."""

    def __init__(self) -> None:
        self.up = False
        self.lookups = 0

    async def __call__(self, host: str) -> list[str]:
        assert host == SERVICE
        self.lookups += 1
        if not self.up:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return ["127.0.0.1"]


class NotFound:
    """Something on the router's address that is not the router yet: 404 to every request, counted."""

    def __init__(self) -> None:
        self.posts = 0
        self.runner: web.AppRunner | None = None

    async def start(self, port: int) -> NotFound:
        async def answer(_request: web.Request) -> web.Response:
            self.posts += 1
            return web.json_response({"detail": "Not Found"}, status=404)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", answer)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        return self

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def test_a_404_is_retried_as_unavailable_with_the_transport_budget() -> None:
    """One turn against a 404: exactly 1 + max_transport_retries posts, then `unavailable` (held by the
    driver), never the final `http_404` that dropped the group."""
    port = free_port()
    server = await NotFound().start(port)
    client = SamplerClient(f"http://127.0.0.1:{port}", policy=FAST)
    try:
        with pytest.raises(TurnFailed) as failed:
            await client.generate([1, 2, 3], SamplingConfig(max_new_tokens=2), session_id="p0/0")
    finally:
        await client.aclose()
        await server.stop()
    assert (failed.value.reason, failed.value.status) == ("unavailable", 404)
    assert server.posts == failed.value.attempts == 1 + FAST.max_transport_retries == 4


async def test_a_starting_fleet_404_then_no_dns_drops_no_prompt() -> None:
    sampler = await start_reference_server(ReferenceEngine(EngineConfig(model=MODEL, seed=3)), port=0)
    sampler_port = int(sampler.url.rsplit(":", 1)[1])
    port = free_port()
    dns = Dns()
    config = RouterConfig(
        port=port,
        retry_after_seconds=0,
        health_interval_seconds=0.2,
        resolve_interval_seconds=0.05,
        groups=[GroupConfig(name="bf16", replicas=[f"http://{SERVICE}:{sampler_port}"])],
    )
    not_found = await NotFound().start(port)
    client = SamplerClient(f"http://127.0.0.1:{port}", policy=FAST)
    max_ahead = 4
    driver = copy_digit_driver(client, max_ahead)
    taken: list[PromptGroup] = []
    stop = threading.Event()
    runner = router = None

    def take(n: int) -> None:  # the trainer's side, off the event loop the servers run on
        taken.extend(driver.take(n, timeout=60, stop=stop))

    driver.start()
    try:
        # Phase 1: 404 from the router's address. The first groups fail with it and are held.
        await asyncio.to_thread(
            wait_for, "the circuit to open on 404", lambda: driver.outage is not None, interval=0.01
        )
        held_at_the_outage = driver.stats.held_groups
        await probes_fail(driver, "two failed probes")
        assert "404" in driver.outage_note()
        position = driver.next_position
        assert position == max_ahead  # the groups dispatched before the circuit opened, and no more

        # Phase 2: the router serves, but the group's Service name cannot be looked up: 503 with the reason.
        await not_found.stop()
        router, runner, _ = await start_service(config, resolve=dns)
        async with httpx.AsyncClient() as http:
            answer = await http.post(f"http://127.0.0.1:{port}/generate", json={"input_ids": [1]})
        assert answer.status_code == 503
        message = answer.json()["error"]["message"]
        assert (
            f"cannot look up {SERVICE} ([Errno {socket.EAI_AGAIN}] Temporary failure in name resolution)"
            in message
        )
        await probes_fail(driver, "two probes answered 503")
        assert "Temporary failure in name resolution" in driver.outage_note()
        assert driver.next_position == position and driver.stats.failed_groups == 0
        assert driver.stats.router_outages == 1

        # Phase 3: the DNS answers; the next probe closes the circuit and the held groups go first.
        dns.up = True
        await asyncio.to_thread(take, 6)
        assert len(taken) == 6, (driver.stats, driver.outage, driver.held_prompts)
        await look_ahead_filled(driver, max_ahead)
    finally:
        stop.set()
        driver.stop()
        if runner is not None and router is not None:
            await runner.cleanup()
            await router.close()
        else:
            await not_found.stop()
        await sampler.stop()
    assert driver.error is None and driver.outage is None and driver.held_prompts == []
    consumed = driver.next_position
    produced = sorted(g.prompt.index for g in [*taken, *driver.buffer.drain()])
    assert produced == list(range(consumed))  # none dropped, none skipped
    assert all(len(g.rollouts) == 2 and all(r.outcome is not None for r in g.rollouts) for g in taken)
    stats = driver.stats
    assert (stats.failed_groups, stats.router_outages, stats.dispatched_prompts) == (0, 1, consumed)
    # every group held was dispatched again; held: those failing when the circuit opened (1 to max_ahead, as the
    # timing goes) and at least the two failed probes of each phase
    assert (
        stats.completed_groups == consumed
        and stats.redispatched_groups == stats.held_groups >= held_at_the_outage + 4
    )
    assert dns.lookups >= 2
