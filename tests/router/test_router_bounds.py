"""The router bounded against its peers (issue 32, item 6; docs/router.md, "Hung replicas" and "Bounds"),
over real sockets on 127.0.0.1: a replica whose engine hangs while /health answers is ejected by the
generation probe and its requests succeed elsewhere, cancelled upstream (not run twice); a slow but
generating replica keeps its request; a client that disconnects cancels its upstream request; an oversize
body is a 413; bodies over the byte budget wait and then get a 503; a body or a header that does not
arrive in time ends its connection; connections beyond the cap read EOF at once (a source's beyond
its own cap always; beyond the total cap the oldest idle one is closed instead, if any); JSON nested too
deep is a 400. Upstreams are real aiohttp servers (tests/support/upstreams.py); a hung one accepts and never answers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from functools import partial

import aiohttp
import pytest
from support import waits
from support.router_bench import RouterBench
from support.upstreams import InProcessUpstream, UpstreamState

from rlfleet.router import hashing
from rlfleet.router.bounds import BoundedTCPSite, _awaits_request_headers
from rlfleet.router.config import GroupConfig, RouterConfig
from rlfleet.router.service import BUDGET_KEY

BOUND_S = 30.0  # the longest any condition below may take to come true before the test fails


eventually = partial(waits.eventually, bound_s=BOUND_S)


class Bench(RouterBench):
    """A router service in front of named in-process upstreams (one group, g), and an HTTP client."""

    def __init__(self) -> None:
        super().__init__()
        self.upstreams: dict[str, InProcessUpstream] = {}

    async def start(self, states: list[UpstreamState], health_checks: bool = False, **config) -> Bench:
        for state in states:
            self.upstreams[state.name] = self.stop_at_close(await InProcessUpstream(state).start())
        router_config = RouterConfig(
            port=0,
            groups=[GroupConfig(name="g", replicas=[u.url for u in self.upstreams.values()])],
            **config,
        )
        await self.start_router(router_config, health_checks=health_checks, connections=0)
        return self

    def state(self, name: str) -> UpstreamState:
        return self.upstreams[name].state

    async def generate(self, session: str, **sampling) -> tuple[int, dict[str, str], bytes]:
        payload = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, **sampling}}
        async with self.http.post(
            self.url + "/generate", json=payload, headers={"X-Session-Id": session}
        ) as response:
            return response.status, dict(response.headers), await response.read()

    async def raw(
        self, request: bytes, source: str = "127.0.0.1"
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection from `source` (any 127.0.0.0/8 address: Linux routes them all to loopback)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port, local_addr=(source, 0))
        writer.write(request)
        await writer.drain()
        return reader, writer


@pytest.fixture
async def bench() -> AsyncIterator[Bench]:
    made = Bench()
    yield made
    await made.close()


def refused(bench: Bench, reason: str | None = None, connections: str | None = None) -> float | None:
    """The router's count of requests refused for `reason` (or of connections refused at a cap)."""
    if connections is not None:
        return bench.router.metrics.registry.get_sample_value(
            "rlfleet_router_refused_connections_total", {"reason": connections}
        )
    return bench.router.metrics.registry.get_sample_value(
        "rlfleet_router_refused_requests_total", {"reason": reason}
    )


def closed_idle(bench: Bench) -> float | None:
    """The router's count of idle connections it closed to admit another at the total cap."""
    return bench.router.metrics.registry.get_sample_value("rlfleet_router_closed_idle_connections_total")


def site_of(bench: Bench) -> BoundedTCPSite:
    (site,) = bench.runner.sites
    return site


def idle(gate) -> bool:
    """Whether the router counts a held connection as waiting for its request header."""
    return _awaits_request_headers(gate.handler)


def held_ports(bench: Bench) -> list[int]:
    """The client ports of the connections the router holds, the oldest first."""
    return [gate.handler.transport.get_extra_info("peername")[1] for gate in site_of(bench).admitted]


