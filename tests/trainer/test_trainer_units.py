"""Unit + property tests of the trainer's pure parts: environments, prompts, advantages, metrics,
collapse detector, checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.api import SafetySpec
from rlfleet.trainer import advantages, collapse, metrics
from rlfleet.trainer.envs import environments, prompts
from rlfleet.trainer.envs.environments import ToyVocab as V
from rlfleet.trainer.publish import checkpoint


# ---------------------------------------------------------------- environments
def test_copy_digit_reward_is_exactly_the_share_of_target_tokens():
    p = environments.copy_digit_prompt(0, 7)
    assert p.input_ids == [V.BOS, V.digit(7), V.SEP]
    assert environments.copy_digit_reward(p, [V.digit(7)] * 4 + [V.EOS]) == 1.0
    assert environments.copy_digit_reward(p, [V.digit(7), V.digit(3), 25, 25, V.EOS]) == pytest.approx(1 / 4)
    assert environments.copy_digit_reward(p, [V.EOS, V.digit(7)]) == 0.0  # nothing after EOS counts
    assert environments.copy_digit_reward(p, []) == 0.0


def test_tool_add_episode_call_then_answer():
    env = environments.ToolAddEnv()
    p = environments.tool_add_prompt(0, 4, 9)
    st_ = env.start(p)
    s1 = env.step(p, st_, [V.CALL, V.digit(4), V.digit(9), V.END_CALL], "stop")
    assert not s1.done and s1.tool_call and not s1.format_error
    assert s1.append_ids == [V.RESULT, V.digit(3), V.END_RESULT]
    s2 = env.step(p, st_, [V.digit(3), V.EOS], "stop")
    assert s2.done
    out = env.score(p, st_, [[V.CALL, V.digit(4), V.digit(9), V.END_CALL], [V.digit(3), V.EOS]])
    assert out.reward == pytest.approx(1.0) and out.tool_calls == 1 and out.format_errors == 0
    assert not out.no_tool_call_termination and not out.empty_final_reply


def test_tool_add_three_turns_without_tool_call_end_the_episode():
    env = environments.ToolAddEnv(max_turns=5, max_turns_without_tool=3)
    p = environments.tool_add_prompt(0, 1, 1)
    st_ = env.start(p)
    steps = [env.step(p, st_, [25, 26], "length") for _ in range(3)]
    assert [s.done for s in steps] == [False, False, True]
    out = env.score(p, st_, [[25, 26]] * 3)
    assert out.no_tool_call_termination and out.reward == 0.0


def test_tool_add_malformed_call_gets_err_and_counts():
    env = environments.ToolAddEnv()
    p = environments.tool_add_prompt(0, 1, 2)
    st_ = env.start(p)
    s = env.step(p, st_, [V.CALL, V.digit(1), V.END_CALL], "stop")
    assert s.format_error and s.append_ids == [V.RESULT, V.ERR, V.END_RESULT]


def test_load_environment_entry_points(tmp_path, monkeypatch):
    assert environments.load_environment("copy_digit") is environments.copy_digit
    env = environments.load_environment("rlfleet.trainer.envs.environments:ToolAddEnv", max_turns=2)
    assert isinstance(env, environments.ToolAddEnv) and env.max_turns == 2
    (tmp_path / "myreward.py").write_text("def reward(prompt, ids):\n    return float(len(ids))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = environments.load_environment("myreward:reward")
    p = environments.copy_digit_prompt(0, 1)
    assert env.score(p, {}, [[5, 6, 7]]).reward == 3.0
    for bad in ("nocolon", "no_such_module_xyz:f", "rlfleet.trainer.envs.environments:nope"):
        with pytest.raises(environments.EnvironmentLoadError):
            environments.load_environment(bad)


# ---------------------------------------------------------------- prompts
def test_generated_prompts_are_a_pure_function_of_seed_and_index():
    a, b = (
        prompts.GeneratedPromptSource("tool_add", seed=3),
        prompts.GeneratedPromptSource("tool_add", seed=3),
    )
    assert [a.get(i).input_ids for i in range(20)] == [b.get(i).input_ids for i in reversed(range(20))][::-1]
    assert len({tuple(a.get(i).input_ids) for i in range(50)}) > 10


def test_jsonl_prompts_cycle_epochs_and_reject_bad_rows(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"input_ids": [1, i + 10], "answer": i}) for i in range(5)) + "\n")
    src = prompts.JsonlPromptSource(path, seed=1)
    epoch0 = sorted(src.get(i).meta["answer"] for i in range(5))
    epoch1 = sorted(src.get(i).meta["answer"] for i in range(5, 10))
    assert epoch0 == epoch1 == list(range(5))
    assert src.get(7).input_ids == prompts.JsonlPromptSource(path, seed=1).get(7).input_ids
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": "hello"}\n')
    with pytest.raises(prompts.PromptFileError, match="bad.jsonl:1"):
        prompts.JsonlPromptSource(bad)
    with pytest.raises(prompts.PromptFileError, match="vocab"):
        prompts.JsonlPromptSource(path, vocab_size=12)


# ---------------------------------------------------------------- advantages
@given(st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=16), st.booleans())
@settings(max_examples=100, deadline=None)
def test_grpo_advantages_are_centered_and_shift_invariant(rewards, norm):
    a = advantages.grpo_advantages(np.array(rewards), normalize_std=norm)
    assert abs(float(a.sum())) < 1e-3 * max(1.0, len(rewards)) * (1 if not norm else 1e3)
    shifted = advantages.grpo_advantages(np.array(rewards) + 3.0, normalize_std=norm)
    np.testing.assert_allclose(a, shifted, atol=1e-3 if norm else 1e-4)
    if not norm:
        np.testing.assert_allclose(a, np.array(rewards) - np.mean(rewards), atol=1e-4)


def test_grpo_advantages_constant_group_is_zero_and_std_norm_is_unit():
    assert not advantages.grpo_advantages(np.ones(8)).any()
    a = advantages.grpo_advantages(np.array([0.0, 1.0, 0.0, 1.0]), normalize_std=True)
    assert np.allclose(a, [-1, 1, -1, 1], atol=1e-5)
    assert advantages.token_advantages(np.array([1.0, -2.0]), np.array([2, 3])).tolist() == [1, 1, -2, -2, -2]


def test_uniform_group_fraction_counts_groups_whose_advantages_are_all_zero():
    groups = [[0.0, 0.0, 0.0], [1.0, 1.0], [0.0, 0.5, 0.0], [0.25]]  # uniform, uniform, mixed, one sample
    assert advantages.uniform_group_fraction(groups) == 0.75
    assert advantages.uniform_group_fraction([[1.0, 0.0]]) == 0.0
    for g in groups:  # the metric's "uniform" is exactly grpo_advantages' all-zero case
        assert (advantages.uniform_group_fraction([g]) == 1.0) == (
            not advantages.grpo_advantages(np.array(g)).any()
        )
    with pytest.raises(ValueError, match="at least one group"):
        advantages.uniform_group_fraction([])


# ---------------------------------------------------------------- metrics
def test_objective_metrics_flatten_groups_views_and_shares():
    from rlfleet.trainer.objective import LossOutput

    out = LossOutput(
        loss=__import__("torch").tensor(0.0),
        metrics={"num_tokens": 100.0, "kl_k3": 0.02, "oor_fraction": 0.1},
        per_group={
            0: {"num_tokens": 10.0, "kl_k3": 0.1, "oor_fraction": 0.3},  # 3 of the 10 OOR tokens
            1: {"num_tokens": 30.0, "kl_k3": 0.02, "oor_fraction": 0.1, "ppo_clip_fraction": 0.2},  # 3
            2: {"num_tokens": 60.0, "kl_k3": 0.01, "oor_fraction": 4 / 60, "ppo_clip_fraction": 0.05},  # 4
        },
        per_staleness={"0-1": {"num_tokens": 70.0, "kl_k3": 0.01}, "6+": {"num_tokens": 30.0, "kl_k3": 0.05}},
    )
    m = metrics.objective_metrics(
        out,
        ["h100-fp8", "b200-nvfp4", "b300-nvfp4"],
        {"h100-fp8": "fp8", "b200-nvfp4": "nvfp4", "b300-nvfp4": "nvfp4"},
    )
    assert m["group/h100-fp8/token_share"] == pytest.approx(0.1)
    assert m["group/h100-fp8/oor_share"] == pytest.approx(
        0.3
    )  # 10% of tokens, 30% of OOR (method.md's pattern)
    assert m["group/b300-nvfp4/oor_share"] == pytest.approx(0.4)
    assert m["view/nvfp4/num_tokens"] == 90
    assert m["view/nvfp4/kl_k3"] == pytest.approx((30 * 0.02 + 60 * 0.01) / 90)
    assert m["view/nvfp4/oor_fraction"] == pytest.approx(7 / 90)
    assert m["view/nvfp4/ppo_clip_fraction"] == pytest.approx((30 * 0.2 + 60 * 0.05) / 90)  # every token mean
    assert "view/fp8/ppo_clip_fraction" not in m  # a view none of whose groups reported it
    assert m["staleness/6+/kl_k3"] == 0.05 and m["kl_k3"] == 0.02


def test_rollout_metrics_rates():
    from rlfleet.trainer.envs.environments import EpisodeOutcome

    outs = [EpisodeOutcome(1.0, 2, False, False, 0, 1), EpisodeOutcome(0.0, 3, True, True, 1, 0)]
    m = metrics.rollout_metrics(outs, [[5, 5, 5, 6], [7]], ["a", "b"])
    assert m["reward_mean"] == 0.5 and m["empty_reply_rate"] == 0.5 and m["no_tool_call_rate"] == 0.5
    assert m["format_error_rate"] == 0.5 and m["response_length"] == 2.5
    assert m["repetition_fraction"] == pytest.approx((2 / 3 + 0) / 2)
    assert m["group/a/reward_mean"] == 1.0
    assert "success_rate" not in m  # neither outcome was judged (a reward function has no notion of success)
    judged = [
        EpisodeOutcome(0.6, 1, False, False, 0, 1, success=True),
        EpisodeOutcome(0.9, 1, False, False, 1, 1, success=False),
        EpisodeOutcome(0.2, 1, False, False, 0, 0, success=True),
        EpisodeOutcome(0.0, 1, True, False, 0, 0),
    ]
    assert metrics.rollout_metrics(judged, [[5]] * 4, ["a"] * 4)["success_rate"] == pytest.approx(
        2 / 3
    )  # 2 of 3 judged


def test_prometheus_exporter_serves_the_latest_values():
    import httpx

    exp = metrics.PrometheusExporter(port=0)
    try:
        exp.update(3, {"kl_k3": 0.25, "group/a/oor_fraction": 0.5})
        text = httpx.get(f"http://127.0.0.1:{exp.port}/metrics").text
        assert 'rlfleet_trainer_kl_k3{key="",scope="fleet"} 0.25' in text
        assert 'rlfleet_trainer_oor_fraction{key="a",scope="group"} 0.5' in text
        assert 'rlfleet_trainer_step{key="",scope="fleet"} 3.0' in text
    finally:
        exp.close()


# ---------------------------------------------------------------- collapse detector
def healthy(step: int, rng: np.random.Generator) -> dict[str, float]:
    return {
        "reward_mean": min(0.9, 0.1 + 0.02 * step) + rng.normal(0, 0.03),
        "kl_k3": 0.01 * (1 + rng.normal(0, 0.1)),
        "oor_fraction": 0.002 * (1 + rng.normal(0, 0.2)),
        "group/a/kl_k3": 0.01 * (1 + rng.normal(0, 0.1)),
        "group/a/oor_fraction": 0.002,
        "entropy": 2.0 - 0.01 * step,
        "grad_norm": 1.0 + rng.normal(0, 0.1),
        "sc_tail_ratio": 1.0 + abs(rng.normal(0, 0.05)),
        "empty_reply_rate": 0.02,
        "no_tool_call_rate": 0.05,
        "format_error_rate": 0.03,  # the local demo's healthy mean is 0.01-0.05 (docs/ablation.md)
    }


def test_detector_is_quiet_on_a_healthy_run():
    rng = np.random.default_rng(0)
    det = collapse.CollapseDetector()
    for step in range(100):
        assert not det.observe(step, healthy(step, rng)).fired, det.history


@pytest.mark.parametrize(
    "signal,inject",
    [
        ("kl_surge", {"kl_k3": 0.2, "oor_fraction": 0.1}),
        ("tool_calls_stop", {"no_tool_call_rate": 0.9, "empty_reply_rate": 0.9}),
        ("format_errors_repeat", {"format_error_rate": 0.5}),
        ("entropy_collapse", {"entropy": 0.001}),
        ("grad_norm_spike", {"grad_norm": 25.0}),
        ("rho_blowup", {"sc_tail_ratio": 52.0}),
    ],
)
def test_detector_fires_on_each_injected_precursor(signal, inject):
    rng = np.random.default_rng(1)
    det = collapse.CollapseDetector(action="pause")
    for step in range(30):
        assert not det.observe(step, healthy(step, rng)).fired
    fired_at = None
    for step in range(30, 35):
        d = det.observe(step, {**healthy(step, rng), **inject})
        if d.fired:
            fired_at = step
            assert signal in {a.signal for a in d.alerts} and d.pause
            break
    assert fired_at == 31  # patience 2: the second consecutive bad step


def test_reward_cliff_is_the_window_mean_falling_to_half_its_peak():
    """Reward 1.0 for 20 steps, then 0.0: after k zero steps the 10-step window's mean is (10 - k) / 10
    against a peak of 1.0, so the cliff (peak - mean > max(0.25, 0.5 x 1.0)) is raised from k = 6 on
    (index 25) and fires at k = 7 (index 26, patience 2); the alert carries the window mean and the peak."""
    det = collapse.CollapseDetector()
    fired = [i for i in range(40) if det.observe(i, {"reward_mean": 1.0 if i < 20 else 0.0}).fired]
    assert fired[0] == 26
    (alert,) = [a for a in det.history if a.step == 26]
    assert (alert.signal, alert.value, alert.baseline) == ("reward_cliff", pytest.approx(0.3), 1.0)


def test_a_batch_of_hard_prompts_is_not_a_reward_cliff():
    """Three consecutive steps at reward 0 in a healthy run (a hard batch of prompts: one step's reward is
    a few prompt groups) move the window mean by less than half the peak: no alert. The per-step rule this
    replaced (reward below its EMA by max(0.25, 0.5 x EMA) for 2 steps) fired here."""
    rng = np.random.default_rng(4)
    det = collapse.CollapseDetector()
    for step in range(60):
        m = healthy(step, rng)
        if 40 <= step < 43:
            m["reward_mean"] = 0.0
        assert not det.observe(step, m).fired, det.history


def test_kl_rising_with_staleness_while_the_pipeline_fills_is_not_a_surge():
    """Lag 8: staleness_max climbs 0..8 over steps 0-8 and the KL and out-of-range fraction climb with it
    (x2 and x3 per step, far above 3x and 10x of any running baseline); every new staleness high makes
    that step's mismatch the baseline, so nothing fires. At the settled staleness a real surge (5x KL,
    20x OOR) still fires on its second step."""
    det = collapse.CollapseDetector()
    for step in range(9):
        m = {"kl_k3": 1e-3 * 2**step, "oor_fraction": 1e-3 * 3**step, "staleness_max": float(step)}
        assert not det.observe(step, m).fired, det.history
    steady = {"kl_k3": 1e-3 * 2**8, "oor_fraction": 1e-3 * 3**8, "staleness_max": 8.0}
    for step in range(9, 30):
        assert not det.observe(step, steady).fired, det.history
    surge = {"kl_k3": 5 * steady["kl_k3"], "oor_fraction": 20 * steady["oor_fraction"], "staleness_max": 8.0}
    assert not det.observe(30, surge).fired
    assert [a.signal for a in det.observe(31, surge).alerts] == ["kl_surge"]


def test_steps_that_train_nothing_do_not_pull_the_grad_norm_baseline_to_zero():
    """Grad norm 1.0 for 20 steps, then 30 steps where every prompt group scored alike (the gradient is
    0), then a step with one informative group at grad norm 1.5: not a spike (the EMA the old rule kept
    had decayed to ~2e-3 of 1.0, so 1.5 read as a ~700x spike). A 25x step still is one."""
    det = collapse.CollapseDetector()
    for step in range(20):
        assert not det.observe(step, {"grad_norm": 1.0, "uniform_group_fraction": 0.5}).fired
    for step in range(20, 50):
        assert not det.observe(step, {"grad_norm": 0.0, "uniform_group_fraction": 1.0}).fired
    for step in range(50, 53):
        assert not det.observe(step, {"grad_norm": 1.5, "uniform_group_fraction": 0.875}).fired
    assert not det.observe(53, {"grad_norm": 25.0, "uniform_group_fraction": 0.875}).fired
    assert [
        a.signal for a in det.observe(54, {"grad_norm": 25.0, "uniform_group_fraction": 0.875}).alerts
    ] == ["grad_norm_spike"]


# Malformed-turn counts per step (32 episodes a step) of three 30-step local runs (`rlfleet run
# examples/rljob.yaml --local --steps 30`, tool_add, 2026-12-05; docs/ablation.md, "Agentic precursors").
HEALTHY_SEED0_FORMAT_ERRORS = [0] * 12 + [3, 0, 3, 4, 2, 6, 1, 0, 0, 0, 0, 0, 2, 0, 0, 2, 1, 0]
HEALTHY_SEED1_FORMAT_ERRORS = [0] * 13 + [1] + [0] * 8 + [1, 2, 0, 0, 4, 2, 0, 1]
LR_1E3_FORMAT_ERRORS = [
    0,
    0,
    0,
    0,
    0,
    0,
    0,
    1,
    0,
    0,
    2,
    7,
    10,
    1,
    1,
    2,
    0,
    0,
    3,
    3,
    3,
    6,
    2,
    0,
    1,
    0,
    7,
    0,
    1,
    1,
]


@pytest.mark.parametrize("counts", [HEALTHY_SEED0_FORMAT_ERRORS, HEALTHY_SEED1_FORMAT_ERRORS])
def test_format_errors_at_the_measured_healthy_rates_never_fire(counts):
    """The measured healthy runs (up to 6 of 32 episodes malformed in one step) raise nothing, with the
    thresholds of a default RLJob."""
    det = collapse.CollapseDetector(collapse.CollapseThresholds.from_safety(SafetySpec()))
    for step, n in enumerate(counts, start=1):
        assert not det.observe(step, {"format_error_rate": n / 32}).fired, det.history


def test_format_errors_of_the_unstable_learning_rate_fire_on_their_second_step_over_the_threshold():
    """At learning rate 1e-3 task success fell to 0 while 7 and then 10 of 32 episodes were malformed
    (steps 12 and 13, both above 0.2 and above 3 x their baseline 0.014 + 0.05): the alert fires at step 13,
    the second of them (patience 2), and only there."""
    det = collapse.CollapseDetector(collapse.CollapseThresholds.from_safety(SafetySpec()))
    fired = [
        step
        for step, n in enumerate(LR_1E3_FORMAT_ERRORS, start=1)
        if det.observe(step, {"format_error_rate": n / 32}).fired
    ]
    assert fired == [13]
    (alert,) = det.history
    assert (alert.signal, alert.value) == ("format_errors_repeat", 10 / 32)


def test_format_errors_rising_during_warmup_do_not_fire():
    """0.4 of episodes malformed on steps 3 and 4 against a baseline of 0: raised twice in a row (0.4 >
    0.2 and > 3 x 0.08 + 0.05 on step 4); in the 5 warmup steps it does not fire. Without warmup the same
    steps fire on step 4."""
    rates = [0.0, 0.0, 0.0, 0.4, 0.4]
    det = collapse.CollapseDetector()
    for step, rate in enumerate(rates):
        assert not det.observe(step, {"format_error_rate": rate}).fired
    assert det.streaks["format_error_rate"] == 2
    no_warmup = collapse.CollapseDetector(collapse.CollapseThresholds(warmup_steps=0))
    fired = [
        step for step, rate in enumerate(rates) if no_warmup.observe(step, {"format_error_rate": rate}).fired
    ]
    assert fired == [4]


def test_format_errors_rising_fire_after_patience_and_do_not_pull_up_their_baseline():
    """20 steps at 0.03, then 0.4: the first 0.4 step is raised but does not fire, the second fires
    (patience 2) against the healthy baseline, and neither surge step moves the baseline."""
    det = collapse.CollapseDetector()
    for step in range(20):
        assert not det.observe(step, {"format_error_rate": 0.03}).fired
    healthy_baseline = det.baselines["format_error_rate"]
    assert healthy_baseline == pytest.approx(0.03)
    assert not det.observe(20, {"format_error_rate": 0.4}).fired
    assert det.baselines["format_error_rate"] == healthy_baseline
    (alert,) = det.observe(21, {"format_error_rate": 0.4}).alerts
    assert (alert.signal, alert.value, alert.baseline) == ("format_errors_repeat", 0.4, healthy_baseline)
    assert det.baselines["format_error_rate"] == healthy_baseline
    assert not det.observe(22, {"format_error_rate": 0.03}).fired  # back at the baseline: the streak ends


def test_detector_state_from_before_the_reward_window_still_loads():
    """A checkpoint whose detector state has no reward window or staleness high (written before they
    existed) resumes: the window and the peak restart, the rest is kept."""
    rng = np.random.default_rng(5)
    det = collapse.CollapseDetector()
    for step in range(20):
        det.observe(step, healthy(step, rng))
    old = {k: v for k, v in det.state_dict().items() if k not in ("rewards", "reward_peak", "staleness_high")}
    restored = collapse.CollapseDetector()
    restored.load_state_dict(old)
    assert (restored.steps_seen, restored.baselines, restored.rewards, restored.reward_peak) == (
        20,
        det.baselines,
        [],
        None,
    )


def test_kl_surge_without_oor_surge_does_not_fire():
    rng = np.random.default_rng(2)
    det = collapse.CollapseDetector()
    for step in range(40):
        m = healthy(step, rng)
        if step >= 20:
            m["kl_k3"] = 0.1  # 10x KL but OOR flat: method.md wants both
        assert not det.observe(step, m).fired


def test_quarantine_action_names_the_offending_group_once():
    rng = np.random.default_rng(3)
    det = collapse.CollapseDetector(action="quarantine-group")
    for step in range(20):
        det.observe(step, healthy(step, rng))
    bad = {"group/a/kl_k3": 0.5, "group/a/oor_fraction": 0.2}
    d1 = det.observe(20, {**healthy(20, rng), **bad})
    d2 = det.observe(21, {**healthy(21, rng), **bad})
    d3 = det.observe(22, {**healthy(22, rng), **bad})
    assert not d1.quarantine and d2.quarantine == ["a"] and d3.quarantine == [] and det.quarantined == {"a"}
    restored = collapse.CollapseDetector(action="quarantine-group")
    restored.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert restored.state_dict() == det.state_dict()


def test_detector_rejects_an_unknown_action():
    with pytest.raises(ValueError, match="unknown safety action 'explode'"):
        collapse.CollapseDetector(action="explode")


# ---------------------------------------------------------------- checkpoint
def test_checkpoint_roundtrip_keeps_latest_and_prunes(tmp_path):
    import torch

    for step in (1, 2, 3):
        checkpoint.save_checkpoint(
            tmp_path, {"step": step, "w": torch.full((2,), float(step)), "data_position": 10 * step}
        )
    state = checkpoint.load_latest(tmp_path)
    assert state["step"] == 3 and state["data_position"] == 30 and state["w"].tolist() == [3.0, 3.0]
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.pt")) == ["ckpt-00000002.pt", "ckpt-00000003.pt"]
    assert checkpoint.load_latest(tmp_path / "none") is None
    assert not list(tmp_path.glob("*.tmp"))


def test_checkpoints_on_a_store_live_under_the_channel_prefix_next_to_its_versions(tmp_path):
    """S3 channels keep checkpoints as `checkpoints/` keys under their prefix (here through the Store
    interface on a filesystem store; the S3 store implements the same put_file/get/list/delete)."""
    import torch

    from rlfleet.store import FilesystemStore, S3Store
    from rlfleet.trainer.run import checkpoint_target

    store = FilesystemStore(tmp_path / "channel", create=True)
    assert checkpoint.load_latest(store) is None
    for step in (1, 2, 3):
        checkpoint.save_checkpoint(store, {"step": step, "w": torch.full((2,), float(step))})
    assert store.list("checkpoints/") == [
        "checkpoints/ckpt-00000002.pt",
        "checkpoints/ckpt-00000003.pt",
        "checkpoints/latest",
    ]
    assert checkpoint.load_latest(store)["w"].tolist() == [3.0, 3.0]
    # where the entrypoint puts them: next to the channel, never /tmp
    assert checkpoint_target(store) == tmp_path / "channel" / "checkpoints"
    s3 = S3Store("bucket", "jobs/a", client=object())  # no request is made: the target is the store itself
    assert checkpoint_target(s3) is s3
    assert checkpoint_target(s3, "/override") == Path("/override")


def test_a_full_volume_fails_a_checkpoint_with_enospc_and_leaves_the_last_one_named(tmp_path):
    """A full volume (the temporary file is /dev/full: every write fails with ENOSPC): the caller gets
    the OSError (torch.save alone would raise its own RuntimeError, losing why; the trainer entrypoint
    turns ENOSPC into one clear line), the temporary file is gone and `latest` still names step 1."""
    import errno

    checkpoint.save_checkpoint(tmp_path, {"step": 1, "w": torch.zeros(4)})
    (tmp_path / "ckpt-00000002.pt.tmp").symlink_to("/dev/full")
    with pytest.raises(OSError) as failed:
        checkpoint.save_checkpoint(tmp_path, {"step": 2, "w": torch.zeros(100_000)})
    assert failed.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".latest.lock",
        "ckpt-00000001.pt",
        "latest",
    ]  # the swap's lock
    assert checkpoint.load_latest(tmp_path)["step"] == 1


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["bit flip", "truncated", "missing", "not a checkpoint"])
def test_a_damaged_newest_checkpoint_is_refused_and_the_previous_one_resumes(tmp_path, damage, caplog):
    """`latest` records each kept checkpoint's digest: the newest's bytes are verified before they are
    unpickled, and a damaged one is skipped (with a warning naming why) for the previous one."""
    for step in (1, 2):
        checkpoint.save_checkpoint(tmp_path, {"step": step, "w": torch.full((2,), float(step))})
    newest = tmp_path / "ckpt-00000002.pt"
    if damage == "bit flip":
        _flip_last_byte(newest)
    elif damage == "truncated":
        newest.write_bytes(newest.read_bytes()[:100])
    elif damage == "missing":
        newest.unlink()
    else:  # the right size and digest of other bytes cannot be faked by accident: a foreign file
        newest.write_bytes(b"x" * newest.stat().st_size)
    with caplog.at_level("WARNING", logger="rlfleet.trainer.publish.checkpoint"):
        state = checkpoint.load_latest(tmp_path)
    assert state["step"] == 1 and state["w"].tolist() == [1.0, 1.0]
    assert any(
        "ckpt-00000002.pt" in r.getMessage() and "not loaded" in r.getMessage() for r in caplog.records
    )


class _RunsACommand:
    """Pickles as a call of os.system: what a writer of the store could put in a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_whose_pickle_calls_a_function_is_refused_not_run(tmp_path, caplog):
    """Checkpoints are unpickled weights-only: a pickle naming os.system (written through save_checkpoint,
    so its digest verifies: whoever can write the store can write `latest` too) is refused like a damaged
    file and the previous checkpoint resumes; the command never runs. Alone, it is a CheckpointError."""
    marker = tmp_path / "ran"
    directory = tmp_path / "ckpts"
    checkpoint.save_checkpoint(directory, {"step": 1, "w": torch.full((2,), 1.0)})
    checkpoint.save_checkpoint(directory, {"step": 2, "w": _RunsACommand(marker)})
    with caplog.at_level("WARNING", logger="rlfleet.trainer.publish.checkpoint"):
        state = checkpoint.load_latest(directory)
    assert state["step"] == 1 and state["w"].tolist() == [1.0, 1.0]
    assert not marker.exists()
    assert any(
        "ckpt-00000002.pt" in r.getMessage() and "unsupported GLOBAL posix.system" in r.getMessage()
        for r in caplog.records
    )
    (directory / "ckpt-00000001.pt").unlink()
    with pytest.raises(
        checkpoint.CheckpointError, match=r"ckpt-00000002.pt: refused to unpickle .*posix.system"
    ):
        checkpoint.load_latest(directory)
    assert not marker.exists()


