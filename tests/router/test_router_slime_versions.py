"""slime's `weight_version` body field through the router (issue 43; docs/router.md "slime's weight_version
field"): slime with `--rollout-http-endpoint-url` POSTs `{url}/generate`, and its request hook adds
`"weight_version": {"exact_version": N}` or `{"min_required_version": N}` to the body. The router routes
on it (the session's group as without it; within the group only a replica at exactly N, or >= N), strips
it from the body it posts, answers 409 with Retry-After at once when no replica of the group serves it
yet, and refuses a malformed field with a 400.

The router is the real HTTP service; each replica is a small real aiohttp engine on 127.0.0.1 that says
its weight version in `/model_info` and in every answer's `meta_info.weight_version` (as SGLang 0.5.23
does, a string), can take its time generating or move to another version while it generates, and records
every body it receives byte for byte.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web
from support.routed_engines import post, routed, sessions_preferring
from support.slime_requests import slime_post

from rlfleet.lora import ADAPTER_NEWEST, ADAPTER_REQUEST_HEADER, ADAPTER_VERSION_HEADER

REQUEST = {"input_ids": [1, 5, 9, 2], "sampling_params": {"max_new_tokens": 3}, "return_logprob": True}


def exact(version: int) -> dict[str, Any]:
    return {**REQUEST, "weight_version": {"exact_version": version}}


def at_least(version: int) -> dict[str, Any]:
    return {**REQUEST, "weight_version": {"min_required_version": version}}


@dataclass
class Engine:
    """One replica's engine: its weight version, how long a generation takes, the version it moves to
    while generating (a weight load landing mid-request), and every body it received (path, bytes)."""

    version: int
    delay: float = 0.0
    moves_to: int | None = None
    bodies: list[tuple[str, bytes]] = field(default_factory=list)
    model_info_reads: int = 0
    url: str = ""

    def generate_bodies(self) -> list[bytes]:
        return [body for path, body in self.bodies if path == "/generate"]

    def app(self) -> web.Application:
        async def generate(request: web.Request) -> web.Response:
            raw = await request.read()
            self.bodies.append((request.path, raw))
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.moves_to is not None:
                self.version, self.moves_to = self.moves_to, None
            return web.json_response(
                {
                    "text": "",
                    "output_ids": [30, 5, 0],
                    "meta_info": {
                        "prompt_tokens": 4,
                        "completion_tokens": 3,
                        "weight_version": str(self.version),
                    },
                }
            )

        async def model_info(request: web.Request) -> web.Response:
            self.model_info_reads += 1
            return web.json_response({"model_path": "tiny", "weight_version": str(self.version)})

        async def health_generate(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_post("/v1/completions", generate)
        app.router.add_get("/model_info", model_info)
        app.router.add_get("/health_generate", health_generate)
        return app


def answered_version(body: bytes) -> int:
    return int(json.loads(body)["meta_info"]["weight_version"])


async def test_exact_version_goes_only_to_the_replica_at_that_version_in_the_sessions_group() -> None:
    """Two groups, each with one replica at 5 among others: every session keeps the group it has without
    the field, and within it only the replica at 5 is posted to (the others' versions were read from
    /model_info first, no post wasted); the answer says 5."""
    a = [Engine(4), Engine(5), Engine(6)]
    b = [Engine(5), Engine(7)]
    sessions = [f"episode-{i}" for i in range(24)]
    async with routed({"a": a, "b": b}) as url, aiohttp.ClientSession() as http:
        plain = {s: await post(http, url, REQUEST, {"X-Session-Id": s}) for s in sessions}
        for e in a + b:
            e.bodies.clear()
        versioned = {s: await post(http, url, exact(5), {"X-Session-Id": s}) for s in sessions}
    groups = {s: headers["X-RLFleet-Group"] for s, (_, headers, _) in plain.items()}
    assert set(groups.values()) == {"a", "b"}, "both groups took sessions"
    at_five = {"a": a[1].url, "b": b[0].url}
    for s, (status, headers, body) in versioned.items():
        assert status == 200
        assert headers["X-RLFleet-Group"] == groups[s]  # the session's group, as without the field
        assert headers["X-RLFleet-Replica"] == at_five[groups[s]]
        assert (headers["X-RLFleet-Weight-Version"], headers["X-RLFleet-Attempts"]) == ("5", "1")
        assert answered_version(body) == 5
    assert [len(e.bodies) for e in a + b] == [0, len(a[1].bodies), 0, len(b[0].bodies), 0]
    assert len(a[1].bodies) + len(b[0].bodies) == 24


async def test_min_required_version_goes_to_a_replica_at_or_above_it() -> None:
    """min_required_version 5 over replicas at 3, 5, 6: never the one at 3. With X-Min-Weight-Version as
    well the stricter of the two holds (either way round); an exact_version below the header's minimum
    can never be served: a 400."""
    old, five, six = Engine(3), Engine(5), Engine(6)
    replicas = [old, five, six]
    async with routed({"g": replicas}) as url, aiohttp.ClientSession() as http:
        field_only = [await post(http, url, at_least(5), {"X-Session-Id": f"s{i}"}) for i in range(24)]
        assert old.bodies == [] and five.bodies and six.bodies
        for status, headers, body in field_only:
            assert status == 200 and int(headers["X-RLFleet-Weight-Version"]) >= 5
            assert answered_version(body) == int(headers["X-RLFleet-Weight-Version"])
        for e in replicas:
            e.bodies.clear()
        header_stricter = [
            await post(http, url, at_least(5), {"X-Session-Id": f"s{i}", "X-Min-Weight-Version": "6"})
            for i in range(12)
        ]
        field_stricter = [
            await post(http, url, at_least(6), {"X-Session-Id": f"s{i}", "X-Min-Weight-Version": "4"})
            for i in range(12)
        ]
        both = await post(http, url, exact(5), {"X-Min-Weight-Version": "6"})
    for status, headers, _ in header_stricter + field_stricter:
        assert (status, headers["X-RLFleet-Replica"]) == (200, six.url)
    assert old.bodies == five.bodies == [] and len(six.bodies) == 24
    assert both[0] == 400
    assert json.loads(both[2])["error"]["message"] == (
        '"weight_version".exact_version 5 is below the minimum weight version 6 (X-Min-Weight-Version): '
        "no replica can serve both"
    )


async def test_no_replica_at_the_version_is_a_409_at_once() -> None:
    """The group's replicas are at 3 and 4 and take 5 s to generate: exact_version 5 and
    min_required_version 5 are each answered 409 with Retry-After and a JSON body naming the requested and
    served versions, within a fraction of a second (no engine is posted to or waited for). A group whose
    every replica is past an exact version says it will not be served again."""
    slow = [Engine(3, delay=5.0), Engine(4, delay=5.0)]
    async with routed({"g": slow}, retry_after_seconds=1) as url, aiohttp.ClientSession() as http:
        timed = []
        for payload in (exact(5), at_least(5)):
            started = time.perf_counter()
            timed.append(
                (await post(http, url, payload, {"X-Session-Id": "episode-1"}), time.perf_counter() - started)
            )
    (exact_answer, exact_s), (min_answer, min_s) = timed
    assert exact_s < 1.0 and min_s < 1.0, (exact_s, min_s)
    assert [e.bodies for e in slow] == [[], []]
    for (status, headers, body), asked in ((exact_answer, "5 exactly"), (min_answer, ">= 5")):
        assert (status, headers["Retry-After"], headers["Content-Type"]) == (409, "1", "application/json")
        error = json.loads(body)["error"]
        assert error["message"] == f"no replica of group 'g' serves weight version {asked} yet; retry"
        assert (error["code"], error["group"], error["servedVersions"]) == (409, "g", [3, 4])
    assert json.loads(exact_answer[2])["error"]["exactWeightVersion"] == 5
    assert json.loads(exact_answer[2])["error"]["minWeightVersion"] is None
    assert json.loads(min_answer[2])["error"]["minWeightVersion"] == 5

    past = [Engine(6), Engine(7)]
    async with routed({"g": past}) as url, aiohttp.ClientSession() as http:
        status, headers, body = await post(http, url, exact(5))
    assert (status, headers["Retry-After"]) == (409, "0")
    assert json.loads(body)["error"]["message"] == (
        "every replica of group 'g' serves a weight version past 5 (asked for exactly): it will not be served again"
    )


async def test_the_field_is_stripped_and_the_rest_of_the_body_kept() -> None:
    """The engine receives the client's JSON less the field (key order, strings, numbers as they were); with
    X-RLFleet-Adapter too it names the adapter of the replica at the exact version (not the newest)."""
    client_body = (
        b'{ "text" : "caf\\u00e9 \\"weight_version\\"", "weight_version" : {"min_required_version": 2},\n'
        b' "sampling_params": {"temperature": 0.7, "max_new_tokens": 3, "stop": ["\\n"]}, "rid": "r-1",'
        b' "return_logprob": true, "custom_labels": {"k": "v"} }'
    )
    replica = Engine(2)
    async with routed({"g": [replica]}) as url, aiohttp.ClientSession() as http:
        status, _, _ = await post(http, url, client_body)
    assert status == 200
    [received] = replica.generate_bodies()
    expected = json.loads(client_body)
    del expected["weight_version"]
    assert json.loads(received) == expected
    assert list(json.loads(received)) == ["text", "sampling_params", "rid", "return_logprob", "custom_labels"]
    assert b'"weight_version"' not in received

    four, five, six = Engine(4), Engine(5), Engine(6)
    adapter = {ADAPTER_REQUEST_HEADER: ADAPTER_NEWEST}
    async with routed({"g": [four, five, six]}) as url, aiohttp.ClientSession() as http:
        answers = [await post(http, url, exact(5), {**adapter, "X-Session-Id": f"s{i}"}) for i in range(8)]
    assert four.bodies == six.bodies == []
    assert [json.loads(body) for body in five.generate_bodies()] == [{**REQUEST, "lora_path": "v5"}] * 8
    for status, headers, _ in answers:
        assert (status, headers[ADAPTER_VERSION_HEADER], headers["X-RLFleet-Replica"]) == (200, "5", five.url)


async def test_a_body_without_the_field_is_forwarded_byte_for_byte() -> None:
    """No top-level field: the body goes out as it came, including one that is not JSON and ones whose
    bytes hold `"weight_version"` as a string value or a nested key (SGLang judges those itself); the
    field on another path than /generate is not slime's and is not read."""
    replica = Engine(2)
    bodies = [
        (
            b'{ "input_ids" :[1, 5,9 ,2],\n "sampling_params": {"max_new_tokens": 3.0e0}, "note": "caf\\u00e9" }',
            "/generate",
        ),
        (b"not json at all", "/generate"),
        (b'{"text": "weight_version", "input_ids": [1]}', "/generate"),
        (b'{"input_ids": [1], "sampling_params": {"weight_version": {"exact_version": 9}}}', "/generate"),
        (b'{"prompt": "x", "weight_version": {"exact_version": 9}}', "/v1/completions"),
    ]
    async with routed({"g": [replica]}) as url, aiohttp.ClientSession() as http:
        answers = [
            await post(http, url, body, {"Content-Type": "application/json"}, path) for body, path in bodies
        ]
    assert [status for status, _, _ in answers] == [200] * 5
    assert replica.bodies == [(path, body) for body, path in bodies]


