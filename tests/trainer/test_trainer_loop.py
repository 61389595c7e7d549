"""Loop invariants on real parts in one process: the transformers trainer backend (HFBackend) on a tiny
Qwen3 checkpoint built with `save_pretrained` (rlfleet/tiny_qwen3.py, as local mode and a cluster load
it), emulated low-precision sampler engines of that checkpoint's shape (rlfleet/local/emulated.py: the
reference engine's Qwen3, real fake-quantised weights, the sampler's SGLang sampling; only HTTP is
absent, local mode tests cover it), the async rollout driver in its own thread, the corrected objective,
checkpoints."""

from __future__ import annotations

import asyncio
import collections
import contextvars
import threading

import numpy as np
import pytest
import torch
from support.tiny_models import LOOP_MODEL
from support.waits import wait_for

from rlfleet.local.emulated import EmulatedFleet, EmulatedSampler
from rlfleet.numerics.engine_model import ModelShape
from rlfleet.sampler.protocol import SamplingConfig
from rlfleet.trainer.backends.backend_hf import HFBackend, OptimConfig
from rlfleet.trainer.collapse import CollapseDetector
from rlfleet.trainer.envs.environments import ToolAddEnv
from rlfleet.trainer.envs.prompts import GeneratedPromptSource
from rlfleet.trainer.loop import LoopConfig, TrainingLoop, split_by_staleness
from rlfleet.trainer.objective import ObjectiveConfig
from rlfleet.trainer.publish import checkpoint
from rlfleet.trainer.rollout.batching import flatten_groups
from rlfleet.trainer.rollout.driver import RolloutDriver