def test_no_loadable_checkpoint_fails_naming_each_reason(tmp_path):
    for step in (1, 2):
        checkpoint.save_checkpoint(tmp_path, {"step": step, "w": torch.zeros(2)})
    _flip_last_byte(tmp_path / "ckpt-00000002.pt")
    (tmp_path / "ckpt-00000001.pt").unlink()
    with pytest.raises(checkpoint.CheckpointError) as failed:
        checkpoint.load_latest(tmp_path)
    message = str(failed.value)
    assert "ckpt-00000002.pt: blake3:" in message and "ckpt-00000001.pt: missing" in message
    (tmp_path / "latest").write_text("{not json")
    with pytest.raises(checkpoint.CheckpointError, match="is not readable"):
        checkpoint.load_latest(tmp_path)


def test_a_latest_of_a_run_before_digests_still_resumes_and_the_next_save_records_digests(tmp_path):
    torch.save({"step": 4, "w": torch.ones(2)}, tmp_path / "ckpt-00000004.pt")
    (tmp_path / "latest").write_text("ckpt-00000004.pt")  # what earlier versions wrote
    assert checkpoint.load_latest(tmp_path)["step"] == 4
    checkpoint.save_checkpoint(tmp_path, {"step": 5, "w": torch.ones(2)})
    entries = json.loads((tmp_path / "latest").read_text())["checkpoints"]
    assert [e["name"] for e in entries] == ["ckpt-00000005.pt"] and entries[0]["digest"].startswith("blake3:")
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.pt")) == ["ckpt-00000005.pt"]


