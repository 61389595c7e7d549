"""LoRA adapters through the router (issue 42; docs/router.md "LoRA adapters"): with `X-RLFleet-Adapter:
newest` the router names, in the body it posts, the newest adapter of the replica it chose, and says which
in `X-RLFleet-Adapter-Version`; the sampler client (`adapters=True`) takes every token's version from it.

The router is the real HTTP service; each replica is a small real aiohttp engine on 127.0.0.1 that keeps
adapters as SGLang 0.5.23 does (a request's `lora_path` must name one it holds, else its own 400s, worded
as srt/managers/tokenizer_manager.py and srt/lora/lora_registry.py word them), serves `/model_info`, and
records every body it receives byte for byte.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from support.routed_engines import post, routed, sessions_preferring
from support.upstreams import serving

from rlfleet.lora import ADAPTER_NEWEST, ADAPTER_REQUEST_HEADER, ADAPTER_VERSION_HEADER, adapter_name
from rlfleet.retries import ClientRetryPolicy
from rlfleet.sampler.client import SamplerClient, TurnFailed
from rlfleet.sampler.sglang_errors import value_error

FIXTURES = Path(__file__).resolve().parents[1] / "sampler" / "fixtures"
# SGLang 0.5.23's answer to a support-mode request that straddled a weight load: tokens 0-1 under
# weight_version 11, token 2 under 12 (its meta_info weight_versions spans).
STRADDLE = json.loads((FIXTURES / "sglang_support_straddle.json").read_text())
FAST = ClientRetryPolicy(backoff_initial_s=0.001, backoff_max_s=0.002, version_wait_cap_s=0.001)
ADAPTER = {ADAPTER_REQUEST_HEADER: ADAPTER_NEWEST}


@dataclass
class Engine:
    """One replica's engine: its weight version (None: /model_info answers 503, as while starting), the
    adapters it holds and has ever loaded, and what it received."""

    version: int | None
    loaded: set[str] = field(default_factory=set)
    ever_loaded: set[str] = field(default_factory=set)
    fail_status: int | None = None  # answer every /generate with this status (503: a replica failure)
    files_gone: bool = False  # an unloaded adapter cannot be loaded again (SGLang's implicit reload fails)
    response: dict[str, Any] | None = None  # the 200 body; default: the fixture at this engine's version
    bodies: list[bytes] = field(default_factory=list)  # every /generate body, as received
    model_info_reads: int = 0
    url: str = ""

    def load(self, version: int) -> None:
        """The sidecar: load vN, say N (update_weight_version), unload what is older than N - 1."""
        self.loaded.add(adapter_name(version))
        self.ever_loaded.add(adapter_name(version))
        self.version = version
        self.loaded = {name for name in self.loaded if int(name[1:]) >= version - 1}

    def lora_paths(self) -> list[str | None]:
        return [json.loads(body).get("lora_path") for body in self.bodies]

    def _refusal(self, name: str) -> web.Response | None:
        """SGLang 0.5.23's 400 for `lora_path` naming an adapter it does not hold (None: it holds it)."""
        if name in self.loaded:
            return None
        if name not in self.ever_loaded:
            message = (
                f"Got LoRA adapter that has never been loaded: {name}\n"
                f"All loaded adapters: {dict.fromkeys(sorted(self.ever_loaded)).keys()}."
            )
        elif self.files_gone:
            message = f"Failed to implicitly load LoRA adapter {name}: Failed to load LoRA adapter {name}: no such file"
        else:
            message = (
                f"The following requested LoRA adapters are not loaded: {name}\n"
                f"Loaded adapters: {dict.fromkeys(sorted(self.loaded)).keys()}."
            )
        return value_error(message).response()

    def app(self) -> web.Application:
        async def generate(request: web.Request) -> web.Response:
            raw = await request.read()
            self.bodies.append(raw)
            if self.fail_status is not None:
                return web.json_response({"error": "failing on purpose"}, status=self.fail_status)
            try:
                body = json.loads(raw)
            except ValueError:
                return value_error("request body is not JSON").response()
            name = body.get("lora_path")
            refusal = self._refusal(name) if name is not None else None
            if refusal is not None:
                return refusal
            if self.response is not None:
                return web.json_response(self.response)
            answer = copy.deepcopy(STRADDLE["response"])
            answer["meta_info"]["weight_version"] = str(self.version)
            del answer["meta_info"]["weight_versions"]
            return web.json_response(answer)

        async def model_info(request: web.Request) -> web.Response:
            self.model_info_reads += 1
            if self.version is None:
                return web.json_response({"error": "starting"}, status=503)
            return web.json_response({"model_path": "tiny", "weight_version": str(self.version)})

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_get("/model_info", model_info)
        return app