def port_of(writer: asyncio.StreamWriter) -> int:
    return writer.get_extra_info("sockname")[1]


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The status and body of one HTTP/1.1 response whose connection then closes (bounded)."""
    data = await asyncio.wait_for(reader.read(), BOUND_S)
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def headers_of(path: str, length: int | None, chunked: bool = False) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: router", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


# --- hung replicas ------------------------------------------------------------------------------


async def test_a_replica_whose_generation_hangs_is_ejected_and_its_requests_succeed_elsewhere(bench) -> None:
    """/health answers on the hung replica; its /generate and /health_generate never do. Sessions that
    land on it are cancelled there (their connection closed: not left running) and answered by the other."""
    await bench.start(
        [UpstreamState("hung", hung=True), UpstreamState("ok")],
        health_checks=True,
        health_interval_seconds=0.2,
        health_timeout_seconds=0.5,
        request_timeout_seconds=1.0,
        hung_after_seconds=1.0,
    )
    answers = await asyncio.wait_for(
        asyncio.gather(*(bench.generate(f"s{i}") for i in range(40))), 2 * BOUND_S
    )
    assert [status for status, _, _ in answers] == [200] * 40
    assert {headers["X-RLFleet-Replica"] for _, headers, _ in answers} == {bench.upstreams["ok"].url}
    hung = bench.state("hung")
    await eventually(
        lambda: hung.cancelled == hung.started, "every request the hung replica got is cancelled there"
    )
    replicas = {r.url: r for r in bench.router.table.groups["g"].replicas.values()}
    assert not replicas[bench.upstreams["hung"].url].healthy
    assert replicas[bench.upstreams["hung"].url].inflight == 0
    assert (
        bench.router.metrics.registry.get_sample_value(
            "rlfleet_router_upstream_errors_total", {"group": "g", "kind": "hung"}
        )
        == hung.started
    )


async def test_a_request_past_its_timeout_moves_when_its_replica_stops_generating(bench) -> None:
    """No periodic probe: the request's own timeouts probe the replica until its probes have been silent
    for hungAfterSeconds, then the request moves."""
    await bench.start(
        [UpstreamState("hung", hung=True), UpstreamState("ok")],
        health_timeout_seconds=0.5,
        request_timeout_seconds=0.5,
        hung_after_seconds=1.0,
    )
    hung_url = bench.upstreams["hung"].url
    sessions = [f"s{i}" for i in range(64)]
    group = bench.router.table.groups["g"]
    session = next(
        s
        for s in sessions
        if bench.router.table.choose_replica(group, hashing.key_hash(s), set(), None, 2, False).url
        == hung_url
    )
    status, headers, _ = await asyncio.wait_for(bench.generate(session), BOUND_S)
    assert status == 200
    assert headers["X-RLFleet-Replica"] == bench.upstreams["ok"].url
    assert headers["X-RLFleet-Attempts"] == "2"
    await eventually(
        lambda: bench.state("hung").cancelled == 1, "the hung replica's request is cancelled there"
    )


@pytest.mark.parametrize("probe_status", [200, 503])
async def test_a_slow_replica_that_still_generates_keeps_its_request(bench, probe_status: int) -> None:
    """Past requestTimeoutSeconds the replica is probed and answers (200: generating; 503: starting or
    draining, whose requests in flight finish): the request stays, one post in all."""
    await bench.start(
        [
            UpstreamState("slow", tokens_per_second=20.0, probe_status=probe_status),
            UpstreamState("other", tokens_per_second=20.0, probe_status=probe_status),
        ],
        request_timeout_seconds=0.2,
    )
    status, headers, _ = await asyncio.wait_for(
        bench.generate("s", max_new_tokens=20), BOUND_S
    )  # ~1 s of work
    assert status == 200
    replica = headers["X-RLFleet-Replica"]
    assert headers["X-RLFleet-Attempts"] == "1"
    served = next(u.state for u in bench.upstreams.values() if u.url == replica)
    assert served.started == 1 and served.cancelled == 0
    assert sum(u.state.started for u in bench.upstreams.values()) == 1  # never posted twice


async def test_a_client_that_disconnects_cancels_its_upstream_request(bench) -> None:
    await bench.start([UpstreamState("hung", hung=True)], request_timeout_seconds=None)
    body = json.dumps({"input_ids": [1], "sampling_params": {}}).encode()
    _, writer = await bench.raw(headers_of("/generate", len(body)) + body)
    hung = bench.state("hung")
    await eventually(lambda: hung.started == 1, "the request reached the replica")
    writer.close()
    await eventually(lambda: hung.cancelled == 1, "the upstream request is cancelled after the client left")
    replica = next(iter(bench.router.table.groups["g"].replicas.values()))
    await eventually(lambda: replica.inflight == 0, "the replica's in-flight count is released")


async def test_a_stream_whose_replica_hangs_after_its_first_bytes_ends(bench) -> None:
    """What went out cannot be retried: once the replica is found hung the stream ends, without its
    `[DONE]`, and the replica's request is cancelled there."""
    await bench.start(
        [UpstreamState("stalls", stall_stream=True)],
        health_checks=True,
        health_interval_seconds=0.2,
        health_timeout_seconds=0.3,
        hung_after_seconds=0.5,
    )
    payload = {"input_ids": [1], "sampling_params": {}, "stream": True}
    async with bench.http.post(bench.url + "/generate", json=payload) as response:
        assert response.status == 200
        first = await asyncio.wait_for(response.content.readline(), BOUND_S)
        assert first.startswith(b"data: ")
        rest = await asyncio.wait_for(response.content.read(), BOUND_S)  # returns: the stream ended
        assert b"[DONE]" not in rest  # ... without SGLang's terminator: the client knows it is cut
    await eventually(
        lambda: bench.state("stalls").cancelled == 1, "the stalled stream is cancelled at the replica"
    )