# the loop tests' tiny Qwen3 (support/tiny_models.py: no fp8 view is published here), seed 0
SIZES = {**LOOP_MODEL, "seed": 0}
MAX_SEQ_LEN = SIZES["max_position_embeddings"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")
GROUPS = [("g-bf16", "bf16", "auto"), ("g-nvfp4", "nvfp4", "fp8_e4m3")]
SAMPLING = SamplingConfig(temperature=1.0, top_p=0.97, top_k=16, max_new_tokens=4, candidate_mode="support")


SAMPLE: contextvars.ContextVar[int] = contextvars.ContextVar("sample")
"""The sample an episode's task runs (each episode is its own asyncio task, and asyncio.to_thread, which
runs the environment's calls, carries the task's context into the thread)."""


class CountingEnv(ToolAddEnv):
    """tool_add, counting how often each episode is scored."""

    def __init__(self) -> None:
        super().__init__(max_turns=3)
        self.scored: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def start(self, prompt):
        return {**super().start(prompt), "sample": SAMPLE.get()}

    def score(self, prompt, state, replies):
        with self._lock:
            self.scored[f"p{prompt.index}/{state['sample']}"] += 1
        return super().score(prompt, state, replies)


class _SampleTagDriver(RolloutDriver):
    async def run_episode(self, prompt, sample):
        # let the env know which sample it scores (the env API does not need it; the test does)
        SAMPLE.set(sample)
        return await super().run_episode(prompt, sample)


@pytest.fixture
def model_dir(tiny_qwen3_factory):
    return tiny_qwen3_factory(**SIZES)


def make(model_dir, tmp_path, env=None, start_position=0, generate=None, steps=4, checkpoints=False):
    """`checkpoints`: checkpoint before each publish, as the composition root does (trainer/run.py)."""
    torch.manual_seed(0)
    shape = ModelShape.from_checkpoint(model_dir)
    samplers = [EmulatedSampler(n, f, kv, shape, seed=i) for i, (n, f, kv) in enumerate(GROUPS)]
    fleet = EmulatedFleet(samplers)
    backend = HFBackend.from_pretrained(
        model_dir, ObjectiveConfig.from_correction("sc-mis-topp"), optim=OptimConfig(learning_rate=1e-3)
    )
    fleet.load_weights(backend.weights(), 0)
    env = env or ToolAddEnv(max_turns=3)
    driver_cls = _SampleTagDriver if isinstance(env, CountingEnv) else RolloutDriver
    driver = driver_cls(
        generate or fleet.generate,
        env,
        GeneratedPromptSource("tool_add", 0),
        samples_per_prompt=3,
        sampling=SAMPLING,
        max_seq_len=MAX_SEQ_LEN,
        start_position=start_position,
        max_ahead_prompts=6,
    )

    def publish(version, weights):
        if checkpoints:
            loop.checkpoint()
        fleet.load_weights(weights, version)

    loop = TrainingLoop(
        LoopConfig(total_steps=steps, prompts_per_step=2, checkpoint_dir=tmp_path / "ckpt"),
        backend,
        driver,
        publish=publish,
        detector=CollapseDetector(),
        group_names=[g[0] for g in GROUPS],
        group_views={g[0]: g[1] for g in GROUPS},
    )
    return loop, driver, fleet


def run(loop, driver):
    driver.start()
    try:
        return loop.run()
    finally:
        driver.stop()


class HeldScoreEnv(CountingEnv):
    """CountingEnv whose every score waits in its worker thread until the test releases it."""

    def __init__(self) -> None:
        super().__init__()
        self.scoring = threading.Event()  # some episode is in its score
        self.release = threading.Event()
        self.entered = 0

    def score(self, prompt, state, replies):
        with self._lock:
            self.entered += 1
        self.scoring.set()
        assert self.release.wait(60), "never released"
        return super().score(prompt, state, replies)


def test_a_driver_stopped_mid_score_waits_for_the_score_and_counts_it(model_dir, tmp_path):
    """The stop cancels the episodes' tasks, not the worker threads that run the environment: the scores
    in flight finish after it. `stop` waits for them, and each is counted (scored_episodes was counted by
    the cancelled task, so the environment scored episodes the driver never counted, and `stop` returned
    while they still ran: test_every_record_scored_once_and_trained_once saw 35 scored and 32 counted)."""
    env = HeldScoreEnv()
    _, driver, _ = make(model_dir, tmp_path, env=env, steps=1)
    driver.start()
    assert env.scoring.wait(60), "no episode reached its score"
    stopper = threading.Thread(target=driver.stop, kwargs={"timeout": 60})
    stopper.start()
    wait_for("the episodes' tasks cancelled", lambda: driver._in_flight == 0)  # the scores still held
    assert env.entered >= 1 and sum(env.scored.values()) == 0
    env.release.set()
    stopper.join(90)
    assert not stopper.is_alive() and driver._thread is not None and not driver._thread.is_alive()
    assert sum(env.scored.values()) == env.entered == driver.stats.scored_episodes


def test_every_record_scored_once_and_trained_once(model_dir, tmp_path):
    env = CountingEnv()
    loop, driver, _ = make(model_dir, tmp_path, env=env, steps=4)
    trained_batches = []
    original = loop.backend.train_step

    def spy(flat, group_index):
        trained_batches.append(flat)
        return original(flat, group_index)

    loop.backend.train_step = spy  # type: ignore[method-assign]
    state = run(loop, driver)
    assert state.step == 4
    uids = [u for flat in trained_batches for u in flat.rollout_uids]
    assert len(uids) == len(set(uids)) == 4 * 2 * 3  # steps x prompts x samples, none twice
    assert all(env.scored[u] == 1 for u in uids)  # each trained rollout scored exactly once
    assert max(env.scored.values()) == 1  # ... and so was every rollout the driver finished
    assert sum(env.scored.values()) == driver.stats.scored_episodes
    # uniform_group_fraction: the share of each step's prompt groups (uid "p<index>/<sample>") whose
    # trained tokens all carry advantage 0, read from the batch the backend really trained on
    for flat, metrics in zip(trained_batches, state.history, strict=True):
        by_prompt: dict[str, list[float]] = collections.defaultdict(list)
        for seq, adv in zip(flat.row_seq, flat.advantages, strict=True):
            by_prompt[flat.rollout_uids[seq].split("/")[0]].append(float(adv))
        expected = sum(all(a == 0.0 for a in advs) for advs in by_prompt.values()) / len(by_prompt)
        assert metrics["uniform_group_fraction"] == expected


def test_tokens_trained_on_are_exactly_the_tokens_sampled(model_dir, tmp_path):
    loop, driver, _ = make(model_dir, tmp_path, steps=1)
    driver.start()
    try:
        groups = driver.buffer.take(3, timeout=120)
    finally:
        driver.stop()
    assert len(groups) == 3
    flat = flatten_groups(groups, trainer_version=0)
    rollouts = [r for g in groups for r in g.rollouts]
    # the row of every trained token points at that very token in the sequence the trainer reads
    assert np.array_equal(flat.input_ids[flat.row_seq, flat.row_pos + 1], flat.target_ids)
    for b, r in enumerate(rollouts):
        sampled = np.concatenate([np.asarray(t.output_ids) for t in r.turns])
        assert np.array_equal(flat.target_ids[flat.row_seq == b], sampled)  # all sampled, nothing else
        # turn k was generated from exactly the ids of the trajectory so far (no re-tokenisation)
        seq = r.token_ids()
        pos = len(r.prompt.input_ids)
        for turn, env_ids in zip(r.turns, r.env_ids, strict=True):
            assert np.array_equal(np.asarray(turn.prompt_ids), seq[:pos])
            pos += turn.num_tokens + len(env_ids)
        # environment tokens are context, never trained on
        assert int((flat.row_seq == b).sum()) == r.num_sampled == int(r.loss_mask().sum())
        # the sampler's q is carried over untouched
        lq = np.concatenate([np.asarray(t.sampled_logprobs) for t in r.turns])
        assert np.allclose(flat.logq_support[flat.row_seq == b], lq)


def test_staleness_is_per_token_version_under_in_flight_updates(model_dir, tmp_path):
    """Weights change between the turns of running episodes: each token keeps the version that
    produced it, and staleness is the trainer version minus the sample's OLDEST version."""
    holder = {}
    calls = {"n": 0}

    async def generate(session, ids, params):
        turn = await holder["fleet"].generate(session, ids, params)
        calls["n"] += 1
        if calls["n"] % 4 == 0:  # an update lands while other sessions are mid-episode
            fleet = holder["fleet"]
            new = max(s.version for s in fleet.samplers.values()) + 1
            await asyncio.to_thread(fleet.load_weights, holder["weights"], new)
        return turn

    loop, driver, fleet = make(model_dir, tmp_path, generate=generate, steps=1)
    holder["fleet"], holder["weights"] = fleet, loop.backend.weights()
    driver.start()
    try:
        groups = driver.buffer.take(6, timeout=180)
    finally:
        driver.stop()
    rollouts = [r for g in groups for r in g.rollouts]
    mixed = [r for r in rollouts if len({int(v) for t in r.turns for v in t.weight_versions}) > 1]
    assert mixed, "expected episodes that straddle a weight update"
    trainer_version = max(int(r.weight_versions().max()) for r in rollouts) + 2
    flat = flatten_groups(groups, trainer_version=trainer_version)
    for b, r in enumerate(rollouts):
        rows = flat.row_seq == b
        assert np.array_equal(flat.versions[rows], r.weight_versions())
        assert set(flat.staleness[rows].tolist()) == {trainer_version - int(r.weight_versions().min())}
    # the loop's bound: groups staler than max_staleness are dropped (and counted), never trained
    oldest = min(g.staleness(trainer_version) for g in groups)
    kept, dropped = split_by_staleness(groups, trainer_version, max_staleness=oldest)
    assert kept and all(g.staleness(trainer_version) <= oldest for g in kept)
    assert len(kept) + len(dropped) == len(groups) and all(
        g.staleness(trainer_version) > oldest for g in dropped
    )
    assert split_by_staleness(groups, trainer_version, None) == (groups, [])


def test_resume_continues_at_step_and_data_position_without_reuse(model_dir, tmp_path):
    loop, driver, _ = make(model_dir, tmp_path, steps=3, checkpoints=True)
    first = run(loop, driver)
    loop.checkpoint()  # and at the end, as trainer/run.py does
    assert first.step == 3
    state = checkpoint.load_latest(tmp_path / "ckpt")
    assert state["step"] == 3 and state["buffer_policy"] == "discard-unconsumed"
    position = state["data_position"]
    trained_before = set(state["trained_uids"])
    assert position >= 3 * 2  # at least the prompts trained on were dispatched

    loop2, driver2, _ = make(model_dir, tmp_path, steps=5, start_position=position, checkpoints=True)
    loop2.restore(state)
    # model and optimizer really came back
    for name, w in state["backend"]["model"].items():
        assert torch.equal(loop2.backend.model.state_dict()[name], w)
    assert loop2.backend.optimizer.state_dict()["state"][0]["step"] == 3
    batches = []
    original = loop2.backend.train_step
    loop2.backend.train_step = lambda flat, gi: (batches.append(flat), original(flat, gi))[1]  # type: ignore[method-assign]
    second = run(loop2, driver2)
    assert second.step == 5 and len(batches) == 2  # continued at step 4, not from 1
    assert [row["step"] for row in second.history] == [1, 2, 3, 4, 5]
    new_uids = {u for f in batches for u in f.rollout_uids}
    assert not new_uids & trained_before
    assert min(int(u[1:].split("/")[0]) for u in new_uids) >= position  # no consumed prompt re-served
