"""Elastic and spot sampler groups lose no episode (issue 30 item 4; docs/router.md "Replicas that come
and go").

Real parts: three reference sampler PROCESSES (`rlfleet sampler serve --engine reference`, the tiny Qwen3
on CPU, throttled so turns are in flight), one group's replicas as a headless Service gives them: one
port, an address each (127.0.0.1 / .2 / .3), the router following the name's answer (the answer is the
test's: the Service's ready pods); the router's HTTP service, the sampler client, and the rollout driver
in its own thread with the multi-turn retry_digit environment, as the trainer runs it. Each replica
serves its own weight version (3, 4, 5), so every token's version says which replica made it.

Mid-run: replica C joins (the group scaled up: it starts from the newest version, 5) and takes sessions;
replica A is scaled down (SIGTERM with its turns in flight, and it leaves the answer): it refuses new
connections and finishes what it holds, then exits 0; replica B is reclaimed (SIGKILL with turns in
flight): the router retries them on C from the same ids. Asserted on every episode the driver handed
over: turn k+1 was asked from exactly prompt + every sampled id + every environment id so far, each
token keeps the version of the replica that made it, groups are whole and scored; nothing was dropped
(failed_groups 0), and the router's counters show B's in-flight turns failing and being retried."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.ports import free_port
from support.processes import die_with_parent
from support.waits import eventually

from rlfleet.records import SampledTurn
from rlfleet.retries import ClientRetryPolicy
from rlfleet.router.config import GroupConfig, RouterConfig
from rlfleet.router.service import start_service
from rlfleet.sampler.client import SamplerClient
from rlfleet.sampler.protocol import SamplingConfig
from rlfleet.trainer.envs.environments import RetryDigitEnv
from rlfleet.trainer.envs.prompts import GeneratedPromptSource
from rlfleet.trainer.rollout.driver import PromptGroup, RolloutDriver

SERVICE = "samplers"  # the group's headless Service name
VERSIONS = {"127.0.0.1": 3, "127.0.0.2": 4, "127.0.0.3": 5}  # A, B, C (C joins with the newest)
A, B, C = VERSIONS
TOKENS_PER_SECOND = 20  # each replica's throttle: a 3-token turn among a dozen sessions takes ~1 s


class Replica:
    """One sampler pod: `rlfleet sampler serve --engine reference` on address:port, its own process."""

    def __init__(self, address: str, port: int, tmp: Path) -> None:
        self.address = address
        self.url = f"http://{address}:{port}"
        self.port_file = tmp / f"port-{address}"
        argv = [
            sys.executable,
            "-m",
            "rlfleet.cli",
            "sampler",
            "serve",
            "--engine",
            "reference",
            "--host",
            address,
            "--port",
            str(port),
            "--port-file",
            str(self.port_file),
            "--weight-version",
            str(VERSIONS[address]),
            "--max-tokens-per-second",
            str(TOKENS_PER_SECOND),
            "--hidden-size",
            "32",
            "--head-dim",
            "16",
            "--num-hidden-layers",
            "1",
            "--seed",
            "3",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=die_with_parent
        )

    def listening(self) -> bool:
        assert self.process.poll() is None, self.process.stderr.read().decode() if self.process.stderr else ""
        return self.port_file.exists() and bool(self.port_file.read_text())

    async def running_requests(self, http: aiohttp.ClientSession) -> float:
        async with http.get(self.url + "/metrics") as response:
            text = await response.text()
        return sum(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "sglang:num_running_reqs"
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


@dataclass
class RecordedGenerate:
    """The driver's generate function (the sampler client) with when each turn started and ended."""

    client: SamplerClient
    turns: list[tuple[str, float, float, str]] = field(default_factory=list)  # session, start, end, replica

    async def __call__(self, session: str, ids: list[int], sampling: SamplingConfig) -> SampledTurn:
        start = time.monotonic()
        turn = await self.client(session, ids, sampling)
        self.turns.append((session, start, time.monotonic(), turn.replica))
        return turn

    async def aclose(self) -> None:
        await self.client.aclose()


def address_of(replica_url: str) -> str:
    return replica_url.split("//", 1)[1].rsplit(":", 1)[0]


async def router_counter(http: aiohttp.ClientSession, url: str, name: str) -> float:
    async with http.get(url + "/metrics") as response:
        text = await response.text()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


