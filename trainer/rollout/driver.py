"""Asynchronous rollout driver: prompts -> sessions through the router -> token-exact trajectories ->
environment reward -> buffer of prompt groups.

Runs in its own thread with its own asyncio loop, so generation keeps going while the trainer
computes a step (fully asynchronous: nothing waits for a weight update; staleness is recorded, not
prevented). Per prompt it starts `samples_per_prompt` sessions (session id `p<index>/<k>`, the
router keeps a session on one group); each session loops turn by turn: generate from the exact ids
so far, let the environment answer, append the environment's ids (loss mask 0) and continue. The
trajectory is never detokenised: turn k's `prompt_ids` ARE the ids of the trajectory so far (checked).

Invariants the tests pin:
- every trajectory is scored exactly once (`env.score` at episode end, nowhere else);
- a prompt group reaches the buffer once, complete, or not at all (failures are counted);
- the ids sent for turn k+1 equal the prompt + all sampled ids + all environment ids so far.

Failures: the driver retries no turn. The generate function (the sampler client) has already retried
what can heal, each concern once and bounded (rlfleet/retries.py: the router across replicas, the
client the router's unavailability, a lagging weight version, the mask cap); a turn it gives up on
drops its prompt group, which is counted (`failed_groups`, `generate_errors`). Except one: a turn that
failed because the router is unavailable (`TurnFailed("unavailable")`: refused, timed out or 503 past
the client's retries) says nothing about the prompt. That group is put back (`held_groups`; its
prompt index is dispatched again, never skipped) and the circuit opens: no new prompt is dispatched,
and after each wait of `OutagePolicy` (capped exponential backoff with jitter) one group probes the
router; the first turn that succeeds closes the circuit. So an outage costs no prompt, however long.

Backpressure: at most `max_ahead_prompts` prompt groups are in flight or buffered. Staleness is
unbounded by default; `max_staleness` is enforced where the trainer takes a batch (stale groups are
dropped and counted), because only the trainer knows its version at training time.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import queue
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import numpy as np

from rlfleet.records import SampledTurn
from rlfleet.retries import OutagePolicy
from rlfleet.sampler.client import TurnFailed
from rlfleet.sampler.protocol import SamplingConfig
from rlfleet.trainer.envs.environments import Environment, EpisodeOutcome
from rlfleet.trainer.envs.prompts import Prompt, PromptSource

log = logging.getLogger(__name__)

# async (session_id, input_ids, sampling) -> SampledTurn: sampler/client.py `SamplerClient`, or the
# experiments' in-process fleet
GenerateFn = Callable[[str, list[int], SamplingConfig], Awaitable[SampledTurn]]


@dataclass
class Rollout:
    """One episode: the prompt, every model turn as the sampler recorded it, the env ids between."""

    prompt: Prompt
    sample: int  # k in 0..samples_per_prompt-1
    turns: list[SampledTurn] = field(default_factory=list)
    env_ids: list[list[int]] = field(default_factory=list)  # env tokens appended after turn i
    outcome: EpisodeOutcome | None = None
    dispatched_at: float = 0.0
    finished_at: float = 0.0

    @property
    def uid(self) -> str:
        return f"p{self.prompt.index}/{self.sample}"

    @property
    def scored(self) -> EpisodeOutcome:
        """The outcome of a finished episode (batches and metrics hold only scored ones)."""
        if self.outcome is None:
            raise RuntimeError(f"{self.uid}: the episode has not been scored")
        return self.outcome

    def token_ids(self) -> np.ndarray:
        """int64 [L]: prompt + turn_0 output + env_0 + turn_1 output + ... (the exact sampled ids)."""
        parts: list[np.ndarray] = [np.asarray(self.prompt.input_ids, dtype=np.int64)]
        for turn, env in zip(self.turns, self.env_ids, strict=True):
            parts.append(np.asarray(turn.output_ids, dtype=np.int64))
            parts.append(np.asarray(env, dtype=np.int64))
        return np.concatenate(parts)

    def loss_mask(self) -> np.ndarray:
        """bool [L]: True exactly at sampled (model-generated) positions."""
        parts = [np.zeros(len(self.prompt.input_ids), dtype=bool)]
        for turn, env in zip(self.turns, self.env_ids, strict=True):
            parts.append(np.ones(turn.num_tokens, dtype=bool))
            parts.append(np.zeros(len(env), dtype=bool))
        return np.concatenate(parts)

    def completion_ids(self) -> list[int]:
        return [int(t) for turn in self.turns for t in turn.output_ids]

    @property
    def num_sampled(self) -> int:
        return sum(t.num_tokens for t in self.turns)

    def weight_versions(self) -> np.ndarray:
        if not self.turns:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.asarray(t.weight_versions, dtype=np.int64) for t in self.turns])

    @property
    def min_version(self) -> int:
        v = self.weight_versions()
        return int(v.min()) if v.size else 0

    @property
    def group(self) -> str:
        """The sampler group of the first turn (sessions are sticky; per-token groups come from turns)."""
        return self.turns[0].group if self.turns else ""


def turn_stop_ids(env: Environment, sampling: SamplingConfig) -> list[int]:
    """The stop ids of every model turn: the sampling's own and the environment's (e.g. END_CALL)."""
    return list(dict.fromkeys([*sampling.stop_token_ids, *env.stop_token_ids]))


class Episode:
    """One episode in progress, turn by turn: the environment answers each sampled turn and its ids are
    appended (never re-tokenised). Both rollout sources drive it: `RolloutDriver` (one HTTP session per
    episode) and the ablation's lockstep rollouts (experiments/ablation.py, batched per sampler group)."""

    def __init__(self, env: Environment, rollout: Rollout) -> None:
        self.env, self.rollout = env, rollout
        self.state = env.start(rollout.prompt)
        self.ids: list[int] = list(rollout.prompt.input_ids)  # the trajectory so far
        self.done = False

    def budget(self, max_new_tokens: int, max_seq_len: int) -> int:
        """Tokens the next turn may sample (<= 0: the context is full, the episode cannot go on)."""
        return min(int(max_new_tokens), int(max_seq_len) - len(self.ids))

    def add_turn(self, turn: SampledTurn) -> bool:
        """Record a sampled turn and the environment's answer; True when the episode ended."""
        if list(np.asarray(turn.prompt_ids).tolist()) != self.ids:
            raise RuntimeError(f"{self.rollout.uid}: sampler echoed different prompt ids (re-tokenised?)")
        out_ids = [int(t) for t in turn.output_ids]
        step = self.env.step(self.rollout.prompt, self.state, out_ids, turn.finish_reason)
        append = [] if step.done else [int(t) for t in step.append_ids]
        self.rollout.turns.append(turn)
        self.rollout.env_ids.append(append)
        self.ids = self.ids + out_ids + append
        self.done = step.done
        return step.done

    def score(self) -> EpisodeOutcome:
        r = self.rollout
        r.outcome = self.env.score(r.prompt, self.state, [[int(t) for t in t_.output_ids] for t_ in r.turns])
        return r.outcome


