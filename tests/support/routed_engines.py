"""Small real aiohttp engines behind the real router, for the router tests that watch what each replica is
sent (tests/router/test_router_lora_adapters.py, test_router_slime_versions.py): the engines are the tests'
own (anything with `app()` and a `url` the fixture sets), the router is rlfleet's."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, Protocol

import aiohttp

from rlfleet.router import hashing
from rlfleet.router.config import GroupConfig, RouterConfig
from rlfleet.router.service import start_service
from support.upstreams import serving


class Served(Protocol):
    url: str

    def app(self) -> Any: ...


@asynccontextmanager
async def routed(
    groups: Mapping[str, Sequence[Served]], health_checks: bool = False, **settings: Any
) -> AsyncIterator[str]:
    """The engines served, behind the real router (`settings`: RouterConfig fields; Retry-After 0 unless
    given); yields the router's URL. Without health checks what the router knows of each replica's
    version comes from its requests alone (its /model_info reads and the answers)."""
    async with AsyncExitStack() as stack:
        for engines in groups.values():
            for e in engines:
                e.url = await stack.enter_async_context(serving(e.app(), access_log=None))
        config = RouterConfig(
            port=0,
            **{"retry_after_seconds": 0, **settings},
            groups=[GroupConfig(name=g, replicas=[e.url for e in es]) for g, es in groups.items()],
        )
        router, runner, port = await start_service(config, health_checks=health_checks)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            await runner.cleanup()
            await router.close()


def sessions_preferring(first: Served, of: Sequence[Served], count: int) -> list[str]:
    """`count` session keys whose rendezvous choice among `of` is `first` (router/table.py choose_replica)."""
    found: list[str] = []
    for i in range(10_000):
        key_h = hashing.key_hash(f"s{i}")
        if min(of, key=lambda e: hashing.race_time(key_h, hashing.member_seed(e.url), 1.0)) is first:
            found.append(f"s{i}")
            if len(found) == count:
                return found
    raise AssertionError("no such sessions")


async def post(
    http: aiohttp.ClientSession,
    url: str,
    body: bytes | dict[str, Any],
    headers: dict[str, str] | None = None,
    path: str = "/generate",
) -> tuple[int, dict[str, str], bytes]:
    """One request to the router: (status, headers, body); a dict body is sent as JSON."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    async with http.post(url + path, data=data, headers=headers or {}) as response:
        return response.status, dict(response.headers), await response.read()
