"""The bound on the upstream posts of ONE rollout turn (rlfleet/retries.py, docs/architecture.md "Retries").

The whole real path: the rollout driver (`RolloutDriver.run_group`, one prompt, one sample, one turn)
-> the sampler client -> the router's HTTP service -> real aiohttp replicas on 127.0.0.1, which count
every `/generate` post they receive. Only the client's waits are shortened; every attempt count is the
default policy's. Each layer retries only its own concern, so the posts are exactly (client posts) x
(router attempts per post), with no third factor from the driver.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web
from support.upstreams import InProcessUpstream, UpstreamState

from rlfleet.records import SampledTurn
from rlfleet.retries import ROUTER_MAX_ATTEMPTS, ClientRetryPolicy, OutagePolicy, turn_upstream_posts
from rlfleet.router.config import GroupConfig, RouterConfig
from rlfleet.router.service import start_service
from rlfleet.sampler.client import SamplerClient
from rlfleet.sampler.protocol import SamplingConfig
from rlfleet.trainer.envs.environments import copy_digit, copy_digit_prompt
from rlfleet.trainer.rollout.driver import RolloutDriver

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "sampler" / "fixtures"
# Default attempt counts; only the waits are shortened (the router answers Retry-After: 0 too).
POLICY = ClientRetryPolicy(backoff_initial_s=0.001, backoff_max_s=0.002, version_wait_cap_s=0.001)
SAMPLING = SamplingConfig(temperature=1.0, top_p=0.9, top_k=4096, max_new_tokens=3)


async def _one_turn(
    groups: dict[str, list[str]], min_weight_version: int | None = None
) -> tuple[RolloutDriver, SamplerClient]:
    """Run one prompt group of one single-turn episode through client -> router -> `groups`.
    The worst case: the router keeps counting every replica healthy (as when health checks bring them
    back between requests), so it never skips one; a replica it marked down is skipped while another
    group is left, and the turn then costs fewer posts."""
    config = RouterConfig(
        port=0,
        retry_after_seconds=0,
        failure_threshold=1000,
        groups=[GroupConfig(name=g, replicas=urls) for g, urls in groups.items()],
    )
    router, runner, port = await start_service(config, health_checks=False)
    client = SamplerClient(f"http://127.0.0.1:{port}", policy=POLICY)
    try:

        async def generate(session: str, ids: list[int], sampling: SamplingConfig) -> SampledTurn:
            return await client.generate(
                ids, sampling, session_id=session, min_weight_version=min_weight_version
            )

        driver = RolloutDriver(
            generate,
            copy_digit,
            None,
            samples_per_prompt=1,  # type: ignore[arg-type]
            sampling=SAMPLING,
            max_seq_len=64,
        )
        assert await driver.run_group(copy_digit_prompt(0, 3)) is None  # the turn failed: no group
    finally:
        await client.aclose()
        await runner.cleanup()
        await router.close()
    # The driver did not retry the failed turn: one call of the client, one error. The turn failed
    # "unavailable", so the group is put back for the driver's outage probe, not dropped (issue 32).
    assert (driver.stats.generate_errors, driver.stats.failed_groups, driver.stats.held_groups) == (1, 0, 1)
    assert driver.held_prompts == [0] and driver.outage is not None
    return driver, client


@pytest.mark.parametrize(("layout", "bound"), [((5, 5), 32), ((2, 1), 12)])
async def test_every_replica_failing_costs_one_turn_exactly_the_bound(
    layout: tuple[int, ...], bound: int
) -> None:
    """Every replica answers 503: the router tries each at most once and at most 8 per request (across
    both groups); the client retries the router's 503 three times; the driver not at all."""
    replicas = {
        f"g{i}": [
            await InProcessUpstream(UpstreamState(f"g{i}-{j}", fail_status=503)).start() for j in range(n)
        ]
        for i, n in enumerate(layout)
    }
    try:
        _, client = await _one_turn({g: [u.url for u in ups] for g, ups in replicas.items()})
    finally:
        for ups in replicas.values():
            for u in ups:
                await u.stop()
    posts = sum(len(u.state.sessions) for ups in replicas.values() for u in ups)
    assert posts == bound == turn_upstream_posts(POLICY, sum(layout), every_replica_fails=True)
    assert bound == (1 + 3) * min(ROUTER_MAX_ATTEMPTS, sum(layout))
    assert client.stats.requests == 4 and dict(client.stats.failures) == {"unavailable": 1}
    assert all(
        len(u.state.sessions) <= 4 for ups in replicas.values() for u in ups
    )  # once per router request