@pytest.mark.slow
async def test_replicas_added_scaled_down_and_reclaimed_mid_rollout_lose_no_episode(tmp_path: Path) -> None:
    port = free_port()
    replicas = {a: Replica(a, port, tmp_path) for a in (A, B)}
    answer = [A, B]  # the Service's ready pods

    async def lookup(host: str) -> list[str]:
        assert host == SERVICE
        return list(answer)

    await eventually(lambda: all(r.listening() for r in replicas.values()), "A and B listening", 120)
    config = RouterConfig(
        port=0,
        resolve_interval_seconds=0.1,
        health_interval_seconds=0.2,
        groups=[GroupConfig(name="g", replicas=[f"http://{SERVICE}:{port}"])],
    )
    router, runner, router_port = await start_service(config, resolve=lookup)
    router_url = f"http://127.0.0.1:{router_port}"
    generate = RecordedGenerate(
        SamplerClient(router_url, policy=ClientRetryPolicy(backoff_initial_s=0.01, backoff_max_s=0.05))
    )
    driver = RolloutDriver(
        generate,
        RetryDigitEnv(max_turns=4),
        GeneratedPromptSource("retry_digit"),
        samples_per_prompt=2,
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=3),
        max_seq_len=64,
        max_ahead_prompts=6,
    )
    taken: list[PromptGroup] = []
    stop = threading.Event()

    def trainer() -> None:  # the trainer's side, in its own thread: it keeps taking what the driver makes
        while not stop.is_set():
            taken.extend(driver.take(1, 0.5, stop))

    def taken_past(index: int) -> bool:
        assert driver.error is None, driver.error
        return any(g.prompt.index >= index for g in taken)

    http = aiohttp.ClientSession()
    driver.start()
    consumer = threading.Thread(target=trainer, name="trainer", daemon=True)
    consumer.start()
    try:
        await eventually(lambda: len(taken) >= 3, "3 groups", 180)
        # Scale up: C starts (from the newest version) and joins the Service's answer.
        replicas[C] = Replica(C, port, tmp_path)
        await eventually(replicas[C].listening, "C listening", 120)
        answer.append(C)
        await eventually(lambda: any(address_of(t[3]) == C for t in generate.turns), "a turn served by C", 60)

        # Scale down A: SIGTERM while it holds turns (the pod leaves the Service's answer as it terminates).
        await eventually(lambda: replicas[A].running_requests(http), "turns in flight on A", 60)
        answer.remove(A)
        replicas[A].process.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()
        assert await asyncio.to_thread(replicas[A].process.wait, 60) == 0  # it finished and exited cleanly

        # Spot reclaim of B: SIGKILL while it holds turns.
        errors_before = await router_counter(http, router_url, "rlfleet_router_upstream_errors_total")
        retries_before = await router_counter(http, router_url, "rlfleet_router_retries_total")
        await eventually(lambda: replicas[B].running_requests(http), "turns in flight on B", 60)
        replicas[B].process.kill()
        killed_at = time.monotonic()
        answer.remove(B)
        replicas[B].process.wait(timeout=30)
        # every group dispatched before the kill (those in flight at the SIGTERM and at the kill among
        # them) reaches the trainer whole, or is dropped and counted; and groups started after it too
        dispatched_at_kill = driver.stats.dispatched_prompts
        await eventually(
            lambda: (
                driver.stats.failed_groups > 0
                or (
                    set(range(dispatched_at_kill)) <= {g.prompt.index for g in taken}
                    and taken_past(dispatched_at_kill + 1)
                )
            ),
            "every group dispatched before the kill, and one after it",
            180,
        )
        errors = (
            await router_counter(http, router_url, "rlfleet_router_upstream_errors_total") - errors_before
        )
        retries = await router_counter(http, router_url, "rlfleet_router_retries_total") - retries_before
    finally:
        stop.set()
        await asyncio.to_thread(consumer.join, 30)
        await asyncio.to_thread(driver.stop, 30)
        await http.close()
        await runner.cleanup()
        await router.close()
        for r in replicas.values():
            r.stop()

    assert driver.error is None
    # nothing dropped: every turn on a removed replica finished there (A) or was retried elsewhere (B)
    assert driver.stats.failed_groups == 0 and driver.stats.generate_errors == 0, driver.stats
    assert errors >= 1 and retries >= 1, (errors, retries)  # B's in-flight turns failed and were retried

    groups = [*taken, *driver.buffer.drain()]
    assert len({g.prompt.index for g in groups}) == len(groups)
    for g in groups:
        assert len(g.rollouts) == 2 and all(r.outcome is not None for r in g.rollouts)
        for r in g.rollouts:
            so_far = list(g.prompt.input_ids)
            for turn, env_ids in zip(r.turns, r.env_ids, strict=True):
                assert turn.prompt_ids.tolist() == so_far, r.uid  # the exact ids so far, never re-tokenised
                # each token keeps the version of the replica that made it
                assert turn.weight_versions.tolist() == [VERSIONS[address_of(turn.replica)]] * turn.num_tokens
                so_far += turn.output_ids.tolist() + list(env_ids)
            assert r.token_ids().tolist() == so_far
            assert np.array_equal(r.weight_versions(), np.concatenate([t.weight_versions for t in r.turns]))

    # A finished turns it held at the SIGTERM (asked before, answered after, by A itself)
    assert any(address_of(rep) == A and start < sigterm_at < end for _, start, end, rep in generate.turns)
    assert not any(address_of(rep) == A and start > sigterm_at + 1.0 for _, start, _, rep in generate.turns)
    assert not any(address_of(rep) == B and start > killed_at for _, start, _, rep in generate.turns)
    # sessions moved mid-episode: an episode with turns by B and then by C, continued from its exact ids
    served_by = [[address_of(t.replica) for t in r.turns] for g in groups for r in g.rollouts]
    assert any(B in by and by[-1] == C for by in served_by), "no episode continued on C after B"
    # the replica added mid-run took sessions: episodes started on it
    assert any(address_of(r.turns[0].replica) == C for g in groups for r in g.rollouts)