def test_a_damaged_checkpoint_on_a_store_falls_back_too(tmp_path):
    from rlfleet.store import FilesystemStore

    store = FilesystemStore(tmp_path / "channel", create=True)
    for step in (1, 2):
        checkpoint.save_checkpoint(store, {"step": step, "w": torch.full((2,), float(step))})
    _flip_last_byte(tmp_path / "channel" / "checkpoints" / "ckpt-00000002.pt")
    assert checkpoint.load_latest(store)["step"] == 1


def test_checkpoints_on_a_real_s3_store_under_the_channel_prefix(tmp_path):
    """The same on the REAL S3-compatible server of the weight tests (moto_server, tests/support/moto.py):
    keys under the channel's prefix, next to its versions."""
    from support.moto import make_bucket, moto_endpoint

    from rlfleet.store import S3Store

    with moto_endpoint() as endpoint:
        store = S3Store(make_bucket(endpoint), "jobs/a/channel", endpoint_url=endpoint)
        assert checkpoint.load_latest(store) is None
        for step in (1, 2):
            checkpoint.save_checkpoint(store, {"step": step, "w": torch.full((3,), float(step))}, keep=1)
        assert store.list("checkpoints/") == ["checkpoints/ckpt-00000002.pt", "checkpoints/latest"]
        latest = store.client.get_object(Bucket=store.bucket, Key="jobs/a/channel/checkpoints/latest")[
            "Body"
        ].read()
        assert [e["name"] for e in json.loads(latest)["checkpoints"]] == ["ckpt-00000002.pt"]
        assert checkpoint.load_latest(store)["w"].tolist() == [2.0, 2.0, 2.0]
        store.close()