def engine(version: int | None, *held: int) -> Engine:
    made = Engine(version)
    for v in held:
        made.loaded.add(adapter_name(v))
        made.ever_loaded.add(adapter_name(v))
    return made


REQUEST = {"input_ids": [1, 5, 9, 2], "sampling_params": {"max_new_tokens": 3}, "return_logprob": True}


async def test_each_replica_is_posted_its_own_newest_adapter() -> None:
    """Two groups at different versions (a mixed fleet mid-load): every body a replica receives names
    that replica's adapter, is otherwise the client's request, and the answer says that version."""
    old, new = engine(3, 2, 3), engine(5, 4, 5)
    async with routed({"a100-bf16": [old], "h100-fp8": [new]}) as url, aiohttp.ClientSession() as http:
        answers = [
            await post(http, url, json.dumps(REQUEST).encode(), {**ADAPTER, "X-Session-Id": f"episode-{i}"})
            for i in range(24)
        ]
    assert old.bodies and new.bodies, "both groups took sessions"
    assert set(old.lora_paths()) == {"v3"} and set(new.lora_paths()) == {"v5"}
    for body in old.bodies + new.bodies:
        decoded = json.loads(body)
        assert decoded.pop("lora_path") in ("v3", "v5") and decoded == REQUEST
    by_replica = {old.url: "3", new.url: "5"}
    for status, headers, _ in answers:
        assert status == 200
        assert headers[ADAPTER_VERSION_HEADER] == by_replica[headers["X-RLFleet-Replica"]]
        assert headers["X-RLFleet-Attempts"] == "1"
    # each version was read from the replica's /model_info once, before its first post
    assert (old.model_info_reads, new.model_info_reads) == (1, 1)


async def test_a_retry_on_another_replica_names_that_replicas_adapter() -> None:
    """The session's replica fails (503): the retry on its sibling names the sibling's adapter."""
    failing, sibling = engine(4, 4), engine(3, 3)
    failing.fail_status = 503
    # failureThreshold high: the failing replica stays first choice of its sessions (not marked down)
    async with (
        routed({"g": [failing, sibling]}, failure_threshold=100) as url,
        aiohttp.ClientSession() as http,
    ):
        sessions = sessions_preferring(failing, [failing, sibling], 4)
        sessions += sessions_preferring(sibling, [failing, sibling], 4)
        answers = [
            await post(http, url, json.dumps(REQUEST).encode(), {**ADAPTER, "X-Session-Id": session})
            for session in sessions
        ]
    assert failing.lora_paths() == ["v4"] * 4 and sibling.lora_paths() == ["v3"] * 8
    for status, headers, _ in answers:
        assert (status, headers["X-RLFleet-Replica"], headers[ADAPTER_VERSION_HEADER]) == (
            200,
            sibling.url,
            "3",
        )
    assert [h["X-RLFleet-Attempts"] for _, h, _ in answers] == ["2"] * 4 + ["1"] * 4