ATTACKS = {
    "negative": b'{"weight_version": {"exact_version": -1}}',
    "bool": b'{"weight_version": {"exact_version": true}}',
    "string": b'{"weight_version": {"min_required_version": "5"}}',
    "float": b'{"weight_version": {"exact_version": 5.0}}',
    "both-keys": b'{"weight_version": {"exact_version": 5, "min_required_version": 5}}',
    "unknown-key": b'{"weight_version": {"version": 5}}',
    "no-key": b'{"weight_version": {}}',
    "not-an-object": b'{"weight_version": 5}',
    "null": b'{"weight_version": null}',
    "list": b'{"weight_version": [{"exact_version": 5}]}',
    "nested-garbage": b'{"weight_version": {"exact_version": {"exact_version": [5, {"x": null}]}}}',
    "key-with-newline": b'{"weight_version": {"exact_version\\n\\u0000": 5}}',
    "huge-int": b'{"weight_version": {"exact_version": 1000000000000000000000000000000}}',
    "past-int64": b'{"weight_version": {"exact_version": 9223372036854775808}}',
    "u64-max": b'{"weight_version": {"min_required_version": 18446744073709551615}}',
    "infinity": b'{"weight_version": {"exact_version": 1e999}}',
    "body-a-list": b'[{"weight_version": {"exact_version": 5}}]',
    "body-not-json": b'{"weight_version": {"exact_version": 5}',
    "body-deep": b'{"weight_version": {"exact_version": 5}, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
}