def test_run_training_refuses_a_channel_ahead_of_the_trainer(example_run):
    from rlfleet.trainer.run import TrainingStartError, run_training

    class ChannelAtFive:  # a VersionSink whose channel already holds version 5
        def latest_version(self):
            return 5

        def publish(self, weights, version):
            raise AssertionError("nothing may be published")

    sink = ChannelAtFive()
    rc = example_run(steps=1, prompts_per_step=1, max_staleness=None, groups=[])
    with pytest.raises(TrainingStartError, match="at version 5, ahead of the trainer \\(no checkpoint\\)"):
        run_training(rc, object(), sink, collapse.CollapseDetector(), lambda position: None, checkpoint=None)


# ---------------------------------------------------------------- trainer pod entrypoint
def test_entrypoint_rejects_missing_config_and_makes_no_api_call(capsys, monkeypatch):
    from rlfleet.trainer import entrypoint

    monkeypatch.delenv("RLFLEET_CONFIG", raising=False)
    assert entrypoint.cli([]) == 2
    assert "--config" in capsys.readouterr().err
    # least privilege: the trainer has no Kubernetes client code path at all (the operator writes status)
    source = open(entrypoint.__file__).read()
    assert "kubernetes" not in source.replace("Kubernetes", "") and "load_incluster_config" not in source