# --- bodies -------------------------------------------------------------------------------------


async def test_a_body_over_the_limit_is_a_413_without_being_read(bench) -> None:
    await bench.start([UpstreamState("ok")], max_body_bytes=64 * 1024)
    reader, _ = await bench.raw(headers_of("/generate", 200 * 1024 * 1024))  # announced, never sent
    status, body = await read_response(reader)
    assert status == 413
    assert "maxBodyBytes (65536 bytes)" in json.loads(body)["error"]["message"]
    assert bench.state("ok").started == 0
    assert refused(bench, "body_too_large") == 1


async def test_a_chunked_body_that_grows_over_the_limit_is_a_413(bench) -> None:
    await bench.start([UpstreamState("ok")], max_body_bytes=64 * 1024)
    chunk = b"[" * (48 * 1024)
    framed = b"".join(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" for _ in range(2)) + b"0\r\n\r\n"
    reader, _ = await bench.raw(headers_of("/generate", None, chunked=True) + framed)
    status, _ = await read_response(reader)
    assert status == 413
    assert bench.state("ok").started == 0
    assert refused(bench, "body_too_large") == 1


async def test_bodies_over_the_byte_budget_wait_then_get_a_503_with_retry_after(bench) -> None:
    """One request holds 60 KB of a 64 KiB budget (its body partly sent): a 6 KB request waits
    bodyWaitSeconds and gets 503 + Retry-After; once the first is done, the same request is routed."""
    await bench.start(
        [UpstreamState("ok")], max_body_bytes=64 * 1024, body_budget_bytes=64 * 1024, body_wait_seconds=0.3
    )
    big = json.dumps({"input_ids": [7] * 20000}).encode()
    small = json.dumps({"input_ids": [1] * 2000, "sampling_params": {}}).encode()
    assert len(big) <= 64 * 1024 < len(big) + len(small)  # each fits the budget, not both at once
    reader, writer = await bench.raw(headers_of("/generate", len(big)) + big[:1024])
    await eventually(lambda: _budget(bench).in_use == len(big), "the first body holds its bytes")
    async with bench.http.post(bench.url + "/generate", data=small) as response:
        assert response.status == 503
        assert response.headers["Retry-After"] == "1"
        assert "bodyBudgetBytes 65536" in (await response.json())["error"]["message"]
    assert refused(bench, "body_budget") == 1
    writer.write(big[1024:])
    await writer.drain()
    status, _ = await read_response_keepalive(reader)
    assert status == 200
    await eventually(lambda: _budget(bench).in_use == 0, "the first body's bytes are released")
    async with bench.http.post(bench.url + "/generate", data=small) as response:
        assert response.status == 200


def _budget(bench: Bench):
    return bench.runner.app[BUDGET_KEY]


async def read_response_keepalive(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The status line and headers of one response on a connection that stays open (bounded)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND_S)
    return int(head.split(b" ", 2)[1]), head


async def test_a_large_body_reaches_the_replica_whole_with_its_length(bench) -> None:
    """A body over the upload piece size is sent in pieces, still as one plain (not chunked) request."""
    await bench.start([UpstreamState("ok")])
    body = json.dumps({"input_ids": list(range(300_000)), "sampling_params": {"max_new_tokens": 2}}).encode()
    assert len(body) > 1024 * 1024
    async with bench.http.post(bench.url + "/generate", data=body) as response:
        assert response.status == 200
        assert (await response.json())["meta_info"]["prompt_tokens"] == 300_000
    assert bench.state("ok").bodies == [(len(body), len(body))]


async def test_a_body_not_sent_in_time_is_a_408_and_the_connection_closes(bench) -> None:
    await bench.start([UpstreamState("ok")], body_timeout_seconds=0.5)
    reader, _ = await bench.raw(headers_of("/generate", 1000) + b'{"input_ids": [')
    status, body = await read_response(reader)  # read() returns at EOF: the router closed the connection
    assert status == 408
    assert "bodyTimeoutSeconds" in json.loads(body)["error"]["message"]
    assert refused(bench, "body_timeout") == 1
    assert _budget(bench).in_use == 0


@pytest.mark.parametrize("stream", [True, False])
async def test_json_nested_too_deep_is_a_400(bench, stream: bool) -> None:
    await bench.start([UpstreamState("ok")])
    depth = 100_000
    prefix = b'{"stream": true, "input_ids": ' if stream else b'{"input_ids": '
    body = prefix + b"[" * depth + b"]" * depth + b"}"
    async with bench.http.post(bench.url + "/generate", data=body) as response:
        assert response.status == 400
        assert "nested too deeply" in (await response.json())["error"]["message"]
    assert bench.state("ok").started == 0
    assert refused(bench, "deep_json") == 1


# --- connections --------------------------------------------------------------------------------


async def test_connections_that_send_headers_too_slowly_are_closed_and_others_are_served(bench) -> None:
    """200 connections trickle a header byte every 0.1 s and never finish it: each reads EOF after
    headerTimeoutSeconds, and a normal request is answered while they trickle."""
    await bench.start([UpstreamState("ok")], header_timeout_seconds=1.0)
    slow = [await bench.raw(b"POST /generate HTTP/1.1\r\nHost: router\r\n") for _ in range(200)]

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        async def send() -> None:
            for _ in range(int(BOUND_S / 0.1)):
                writer.write(b"X")
                await writer.drain()
                await asyncio.sleep(0.1)

        sender = asyncio.ensure_future(send())
        try:
            return await asyncio.wait_for(reader.read(), BOUND_S)
        except ConnectionError:
            return b""
        finally:
            sender.cancel()

    ends = asyncio.ensure_future(asyncio.gather(*(trickle(r, w) for r, w in slow), return_exceptions=True))
    status, _, _ = await bench.generate("normal")
    assert status == 200
    results = await ends
    assert all(result == b"" for result in results), {repr(r)[:80] for r in results if r != b""}
    for _, writer in slow:
        writer.close()


async def start_capped_at_20(bench: Bench, per_source: int) -> None:
    """The bench's router in front of one upstream, taking at most 20 client connections and `per_source`
    of them from one source; header and body timeouts of 60 s (none runs out within a test)."""
    await bench.start(
        [UpstreamState("ok")],
        max_client_connections=20,
        max_client_connections_per_source=per_source,
        header_timeout_seconds=60.0,
        body_timeout_seconds=60.0,
    )


async def test_connections_over_the_cap_read_eof_at_once_and_fds_stay_bounded(bench) -> None:
    """20 connections each in a request (its body still coming): none is idle, so the 21st is closed
    on accept."""
    await start_capped_at_20(bench, per_source=30)
    held = [await bench.raw(headers_of("/generate", 100) + b'{"input_ids": ') for _ in range(20)]
    await eventually(lambda: len(bench.runner.server.connections) == 20, "20 connections held")
    await eventually(
        lambda: not any(map(idle, site_of(bench).admitted)), "every held connection in its request"
    )
    reader, _ = await bench.raw(b"")
    assert await asyncio.wait_for(reader.read(), BOUND_S) == b""  # closed on accept
    assert len(bench.runner.server.connections) == 20
    assert refused(bench, connections="total") == 1
    assert closed_idle(bench) == 0
    for _, writer in held:
        writer.close()
    await eventually(lambda: len(bench.runner.server.connections) == 0, "the held connections are gone")
    status, _, _ = await bench.generate("after")
    assert status == 200


FLOOD, OTHER = "127.0.0.2", "127.0.0.3"  # two sources: Linux routes all of 127.0.0.0/8 to loopback


async def generate_with(http: aiohttp.ClientSession, url: str) -> int:
    payload = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
    async with http.post(url + "/generate", json=payload) as response:
        await response.read()
        return response.status


def client_from(source: str) -> aiohttp.ClientSession:
    """An HTTP client whose connections come from `source` (kept alive after each answer)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(source, 0)))


async def test_a_reconnecting_flood_from_one_source_is_capped_and_another_source_is_served(bench) -> None:
    """Issue 39: connections from a source at maxClientConnectionsPerSource are closed on accept, however
    often it reconnects, and another source's request is answered meanwhile; the flood holds 8 of 20,
    so nothing idle had to be closed for it."""
    await start_capped_at_20(bench, per_source=8)
    site = site_of(bench)
    for flood_round in (1, 2):  # the flood drops what it holds and comes back
        flood = [await bench.raw(b"", source=FLOOD) for _ in range(30)]
        ends = await asyncio.wait_for(asyncio.gather(*(reader.read() for reader, _ in flood[8:])), BOUND_S)
        assert ends == [b""] * 22  # closed on accept
        assert refused(bench, connections="source") == 22 * flood_round
        assert held_ports(bench) == [port_of(writer) for _, writer in flood[:8]]
        assert site.per_source == {FLOOD: 8}
        async with client_from(OTHER) as http:
            assert await generate_with(http, bench.url) == 200
            assert site.per_source == {FLOOD: 8, OTHER: 1}
        for _, writer in flood:
            writer.close()
        await eventually(lambda: not site.admitted and not site.per_source, "every connection released")
    assert closed_idle(bench) == 0
    assert refused(bench, connections="total") is None


async def test_at_the_total_cap_the_oldest_connection_waiting_for_its_header_is_closed_first(bench) -> None:
    """20 held, the oldest in a request (its body still coming), then 9 that sent nothing and 10 that
    trickle a header that never ends (slowloris), from three sources. Three new clients one after the
    other are each served: for each the oldest connection waiting for its header is closed (the three
    that sent nothing, in order), never the one in a request; each new client's connection, idle
    after its answer, is the newest and stays."""
    await start_capped_at_20(bench, per_source=10)
    site = site_of(bench)
    busy = await bench.raw(headers_of("/generate", 100) + b'{"input_ids": ', source="127.0.0.4")
    quiet = [await bench.raw(b"", source=FLOOD) for _ in range(9)]
    slow = [await bench.raw(b"POST /generate HTTP/1.1\r\nHost: router\r\n", source=OTHER) for _ in range(10)]
    await eventually(
        lambda: len(site.admitted) == 20 and sum(map(idle, site.admitted)) == 19, "19 idle, 1 in a request"
    )
    assert held_ports(bench) == [port_of(writer) for _, writer in [busy, *quiet, *slow]]
    assert not idle(site.admitted[0])
    clients = [client_from("127.0.0.5") for _ in range(3)]
    try:
        for served, http in enumerate(clients, start=1):
            assert await generate_with(http, bench.url) == 200
            assert closed_idle(bench) == served
        ends = await asyncio.wait_for(asyncio.gather(*(reader.read() for reader, _ in quiet[:3])), BOUND_S)
        assert ends == [b""] * 3
        assert held_ports(bench)[:17] == [port_of(writer) for _, writer in [busy, *quiet[3:], *slow]]
        assert site.per_source == {"127.0.0.4": 1, FLOOD: 6, OTHER: 10, "127.0.0.5": 3}
        assert refused(bench, connections="total") is None and refused(bench, connections="source") is None
    finally:
        for http in clients:
            await http.close()
        for _, writer in [busy, *quiet, *slow]:
            writer.close()


# --- the operator's limit -----------------------------------------------------------------------


@pytest.mark.parametrize(("max_seq_len", "limit"), [(4096, 1_179_648), (None, 5_242_880)])
def test_the_operator_bounds_bodies_by_the_jobs_context(max_seq_len: int | None, limit: int) -> None:
    """maxBodyBytes = 1 MiB + 32 B x the context (128k tokens when model.maxSeqLen is unset); a prompt
    of the whole context, as the sampler client posts it with the largest token ids, fits it."""
    from pathlib import Path

    from rlfleet.api import load_rljob
    from rlfleet.operator.config_files import router_config
    from rlfleet.sampler.protocol import SamplingConfig, build_generate_request, dumps_json

    job = load_rljob(Path(__file__).resolve().parents[2] / "examples" / "rljob.yaml")
    job.spec.model.max_seq_len = max_seq_len
    config = RouterConfig.model_validate(router_config(job, "ns"))
    assert config.max_body_bytes == limit
    context = max_seq_len or 131072
    body = dumps_json(build_generate_request([999_999] * context, SamplingConfig(), sampling_seed=2**63 - 1))
    assert len(body) < limit
