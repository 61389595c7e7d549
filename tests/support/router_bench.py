"""The router service on real sockets in front of upstreams, with a client: what the router tests drive.

`router_bench()` yields a `RouterBench`: the upstreams a test starts are handed to `stop_at_close`, the
router is started with `start_router` (the service `rlfleet router serve` runs: `start_service`, on a free
port), and everything stops when the block ends. `sessions_load` runs concurrent clients through the
router for the length of a block and fails the test if one of them raised."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

import aiohttp
from aiohttp import web

from rlfleet.router import membership
from rlfleet.router.config import RouterConfig
from rlfleet.router.core import Router
from rlfleet.router.service import start_service


class Stoppable(Protocol):
    async def stop(self) -> None: ...


S = TypeVar("S", bound=Stoppable)


class RouterBench:
    """A router service, the servers behind it and a client session; `close()` stops all of them (the
    client first, the router, then the servers)."""

    def __init__(self) -> None:
        self.router: Router | None = None
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.http: aiohttp.ClientSession | None = None
        self.servers: list[Stoppable] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop_at_close(self, server: S) -> S:
        """`server` (a started upstream or engine server), stopped when the bench closes."""
        self.servers.append(server)
        return server

    async def start_router(
        self,
        config: RouterConfig,
        *,
        health_checks: bool = True,
        resolve: membership.Resolve | None = None,
        connections: int = 100,
    ) -> Router:
        """The service on `config` (port 0: a free one), and the client session (`connections`: its
        connection pool's size, 0 for no limit: load tests)."""
        self.router, self.runner, self.port = await start_service(
            config, health_checks=health_checks, resolve=resolve
        )
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections))
        return self.router

    async def close(self) -> None:
        if self.http:
            await self.http.close()
        if self.runner:
            await self.runner.cleanup()
        if self.router:
            await self.router.close()
        for server in self.servers:
            await server.stop()


@asynccontextmanager
async def router_bench() -> AsyncIterator[RouterBench]:
    bench = RouterBench()
    try:
        yield bench
    finally:
        await bench.close()


@asynccontextmanager
async def sessions_load(
    bench: RouterBench,
    clients: int,
    body: Callable[[int], dict[str, Any]],
    turns_per_session: int,
    record: Callable[[aiohttp.ClientResponse], None],
) -> AsyncIterator[None]:
    """`clients` concurrent clients posting /generate through the bench's router for the length of the
    block, each in a loop: client i posts `body(i)` with session id w<i>-t<n>, a new session every
    `turns_per_session` turns, and hands each answer (read) to `record`. At the block's end they stop and
    are awaited; one that raised fails the test (a client that died, e.g. on a ClientError when the router
    failed a request, would hide the request it lost). Record, then assert after the block: no assertion
    inside a client."""
    http = bench.http
    assert http is not None, "start the router first"
    stop = asyncio.Event()

    async def client(index: int) -> None:
        turn = 0
        while not stop.is_set():
            turn += 1
            headers = {"X-Session-Id": f"w{index}-t{turn // turns_per_session}"}
            async with http.post(bench.url + "/generate", json=body(index), headers=headers) as response:
                await response.read()
                record(response)

    tasks = [asyncio.create_task(client(index)) for index in range(clients)]
    try:
        yield
    finally:
        stop.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    crashed = [r for r in results if r is not None]
    assert crashed == [], f"{len(crashed)} load clients crashed: {crashed[:3]!r}"