def test_exporter_publishes_the_collapse_state_the_operator_parses():
    """Real exporter over HTTP -> the operator's parser (rlfleet.operator.trainer_report)."""
    import httpx

    from rlfleet.operator.trainer_report import parse_trainer_report

    exp = metrics.PrometheusExporter(port=0)
    try:
        alert = collapse.Alert(
            step=7, signal="kl_surge", value=0.3, baseline=0.01, group="h100-fp8", message="m"
        )
        exp.update(7, {"reward_mean": 0.5, "kl_k3": 0.02, "weight_version": 6.0, "group/h100-fp8/kl_k3": 0.3})
        exp.update_collapse([alert], ["h100-fp8"], pause=False)
        report = parse_trainer_report(httpx.get(f"http://127.0.0.1:{exp.port}/metrics").text)
        assert (report.step, report.weight_version, report.fleet["reward_mean"]) == (7, 6, 0.5)
        assert [(s.signal, s.group, s.value, s.baseline) for s in report.signals] == [
            ("kl_surge", "h100-fp8", 0.3, 0.01)
        ]
        assert report.quarantine_requested == ("h100-fp8",) and not report.pause_requested
        exp.update_collapse([], ["h100-fp8"], pause=True)  # the signal stopped: it reads 0, quarantine stays
        report = parse_trainer_report(httpx.get(f"http://127.0.0.1:{exp.port}/metrics").text)
        assert (
            report.signals == () and report.quarantine_requested == ("h100-fp8",) and report.pause_requested
        )
    finally:
        exp.close()


