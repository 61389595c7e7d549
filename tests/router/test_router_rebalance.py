"""operator/rebalance.py: parsing SGLang metrics, rates, policies, bounds, history, costs."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.operator.rebalance import (
    GroupInput,
    PodSample,
    RebalanceConfig,
    RebalanceState,
    parse_sglang_metrics,
    parse_trainer_group_metrics,
    rebalance,
)

# As SGLang 0.5.23 exposes it (prometheus_client, colons in names, model_name/tp_rank labels); the names
# and labels are held against SGLang's own metrics collector in tests/sglang_contract.
SGLANG_METRICS = """\
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="qwen",tp_rank="0"} 1234.5
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen",tp_rank="0"} 17.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen",tp_rank="0"} 3.0
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="qwen",tp_rank="0"} 1.5e+06
sglang:generation_tokens_total{model_name="qwen",tp_rank="1"} 5e+05
# HELP sglang:realtime_tokens_total Total number of tokens processed (updated on each log interval).
# TYPE sglang:realtime_tokens_total counter
sglang:realtime_tokens_total{mode="prefill_compute",model_name="qwen",tp_rank="0"} 9e+06
sglang:realtime_tokens_total{mode="prefill_cache",model_name="qwen",tp_rank="0"} 1e+06
sglang:realtime_tokens_total{mode="decode",model_name="qwen",tp_rank="0"} 2.5e+06
sglang:realtime_tokens_total{mode="decode",model_name="qwen",tp_rank="1"} 5e+05
# HELP sglang:num_requests_total Number of requests processed.
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{model_name="qwen",tp_rank="0"} 4200.0
# HELP sglang:e2e_request_latency_seconds Histogram of End-to-end request latency in seconds
# TYPE sglang:e2e_request_latency_seconds histogram
sglang:e2e_request_latency_seconds_bucket{le="0.1",model_name="qwen",tp_rank="0"} 5.0
sglang:e2e_request_latency_seconds_bucket{le="+Inf",model_name="qwen",tp_rank="0"} 9.0
sglang:e2e_request_latency_seconds_sum{model_name="qwen",tp_rank="0"} 12.5
sglang:e2e_request_latency_seconds_count{model_name="qwen",tp_rank="0"} 9.0
"""


def test_parse_sglang_metrics_sums_label_sets() -> None:
    sample = parse_sglang_metrics(SGLANG_METRICS)
    assert sample == PodSample(
        generation_tokens_total=2.0e6,
        realtime_decode_tokens_total=3.0e6,  # decode only, summed over ranks; prefill modes left out
        gen_throughput=1234.5,
        num_running_reqs=17.0,
        num_queue_reqs=3.0,
        num_requests_total=4200.0,
    )


def test_parse_ignores_created_timestamps_of_prometheus_client() -> None:
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    registry = CollectorRegistry()
    Counter("sglang:generation_tokens", "t", ["model_name"], registry=registry).labels("m").inc(42)
    assert parse_sglang_metrics(generate_latest(registry).decode()).generation_tokens_total == 42.0


def test_parse_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        parse_sglang_metrics("this is { not prometheus")


def test_parse_trainer_group_metrics() -> None:
    text = (
        'rlfleet_trainer_kl_k3{scope="group",key="h100-fp8"} 0.02\n'
        'rlfleet_trainer_oor_fraction{scope="group",key="h100-fp8"} 0.003\n'
        'rlfleet_trainer_kl_k3{scope="fleet",key=""} 0.01\n'
    )
    assert parse_trainer_group_metrics(text) == {"h100-fp8": {"kl_k3": 0.02, "oor_fraction": 0.003}}


def group(name: str, tokens: float | None = None, gauge: float | None = None, **kw) -> GroupInput:
    """One pod whose realtime decode counter reads `tokens` and gen_throughput gauge `gauge`."""
    pods = {f"{name}-0": PodSample(realtime_decode_tokens_total=tokens, gen_throughput=gauge)}
    return GroupInput(
        name=name,
        ready_replicas=kw.pop("ready", 1),
        gpus=kw.pop("gpus", 1),
        price_per_gpu_hour=kw.pop("price", 0.0),
        pods=pods,
        **kw,
    )


def test_throughput_is_the_decode_counter_rate_with_gauges_for_new_and_restarted_pods() -> None:
    config = RebalanceConfig(smoothing=1.0)
    first = rebalance([group("a", tokens=1000, gauge=50)], None, now=100.0, config=config)
    assert first.groups["a"].tokens_per_second == 50  # no previous counter: the gauge
    second = rebalance([group("a", tokens=4000, gauge=999)], first.state, now=110.0, config=config)
    assert second.groups["a"].tokens_per_second == pytest.approx(300.0)  # (4000 - 1000) / 10
    restarted = rebalance([group("a", tokens=500, gauge=80)], second.state, now=120.0, config=config)
    assert restarted.groups["a"].tokens_per_second == pytest.approx(80.0)  # counter went down: the gauge
    no_gauge = rebalance([group("a", tokens=100)], second.state, now=120.0, config=config)
    assert no_gauge.groups["a"].tokens_per_second == pytest.approx(10.0)  # restarted, no gauge: 100 / 10
    two_pods = GroupInput(
        "a",
        2,
        2,
        0.0,
        pods={
            "a-0": PodSample(realtime_decode_tokens_total=1500),
            "a-1": PodSample(realtime_decode_tokens_total=10, gen_throughput=70),
        },
    )
    assert rebalance([two_pods], restarted.state, now=130.0, config=config).groups[
        "a"
    ].tokens_per_second == pytest.approx(170.0)


def test_busy_group_with_long_rollouts_and_no_finished_request_does_not_read_zero() -> None:
    """SGLang counts generation_tokens_total when a request FINISHES: 64 rollouts of 30k tokens decode
    for minutes without moving it. The rate comes from the per-step decode counter (or the gauge)."""
    config = RebalanceConfig(smoothing=1.0)
    state = None
    for i, decoded in enumerate([0.0, 10_000.0, 20_000.0, 30_000.0]):  # 1000 tok/s, nothing finished
        pod = PodSample(
            generation_tokens_total=0.0, realtime_decode_tokens_total=decoded, gen_throughput=1000.0
        )
        result = rebalance([GroupInput("busy", 1, 1, 1.0, pods={"busy-0": pod})], state, 10.0 * i, config)
        assert result.groups["busy"].tokens_per_second == pytest.approx(1000.0)
        state = result.state
    # A server exporting only the gauge (no realtime counter) reads the gauge every interval.
    gauge_only = PodSample(generation_tokens_total=0.0, gen_throughput=900.0)
    state = None
    for i in range(3):
        result = rebalance(
            [GroupInput("busy", 1, 1, 1.0, pods={"busy-0": gauge_only})], state, 10.0 * i, config
        )
        assert result.groups["busy"].tokens_per_second == pytest.approx(900.0)
        state = result.state
    # The finish-time counter alone is no throughput reading at all (None, not 0).
    finished_only = PodSample(generation_tokens_total=5e6)
    result = rebalance([GroupInput("busy", 1, 1, 1.0, pods={"busy-0": finished_only})], None, 0.0, config)
    assert result.groups["busy"].tokens_per_second is None


def test_ema_smoothing() -> None:
    config = RebalanceConfig(smoothing=0.25)
    r = rebalance([group("a", gauge=100)], None, 0.0, config)
    r = rebalance([GroupInput("a", 1, 1, 0.0, tokens_per_second=200.0)], r.state, 10.0, config)
    assert r.groups["a"].tokens_per_second == pytest.approx(0.25 * 200 + 0.75 * 100)


def run_constant(speeds: dict[str, float], intervals: int, config: RebalanceConfig, **kw) -> list:
    state, results = None, []
    for i in range(intervals):
        inputs = [
            GroupInput(
                n,
                1,
                1,
                kw.get("prices", {}).get(n, 1.0),
                tokens_per_second=s,
                oor_fraction=kw.get("oor", {}).get(n),
            )
            for n, s in speeds.items()
        ]
        result = rebalance(inputs, state, 30.0 * i, config)
        state = result.state
        results.append(result)
    return results


def test_throughput_shares_converge_within_10_percent_in_3_intervals_with_default_bounds() -> None:
    speeds = {"a100-bf16": 1000.0, "h100-fp8": 2000.0, "b200-nvfp4": 4000.0}
    results = run_constant(speeds, 3, RebalanceConfig())
    ratio = {n: s / sum(speeds.values()) for n, s in speeds.items()}
    for n in speeds:
        assert abs(results[2].shares[n] - ratio[n]) <= 0.1 * ratio[n], (n, results[2].shares[n], ratio[n])
    # ...and each step respected the bound.
    previous = {n: 1 / 3 for n in speeds}
    for r in results:
        assert max(abs(r.shares[n] - previous[n]) for n in speeds) <= 0.1 + 1e-12
        previous = r.shares


def test_cost_policy_with_a_subnormal_rate_gives_finite_shares() -> None:
    """Found by Hypothesis: tokens/s of 2.2e-308 made the cost per token inf and every share NaN."""
    inputs = [
        GroupInput("g0", 1, 1, 1.0, tokens_per_second=0.0),
        GroupInput("g1", 1, 1, 1.0, tokens_per_second=2.2250738585072014e-308),
    ]
    config = RebalanceConfig(policy="cost", max_share_change=1.0, min_share=0.0)
    result = rebalance(inputs, None, 0.0, config, current_shares={"g0": 0.0, "g1": 0.0})
    assert all(math.isfinite(v) for v in result.shares.values()), result.shares
    assert math.isclose(sum(result.shares.values()), 1.0, rel_tol=1e-9)


shares_strategy = st.lists(st.floats(0.0, 1.0), min_size=2, max_size=6)


@settings(max_examples=200, deadline=None)
@given(
    shares_strategy,
    st.data(),
    st.sampled_from(["throughput", "cost", "static"]),
    st.floats(0.01, 1.0),
    st.floats(0.0, 0.2),
)
def test_shares_sum_to_one_and_move_at_most_the_bound(old_raw, data, policy, max_change, min_share) -> None:
    n = len(old_raw)
    names = [f"g{i}" for i in range(n)]
    speeds = data.draw(st.lists(st.floats(0.0, 1e5), min_size=n, max_size=n))
    quarantined = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    prices = data.draw(st.lists(st.floats(0.5, 10.0), min_size=n, max_size=n))
    oor = data.draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n))
    inputs = [
        GroupInput(
            name,
            1,
            1,
            prices[i],
            tokens_per_second=speeds[i],
            quarantined=quarantined[i],
            oor_fraction=oor[i],
            static_share=old_raw[(i + 1) % n],
        )
        for i, name in enumerate(names)
    ]
    current = dict(zip(names, old_raw, strict=True))
    config = RebalanceConfig(policy=policy, max_share_change=max_change, min_share=min_share)
    result = rebalance(inputs, None, 0.0, config, current_shares=current)
    shares = result.shares
    eligible = [name for name, q in zip(names, quarantined, strict=True) if not q]
    if not eligible:
        assert all(v == 0.0 for v in shares.values())
        return
    assert math.isclose(sum(shares.values()), 1.0, rel_tol=1e-9)
    for name, q in zip(names, quarantined, strict=True):
        if q:
            assert shares[name] == 0.0 and result.groups[name].reason == "quarantined"
    # The bound applies to the move from the current shares renormalised over eligible groups.
    base_total = sum(current[g] for g in eligible)
    base = {g: (current[g] / base_total if base_total > 0 else 1 / len(eligible)) for g in eligible}
    assert max(abs(shares[g] - base[g]) for g in eligible) <= max_change + 1e-9
    # Moving toward a target above the floor never goes below min(base, floor).
    floor = min(min_share, 1 / len(eligible))
    for g in eligible:
        assert shares[g] >= min(base[g], floor) - 1e-9


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(1.0, 1e4), min_size=2, max_size=5), st.floats(0.05, 0.5))
def test_repeated_rebalancing_reaches_the_proportional_target(speeds, max_change) -> None:
    names = {f"g{i}": s for i, s in enumerate(speeds)}
    steps = math.ceil(1.0 / max_change) + 1
    final = run_constant(names, steps, RebalanceConfig(max_share_change=max_change, min_share=0.0))[-1]
    for name, s in names.items():
        assert final.shares[name] == pytest.approx(s / sum(speeds), abs=1e-9)


def test_cost_policy_favours_cheap_useful_tokens() -> None:
    config = RebalanceConfig(policy="cost", min_share=0.0, max_share_change=1.0)
    # Same speed; b is twice as expensive; c is cheap but half its tokens are out of range.
    final = run_constant(
        {"a": 1000.0, "b": 1000.0, "c": 1000.0},
        1,
        config,
        prices={"a": 1.0, "b": 2.0, "c": 1.0},
        oor={"c": 0.5},
    )[-1]
    # raw: a = 1000 * 1, b = 1000 * 1/2, c = 500 * (cost_a / cost_c = 1/2) = 250
    assert final.shares["a"] == pytest.approx(1000 / 1750)
    assert final.shares["b"] == pytest.approx(500 / 1750)
    assert final.shares["c"] == pytest.approx(250 / 1750)
    assert final.groups["b"].cost_per_1m_useful_tokens == pytest.approx(2.0 / 3600 / 1000 * 1e6)
    assert final.groups["c"].cost_per_1m_tokens == pytest.approx(1.0 / 3600 / 1000 * 1e6)
    assert final.groups["c"].cost_per_1m_useful_tokens == pytest.approx(1.0 / 3600 / 500 * 1e6)


def test_static_policy_uses_configured_shares() -> None:
    inputs = [
        GroupInput("a", 1, 1, 1.0, tokens_per_second=10.0, static_share=3.0),
        GroupInput("b", 1, 1, 1.0, tokens_per_second=1e6, static_share=1.0),
    ]
    result = rebalance(
        inputs, None, 0.0, RebalanceConfig(policy="static", min_share=0.0, max_share_change=1.0)
    )
    assert result.shares == {"a": 0.75, "b": 0.25}


def test_quarantine_and_dead_groups_drop_to_zero_at_once() -> None:
    config = RebalanceConfig(max_share_change=0.05)
    inputs = [
        GroupInput("a", 1, 1, 1.0, tokens_per_second=100.0),
        GroupInput("b", 1, 1, 1.0, tokens_per_second=100.0, quarantined=True),
        GroupInput("c", 0, 1, 1.0, tokens_per_second=100.0),
    ]
    result = rebalance(inputs, None, 0.0, config, current_shares={"a": 0.2, "b": 0.4, "c": 0.4})
    assert result.shares == {"a": 1.0, "b": 0.0, "c": 0.0}
    assert result.groups["c"].reason == "no ready replicas"
    assert result.groups["b"].status_patch()["quarantined"] is True


def test_history_keeps_the_last_five_changes_with_reasons_and_skips_noise() -> None:
    config = RebalanceConfig(max_share_change=0.02, min_share=0.0)
    results = run_constant({"a": 1000.0, "b": 3000.0}, 12, config)
    history = results[-1].groups["b"].history
    assert len(history) == 5
    assert [h["to"] for h in history] == [round(r.groups["b"].share, 4) for r in results[-5:]]
    assert all(h["reason"].startswith("throughput 3000 tok/s; bounded toward 0.750") for h in history)
    assert history[-1]["from"] == round(results[-2].groups["b"].share, 4)
    assert results[-1].changes and "b: share" in results[-1].changes[1]
    # Converged: the next interval changes nothing and records nothing.
    settled = run_constant({"a": 1000.0, "b": 3000.0}, 40, config)
    assert settled[-1].changes == () and len(settled[-1].groups["b"].history) == 5
    assert settled[-1].groups["b"].history == settled[-2].groups["b"].history


def test_status_fields_and_fleet_cost_against_the_trainer_class_baseline() -> None:
    config = RebalanceConfig(reference_accelerator="b200", min_share=0.0, max_share_change=1.0)
    inputs = [
        GroupInput(
            "b200-bf16", 1, 8, 6.0, accelerator="b200", tokens_per_second=8000.0, oor_fraction=0.001, kl=0.001
        ),
        GroupInput(
            "h100-fp8",
            2,
            16,
            3.0,
            accelerator="h100",
            tokens_per_second=24000.0,
            oor_fraction=0.003,
            kl=0.004,
        ),
    ]
    result = rebalance(inputs, None, 1_700_000_000.0, config)
    # Fleet: (6*8 + 3*16) $/h over 8000*0.999 + 24000*0.997 = 31920 usable tok/s. Reference: the b200
    # group at bf16 (the default weight format): 1000 tok/s per GPU, 0.1% out of range, $6/GPU-h.
    assert result.fleet_cost_per_1m_usable_tokens == pytest.approx(96 / 3600 / 31920 * 1e6, rel=1e-12)
    assert result.baseline_cost_per_1m_usable_tokens == pytest.approx(6 / 3600 / 999 * 1e6, rel=1e-12)
    assert result.saving == pytest.approx(1 - (96 / 31920) / (6 / 999), rel=1e-12)
    patch = result.groups["h100-fp8"].status_patch()
    assert patch["tokensPerSecond"] == 24000.0 and patch["share"] == 0.75
    assert patch["tokenShare"] == 0.75
    assert patch["oorShare"] == pytest.approx(round(24000 * 0.003 / (24000 * 0.003 + 8000 * 0.001), 4))
    assert patch["costPer1MTokens"] == pytest.approx(round(48 / 3600 / (24000 * 0.997) * 1e6, 4))
    assert patch["kl"] == 0.004 and patch["quarantined"] is False
    assert patch["costPerHour"] == 48.0  # 16 GPUs at $3
    assert patch["shareHistory"][0]["time"] == "2023-11-14T22:13:20Z"
    # Without a group on the trainer class the baseline needs an estimate (or stays unknown).
    assert rebalance(inputs[1:], None, 0.0, config).baseline_cost_per_1m_usable_tokens is None
    estimated = RebalanceConfig(reference_price_per_gpu_hour=6.0, reference_tokens_per_gpu_second=1500.0)
    assert rebalance(inputs[1:], None, 0.0, estimated).baseline_cost_per_1m_usable_tokens == pytest.approx(
        6 / 3600 / 1500 * 1e6
    )


def test_state_survives_a_json_round_trip() -> None:
    results = run_constant({"a": 100.0, "b": 300.0}, 3, RebalanceConfig())
    restored = RebalanceState.from_dict(json.loads(json.dumps(results[-1].state.to_dict())))
    a = rebalance(
        [
            GroupInput("a", 1, 1, 1.0, tokens_per_second=100.0),
            GroupInput("b", 1, 1, 1.0, tokens_per_second=300.0),
        ],
        restored,
        120.0,
        RebalanceConfig(),
    )
    b = rebalance(
        [
            GroupInput("a", 1, 1, 1.0, tokens_per_second=100.0),
            GroupInput("b", 1, 1, 1.0, tokens_per_second=300.0),
        ],
        results[-1].state,
        120.0,
        RebalanceConfig(),
    )
    assert a.shares == b.shares and a.groups["b"].history == b.groups["b"].history


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        RebalanceConfig(policy="fastest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_share_change"):
        RebalanceConfig(max_share_change=0.0)
