"""The router service over real HTTP: stickiness, shares, annotations, admin auth, metrics,
minimum weight version, retries, streaming, CLI errors. Upstreams are small real aiohttp servers
(tests/support/upstreams.py) on 127.0.0.1 free ports."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections import Counter, defaultdict

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.router_bench import RouterBench
from support.upstreams import InProcessUpstream, UpstreamState

from rlfleet.router.config import GroupConfig, RouterConfig

TOKEN = "s3cret-token"


class Fleet(RouterBench):
    """Groups of in-process upstreams (`{group: replicas}`) behind a router service, and an HTTP client."""

    def __init__(self) -> None:
        super().__init__()
        self.upstreams: dict[str, list[InProcessUpstream]] = {}

    async def start(self, groups: dict[str, int], config_extra: dict | None = None, **state_kw) -> Fleet:
        for name, n in groups.items():
            self.upstreams[name] = [
                self.stop_at_close(await InProcessUpstream(UpstreamState(f"{name}-{i}", **state_kw)).start())
                for i in range(n)
            ]
        config = RouterConfig(
            port=0,
            groups=[GroupConfig(name=g, replicas=[u.url for u in ups]) for g, ups in self.upstreams.items()],
            **(config_extra or {}),
        )
        await self.start_router(config, health_checks=False)
        return self

    async def generate(
        self, session: str | None, headers: dict | None = None, **body
    ) -> aiohttp.ClientResponse:
        all_headers = {**({"X-Session-Id": session} if session else {}), **(headers or {})}
        payload = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, **body}
        response = await self.http.post(self.url + "/generate", json=payload, headers=all_headers)
        await response.read()
        return response

    async def admin(self, method: str, path: str, token: str | None = TOKEN, **kw) -> aiohttp.ClientResponse:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        response = await self.http.request(method, self.url + path, headers=headers, **kw)
        await response.read()
        return response


@pytest.fixture
async def fleet(monkeypatch):
    monkeypatch.setenv("RLFLEET_ROUTER_ADMIN_TOKEN", TOKEN)
    f = Fleet()
    yield f
    await f.close()


async def test_sessions_stick_and_responses_name_group_replica_and_version(fleet: Fleet) -> None:
    await fleet.start({"a100-bf16": 2, "h100-fp8": 2, "b200-nvfp4": 2}, weight_version=7)
    groups_by_session: dict[str, set[str]] = defaultdict(set)
    for _turn in range(4):
        for s in range(60):
            response = await fleet.generate(f"episode-{s}")
            assert response.status == 200
            body = await response.json()
            group = response.headers["X-RLFleet-Group"]
            replica = response.headers["X-RLFleet-Replica"]
            assert body["meta_info"]["rlfleet_group"] == group
            assert body["meta_info"]["rlfleet_replica"] == replica
            assert response.headers["X-RLFleet-Weight-Version"] == "7"
            # The replica that answered really belongs to the group the router names.
            assert body["meta_info"]["upstream"].rsplit("-", 1)[0] == group
            assert replica in [u.url for u in fleet.upstreams[group]]
            groups_by_session[f"episode-{s}"].add(group)
    assert all(len(g) == 1 for g in groups_by_session.values())
    assert len({next(iter(g)) for g in groups_by_session.values()}) == 3  # all groups got sessions


async def test_smg_routing_key_header_is_honoured(fleet: Fleet) -> None:
    await fleet.start({"g1": 1, "g2": 1, "g3": 1})
    for s in range(20):
        a = await fleet.generate(f"k{s}")
        b = await fleet.generate(None, headers={"X-SMG-Routing-Key": f"k{s}"})
        assert a.headers["X-RLFleet-Group"] == b.headers["X-RLFleet-Group"]


async def test_admin_shares_steer_new_sessions_and_quarantine_empties_a_group(fleet: Fleet) -> None:
    await fleet.start({"fast": 1, "slow": 1})
    response = await fleet.admin("PUT", "/admin/shares", json={"shares": {"fast": 3.0, "slow": 1.0}})
    assert response.status == 200
    counts = Counter()
    for s in range(400):
        counts[(await fleet.generate(f"s{s}")).headers["X-RLFleet-Group"]] += 1
    assert 0.68 <= counts["fast"] / 400 <= 0.82
    response = await fleet.admin("PUT", "/admin/groups/slow", json={"quarantined": True})
    assert response.status == 200
    state = await response.json()
    assert {g["name"]: g["effectiveShare"] for g in state["groups"]} == {"fast": 1.0, "slow": 0.0}
    for s in range(50):
        assert (await fleet.generate(f"s{s}")).headers["X-RLFleet-Group"] == "fast"


async def test_admin_api_requires_the_bearer_token(fleet: Fleet, tmp_path, monkeypatch) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("first\n")
    await fleet.start({"g": 1}, config_extra={"admin_token_file": str(token_file)})
    assert (await fleet.admin("GET", "/admin/state", token=None)).status == 401
    assert (await fleet.admin("GET", "/admin/state", token="wrong")).status == 401
    assert (await fleet.admin("PUT", "/admin/shares", token="wrong", json={"shares": {"g": 0}})).status == 401
    assert (await fleet.admin("GET", "/admin/state", token="first")).status == 200
    # A rotated Secret is picked up without a restart.
    token_file.write_text("second")
    os.utime(token_file, (1, 1))
    assert (await fleet.admin("GET", "/admin/state", token="first")).status == 401
    assert (await fleet.admin("GET", "/admin/state", token="second")).status == 200
    # Health and metrics stay open (probes and Prometheus).
    assert (await fleet.http.get(fleet.url + "/health")).status == 200
    assert (await fleet.http.get(fleet.url + "/metrics")).status == 200


async def test_admin_api_is_disabled_without_a_token_and_rejects_bad_bodies(
    fleet: Fleet, monkeypatch
) -> None:
    await fleet.start({"g": 1})
    bad = await fleet.admin("PUT", "/admin/shares", json={"shares": {"g": -1}})
    assert bad.status == 400 and "share" in (await bad.json())["error"]["message"]
    unknown = await fleet.admin("PUT", "/admin/shares", json={"shares": {"nope": 1}})
    assert unknown.status == 404
    not_json = await fleet.admin("PUT", "/admin/shares", data=b"{")
    assert not_json.status == 400
    replicas = await fleet.admin(
        "PUT", "/admin/groups/g", json={"replicas": ["http://127.0.0.1:1"], "quarantined": False}
    )
    assert (
        replicas.status == 400 and "replicas" in (await replicas.json())["error"]["message"]
    )  # the config's
    unknown_group = await fleet.admin("PUT", "/admin/groups/nope", json={"quarantined": True})
    assert (
        unknown_group.status == 404
        and "unknown group: nope" in (await unknown_group.json())["error"]["message"]
    )
    monkeypatch.delenv("RLFLEET_ROUTER_ADMIN_TOKEN")
    assert (await fleet.admin("GET", "/admin/state")).status == 403


async def test_metrics_count_requests_tokens_latency_and_retries(fleet: Fleet) -> None:
    await fleet.start({"g1": 2, "g2": 1})
    fleet.upstreams["g1"][0].state.fail_status = 503
    seen = Counter()
    for s in range(30):
        response = await fleet.generate(f"s{s}", sampling_params={"max_new_tokens": 5})
        assert response.status == 200  # the 503 replica is retried around, never surfaced
        seen[response.headers["X-RLFleet-Group"]] += 1
    text = await (await fleet.http.get(fleet.url + "/metrics")).text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    for group, n in seen.items():
        assert samples[("rlfleet_router_requests_total", (("code", "200"), ("group", group)))] == n
        assert samples[("rlfleet_router_generated_tokens_total", (("group", group),))] == 5 * n
        assert samples[("rlfleet_router_request_seconds_count", (("group", group),))] == n
    failures = samples.get(
        ("rlfleet_router_upstream_errors_total", (("group", "g1"), ("kind", "http_5xx"))), 0
    )
    retries = samples.get(("rlfleet_router_retries_total", (("group", "g1"),)), 0)
    assert failures >= 1 and retries == failures
    assert samples[("rlfleet_router_group_healthy_replicas", (("group", "g2"),))] == 1


async def test_min_weight_version_answers_409_until_a_replica_catches_up(fleet: Fleet) -> None:
    await fleet.start({"g": 2}, weight_version=3)
    await fleet.router.check_health_once()  # learn versions from /model_info
    response = await fleet.generate("s", headers={"X-Min-Weight-Version": "5"})
    assert response.status == 409
    assert response.headers["Retry-After"] == "1"
    assert (await response.json())["error"]["servedVersions"] == [3]
    fleet.upstreams["g"][1].state.weight_version = 5
    await fleet.router.check_health_once()
    for _ in range(5):
        response = await fleet.generate("s", headers={"X-Min-Weight-Version": "5"})
        assert response.status == 200
        assert response.headers["X-RLFleet-Replica"] == fleet.upstreams["g"][1].url
        assert response.headers["X-RLFleet-Weight-Version"] == "5"
    ok = await fleet.generate("s", headers={"X-Min-Weight-Version": "3"})
    assert ok.status == 200
    bad = await fleet.generate("s", headers={"X-Min-Weight-Version": "soon"})
    assert bad.status == 400


async def test_version_learned_from_responses_discards_stale_answers(fleet: Fleet) -> None:
    """Without health checks the router only learns versions from meta_info; a stale answer is
    discarded and retried on the sibling that serves the version."""
    await fleet.start({"g": 2}, weight_version=1)
    fleet.upstreams["g"][0].state.weight_version = 4
    results = [await fleet.generate(f"s{i}", headers={"X-Min-Weight-Version": "4"}) for i in range(10)]
    assert all(r.status == 200 for r in results)
    assert {r.headers["X-RLFleet-Replica"] for r in results} == {fleet.upstreams["g"][0].url}


async def test_a_replica_that_answers_409_itself_is_retried_on_a_sibling(fleet: Fleet) -> None:
    """The router forwards X-Min-Weight-Version; a replica checking it at serving time (like the
    reference sampler) answers 409, and the router tries the sibling, then answers 409 itself."""
    await fleet.start({"g": 2}, weight_version=2, check_min_version=True)
    fleet.upstreams["g"][1].state.weight_version = 6
    results = [await fleet.generate(f"s{i}", headers={"X-Min-Weight-Version": "6"}) for i in range(10)]
    assert all(r.status == 200 for r in results)
    assert {r.headers["X-RLFleet-Replica"] for r in results} == {fleet.upstreams["g"][1].url}
    too_new = await fleet.generate("s", headers={"X-Min-Weight-Version": "9"})
    assert too_new.status == 409 and too_new.headers["Retry-After"] == "1"
    # Without a version request a 409 is the request's own answer and passes through unretried.
    fleet.upstreams["g"][0].state.fail_status = 409
    fleet.upstreams["g"][1].state.fail_status = 409
    plain = await fleet.generate("s")
    assert plain.status == 409 and plain.headers["X-RLFleet-Attempts"] == "1"


async def test_data_plane_key_is_required_and_presented_to_replicas(fleet: Fleet, tmp_path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text("data-key\n")
    await fleet.start(
        {"g": 1}, config_extra={"api_key_file": str(key_file)}, api_key="data-key", weight_version=4
    )
    await fleet.router.check_health_once()  # /model_info needs the key too
    assert fleet.router.table.groups["g"].replicas[fleet.upstreams["g"][0].url].weight_version == 4
    assert (await fleet.generate("s")).status == 401
    assert (await fleet.generate("s", headers={"Authorization": "Bearer nope"})).status == 401
    ok = await fleet.generate("s", headers={"Authorization": "Bearer data-key"})
    assert ok.status == 200
    upstream = fleet.upstreams["g"][0].state
    assert upstream.authorizations == ["Bearer data-key"]  # only the authorised request got through


async def test_without_a_data_plane_key_the_clients_authorization_passes_through(fleet: Fleet) -> None:
    await fleet.start({"g": 1}, api_key="sglang-key")
    assert (await fleet.generate("s")).status == 401  # the replica's own answer
    assert (await fleet.generate("s", headers={"Authorization": "Bearer sglang-key"})).status == 200


async def test_streaming_is_passed_through(fleet: Fleet) -> None:
    await fleet.start({"g": 1})
    response = await fleet.http.post(
        fleet.url + "/generate", json={"input_ids": [1], "stream": True}, headers={"X-Session-Id": "s"}
    )
    body = await response.read()
    assert response.status == 200 and response.headers["X-RLFleet-Group"] == "g"
    events = [line for line in body.split(b"\n\n") if line]
    assert events[-1] == b"data: [DONE]" and len(events) == 4
    assert json.loads(events[0][len(b"data: ") :])["meta_info"]["completion_tokens"] == 1
    assert fleet.router.table.groups["g"].replicas[fleet.upstreams["g"][0].url].inflight == 0


async def test_chat_completions_are_routed_by_session(fleet: Fleet) -> None:
    await fleet.start({"g1": 1, "g2": 1})
    groups = set()
    for _ in range(3):
        response = await fleet.http.post(
            fleet.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "return_meta_info": True},
            headers={"X-Session-Id": "chat-1"},
        )
        assert response.status == 200
        groups.add(response.headers["X-RLFleet-Group"])
    assert len(groups) == 1


async def test_no_routable_group_is_a_503_with_retry_after(fleet: Fleet) -> None:
    await fleet.start({"g": 1})
    await fleet.admin("PUT", "/admin/shares", json={"shares": {"g": 0}})
    response = await fleet.generate("s")
    assert response.status == 503 and response.headers["Retry-After"] == "1"


def _rlfleet(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", *args], capture_output=True, text=True, timeout=60, **kw
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config", "/nonexistent.yaml"], "cannot read router config"),
        (["--group", "nourl"], "NAME=URL"),
        (["--group", "g=ftp://x"], "http://host:port"),
        (["--group", "g=http://127.0.0.1:1@-2"], "greater than or equal to 0"),
        (["--log-level", "LOUD"], "unknown --log-level"),
    ],
)
def test_cli_rejects_bad_input_with_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = _rlfleet("router", "serve", *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_cli_rejects_an_invalid_config_file(tmp_path) -> None:
    config = tmp_path / "router.yaml"
    config.write_text("groups:\n  - name: g\n    shares: 2\n")
    result = _rlfleet("router", "serve", "--config", str(config))
    assert result.returncode == 2 and "groups.0.shares" in result.stderr and "Traceback" not in result.stderr


async def test_cli_serves_until_sigterm(tmp_path) -> None:
    upstream = await InProcessUpstream(UpstreamState("g-0")).start()
    config = tmp_path / "router.yaml"
    config.write_text(f"port: 0\ngroups:\n  - name: g\n    share: 1\n    replicas: ['{upstream.url}']\n")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rlfleet.cli",
        "router",
        "serve",
        "--config",
        str(config),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        assert line.startswith("rlfleet router listening on http://127.0.0.1:")
        url = line.split()[-1]
        async with aiohttp.ClientSession() as http:
            async with http.post(
                url + "/generate", json={"input_ids": [1]}, headers={"X-Session-Id": "s"}
            ) as r:
                assert r.status == 200 and r.headers["X-RLFleet-Group"] == "g"
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await upstream.stop()


async def test_in_flight_counts_return_to_zero_after_upstream_errors(fleet: Fleet) -> None:
    """Least-loaded replica choice reads `inflight`: an attempt that ends in a 5xx or a dead connection
    must give its slot back, or the failed replica looks busy forever (and a sibling idle)."""
    await fleet.start({"g": 3})
    failing, dead, healthy = fleet.upstreams["g"]
    failing.state.fail_status = 503
    await dead.stop()  # connection refused: an UpstreamError, not an HTTP answer
    answers = [await fleet.generate(f"s{i}") for i in range(30)]
    assert [r.status for r in answers] == [200] * 30  # every request retried onto the healthy replica
    replicas = fleet.router.table.groups["g"].replicas
    assert replicas[failing.url].failures >= 1 and replicas[dead.url].failures >= 1  # both paths were taken
    assert {url: r.inflight for url, r in replicas.items()} == {u.url: 0 for u in (failing, dead, healthy)}
