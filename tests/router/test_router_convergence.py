"""Proof: with upstreams of deliberately different speeds, shares computed by rebalance.py from
LIVE scraped /metrics and pushed through the router's admin API converge to within 10% of the
throughput ratio within 3 rebalance intervals. Everything is real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest
from support.router_bench import router_bench, sessions_load
from support.upstreams import InProcessUpstream, UpstreamState, rebalance_inputs

from rlfleet.operator.rebalance import RebalanceConfig, rebalance
from rlfleet.router.config import GroupConfig, RouterConfig

TOKEN = "t0ken"
CAPACITY = {"a100-bf16": 100.0, "h100-fp8": 200.0, "b200-nvfp4": 400.0}  # tokens/s, deliberately 1:2:4
TOKENS_PER_REQUEST = 32
INTERVAL = 2.0


@pytest.mark.slow
async def test_shares_converge_to_the_throughput_ratio_within_3_intervals(monkeypatch) -> None:
    monkeypatch.setenv("RLFLEET_ROUTER_ADMIN_TOKEN", TOKEN)
    statuses: list[int] = []  # every answer (checked after the run: no assertion inside a task)
    async with router_bench() as bench:
        upstreams = {
            name: bench.stop_at_close(
                await InProcessUpstream(
                    UpstreamState(name, tokens_per_second=tps, tokens_per_request=TOKENS_PER_REQUEST)
                ).start()
            )
            for name, tps in CAPACITY.items()
        }
        config = RouterConfig(
            port=0, groups=[GroupConfig(name=n, replicas=[u.url]) for n, u in upstreams.items()]
        )
        router = await bench.start_router(config, health_checks=False, connections=0)
        http = bench.http
        assert http is not None
        body = {"input_ids": [1], "sampling_params": {"max_new_tokens": TOKENS_PER_REQUEST}}
        async with sessions_load(
            bench, 48, lambda index: body, 3, lambda response: statuses.append(response.status)
        ):
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
                    bench.url + "/admin/shares",
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
                assert measured[name] / sum(measured.values()) == pytest.approx(ratio[name], rel=0.05), (
                    measured
                )
    assert len(statuses) > 100 and set(statuses) == {200}, [s for s in statuses if s != 200][:5]