def test_build_backend_trains_an_hf_checkpoint_source_with_the_hf_backend(tmp_path, example_run):
    """An HF checkpoint (the project's tiny Qwen3) -> the hf backend; its weights carry the checkpoint's
    names, so version 0 published from them is the base checkpoint in HF layout."""
    from safetensors.torch import load_file

    from rlfleet.tiny_qwen3 import build_tiny_qwen3
    from rlfleet.trainer.backends.backend_hf import HFBackend
    from rlfleet.trainer.run import build_backend

    source = build_tiny_qwen3(tmp_path / "qwen3")
    rc = example_run()
    base = build_backend(rc, backend="torch", source_dir=source)
    assert isinstance(base.backend, HFBackend) and (base.vocab_size, base.max_seq_len) == (64, 256)
    assert base.base_checkpoint == source
    on_disk = load_file(str(source / "model.safetensors"))
    weights = base.backend.weights()
    assert set(on_disk) <= set(weights)
    for name, tensor in on_disk.items():
        assert torch.equal(weights[name], tensor.float()), name


@pytest.mark.parametrize("on", [True, False])
def test_activation_checkpointing_from_the_manifest_reaches_both_backends(tmp_path, on):
    """RLJob trainer.activationCheckpointing -> resolve_run -> build_backend: the hf backend's model has
    transformers' gradient checkpointing on (off by default), and the megatron model config built from
    the same run asks for the recompute."""
    import yaml

    from rlfleet.api import load_rljob
    from rlfleet.tiny_qwen3 import build_tiny_qwen3
    from rlfleet.trainer.config import resolve_run
    from rlfleet.trainer.run import build_backend, megatron_model_config

    manifest = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "rljob.yaml").read_text())
    if on:
        manifest["spec"]["trainer"]["activationCheckpointing"] = True
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(manifest))
    rc = resolve_run(load_rljob(tmp_path / "job.yaml"), local=True)
    assert rc.activation_checkpointing is on

    source = build_tiny_qwen3(tmp_path / "qwen3")
    base = build_backend(rc, backend="torch", source_dir=source, device="cpu")
    assert base.backend.model.is_gradient_checkpointing is on
    cfg = megatron_model_config(rc, json.loads((source / "config.json").read_text()), device="cpu")
    assert cfg.activation_checkpointing is on