@pytest.mark.parametrize("body", list(ATTACKS.values()), ids=list(ATTACKS))
async def test_a_malformed_field_is_a_400_from_the_router(body: bytes) -> None:
    """Every malformed field (or a body holding one that is not a JSON object) is the router's 400 with a
    one-line JSON message naming the field; no replica sees it."""
    replica = Engine(5)
    async with routed({"g": [replica]}) as url, aiohttp.ClientSession() as http:
        status, headers, answer = await post(http, url, body, {"X-Session-Id": "s"})
    assert (status, headers["Content-Type"]) == (400, "application/json"), answer
    message = json.loads(answer)["error"]["message"]
    assert "\n" not in message and len(message) < 300, message
    assert "weight_version" in message or "nested too deeply" in message, message
    assert replica.bodies == [] and replica.model_info_reads == 0


async def test_an_answer_from_a_version_reached_mid_request_is_discarded_and_retried() -> None:
    """Both replicas are at 5; the session's replica loads 6 while it generates and answers at 6: that
    answer is discarded and the request posted to the sibling, still at 5 (2 attempts); the router now
    knows the first is at 6, and the session's next exact-5 request goes straight to the sibling. Alone in
    its group, such a replica leaves nothing to serve 5: the 409."""
    moving, steady = Engine(5, moves_to=6), Engine(5)
    async with routed({"g": [moving, steady]}) as url, aiohttp.ClientSession() as http:
        session = sessions_preferring(moving, [moving, steady], 1)[0]
        first = await post(http, url, exact(5), {"X-Session-Id": session})
        second = await post(http, url, exact(5), {"X-Session-Id": session})
    for (status, headers, body), attempts in ((first, "2"), (second, "1")):
        assert (status, headers["X-RLFleet-Replica"], headers["X-RLFleet-Attempts"]) == (
            200,
            steady.url,
            attempts,
        )
        assert answered_version(body) == 5
    assert len(moving.bodies) == 1 and len(steady.bodies) == 2

    alone = Engine(5, moves_to=6)
    async with routed({"g": [alone]}) as url, aiohttp.ClientSession() as http:
        status, headers, body = await post(http, url, exact(5))
    assert (status, headers["Retry-After"]) == (409, "0") and len(alone.bodies) == 1
    assert json.loads(body)["error"]["servedVersions"] == [6]