async def test_a_replica_at_an_unknown_version_is_skipped() -> None:
    """A replica whose /model_info does not say its version is never posted to; the sibling serves every
    session. A group with no replica at a known version answers 409 with Retry-After, posting nothing."""
    starting, ready = engine(None), engine(2, 1, 2)
    async with routed({"g": [starting, ready]}) as url, aiohttp.ClientSession() as http:
        sessions = sessions_preferring(starting, [starting, ready], 6)
        sessions += sessions_preferring(ready, [starting, ready], 6)
        answers = [
            await post(http, url, json.dumps(REQUEST).encode(), {**ADAPTER, "X-Session-Id": session})
            for session in sessions
        ]
    assert starting.bodies == [] and starting.model_info_reads == 6  # read again each time it is chosen
    assert len(ready.bodies) == 12 and set(ready.lora_paths()) == {"v2"}
    assert {(s, h["X-RLFleet-Replica"], h[ADAPTER_VERSION_HEADER]) for s, h, _ in answers} == {
        (200, ready.url, "2")
    }

    alone = engine(None)
    async with routed({"g": [alone]}) as url, aiohttp.ClientSession() as http:
        status, headers, body = await post(http, url, json.dumps(REQUEST).encode(), ADAPTER)
        plain_status, _, _ = await post(http, url, json.dumps(REQUEST).encode(), {})
    assert status == 409 and headers["Retry-After"] == "0"
    assert "serves a known weight version" in json.loads(body)["error"]["message"]
    assert ADAPTER_VERSION_HEADER not in headers
    assert len(alone.bodies) == 1 and b"lora_path" not in alone.bodies[0]  # only the plain request
    assert plain_status == 200


@pytest.mark.parametrize("files_gone", [False, True], ids=["not-loaded", "implicit-reload-fails"])
async def test_an_adapter_unloaded_since_the_router_looked_is_read_again_and_posted_once_more(
    files_gone: bool,
) -> None:
    """The router knows v5; the replica loaded v6 and v7 since and dropped v5: its 400 has the router read
    /model_info again and post v7 to it, once; the answer says 7."""
    replica = engine(5, 4, 5)
    replica.files_gone = files_gone
    async with routed({"g": [replica]}) as url, aiohttp.ClientSession() as http:
        first = await post(http, url, json.dumps(REQUEST).encode(), ADAPTER)
        replica.load(6)
        replica.load(7)
        assert replica.loaded == {"v6", "v7"}
        status, headers, _ = await post(http, url, json.dumps(REQUEST).encode(), ADAPTER)
    assert first[0] == 200 and first[1][ADAPTER_VERSION_HEADER] == "5"
    assert replica.lora_paths() == ["v5", "v5", "v7"]
    assert (status, headers[ADAPTER_VERSION_HEADER], headers["X-RLFleet-Attempts"]) == (200, "7", "2")
    assert replica.model_info_reads == 2  # before the first post, and after the 400


async def test_a_replica_that_does_not_hold_the_adapter_it_says_it_serves_lags() -> None:
    """A replica whose /model_info names an adapter it does not hold (an engine just started from its base,
    its sidecar not done loading): posted twice (the first named the router's stale version, the second
    the one read again), then it counts as lagging: 409 with Retry-After, which the client waits out, and
    no 400 reaches the client. Without room for a second post (maxAttempts 1) the first 400 does the same.
    Its sibling that holds its adapter serves the request instead."""
    broken = engine(3, 3)
    async with routed({"g": [broken]}) as url, aiohttp.ClientSession() as http:
        await post(http, url, json.dumps(REQUEST).encode(), ADAPTER)
        broken.version, broken.loaded = 9, set()  # says 9, holds nothing
        status, headers, body = await post(http, url, json.dumps(REQUEST).encode(), ADAPTER)
    assert broken.lora_paths() == ["v3", "v3", "v9"]
    assert (status, headers["Retry-After"]) == (409, "0") and ADAPTER_VERSION_HEADER not in headers
    assert "retry" in json.loads(body)["error"]["message"]

    once = engine(3, 3)
    async with routed({"g": [once]}, max_attempts=1) as url, aiohttp.ClientSession() as http:
        await post(http, url, json.dumps(REQUEST).encode(), ADAPTER)
        once.load(4)
        once.load(5)
        status, headers, body = await post(http, url, json.dumps(REQUEST).encode(), ADAPTER)
    assert once.lora_paths() == ["v3", "v3"]
    assert status == 409 and ADAPTER_VERSION_HEADER not in headers

    starting, ready = engine(0), engine(0, 0)  # both say 0; only `ready` loaded adapter v0 yet
    async with routed({"g": [starting, ready]}) as url, aiohttp.ClientSession() as http:
        session = sessions_preferring(starting, [starting, ready], 1)[0]
        status, headers, _ = await post(
            http, url, json.dumps(REQUEST).encode(), {**ADAPTER, "X-Session-Id": session}
        )
    assert starting.lora_paths() == ["v0", "v0"] and ready.lora_paths() == ["v0"]
    assert (status, headers["X-RLFleet-Replica"], headers[ADAPTER_VERSION_HEADER]) == (200, ready.url, "0")


