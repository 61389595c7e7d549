"""Proof with the project's reference sampler servers (SGLang API subset, the tiny Qwen3 on CPU) throttled to
deliberately different speeds (throttles 1:2:4): shares computed by rebalance.py from their scraped /metrics
and pushed through the router's admin API converge to within 10% of the throughput ratio they
deliver over the last 3 of 5 rebalance intervals; then one group is stopped under load and no request is lost."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from support.router_bench import router_bench, sessions_load
from support.tiny_models import SERVED_MODEL
from support.upstreams import rebalance_inputs

from rlfleet.operator.rebalance import RebalanceConfig, rebalance
from rlfleet.router.config import GroupConfig, RouterConfig
from rlfleet.sampler.reference_engine import EngineConfig, ReferenceEngine, tiny_shape
from rlfleet.sampler.server import start_reference_server

SPEEDS = {"a100-bf16": 50.0, "h100-fp8": 100.0, "b200-nvfp4": 200.0}  # tokens/s (throttle)
FORMATS = {"a100-bf16": "bf16", "h100-fp8": "fp8", "b200-nvfp4": "nvfp4"}
MODEL = tiny_shape(**SERVED_MODEL)
TOKENS = 16
INTERVAL = 3.0
TOKEN = "ref-token"


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.mark.slow
async def test_reference_samplers_shares_converge_and_a_stopped_group_loses_nothing(monkeypatch) -> None:
    monkeypatch.setenv("RLFLEET_ROUTER_ADMIN_TOKEN", TOKEN)
    answers: list[tuple[int, str | None]] = []
    async with router_bench() as bench:
        servers = {
            name: bench.stop_at_close(
                await start_reference_server(
                    ReferenceEngine(
                        EngineConfig(
                            model=MODEL, seed=3, weight_format=FORMATS[name], max_tokens_per_second=tps
                        )
                    )
                )
            )
            for name, tps in SPEEDS.items()
        }
        config = RouterConfig(
            port=0,
            groups=[GroupConfig(name=n, replicas=[s.url]) for n, s in servers.items()],
            health_interval_seconds=0.5,
        )
        await bench.start_router(config, connections=0)
        http = bench.http
        assert http is not None

        def body(index: int) -> dict[str, Any]:
            return {
                "input_ids": [1, 2, 3, index % 60],
                "sampling_params": {"max_new_tokens": TOKENS, "temperature": 1.0},
                "return_logprob": True,
            }

        def record(response: aiohttp.ClientResponse) -> None:
            answers.append((response.status, response.headers.get("X-RLFleet-Group")))

        async with sessions_load(bench, 64, body, 4, record):
            rebalance_config = RebalanceConfig(min_share=0.0)  # defaults otherwise: 0.1 per interval, EMA 0.5
            loop = asyncio.get_running_loop()
            state, result = None, None
            readings: list[tuple[float, dict[str, float]]] = []
            for interval in range(6):  # interval 0 only takes the first counter reading
                if interval:
                    await asyncio.sleep(INTERVAL)
                inputs = await rebalance_inputs(http, {name: u.url for name, u in servers.items()})
                now = loop.time()
                readings.append(
                    (now, {g.name: next(iter(g.pods.values())).realtime_decode_tokens_total for g in inputs})
                )
                result = rebalance(inputs, state, now, rebalance_config)
                state = result.state
                async with http.put(
                    bench.url + "/admin/shares",
                    json={"shares": result.shares},
                    headers={"Authorization": f"Bearer {TOKEN}"},
                ) as response:
                    assert response.status == 200
            # The throughput ratio the samplers really delivered (the throttle is a ceiling: a CPU step
            # also takes time on this shared box), from the per-step decode counters (generation_tokens_total
            # moves only when a request finishes: lumpy over a few seconds) over the last 3 intervals: the
            # shares' EMA (0.5) weighs those 7/8, and on a loaded box the first intervals' rates differ.
            (t0, first), (t1, last) = readings[2], readings[-1]
            delivered = {n: (last[n] - first[n]) / (t1 - t0) for n in SPEEDS}
            assert delivered["a100-bf16"] < delivered["h100-fp8"] < delivered["b200-nvfp4"]
            assert delivered["b200-nvfp4"] >= 2.5 * delivered["a100-bf16"], (
                delivered
            )  # deliberately different
            ratio = {n: d / sum(delivered.values()) for n, d in delivered.items()}
            for name in SPEEDS:
                assert abs(result.shares[name] - ratio[name]) <= 0.1 * ratio[name], (
                    result.shares,
                    ratio,
                    delivered,
                )

            # The fastest group goes away under load: its sessions move, nothing is lost.
            await servers["b200-nvfp4"].stop()  # graceful: in-flight requests finish, then it is gone
            before = len(answers)
            await asyncio.sleep(4.0)
            after = answers[before:]
            assert len(after) >= 10
            assert {group for _, group in after} <= {"a100-bf16", "h100-fp8"}
    assert all(status == 200 for status, _ in answers), [a for a in answers if a[0] != 200][:5]
