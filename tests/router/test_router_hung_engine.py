"""A real engine that hangs while /health answers: the project's reference sampler (tiny Qwen3 on CPU)
paused in place (`POST /pause_generation {"mode": "in_place"}`: its scheduler stops, its HTTP server
keeps answering), behind the router (docs/router.md, "Hung replicas"). Also the reference sampler's
side of the contract: /health_generate as SGLang 0.5.23 answers it, and JSON nested too deep is a 400."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import aiohttp
import pytest
from support import waits
from support.router_bench import RouterBench, router_bench
from support.tiny_models import SERVED_MODEL

from rlfleet.router import hashing
from rlfleet.router.config import GroupConfig, RouterConfig
from rlfleet.sampler.http_app import RunningServer
from rlfleet.sampler.reference_engine import EngineConfig, ReferenceEngine, tiny_shape
from rlfleet.sampler.server import start_reference_server

MODEL = tiny_shape(**SERVED_MODEL)
BOUND_S = 60.0

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


eventually = partial(waits.eventually, bound_s=BOUND_S)


@asynccontextmanager
async def two_engines_behind_a_router(
    **timeouts: Any,
) -> AsyncIterator[tuple[RouterBench, list[RunningServer]]]:
    """Two reference samplers (seeds 1 and 2) as the replicas of group g behind the router service, its
    health probes every 0.2 s with `timeouts` (RouterConfig fields)."""
    async with router_bench() as bench:
        servers = [
            bench.stop_at_close(
                await start_reference_server(ReferenceEngine(EngineConfig(model=MODEL, seed=s)))
            )
            for s in (1, 2)
        ]
        await bench.start_router(
            RouterConfig(
                port=0,
                groups=[GroupConfig(name="g", replicas=[s.url for s in servers])],
                health_interval_seconds=0.2,
                **timeouts,
            )
        )
        yield bench, servers


async def test_a_paused_engine_is_ejected_its_requests_move_and_it_returns_when_it_generates() -> None:
    async with two_engines_behind_a_router(
        health_timeout_seconds=2.0, request_timeout_seconds=2.0, hung_after_seconds=2.0
    ) as (bench, servers):
        hung, other = servers
        router, http = bench.router, bench.http
        assert router is not None and http is not None
        group = router.table.groups["g"]
        sessions = [f"s{i}" for i in range(200)]
        on_hung = [
            s
            for s in sessions
            if router.table.choose_replica(group, hashing.key_hash(s), set(), None, 99, False).url == hung.url
        ]

        async def generate(session: str) -> tuple[int, str]:
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 1.0}}
            async with http.post(bench.url + "/generate", json=body, headers={"X-Session-Id": session}) as r:
                await r.read()
                return r.status, r.headers.get("X-RLFleet-Replica", "")

        async with http.post(hung.url + "/pause_generation", json={"mode": "in_place"}) as r:
            assert r.status == 200
        # Right away, before any probe has failed: sessions of the hung replica post there, hang, move.
        answers = await asyncio.wait_for(asyncio.gather(*(generate(s) for s in on_hung[:10])), BOUND_S)
        assert answers == [(200, other.url)] * 10
        async with http.get(hung.url + "/health") as r:
            assert r.status == 200  # what a /health readiness would have kept routing to
        assert not group.replicas[hung.url].healthy
        assert hung.engine.waiting or hung.engine.running  # the posts that reached it, still queued ...
        await eventually(lambda: _all_cancelled(hung.engine), "... are cancelled (their connections closed)")

        async with http.post(hung.url + "/continue_generation") as r:
            assert r.status == 200

        async def back() -> bool:
            return group.replicas[hung.url].healthy

        await eventually(back, "the replica is routable again once it generates")
        assert await generate(on_hung[0]) == (200, hung.url)  # its sessions come back


async def test_an_engine_paused_shorter_than_hung_after_keeps_its_request() -> None:
    """A pause like a weight load (update_weights_from_disk blocks SGLang's scheduler): its probes fail,
    so the replica takes no new request, but the request in flight on it is not moved (not run twice)
    and is answered there once the engine generates again."""
    async with two_engines_behind_a_router(
        health_timeout_seconds=0.5,
        failure_threshold=1,
        request_timeout_seconds=0.5,
        hung_after_seconds=BOUND_S,
    ) as (bench, servers):
        router, http = bench.router, bench.http
        assert router is not None and http is not None
        paused, _ = servers
        group = router.table.groups["g"]
        session = next(
            f"s{i}"
            for i in range(200)
            if router.table.choose_replica(group, hashing.key_hash(f"s{i}"), set(), None, 2, False).url
            == paused.url
        )
        async with http.post(paused.url + "/pause_generation", json={"mode": "in_place"}) as r:
            assert r.status == 200
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
        answer = asyncio.ensure_future(
            http.post(bench.url + "/generate", json=body, headers={"X-Session-Id": session})
        )

        async def out() -> bool:
            return not group.replicas[paused.url].healthy and bool(paused.engine.waiting)

        await eventually(out, "the paused replica is out for new requests, its request still queued there")
        assert not answer.done()
        async with http.post(paused.url + "/continue_generation") as r:
            assert r.status == 200
        response = await asyncio.wait_for(answer, BOUND_S)
        assert response.status == 200
        assert response.headers["X-RLFleet-Replica"] == paused.url
        assert response.headers["X-RLFleet-Attempts"] == "1"
        response.release()


async def _all_cancelled(engine: ReferenceEngine) -> bool:
    return all(req.cancelled for req in [*engine.waiting, *engine.running])


async def test_reference_health_generate_answers_as_sglang(monkeypatch) -> None:
    """SGLang 0.5.23 http_server.health_generate: 200 once one token is generated, 503 after
    SGLANG_HEALTH_CHECK_TIMEOUT seconds without, empty bodies both."""
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")
    server = await start_reference_server(ReferenceEngine(EngineConfig(model=MODEL, seed=1)))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(server.url + "/health_generate") as r:
                assert (r.status, await r.read()) == (200, b"")
            server.engine.pause()
            async with http.get(server.url + "/health_generate") as r:
                assert (r.status, await r.read()) == (503, b"")
            async with http.get(server.url + "/health") as r:
                assert r.status == 200
            server.engine.resume()
            async with http.get(server.url + "/health_generate") as r:
                assert r.status == 200
    finally:
        await server.stop()


async def test_reference_sampler_answers_json_nested_too_deep_with_a_400() -> None:
    server = await start_reference_server(ReferenceEngine(EngineConfig(model=MODEL, seed=1)))
    depth = 100_000
    try:
        async with aiohttp.ClientSession() as http:
            body = b'{"input_ids": ' + b"[" * depth + b"]" * depth + b"}"
            async with http.post(
                server.url + "/generate", data=body, headers={"Content-Type": "application/json"}
            ) as r:
                assert r.status == 400
                assert "nested too deeply" in await r.text()
    finally:
        await server.stop()