async def test_without_the_header_the_body_is_forwarded_byte_for_byte() -> None:
    """No X-RLFleet-Adapter: the router does not touch the body (spacing, key order, escapes, a client's own
    lora_path, even a body that is not JSON); the answer has no adapter header."""
    replica = engine(2, 2)
    bodies = [
        b'{ "input_ids" :[1, 5,9 ,2],\n "lora_path":"v2", "sampling_params": {"max_new_tokens": 3.0e0},'
        b' "note": "caf\\u00e9" }',
        b"not json at all",
    ]
    async with routed({"g": [replica]}) as url, aiohttp.ClientSession() as http:
        answers = [await post(http, url, body, {"Content-Type": "application/json"}) for body in bodies]
    assert replica.bodies == bodies
    assert [status for status, _, _ in answers] == [200, 400]
    assert all(ADAPTER_VERSION_HEADER not in headers for _, headers, _ in answers)


@pytest.mark.parametrize(
    ("body", "headers", "says"),
    [
        (b"not json", ADAPTER, "needs a JSON object body"),
        (b"[1, 2]", ADAPTER, "got a JSON list"),
        (json.dumps(REQUEST).encode(), {ADAPTER_REQUEST_HEADER: "v3"}, "must be 'newest'"),
    ],
    ids=["not-json", "not-an-object", "not-newest"],
)
async def test_a_request_the_router_cannot_name_an_adapter_for_is_a_400(
    body: bytes, headers: dict[str, str], says: str
) -> None:
    replica = engine(2, 2)
    async with routed({"g": [replica]}) as url, aiohttp.ClientSession() as http:
        status, _, answer = await post(http, url, body, headers)
    assert status == 400 and says in json.loads(answer)["error"]["message"]
    assert replica.bodies == []


async def test_the_client_in_adapter_mode_takes_every_tokens_version_from_the_router() -> None:
    """A turn that straddled a load (meta_info spans: 11, 11, 12) ran on adapter v11 alone: in adapter mode
    every token is version 11, the router's header; without adapter mode the spans' versions stand."""
    replica = engine(11, 10, 11)
    replica.response = STRADDLE["response"]
    ids = STRADDLE["request"]["input_ids"]
    config = {"temperature": 0.8, "top_p": 0.9, "top_k": 64, "max_new_tokens": 3}
    async with routed({"g": [replica]}) as url:
        async with SamplerClient(url, policy=FAST, adapters=True) as client:
            turn = await client.generate(ids, config, session_id="episode-1")
        async with SamplerClient(url, policy=FAST) as plain:
            spanned = await plain.generate(ids, config, session_id="episode-1")
    assert turn.weight_versions.tolist() == [11, 11, 11]
    assert turn.valid.all() and turn.group == "g" and turn.replica == replica.url
    assert spanned.weight_versions.tolist() == [11, 11, 12]
    assert replica.lora_paths() == ["v11", None]


async def test_the_client_in_adapter_mode_fails_a_turn_without_the_routers_header() -> None:
    """Talking to an engine directly (no router to name the adapter and say which ran): a 200 without
    X-RLFleet-Adapter-Version fails the turn as malformed_response, at once."""
    replica = engine(11, 11)
    replica.response = STRADDLE["response"]
    async with (
        serving(replica.app(), access_log=None) as url,
        SamplerClient(url, policy=FAST, adapters=True) as client,
    ):
        with pytest.raises(TurnFailed, match=ADAPTER_VERSION_HEADER) as failed:
            await client.generate(STRADDLE["request"]["input_ids"], {"max_new_tokens": 3})
    assert failed.value.reason == "malformed_response" and failed.value.attempts == 1
    assert client.stats.failures == {"malformed_response": 1}
    assert len(replica.bodies) == 1
