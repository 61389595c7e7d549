"""Proof: with upstreams of deliberately different speeds, shares computed by rebalance.py from
LIVE scraped /metrics and pushed through the router's admin API converge to within 10% of the
throughput ratio within 3 rebalance intervals. Everything is real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from support.upstreams import InProcessUpstream, UpstreamState, rebalance_inputs

from rlfleet.operator.rebalance import RebalanceConfig, rebalance
from rlfleet.router.config import GroupConfig, RouterConfig
from rlfleet.router.service import start_service

TOKEN = "t0ken"
CAPACITY = {"a100-bf16": 100.0, "h100-fp8": 200.0, "b200-nvfp4": 400.0}  # tokens/s, deliberately 1:2:4
TOKENS_PER_REQUEST = 32
INTERVAL = 2.0


@pytest.mark.slow
async def test_shares_converge_to_the_throughput_ratio_within_3_intervals(monkeypatch) -> None:
    monkeypatch.setenv("RLFLEET_ROUTER_ADMIN_TOKEN", TOKEN)
    upstreams = {
        name: await InProcessUpstream(
            UpstreamState(name, tokens_per_second=tps, tokens_per_request=TOKENS_PER_REQUEST)
        ).start()
        for name, tps in CAPACITY.items()
    }
    config = RouterConfig(port=0, groups=[GroupConfig(name=n, replicas=[u.url]) for n, u in upstreams.items()])
    router, runner, port = await start_service(config, health_checks=False)
    url = f"http://127.0.0.1:{port}"
    stop = asyncio.Event()
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    statuses: list[int] = []  # every answer (checked after the run: no assertion inside a task)

    async def worker(index: int) -> None:
        turn = 0
        while not stop.is_set():
            turn += 1
            async with http.post(
                url + "/generate",
                json={"input_ids": [1], "sampling_params": {"max_new_tokens": TOKENS_PER_REQUEST}},
                headers={"X-Session-Id": f"w{index}-t{turn // 3}"},  # 3 turns per session
            ) as response:
                await response.read()
                statuses.append(response.status)

    workers = [asyncio.create_task(worker(i)) for i in range(48)]
    try:
        # The RLJob defaults (max change 0.1 per interval, EMA 0.5) without the 0.02 share floor, which
        # deliberately keeps the smallest group above its ratio (0.02 + 0.94 x 0.143 = 0.154 here).
        rebalance_config = RebalanceConfig(min_share=0.0)
        loop = asyncio.get_running_loop()
        state = None
        history = []
        for interval in range(4):  # interval 0 only takes the first counter reading
            if interval:
                await asyncio.sleep(INTERVAL)
            inputs = await rebalance_inputs(http, {name: u.url for name, u in upstreams.items()})
            result = rebalance(inputs, state, loop.time(), rebalance_config)
            state = result.state
            async with http.put(
                url + "/admin/shares",
                json={"shares": result.shares, "reason": "test"},
                headers={"Authorization": f"Bearer {TOKEN}"},
            ) as response:
                assert response.status == 200
            history.append(result)
        assert router.table.effective_shares() == pytest.approx(history[-1].shares)
        ratio = {n: c / sum(CAPACITY.values()) for n, c in CAPACITY.items()}
        final = history[-1].shares
        for name in CAPACITY:
            assert abs(final[name] - ratio[name]) <= 0.1 * ratio[name], (name, final, ratio)
        measured = {n: history[-1].groups[n].tokens_per_second for n in CAPACITY}
        for name in CAPACITY:  # the groups stayed saturated: delivered throughput has the capacity ratio
            assert measured[name] / sum(measured.values()) == pytest.approx(ratio[name], rel=0.05), measured
    finally:
        stop.set()
        results = await asyncio.gather(*workers, return_exceptions=True)
        await http.close()
        await runner.cleanup()
        await router.close()
        for u in upstreams.values():
            await u.stop()
    crashed = [r for r in results if r is not None]
    assert crashed == [], f"{len(crashed)} load workers crashed: {crashed[:3]!r}"
    assert len(statuses) > 100 and set(statuses) == {200}, [s for s in statuses if s != 200][:5]