@dataclass
class PromptGroup:
    """All samples of one prompt (the GRPO group)."""

    prompt: Prompt
    rollouts: list[Rollout]

    def staleness(self, trainer_version: int) -> int:
        """Trainer version minus the OLDEST weight version any token of the group was sampled with."""
        return max(0, trainer_version - min(r.min_version for r in self.rollouts))


class RolloutStallError(TimeoutError):
    """No complete prompt group for the loop's stall limit (trainer/loop.py): the samplers or the router
    produce nothing. Its own class so that the entrypoints can say so in one line (trainer/failures.py)."""


@dataclass
class DriverStats:
    dispatched_prompts: int = 0  # new prompt indices dispatched (data positions consumed)
    completed_groups: int = 0
    failed_groups: int = 0  # dropped: their prompts are consumed
    held_groups: int = 0  # put back because the router was unavailable: dispatched again, not consumed
    redispatched_groups: int = 0
    router_outages: int = 0  # times the circuit opened
    generate_errors: int = 0
    scored_episodes: int = 0
    sampled_tokens: int = 0
    generate_seconds: float = 0.0


class RolloutBuffer:
    """Thread-safe FIFO of complete prompt groups between the rollout thread and the trainer."""

    def __init__(self) -> None:
        self._q: queue.Queue[PromptGroup] = queue.Queue()

    def put(self, group: PromptGroup) -> None:
        self._q.put(group)

    def qsize(self) -> int:
        return self._q.qsize()

    def take(
        self, n: int, timeout: float | None = None, stop: threading.Event | None = None
    ) -> list[PromptGroup]:
        """Block until `n` groups are available (or `stop` is set / timeout: returns what it has)."""
        out: list[PromptGroup] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(out) < n:
            if stop is not None and stop.is_set():
                break
            wait = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if wait <= 0:
                break
            try:
                out.append(self._q.get(timeout=wait))
            except queue.Empty:
                continue
        return out

    def drain(self) -> list[PromptGroup]:
        out = []
        while True:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                return out


