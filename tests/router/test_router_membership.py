"""The router's membership over real HTTP (router/membership.py): a group's replica URL names a host, as the
operator's headless Service does, and the router looks it up itself. The lookup is the only fake: a
function injected at the Router's boundary, answering as the cluster's DNS would (the ready pods'
addresses). The router service, its upstreams (real aiohttp servers, one per loopback
address on one shared port, as a Service's pods share its port) and the connections between them are real."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from support.router_bench import RouterBench
from support.upstreams import InProcessUpstream, UpstreamState

from rlfleet.router import membership
from rlfleet.router.config import GroupConfig, RouterConfig
from rlfleet.router.core import Router

SERVICE = "j-g.team-a.svc"
ADDRESSES = ("127.0.0.1", "127.0.0.2")


class Lookups:
    """The DNS answer for the Service, set by the test: its addresses, or the error getaddrinfo raises."""

    def __init__(self, *addresses: str) -> None:
        self.answer: tuple[str, ...] | OSError = addresses
        self.hosts: list[str] = []

    async def __call__(self, host: str) -> list[str]:
        self.hosts.append(host)
        if isinstance(self.answer, OSError):
            raise self.answer
        return list(self.answer)


class Fleet(RouterBench):
    """Two upstreams on one port (the Service's pods) and a router service whose group names the Service."""

    def __init__(self) -> None:
        super().__init__()
        self.upstreams: list[InProcessUpstream] = []

    async def start(self, lookups: Lookups, **config: Any) -> Fleet:
        first = self.stop_at_close(await InProcessUpstream(UpstreamState("pod-0"), ADDRESSES[0]).start())
        self.upstreams = [first] + [
            self.stop_at_close(await InProcessUpstream(UpstreamState(f"pod-{i}"), host).start(first.port))
            for i, host in enumerate(ADDRESSES[1:], start=1)
        ]
        group = GroupConfig(name="g", replicas=[f"http://{SERVICE}:{first.port}"])
        await self.start_router(
            RouterConfig(port=0, groups=[group], **config), health_checks=False, resolve=lookups
        )
        return self

    def url_of(self, address: str) -> str:
        return f"http://{address}:{self.upstreams[0].port}"

    async def replica_of(self, session: str) -> str:
        """The replica that answered one request of the session (its upstream says who it is, too)."""
        assert self.http is not None
        async with self.http.post(
            self.url + "/generate", json={"input_ids": [1, 2]}, headers={"X-Session-Id": session}
        ) as response:
            body = await response.json()
            assert response.status == 200, body
            replica = response.headers["X-RLFleet-Replica"]
        pod = body["meta_info"]["upstream"]
        assert (
            replica == self.upstreams[int(pod.split("-")[1])].url
        )  # the address named is the pod that answered
        return replica


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = Fleet()
    yield f
    await f.close()


SESSIONS = [f"episode-{i}" for i in range(40)]


async def test_a_service_name_is_routed_to_each_address_it_resolves_to_and_follows_the_answer(
    fleet: Fleet,
) -> None:
    lookups = Lookups(*ADDRESSES)
    await fleet.start(lookups, resolve_interval_seconds=3600)  # the test looks up again itself
    both = {fleet.url_of(a) for a in ADDRESSES}
    first = {s: await fleet.replica_of(s) for s in SESSIONS}
    assert set(first.values()) == both  # sessions spread over the two pods, none to the name itself
    assert {s: await fleet.replica_of(s) for s in SESSIONS} == first  # and each stays on its pod

    lookups.answer = ADDRESSES[1:]  # pod-0 is no longer ready
    await fleet.router.resolve_replicas()
    assert {await fleet.replica_of(s) for s in SESSIONS} == {fleet.url_of(ADDRESSES[1])}
    assert list(fleet.router.table.groups["g"].replicas) == [fleet.url_of(ADDRESSES[1])]

    lookups.answer = ADDRESSES  # ready again: each session is back on its own pod (prefix cache)
    await fleet.router.resolve_replicas()
    assert {s: await fleet.replica_of(s) for s in SESSIONS} == first
    assert set(lookups.hosts) == {SERVICE}


async def test_a_name_without_an_address_empties_the_group_and_a_failed_lookup_keeps_it(fleet: Fleet) -> None:
    lookups = Lookups(*ADDRESSES)
    await fleet.start(lookups, resolve_interval_seconds=3600)
    both = [fleet.url_of(a) for a in ADDRESSES]
    lookups.answer = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    await fleet.router.resolve_replicas()
    assert list(fleet.router.table.groups["g"].replicas) == both
    assert {await fleet.replica_of(s) for s in SESSIONS} == set(both)

    lookups.answer = socket.gaierror(socket.EAI_NONAME, "Name or service not known")  # no ready pod
    await fleet.router.resolve_replicas()
    assert list(fleet.router.table.groups["g"].replicas) == []
    async with fleet.http.post(fleet.url + "/generate", json={"input_ids": [1]}) as response:
        assert response.status == 503 and response.headers["Retry-After"] == "1"


async def test_a_request_in_flight_on_a_replica_that_leaves_finishes_there(fleet: Fleet) -> None:
    lookups = Lookups(*ADDRESSES)
    await fleet.start(lookups, resolve_interval_seconds=3600)
    leaving = fleet.url_of(ADDRESSES[1])
    first = {s: await fleet.replica_of(s) for s in SESSIONS}
    session = next(s for s, replica in first.items() if replica == leaving)
    for upstream in fleet.upstreams:
        upstream.state.sessions.clear()
    fleet.upstreams[1].state.tokens_per_second = 20.0  # 16 tokens: the next request takes 0.8 s
    in_flight = asyncio.create_task(fleet.replica_of(session))
    while not fleet.upstreams[1].state.sessions:  # the request reached the leaving pod
        await asyncio.sleep(0.01)
    lookups.answer = ADDRESSES[:1]
    await fleet.router.resolve_replicas()
    assert list(fleet.router.table.groups["g"].replicas) == [fleet.url_of(ADDRESSES[0])]
    assert await in_flight == leaving  # answered by the pod it was sent to, not failed or resent
    assert fleet.upstreams[1].state.sessions == [session] and fleet.upstreams[0].state.sessions == []
    assert await fleet.replica_of(session) == fleet.url_of(ADDRESSES[0])  # the session's next request moved


async def test_the_router_looks_the_name_up_again_every_interval(fleet: Fleet) -> None:
    lookups = Lookups(*ADDRESSES)
    await fleet.start(lookups, resolve_interval_seconds=0.05)
    lookups.answer = ADDRESSES[1:]
    seen = len(lookups.hosts)
    async with asyncio.timeout(10):
        while len(lookups.hosts) < seen + 2:  # a whole lookup round after the change has set the table
            await asyncio.sleep(0.01)
    assert {await fleet.replica_of(s) for s in SESSIONS} == {fleet.url_of(ADDRESSES[1])}


async def test_an_ip_literal_is_one_replica_and_never_looked_up() -> None:
    """Local mode's config (http://127.0.0.1:<port>) is routed as it is."""
    upstream = await InProcessUpstream(UpstreamState("local")).start()
    lookups = Lookups()
    router = Router(RouterConfig(groups=[GroupConfig(name="g", replicas=[upstream.url])]), resolve=lookups)
    try:
        await router.start(health_checks=False)
        result = await router.route("/generate", b'{"input_ids": [1]}', "s")
        assert (result.status, result.replica) == (200, upstream.url)
        assert lookups.hosts == [] and router._resolve_task is None
    finally:
        await router.close()
        await upstream.stop()


async def test_the_event_loops_resolver_answers_for_a_real_name() -> None:
    """The default lookup (no fake): localhost's addresses, each a replica; the IPv4 one answers."""
    upstream = await InProcessUpstream(UpstreamState("local")).start()
    router = Router(
        RouterConfig(groups=[GroupConfig(name="g", replicas=[f"http://localhost:{upstream.port}"])])
    )
    try:
        await router.start(health_checks=False)
        assert upstream.url in router.table.groups["g"].replicas
        result = await router.route("/generate", b'{"input_ids": [1]}', "s")
        assert result.status == 200 and result.replica == upstream.url
    finally:
        await router.close()
        await upstream.stop()


def test_replica_urls_of_a_name_and_which_urls_are_names() -> None:
    assert membership.replica_urls("http://svc:30000", ["10.0.0.2", "10.0.0.1", "10.0.0.2", "fd00::1"]) == [
        "http://10.0.0.1:30000",
        "http://10.0.0.2:30000",
        "http://[fd00::1]:30000",
    ]
    assert [
        membership.name_of(u)
        for u in ("http://svc.ns.svc:1", "http://127.0.0.1:1", "http://[::1]:1", "https://svc.example:443")
    ] == ["svc.ns.svc", None, None, None]
