"""operator/rebalance.py: parsing SGLang metrics, rates, policies, bounds, history, costs."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.catalog import load_catalog
from rlfleet.operator.rebalance import (
    GroupInput,
    PodSample,
    RebalanceConfig,
    RebalanceResult,
    RebalanceState,
    parse_sglang_metrics,
    parse_trainer_group_metrics,
    queues_empty,
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


# --- saturation-aware capacity: a demand-limited group's reading is a lower bound ------------------

CATALOG = load_catalog()  # built-in: H100 bf16 = 1 per GPU, H100 fp8 = 2 (half the bytes per weight)
DEMAND = 3000.0  # tokens/s the light producer asks for, spread by the router's shares
STEP = 30.0  # seconds per rebalance interval


def test_catalog_ratios_the_capacity_tests_compute_by_hand() -> None:
    assert CATALOG.decode_throughput("h100", "bf16") == 1.0
    assert CATALOG.decode_throughput("h100", "fp8") == 2.0


def pod(rate: float, queue: float | None, counter: float | None = None) -> PodSample:
    """A pod decoding `rate` tokens/s (its gauge; `counter`: its realtime decode counter) with `queue`
    requests waiting (None: the gauge absent)."""
    return PodSample(realtime_decode_tokens_total=counter, gen_throughput=rate, num_queue_reqs=queue)


def sg(name: str, fmt: str, pods: dict[str, PodSample], gpus: int = 1, **kw) -> GroupInput:
    return GroupInput(
        name,
        kw.pop("ready", 1),
        gpus,
        kw.pop("price", 0.0),
        pods=pods,
        accelerator="h100",
        weight_format=fmt,
        **kw,
    )


def starved_fleet(intervals: int, queue: float | None, catalog, **config_fields) -> list:
    """Three groups behind a light producer (DEMAND tokens/s in all, each group delivering DEMAND x the
    share it was given over the interval): h100-bf16 a and b (prior 1 each), h100-fp8 c (prior 2), which is
    not ready at the first rebalance. Every pod reports `queue` waiting requests."""
    # throughput, 0.1 per interval, min_share 0.02, EMA 0.5, demand-limited after 2 empty readings
    config = RebalanceConfig(catalog=catalog, **config_fields)
    counters = dict.fromkeys("abc", 0.0)
    shares = dict.fromkeys("abc", 1 / 3)  # the router's before the first rebalance: equal
    state, results = None, []
    for i in range(intervals):
        delivered = {n: DEMAND * shares[n] for n in "abc"}
        if i:
            counters = {n: counters[n] + delivered[n] * STEP for n in "abc"}
        inputs = [
            sg("a", "bf16", {"a-0": pod(delivered["a"], queue, counters["a"])}),
            sg("b", "bf16", {"b-0": pod(delivered["b"], queue, counters["b"])}),
            sg("c", "fp8", {"c-0": pod(delivered["c"], queue, counters["c"])} if i else {}, ready=int(i > 0)),
        ]
        result = rebalance(inputs, state, STEP * i, config)
        state, shares = result.state, result.shares
        results.append(result)
    return results


def assert_share_path(results: list[RebalanceResult], names: str, expected: list[tuple[float, ...]]) -> None:
    """Interval by interval, the shares of the groups named by one letter each in `names`, within 1e-12."""
    assert len(results) == len(expected)
    for result, row in zip(results, expected, strict=True):
        assert result.shares == pytest.approx(dict(zip(names, row, strict=True)), abs=1e-12)


def test_a_late_group_behind_a_light_producer_climbs_to_its_prior_share() -> None:
    """The fixed point the `throughput` policy had: c, not ready at the first rebalance (share 0), delivers
    nothing, so measured throughput would keep it at the floor. No pod has a request waiting, so each
    reading is a lower bound: with no saturated group the capacities are proportional to the priors
    a 1 : b 1 : c 2, i.e. targets 0.02 + 0.94 x (1/4, 1/4, 2/4) = 0.255, 0.255, 0.49. From (0.5, 0.5, 0)
    the largest move, c's 0.49, is bounded to 0.1 per interval and the others move along the same line
    (0.245 x 0.1 / 0.49 = 0.05 each), until c is within 0.1 of its target. Here a single empty reading
    makes a group demand-limited (demand_limited_intervals=1); the default waits for two, below."""
    results = starved_fleet(8, 0.0, CATALOG, demand_limited_intervals=1)
    expected = [
        (0.5, 0.5, 0.0),  # c not ready: 0 at once; a and b renormalised
        (0.45, 0.45, 0.10),
        (0.40, 0.40, 0.20),
        (0.35, 0.35, 0.30),
        (0.30, 0.30, 0.40),
        (0.255, 0.255, 0.49),  # within the bound: the target
        (0.255, 0.255, 0.49),
        (0.255, 0.255, 0.49),
    ]
    assert_share_path(results, "abc", expected)
    assert all(sum(r.shares.values()) == pytest.approx(1.0, abs=1e-12) for r in results)
    joined = results[1].groups["c"]
    assert joined.tokens_per_second == 0.0  # the status keeps the measured rate...
    assert joined.capacity_estimated and joined.capacity_tokens_per_second > 0
    assert joined.reason.startswith("throughput 0 tok/s; capacity estimated ")  # ...and says why
    assert "tok/s: no queue; bounded toward 0.490" in joined.reason
    assert joined.status_patch()["shareHistory"][-1]["reason"] == joined.reason
    # k = the largest reading per unit of prior (a's and b's: equal), so a and b are at their readings
    assert not results[1].groups["a"].capacity_estimated


def test_by_default_the_late_group_climbs_from_its_second_empty_reading() -> None:
    """The same fleet at the default demand_limited_intervals = 2. At its first ready interval c's queue has
    read empty once (not ready before: no pod read, unknown), so it is weighed by its reading, 0: targets
    0.02 + 0.94 x (1/2, 1/2, 0) = (0.49, 0.49, 0.02), within 0.1 of (0.5, 0.5, 0). a and b, empty at both
    intervals, are demand-limited, but k = their own reading per unit of prior, so they stay at their
    readings. From the next interval c is demand-limited too: targets (0.255, 0.255, 0.49) as above, c's
    move from 0.02 bounded to 0.1 and a's and b's along the line (0.235 x 0.1 / 0.47 = 0.05 each)."""
    results = starved_fleet(8, 0.0, CATALOG)
    expected = [
        (0.5, 0.5, 0.0),
        (0.49, 0.49, 0.02),  # c: one empty reading, its measured 0 tok/s
        (0.44, 0.44, 0.12),
        (0.39, 0.39, 0.22),
        (0.34, 0.34, 0.32),
        (0.29, 0.29, 0.42),
        (0.255, 0.255, 0.49),  # within the bound: the target
        (0.255, 0.255, 0.49),
    ]
    assert_share_path(results, "abc", expected)
    assert [r.state.groups["c"].empty_queue_intervals for r in results] == [0, 1, 2, 3, 4, 5, 6, 7]
    waiting = results[1].groups["c"]
    assert not waiting.capacity_estimated and waiting.reason == "throughput 0 tok/s"  # says nothing yet
    joined = results[2].groups["c"]
    assert joined.capacity_estimated
    assert joined.reason.startswith("throughput 30 tok/s; capacity estimated ")
    assert joined.reason.endswith(" tok/s: no queue; bounded toward 0.490")


def test_demand_limited_reads_sglang_num_queue_reqs_of_every_pod() -> None:
    queued = parse_sglang_metrics(SGLANG_METRICS)  # 3 waiting
    idle = parse_sglang_metrics(SGLANG_METRICS.replace('tp_rank="0"} 3.0', 'tp_rank="0"} 0.0'))
    assert idle.num_queue_reqs == 0.0
    assert queues_empty(sg("g", "bf16", {"g-0": idle, "g-1": idle}))
    assert not queues_empty(sg("g", "bf16", {"g-0": idle, "g-1": queued}))
    assert not queues_empty(sg("g", "bf16", {}))  # no pod read: unknown


def settled(groups: list[GroupInput], config: RebalanceConfig):
    """The result of the second of two intervals at the same readings (gauges, no counters: the smoothed
    rate is the gauge): with the default demand_limited_intervals = 2, a group whose queues read empty at
    both is demand-limited at the second."""
    first = rebalance(groups, None, 0.0, config)
    return rebalance(groups, first.state, STEP, config)


def test_unknown_queue_keeps_the_measured_throughput_policy_exactly() -> None:
    """No queue reading (or no catalog): shares follow delivered throughput as before this rule, and the
    late group starts from the floor: at its first ready interval a and b read the same rate, c 0, so the
    targets are 0.02 + 0.94 x (1/2, 1/2, 0) = (0.49, 0.49, 0.02), all within 0.1 of (0.5, 0.5, 0)."""
    unknown = starved_fleet(8, None, CATALOG)
    no_catalog = starved_fleet(8, 0.0, None)
    queued = starved_fleet(8, 2.0, CATALOG)  # requests waiting everywhere: saturated, measured
    assert unknown[1].shares == pytest.approx({"a": 0.49, "b": 0.49, "c": 0.02}, abs=1e-12)
    for u, n, q in zip(unknown, no_catalog, queued, strict=True):
        assert u.shares == n.shares == q.shares
        assert [g.reason for g in u.groups.values()] == [g.reason for g in n.groups.values()]
        assert not any(g.capacity_estimated for g in u.groups.values())
    assert unknown[-1].shares["c"] < 0.15  # delivered-proportional: far from its capacity share 0.49
    # a pod without the gauge, next to one reporting 0, leaves the group's queue unknown
    mixed = sg("m", "fp8", {"m-0": pod(100.0, 0.0), "m-1": pod(100.0, None)})
    saturated = sg("s", "bf16", {"s-0": pod(1000.0, 3.0)})
    config = RebalanceConfig(catalog=CATALOG, min_share=0.0, max_share_change=1.0)
    result = rebalance([saturated, mixed], None, 0.0, config)
    assert result.shares == pytest.approx({"s": 1000 / 1200, "m": 200 / 1200})
    # so does a direct reading (Prometheus): no pods
    direct = GroupInput("d", 1, 1, 0.0, accelerator="h100", weight_format="fp8", tokens_per_second=200.0)
    result = rebalance([saturated, direct], None, 0.0, config)
    assert result.shares == pytest.approx({"s": 1000 / 1200, "d": 200 / 1200})


def test_saturated_groups_calibrate_a_demand_limited_one() -> None:
    """k = the median over the saturated groups of tokens/s / (ratio x GPUs): s1 2000 / (1 x 2) = 1000,
    s2 2000 / (2 x 1) = 1000, s3 4000 / (1 x 1) = 4000 (an outlier the median leaves out) -> 1000. d
    (h100 fp8, 1 GPU, nothing waiting) reads 300 but could make 1000 x 2 x 1 = 2000."""
    groups = [
        sg("s1", "bf16", {"s1-0": pod(2000.0, 4.0)}, gpus=2),
        sg("s2", "fp8", {"s2-0": pod(2000.0, 1.0)}),
        sg("s3", "bf16", {"s3-0": pod(4000.0, 9.0)}),
        sg("d", "fp8", {"d-0": pod(300.0, 0.0)}),
    ]
    config = RebalanceConfig(catalog=CATALOG, min_share=0.0, max_share_change=1.0)
    result = settled(groups, config)
    assert result.shares == pytest.approx({"s1": 0.2, "s2": 0.2, "s3": 0.4, "d": 0.2}, abs=1e-12)
    d = result.groups["d"]
    assert d.tokens_per_second == 300.0 and d.status_patch()["tokensPerSecond"] == 300.0
    assert d.capacity_tokens_per_second == pytest.approx(2000.0)
    assert d.reason == "throughput 300 tok/s; capacity estimated 2000 tok/s: no queue"
    assert result.groups["s1"].reason == "throughput 2000 tok/s"
    assert result.groups["d"].token_share == pytest.approx(300 / 8300)  # what it delivered
    # the prior counts the GPUs of the pods read (2 of 4 replicas at tensor parallel 2: 4 GPUs, not 8)
    scaling = sg("d", "bf16", {"d-0": pod(100.0, 0.0), "d-1": pod(100.0, 0.0)}, gpus=8, tensor_parallel=2)
    result = settled([groups[1], scaling], config)
    assert result.groups["d"].capacity_tokens_per_second == pytest.approx(1000.0 * 1 * 4)
    assert result.shares == pytest.approx({"s2": 2000 / 6000, "d": 4000 / 6000}, abs=1e-12)


def test_a_demand_limited_group_reading_above_its_prior_keeps_the_reading() -> None:
    """k = 1000 from s; d (h100 bf16, 1 GPU, nothing waiting) reads 1500 > 1000 x 1 x 1: the reading."""
    groups = [sg("s", "bf16", {"s-0": pod(1000.0, 2.0)}), sg("d", "bf16", {"d-0": pod(1500.0, 0.0)})]
    config = RebalanceConfig(catalog=CATALOG, min_share=0.0, max_share_change=1.0)
    result = settled(groups, config)
    assert result.shares == pytest.approx({"s": 0.4, "d": 0.6}, abs=1e-12)
    assert not result.groups["d"].capacity_estimated
    assert result.groups["d"].capacity_tokens_per_second == 1500.0
    assert result.groups["d"].reason == "throughput 1500 tok/s"


def test_cost_policy_weighs_capacity_and_reports_the_measured_cost() -> None:
    """s (h100 bf16, $2/h, saturated) 1000 tok/s: k = 1000, $2 / 3600 / 1000 x 1e6 per 1M. d (h100 fp8, $2/h,
    nothing waiting) reads 100 tok/s, $2 / 3600 / 100 x 1e6 as measured, but could make 2000 at
    $2 / 3600 / 2000 x 1e6, the cheapest: raw s = 1000 x (1/2000) / (1/1000) = 500, d = 2000."""
    groups = [
        sg("s", "bf16", {"s-0": pod(1000.0, 5.0)}, price=2.0),
        sg("d", "fp8", {"d-0": pod(100.0, 0.0)}, price=2.0),
    ]
    config = RebalanceConfig(policy="cost", catalog=CATALOG, min_share=0.0, max_share_change=1.0)
    result = settled(groups, config)
    assert result.shares == pytest.approx({"s": 0.2, "d": 0.8}, abs=1e-12)
    d = result.groups["d"]
    assert d.cost_per_1m_useful_tokens == pytest.approx(2.0 / 3600 / 100 * 1e6)  # measured, not the estimate
    assert d.status_patch()["costPer1MTokens"] == round(2.0 / 3600 / 100 * 1e6, 4)
    assert (
        d.reason
        == f"cost ${2.0 / 3600 / 100 * 1e6:.3f}/1M useful tokens; capacity estimated 2000 tok/s: no queue"
    )
    # the static policy ignores capacity (and says nothing about it)
    static = rebalance(
        [replace(g, static_share=1.0) for g in groups], None, 0.0, replace(config, policy="static")
    )
    assert static.shares == {"s": 0.5, "d": 0.5} and static.groups["d"].reason == "static"


# --- demand-limited only after empty queues at demand_limited_intervals readings in a row --------------


def queue_run(queues: list[float | None], config: RebalanceConfig) -> list:
    """s (h100 bf16, saturated: 2 waiting) reads 1000 tok/s and d (h100 fp8, prior 2) 250 at every interval
    (gauges), d's pod reporting `queues[i]` waiting at interval i. The router starts at the measured
    shares 1000 : 250 = (0.8, 0.2). Demand-limited, d could make k x prior = (1000 / 1) x 2 = 2000: target
    2000 / 3000 = 2/3, and from d = 0.2 the move 0.467 bounded to 0.1 (s along the line: -0.1)."""
    state, shares, results = None, {"s": 0.8, "d": 0.2}, []
    for i, queue in enumerate(queues):
        groups = [sg("s", "bf16", {"s-0": pod(1000.0, 2.0)}), sg("d", "fp8", {"d-0": pod(250.0, queue)})]
        result = rebalance(groups, state, STEP * i, config, current_shares=shares)
        state, shares = result.state, result.shares
        results.append(result)
    return results


def test_one_empty_queue_reading_between_saturated_ones_changes_no_share() -> None:
    """A scrape that catches d's queue empty for a moment (e.g. right after a weight-version switch): at the
    default 2 intervals nothing moves and nothing is said; at 1 the share churns 0.2 -> 0.3 -> 0.2."""
    queues: list[float | None] = [2.0, 2.0, 0.0, 2.0, 2.0]
    default = queue_run(queues, RebalanceConfig(catalog=CATALOG, min_share=0.0))
    for result in default:
        assert result.shares == {"s": 0.8, "d": 0.2}
        assert result.groups["d"].reason == "throughput 250 tok/s"
        assert not result.groups["d"].capacity_estimated and result.groups["d"].history == ()
    assert [r.state.groups["d"].empty_queue_intervals for r in default] == [0, 0, 1, 0, 0]
    single = queue_run(queues, RebalanceConfig(catalog=CATALOG, min_share=0.0, demand_limited_intervals=1))
    expected = [(0.8, 0.2), (0.8, 0.2), (0.7, 0.3), (0.8, 0.2), (0.8, 0.2)]
    assert_share_path(single, "sd", expected)
    assert single[2].groups["d"].reason == (
        "throughput 250 tok/s; capacity estimated 2000 tok/s: no queue; bounded toward 0.667"
    )
    assert [(h["from"], h["to"]) for h in single[-1].groups["d"].history] == [(0.2, 0.3), (0.3, 0.2)]


def test_two_consecutive_empty_readings_engage_the_estimate() -> None:
    """d's queue empty from interval 1: its second empty reading (interval 2) weighs it by 2000 tok/s,
    0.2 -> 0.3, then 0.3 -> 0.4 (2/3 - 0.3 = 0.367 still over the bound)."""
    results = queue_run([2.0, 0.0, 0.0, 0.0], RebalanceConfig(catalog=CATALOG, min_share=0.0))
    expected = [(0.8, 0.2), (0.8, 0.2), (0.7, 0.3), (0.6, 0.4)]
    assert_share_path(results, "sd", expected)
    assert [r.state.groups["d"].empty_queue_intervals for r in results] == [0, 1, 2, 3]
    assert [r.groups["d"].capacity_estimated for r in results] == [False, False, True, True]
    assert results[2].groups["d"].capacity_tokens_per_second == 2000.0
    assert results[2].groups["d"].reason == (
        "throughput 250 tok/s; capacity estimated 2000 tok/s: no queue; bounded toward 0.667"
    )
    assert results[2].groups["d"].tokens_per_second == 250.0  # the status keeps the measured rate
    # at 3 intervals the same readings engage one interval later
    three = queue_run(
        [2.0, 0.0, 0.0, 0.0], RebalanceConfig(catalog=CATALOG, min_share=0.0, demand_limited_intervals=3)
    )
    assert [r.groups["d"].capacity_estimated for r in three] == [False, False, False, True]
    assert three[3].shares == pytest.approx({"s": 0.7, "d": 0.3}, abs=1e-12)


def test_a_saturated_or_unknown_reading_resets_the_count() -> None:
    """Empty, queued, empty, gauge absent, empty, empty: the queued and the unknown reading each start the
    count again, so d is demand-limited only at the last interval (0.2 -> 0.3)."""
    queues: list[float | None] = [0.0, 2.0, 0.0, None, 0.0, 0.0]
    results = queue_run(queues, RebalanceConfig(catalog=CATALOG, min_share=0.0))
    assert [r.state.groups["d"].empty_queue_intervals for r in results] == [1, 0, 1, 0, 1, 2]
    for result in results[:-1]:
        assert result.shares == {"s": 0.8, "d": 0.2}
    assert results[-1].shares == pytest.approx({"s": 0.7, "d": 0.3}, abs=1e-12)
    # once demand-limited, one queued reading weighs d by its reading again at once: back toward 0.2
    back = queue_run([*queues, 2.0], RebalanceConfig(catalog=CATALOG, min_share=0.0))[-1]
    assert back.shares == pytest.approx({"s": 0.8, "d": 0.2}, abs=1e-12)
    assert back.state.groups["d"].empty_queue_intervals == 0 and not back.groups["d"].capacity_estimated


def test_a_state_written_before_the_count_loads_and_counts_from_zero() -> None:
    """A state dict without `empty_queue_intervals` (an operator of 02850b3) loads through from_dict with
    the count at 0: d's first empty reading after it counts 1 (not yet demand-limited), the second 2."""
    config = RebalanceConfig(catalog=CATALOG, min_share=0.0)
    written = queue_run([0.0, 0.0], config)[-1]
    assert written.state.groups["d"].empty_queue_intervals == 2
    old = json.loads(json.dumps(written.state.to_dict()))
    for memory in old["groups"].values():
        del memory["empty_queue_intervals"]
    loaded = RebalanceState.from_dict(old)
    assert {n: m.empty_queue_intervals for n, m in loaded.groups.items()} == {"s": 0, "d": 0}
    assert loaded.groups["d"].ema_tokens_per_second == 250.0
    groups = [sg("s", "bf16", {"s-0": pod(1000.0, 2.0)}), sg("d", "fp8", {"d-0": pod(250.0, 0.0)})]
    shares = {"s": 0.8, "d": 0.2}
    first = rebalance(groups, loaded, 2 * STEP, config, current_shares=shares)
    assert first.shares == shares and first.state.groups["d"].empty_queue_intervals == 1
    second = rebalance(groups, first.state, 3 * STEP, config, current_shares=first.shares)
    assert second.shares == pytest.approx({"s": 0.7, "d": 0.3}, abs=1e-12)
    # the count survives the state's own round trip
    again = RebalanceState.from_dict(json.loads(json.dumps(second.state.to_dict())))
    assert again == second.state and again.groups["d"].empty_queue_intervals == 2


def test_demand_limited_intervals_is_at_least_one() -> None:
    assert RebalanceConfig().demand_limited_intervals == 2
    with pytest.raises(ValueError, match="demand_limited_intervals"):
        RebalanceConfig(demand_limited_intervals=0)