@dataclass
class Outage:
    """The router has been unavailable since `since` (the circuit is open)."""

    since: float
    last_error: str
    attempt: int = 1  # probes so far + 1: the backoff's attempt number
    retry_at: float = 0.0  # when the next probe may go
    probe: int | None = None  # the prompt index of the probe group in flight

    def describe(self, now: float) -> str:
        return f"the router has been unavailable for {now - self.since:.0f}s (last error: {self.last_error})"


def router_unavailable(exc: BaseException) -> bool:
    """A turn failed because the router could not be reached or served nothing (rlfleet/retries.py)."""
    return isinstance(exc, TurnFailed) and exc.reason == "unavailable"


class RolloutDriver:
    def __init__(
        self,
        generate: GenerateFn,
        env: Environment,
        prompts: PromptSource,
        *,
        samples_per_prompt: int,
        sampling: SamplingConfig,
        max_seq_len: int,
        start_position: int = 0,
        max_ahead_prompts: int = 8,
        buffer: RolloutBuffer | None = None,
        outage_policy: OutagePolicy | None = None,
    ) -> None:
        self.generate = generate
        self.env = env
        self.prompts = prompts
        self.samples_per_prompt = samples_per_prompt
        self.sampling = sampling
        self.max_seq_len = max_seq_len
        self.next_position = start_position  # data position: next prompt index never dispatched
        self.max_ahead_prompts = max_ahead_prompts
        self.buffer = buffer or RolloutBuffer()
        self.stats = DriverStats()
        self._scored_lock = threading.Lock()  # scored_episodes is counted in the worker threads (`_score`)
        self._in_flight = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self.outage_policy = outage_policy or OutagePolicy()
        self.outage: Outage | None = None  # set while the circuit is open
        self._held: list[Prompt] = []  # put back during an outage, by prompt index: dispatched first
        self._rng = random.Random()

    # ---- one episode ----
    async def run_episode(self, prompt: Prompt, sample: int) -> Rollout:
        rollout = Rollout(prompt=prompt, sample=sample, dispatched_at=time.monotonic())
        # The environment's own work (a SWE sandbox made, a bash call up to its timeout, a grading run in
        # a fresh sandbox) runs in a worker thread: on this one event loop it would hold up every other
        # episode's turns until it returned.
        episode = await asyncio.to_thread(Episode, self.env, rollout)
        stop_ids = turn_stop_ids(self.env, self.sampling)
        for _turn_index in range(self.env.max_turns):
            budget = episode.budget(self.sampling.max_new_tokens, self.max_seq_len)
            if budget <= 0:
                break
            # the run's one sampling object, with this turn's budget and stops
            turn = await self._generate(
                rollout.uid,
                episode.ids,
                replace(self.sampling, max_new_tokens=budget, stop_token_ids=stop_ids),
            )
            if await asyncio.to_thread(episode.add_turn, turn):
                break
        await asyncio.to_thread(self._score, episode)  # exactly once, here, whatever ended the episode
        rollout.finished_at = time.monotonic()
        return rollout

    def _score(self, episode: Episode) -> None:
        """In the worker thread, counted there: a driver stopped mid-score cancels the awaiting task, not
        the thread, so an episode the environment scored is counted even then (`stop` waits for it)."""
        episode.score()
        with self._scored_lock:
            self.stats.scored_episodes += 1

    async def _generate(self, session: str, ids: list[int], sampling: SamplingConfig) -> SampledTurn:
        """One turn, not retried here: the generate function owns its retries (rlfleet/retries.py);
        an error fails the episode and so the prompt group (`run_group`)."""
        t0 = time.monotonic()
        try:
            turn = await self.generate(session, list(ids), sampling)
        except Exception:  # not CancelledError (a BaseException): a stopped driver is no error
            self.stats.generate_errors += 1
            raise
        self.stats.generate_seconds += time.monotonic() - t0
        self.stats.sampled_tokens += turn.num_tokens
        if self.outage is not None:  # the router answers again: close the circuit
            log.warning(
                "the router answers again after %.1fs; %d prompt groups put back are dispatched again",
                time.monotonic() - self.outage.since,
                len(self._held),
            )
            self.outage = None
        return turn

    async def run_group(self, prompt: Prompt) -> PromptGroup | None:
        """The prompt's group, or None: dropped (counted), or put back while the router is unavailable."""
        episodes = [asyncio.create_task(self.run_episode(prompt, k)) for k in range(self.samples_per_prompt)]
        try:
            rollouts = await asyncio.gather(*episodes)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            for episode in episodes:  # the group is lost anyway: its other episodes stop here
                episode.cancel()
            await asyncio.gather(*episodes, return_exceptions=True)
            if router_unavailable(exc):
                self._hold(prompt, exc)
            else:
                self.stats.failed_groups += 1
                log.warning("prompt %d dropped: %s", prompt.index, exc)
                if self.outage is not None and self.outage.probe == prompt.index:
                    self.outage.probe = None  # the router answered something: probe again
            return None
        return PromptGroup(prompt=prompt, rollouts=list(rollouts))

    # ---- the circuit breaker (rlfleet/retries.py OutagePolicy) ----
    def _hold(self, prompt: Prompt, exc: BaseException) -> None:
        """Put the group back; open the circuit, or back off further when the failed group was the probe."""
        self.stats.held_groups += 1
        bisect.insort(self._held, prompt, key=lambda p: p.index)
        now = time.monotonic()
        if self.outage is None:
            self.outage = Outage(since=now, last_error=str(exc))
            self.stats.router_outages += 1
            log.warning(
                "the router is unavailable (%s): no new prompt until it answers; prompt groups that "
                "fail on it are put back, not dropped",
                exc,
            )
        elif self.outage.probe == prompt.index:
            self.outage.attempt += 1
            self.outage.probe = None
        else:
            self.outage.last_error = str(exc)
            return  # dispatched before the circuit opened: the wait already runs
        self.outage.last_error = str(exc)
        wait = self.outage_policy.backoff(self.outage.attempt, self._rng.random())
        self.outage.retry_at = now + wait
        log.info(
            "router unavailable for %.1fs: next probe in %.1fs (%d prompt groups held)",
            now - self.outage.since,
            wait,
            len(self._held),
        )

    def _may_dispatch(self) -> bool:
        """Backpressure, and while the circuit is open: one probe group once its wait is over."""
        if self._in_flight + self.buffer.qsize() >= self.max_ahead_prompts:
            return False
        outage = self.outage
        if outage is None:
            return True
        return outage.probe is None and time.monotonic() >= outage.retry_at

    def _next_prompt(self) -> Prompt:
        """A held prompt first (lowest index), else the next data position."""
        if self._held:
            self.stats.redispatched_groups += 1
            prompt = self._held.pop(0)
        else:
            prompt = self.prompts.get(self.next_position)
            self.next_position += 1
            self.stats.dispatched_prompts += 1
        if self.outage is not None:
            self.outage.probe = prompt.index
        return prompt

    def outage_note(self) -> str:
        """What the driver knows of the router now: its outage, or "" while it answers."""
        outage = self.outage
        return "" if outage is None else outage.describe(time.monotonic())

    @property
    def held_prompts(self) -> list[int]:
        """The prompt indices put back and not yet dispatched again."""
        return [p.index for p in self._held]

    # ---- the dispatch loop ----
    async def run(self) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            while not self._stop.is_set():
                if not self._may_dispatch():
                    await asyncio.sleep(0.01)
                    continue
                prompt = self._next_prompt()
                self._in_flight += 1
                task = asyncio.create_task(self._group_task(prompt))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _group_task(self, prompt: Prompt) -> None:
        try:
            group = await self.run_group(prompt)
            if group is not None and not self._stop.is_set():
                self.stats.completed_groups += 1
                self.buffer.put(group)
        finally:
            self._in_flight -= 1

    def start(self) -> None:
        def main() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self.run())
            except BaseException as exc:  # surfaced to the trainer by `check()`
                self.error = exc
            finally:
                closer = getattr(self.generate, "aclose", None)
                if closer is not None:
                    try:
                        self._loop.run_until_complete(closer())
                    except Exception:
                        pass
                # the environment's work in flight (a score, a sandbox made, a tool call) outlives its
                # cancelled task in a worker thread: it ends before the driver does (`stop` waits for it,
                # up to its timeout), so nothing an episode started runs on after the run
                self._loop.run_until_complete(self._loop.shutdown_default_executor())
                self._loop.close()

        self._thread = threading.Thread(target=main, name="rollout-driver", daemon=True)
        self._thread.start()

    def take(self, n: int, timeout: float, stop: threading.Event) -> list[PromptGroup]:
        """Up to `n` complete prompt groups from the buffer (the loop's `RolloutSource`)."""
        return self.buffer.take(n, timeout=timeout, stop=stop)

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"rollout driver failed: {self.error!r}") from self.error

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