def test_expert_parallelism_from_the_manifest_reaches_the_megatron_config(tmp_path) -> None:
    """RLJob trainer.parallelism.expert / expertTensor -> megatron's expert_model_parallel_size and
    expert_tensor_parallel_size; a dense model given expert parallelism is refused when the trainer
    starts, naming why (the API cannot see the model's config)."""
    from types import SimpleNamespace

    from rlfleet.api.rljob import ParallelismSpec
    from rlfleet.tiny_qwen3 import TinyQwen3, build_tiny_qwen3
    from rlfleet.trainer.backends.backend_megatron import UnsupportedModel
    from rlfleet.trainer.run import megatron_model_config

    rc = SimpleNamespace(max_tokens_per_micro_batch=4096, activation_checkpointing=False)
    moe = json.loads(
        (build_tiny_qwen3(tmp_path / "moe", TinyQwen3(architecture="qwen3_moe")) / "config.json").read_text()
    )
    experts = moe.get("num_experts", moe.get("num_local_experts"))
    parallelism = ParallelismSpec(tensor=2, expert=2, expert_tensor=1)
    cfg = megatron_model_config(rc, moe, parallelism=parallelism, device="cpu")  # type: ignore[arg-type]
    assert (cfg.tensor_parallel, cfg.expert_parallel, cfg.expert_tp, cfg.num_experts) == (2, 2, 1, experts)
    cfg.check_supported()
    assert megatron_model_config(rc, moe, parallelism=ParallelismSpec(tensor=2), device="cpu").expert_tp == 2  # type: ignore[arg-type]

    dense = json.loads((build_tiny_qwen3(tmp_path / "dense") / "config.json").read_text())
    cfg = megatron_model_config(rc, dense, parallelism=ParallelismSpec(expert=2), device="cpu")  # type: ignore[arg-type]
    with pytest.raises(UnsupportedModel, match="expert parallelism 2 .* need a mixture of experts"):
        cfg.check_supported()
