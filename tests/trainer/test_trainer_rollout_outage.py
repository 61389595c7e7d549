"""The rollout driver through a router outage (issue 32 item 7; rlfleet/retries.py `OutagePolicy`).

Real parts: the router's HTTP service (router/service.py) in front of the project's reference sampler
server (SGLang API subset, a tiny model on CPU), the sampler client, and the driver in its own thread,
as the trainer runs it. The outage has two phases without a success between them: first the sampler is
down and the router, up, answers 503 to every request (no replica could serve it), then the router
itself is down (connection refused on its port). Then both come back on their ports.

Asserted exactly, not by timing: no prompt group is dropped; while the circuit is open no new data
position is consumed (the probes are the groups put back); and once the router answers again every
data position the driver consumed produced exactly one complete group."""

from __future__ import annotations

import asyncio
import threading

import pytest
from support.ports import free_port
from support.tiny_models import SERVED_MODEL
from support.waits import wait_for

from rlfleet.retries import ClientRetryPolicy, OutagePolicy
from rlfleet.router.config import GroupConfig, RouterConfig
from rlfleet.router.service import start_service
from rlfleet.sampler.client import SamplerClient
from rlfleet.sampler.http_app import start_reference_server
from rlfleet.sampler.protocol import SamplingConfig
from rlfleet.sampler.reference_engine import EngineConfig, ReferenceEngine, tiny_shape
from rlfleet.trainer.envs.environments import copy_digit
from rlfleet.trainer.envs.prompts import GeneratedPromptSource
from rlfleet.trainer.rollout.driver import PromptGroup, RolloutDriver

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py
MODEL = tiny_shape(**SERVED_MODEL)


def copy_digit_driver(client: SamplerClient, max_ahead: int) -> RolloutDriver:
    """The trainer's rollout driver on copy_digit prompts (2 samples each, 2 new tokens), its outage
    backoff short (20 to 100 ms): its circuit opens and its probes run within a test."""
    return RolloutDriver(
        client,
        copy_digit,
        GeneratedPromptSource("copy_digit"),
        samples_per_prompt=2,
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=2),
        max_seq_len=32,
        max_ahead_prompts=max_ahead,
        outage_policy=OutagePolicy(backoff_initial_s=0.02, backoff_max_s=0.1),
    )


async def probes_fail(driver: RolloutDriver, what: str, probes: int = 2) -> None:
    """Wait (off the event loop the servers run on) until `probes` more of the driver's probes have failed:
    each failed probe is one more held group."""
    held = driver.stats.held_groups
    await asyncio.to_thread(wait_for, what, lambda: driver.stats.held_groups >= held + probes, interval=0.01)


async def look_ahead_filled(driver: RolloutDriver, max_ahead: int) -> None:
    """Wait until the driver's look-ahead is full with nothing in flight: all it produced is in its buffer."""
    await asyncio.to_thread(
        wait_for,
        "the driver's look-ahead to fill (nothing in flight)",
        lambda: driver.buffer.qsize() == max_ahead and driver._in_flight == 0,
        timeout=20,
        interval=0.01,
    )


async def test_a_router_outage_burns_no_prompt_and_training_resumes() -> None:
    sampler_port = free_port()
    sampler = await start_reference_server(
        ReferenceEngine(EngineConfig(model=MODEL, seed=3)), port=sampler_port
    )
    port = free_port()
    # health checks readmit the replica once it is back
    config = RouterConfig(
        port=port,
        retry_after_seconds=0,
        health_interval_seconds=0.2,
        groups=[GroupConfig(name="g", replicas=[sampler.url])],
    )
    router, runner, _ = await start_service(config)
    client = SamplerClient(
        f"http://127.0.0.1:{port}", policy=ClientRetryPolicy(backoff_initial_s=0.001, backoff_max_s=0.002)
    )
    max_ahead = 4
    driver = copy_digit_driver(client, max_ahead)
    taken: list[PromptGroup] = []
    stop = threading.Event()

    def take(n: int) -> None:  # the trainer's side, off the event loop the router serves on
        taken.extend(driver.take(n, timeout=60, stop=stop))

    driver.start()
    try:
        await asyncio.to_thread(take, 6)
        assert len(taken) == 6 and driver.outage is None

        # Phase 1: the sampler is down, so the router answers 503 to every request.
        await sampler.stop()
        await asyncio.to_thread(
            wait_for, "the circuit to open", lambda: driver.outage is not None, interval=0.01
        )
        await probes_fail(driver, "two failed probes")
        position = driver.next_position
        # Phase 2: the router is down (refused); the circuit stays open, probes keep failing.
        await runner.cleanup()
        await router.close()
        await probes_fail(driver, "two probes against the closed port")
        assert driver.outage is not None and driver.stats.router_outages == 1
        # no data position consumed while the circuit was open: the probes were the held groups
        assert driver.next_position == position
        assert driver.stats.failed_groups == 0

        # Both back, on the same port: the next probe closes the circuit, the held groups go first.
        sampler = await start_reference_server(
            ReferenceEngine(EngineConfig(model=MODEL, seed=3)), port=sampler_port
        )
        router, runner, _ = await start_service(config)
        await asyncio.to_thread(take, 6)
        assert len(taken) == 12, (driver.stats, driver.outage, driver._in_flight, driver.held_prompts)
        await look_ahead_filled(driver, max_ahead)
    finally:
        stop.set()
        driver.stop()
        await runner.cleanup()
        await router.close()
        await sampler.stop()
    assert driver.error is None and driver.outage is None and driver.held_prompts == []
    consumed = driver.next_position
    produced = sorted(g.prompt.index for g in [*taken, *driver.buffer.drain()])
    # every data position the driver consumed produced exactly one complete group: none dropped or skipped
    assert produced == list(range(consumed))
    assert all(len(g.rollouts) == 2 and all(r.outcome is not None for r in g.rollouts) for g in taken)
    stats = driver.stats
    assert (stats.failed_groups, stats.router_outages, stats.dispatched_prompts) == (0, 1, consumed)
    assert stats.completed_groups == consumed and stats.redispatched_groups == stats.held_groups >= 4