class ScriptedReplicas:
    """Real aiohttp replicas that share one script: post n (counted over all of them) gets `answer(n)`."""

    def __init__(self, answer: Callable[[int], tuple[int, object]]) -> None:
        self.answer = answer
        self.posts = 0
        self.runners: list[web.AppRunner] = []

    async def _generate(self, request: web.Request) -> web.Response:
        await request.read()
        status, body = self.answer(self.posts)
        self.posts += 1
        return web.json_response(body, status=status)

    async def start(self, n: int) -> list[str]:
        urls = []
        for _ in range(n):
            app = web.Application()
            app.router.add_post("/generate", self._generate)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.runners.append(runner)
            urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
        return urls

    async def stop(self) -> None:
        for runner in self.runners:
            await runner.cleanup()


async def test_the_worst_mix_of_failures_costs_one_turn_at_most_27_x_8_posts() -> None:
    """Every concern retried to its limit, each client post costing the router its 8 attempts (7
    replica failures, then the post's own answer): 3 router 503s, 20 version conflicts, 2 mask-cap
    400s, one 500, then a last 503 ends the turn. 27 x 8 = 216, the bound of any mix."""
    busy = (503, {"error": {"message": "queue full"}})
    overflow = (400, json.loads((FIXTURES / "sglang_error_400_mask_overflow.json").read_text())["response"])
    outside = (500, json.loads((FIXTURES / "sglang_error_500_outside_mask.json").read_text())["response"])
    behind = (409, {"error": {"message": "weight version behind"}})
    script = [busy] * 3 + [behind] * 20 + [overflow] * 2 + [outside] + [busy]  # one answer per client post

    def answer(n: int) -> tuple[int, object]:
        post, attempt = divmod(n, ROUTER_MAX_ATTEMPTS)
        return script[post] if attempt == ROUTER_MAX_ATTEMPTS - 1 else busy

    replicas = ScriptedReplicas(answer)
    urls = await replicas.start(10)
    try:
        _, client = await _one_turn({"a": urls[:5], "b": urls[5:]}, min_weight_version=1)
    finally:
        await replicas.stop()
    assert len(script) == POLICY.max_posts == client.stats.requests == 27
    assert replicas.posts == 216 == turn_upstream_posts(POLICY, 10, every_replica_fails=False)
    assert dict(client.stats.retries) == {
        "http_503": 3,
        "version_conflict": 20,
        "shrink_top_k": 2,
        "server_error": 1,
    }
    assert dict(client.stats.failures) == {"unavailable": 1}


def test_the_docs_state_the_bounds_the_code_has() -> None:
    """docs/architecture.md "Retries" is the one statement of the policy; its numbers are the code's."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc[doc.index("## Retries") :]
    section = section[: section.index("\n## ", 1)]
    p, outage = ClientRetryPolicy(), OutagePolicy()
    for stated in (
        f"`maxAttempts` ({ROUTER_MAX_ATTEMPTS})",
        f"`max_transport_retries` ({p.max_transport_retries})",
        f"`max_version_retries` ({p.max_version_retries})",
        f"`max_shrink_retries` ({p.max_shrink_retries})",
        f"`max_server_error_retries` ({p.max_server_error_retries})",
        f"{p.max_posts} x {ROUTER_MAX_ATTEMPTS} = {turn_upstream_posts(p, 8, every_replica_fails=False)}",
        f"(1 + {p.max_transport_retries}) x {ROUTER_MAX_ATTEMPTS} = {turn_upstream_posts(p, 8, every_replica_fails=True)}",
        f"{outage.backoff_initial_s:g} s doubling to {outage.backoff_max_s:g} s",
    ):
        assert stated in section, stated