@pytest.mark.parametrize("kind", ["exact_version", "min_required_version"])
async def test_slimes_retry_loop_gets_the_answer_once_the_replica_reaches_the_version(kind: str) -> None:
    """slime's retry semantics against the router: the replica is at 3 and the hook asks for 4; the loop
    gets 409s (retrying every retry_sleep) until the replica's sidecar loads 4 (the router learns it from
    its health checks' /model_info read), then one 200 answered at 4, the loop's result. The replica was
    never posted a request before it reached 4. Without the load the loop spends max_retries and raises
    the 409."""
    replica = Engine(3)
    statuses: list[int] = []
    payload = {**REQUEST, "weight_version": {kind: 4}}
    async with (
        routed({"g": [replica]}, health_checks=True, health_interval_seconds=0.05) as url,
        httpx.AsyncClient(timeout=httpx.Timeout(None), trust_env=False) as client,
    ):
        loop = asyncio.create_task(
            slime_post(client, url + "/generate", payload, retry_sleep=0.05, statuses=statuses)
        )
        while len(statuses) < 4:
            await asyncio.sleep(0.01)
        replica.version = 4  # the weight-sync sidecar: loaded, update_weight_version(4)
        output = await asyncio.wait_for(loop, timeout=10)

        with pytest.raises(httpx.HTTPStatusError) as spent:
            await slime_post(client, url + "/generate", {**REQUEST, "weight_version": {kind: 9}}, 3, 0.01)
    assert int(output["meta_info"]["weight_version"]) == 4
    assert statuses[-1] == 200 and set(statuses[:-1]) == {409} and len(statuses) >= 5
    assert replica.generate_bodies() == [json.dumps(REQUEST, separators=(",", ":")).encode()]
    assert spent.value.response.status_code == 409
