"""The fleet-mix optimizer in the operator (operator/fleetplan.py): the pure mapping from what a rebalance
interval measured to `rlfleet fleet plan`'s request, exactly; the decision on a fleet with a
hand-computed optimum (stepping, scaling, keeping, infeasible); the shares pushed; the RLJob block.

The fleet of every decision test: b200-nvfp4 makes 4000 tok/s per replica at $5.99/h, a100-bf16 1000 at
$1.79/h; demand 13000 usable tok/s, bounds b200 [0, 3], a100 [0, 4], one replica per step. By hand:
b200 x3 + a100 x1 = 13000 tok/s at $19.76/h is the only plan (b200 x2 needs a100 x5 > 4; b200 x3 + a100 x0
makes 12000), so from (1, 1) the step-bounded problem has none (at most 2 x 4000 + 2 x 1000 = 10000).
"""

from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError
from support.manifests import rljob

from rlfleet.api import RLJob
from rlfleet.catalog import get_catalog, load_catalog
from rlfleet.fleet import (
    Budgets,
    Demand,
    FleetPlanRequest,
    GroupFigures,
    Reference,
)
from rlfleet.operator import fleetplan
from rlfleet.operator.fleetplan import FleetMemory, FleetReading, PlanFigure, ReferenceFigures, SteadyFigure
from rlfleet.operator.rebalance import GroupInput, RebalanceConfig, rebalance

JOB = rljob(
    "j",
    [
        {"name": "b200-nvfp4", "accelerator": "b200", "replicas": 1, "weightFormat": "nvfp4"},
        {"name": "a100-bf16", "accelerator": "a100", "replicas": 1},
        {
            "name": "h100-fp8",
            "accelerator": "h100",
            "replicas": 2,
            "weightFormat": "fp8",
            "tensorParallel": 2,
        },
    ],
    "ns",
    router={
        "optimize": {
            "enabled": True,
            "demand": {"usableTokensPerSecond": 13000},
            "budgets": {"maxKl": 0.01, "groupMaxOorFraction": 0.2},
            "groups": {
                "b200-nvfp4": {"maxReplicas": 3},
                "a100-bf16": {"minReplicas": 0, "maxReplicas": 4, "maxKl": 0.05},
            },
            "maxStepReplicas": 1,
            "hysteresis": 0.1,
        }
    },
)
CATALOG = get_catalog()
REFERENCE = ReferenceFigures(
    accelerator="b200", tokens_per_gpu_second=2500.0, cost_per_gpu_hour=5.99, oor_fraction=None
)


def reading(
    name: str, replicas: int, ready: int | None = None, tps: float | None = None, **kw
) -> FleetReading:
    accelerator, fmt = name.split("-")
    fields = {
        "gpus_per_replica": 1,
        "cost_per_replica_hour": {"b200": 5.99, "a100": 1.79, "h100": 5.98}[accelerator],
        "kl": None,
        "oor_fraction": None,
        "quarantined": False,
        **kw,
    }
    return FleetReading(
        name,
        accelerator,
        fmt,
        replicas=replicas,
        ready_replicas=replicas if ready is None else ready,
        tokens_per_second=tps,
        **fields,
    )


def optimize_spec(**changes):
    job = copy.deepcopy(JOB)
    job["spec"]["router"]["optimize"].update(changes)
    return RLJob.from_manifest(job).spec.router.optimize


# --- the readings -----------------------------------------------------------------------------------------


def test_a_reading_takes_class_format_tensor_parallel_price_and_replicas_from_the_samplergroup() -> None:
    sg = {
        "spec": {
            "name": "h100-fp8",
            "accelerator": "h100",
            "weightFormat": "fp8",
            "replicas": 2,
            "tensorParallel": 2,
        },
        "status": {"readyReplicas": 1},
    }
    assert fleetplan.fleet_reading(sg, 2.99, 1, 3000.0, 0.01, 0.1, False) == reading(
        "h100-fp8",
        2,
        ready=1,
        tps=3000.0,
        gpus_per_replica=2,
        cost_per_replica_hour=5.98,
        kl=0.01,
        oor_fraction=0.1,
    )
    plain = fleetplan.fleet_reading(
        {"spec": {"name": "a", "accelerator": "b200"}}, 5.99, 1, None, None, None, True
    )
    assert (plain.weight_format, plain.gpus_per_replica, plain.replicas, plain.ready_replicas) == (
        "bf16",
        1,
        1,
        0,
    )


def test_tokens_per_replica_are_taken_only_from_a_steady_group_and_kept_otherwise() -> None:
    first = fleetplan.observe(
        FleetMemory(),
        [
            reading("b200-nvfp4", 2, tps=8000.0),  # first seen, ready = replicas: 4000 per replica
            reading("a100-bf16", 2, ready=1, tps=1000.0),  # a pod not ready: no figure
            reading("h100-fp8", 1, tps=0.0),  # made nothing: no figure
        ],
    )
    assert first.per_replica == {"b200-nvfp4": 4000.0}
    assert first.ready == {"b200-nvfp4": (2, 0), "a100-bf16": (1, 0), "h100-fp8": (1, 0)}
    # scaled to 3 and ready: the ready count changed since the last interval, so the reading (of a rate
    # that spans the change) is not taken: the last figure stays
    second = fleetplan.observe(
        first, [reading("b200-nvfp4", 3, tps=11000.0), reading("a100-bf16", 2, tps=2400.0)]
    )
    assert second.per_replica == {"b200-nvfp4": 4000.0}  # h100-fp8 gone: dropped
    assert second.ready == {"b200-nvfp4": (3, 0), "a100-bf16": (2, 0)}
    third = fleetplan.observe(
        second, [reading("b200-nvfp4", 3, tps=12600.0), reading("a100-bf16", 2, tps=2400.0)]
    )
    assert third.per_replica == {"b200-nvfp4": 4200.0, "a100-bf16": 1200.0}
    # a Prometheus rate spanning 3 intervals: 3 unchanged intervals before a figure is taken
    waits = [fleetplan.observe(second, [reading("a100-bf16", 2, tps=2000.0)], settle_intervals=3)]
    for _ in range(2):
        waits.append(fleetplan.observe(waits[-1], [reading("a100-bf16", 2, tps=2000.0)], settle_intervals=3))
    assert [m.per_replica.get("a100-bf16") for m in waits] == [None, None, 1000.0]


def test_a_steady_figure_keeps_what_it_was_read_at_and_is_dropped_when_the_format_changes() -> None:
    first = fleetplan.observe(
        FleetMemory(), [reading("b200-nvfp4", 2, tps=8000.0)], now="2026-12-05T10:00:00Z"
    )
    assert first.steady == {"b200-nvfp4": SteadyFigure(4000.0, 2, "nvfp4", "2026-12-05T10:00:00Z")}
    # scaled to 0: never steady again, the figure stays (of the same format)
    zero = fleetplan.observe(first, [reading("b200-nvfp4", 0)], now="2026-12-05T10:01:00Z")
    assert zero.steady == first.steady
    # the autopilot moved it to fp8: a figure of nvfp4 says nothing of fp8
    moved = fleetplan.observe(
        zero, [FleetReading("b200-nvfp4", "b200", "fp8", 1, 5.99, 0, 0, None, None, None, False)]
    )
    assert moved.steady == {}


def test_a_reading_with_every_queue_empty_only_raises_the_figure_and_alone_is_a_lower_bound() -> None:
    """What a group made with nothing queued is what it was sent: a lower bound on its tokens/s per
    replica. b200 read saturated at 4000 per replica keeps 4000 while idle (1500), takes 4500 when an idle
    reading is higher (still saturated: a saturated reading is behind it), and a saturated 3800 replaces
    it downward. a100, never read with a request queued: 800 is a lower bound, kept over 600, until a
    queued 1000. A group whose queue is unknown (no gauge) is taken as before: saturated."""
    b200, a100 = "b200-nvfp4", "a100-bf16"
    memory = fleetplan.observe(
        FleetMemory(),
        [reading(b200, 3, tps=12000.0), reading(a100, 1, tps=800.0, queues_empty=True)],
        now="t0",
    )
    assert memory.steady == {
        b200: SteadyFigure(4000.0, 3, "nvfp4", "t0"),
        a100: SteadyFigure(800.0, 1, "bf16", "t0", saturated=False),
    }
    figures = []
    for i, (b200_tps, b200_empty, a100_tps, a100_empty) in enumerate(
        [(4500.0, True, 600.0, True), (13500.0, True, 600.0, True), (11400.0, False, 1000.0, False)], 1
    ):
        memory = fleetplan.observe(
            memory,
            [
                reading(b200, 3, tps=b200_tps, queues_empty=b200_empty),
                reading(a100, 1, tps=a100_tps, queues_empty=a100_empty),
            ],
            now=f"t{i}",
        )
        figures.append((memory.steady[b200], memory.steady[a100]))
    assert figures == [
        (SteadyFigure(4000.0, 3, "nvfp4", "t0"), SteadyFigure(800.0, 1, "bf16", "t0", saturated=False)),
        (SteadyFigure(4500.0, 3, "nvfp4", "t2"), SteadyFigure(800.0, 1, "bf16", "t0", saturated=False)),
        (SteadyFigure(3800.0, 3, "nvfp4", "t3"), SteadyFigure(1000.0, 1, "bf16", "t3")),
    ]
    # an idle reading after a format change starts over: a lower bound of the new format
    moved = fleetplan.observe(memory, [reading("b200-fp8", 3, tps=3000.0, queues_empty=True)], now="t4")
    assert moved.steady == {"b200-fp8": SteadyFigure(1000.0, 3, "fp8", "t4", saturated=False)}
    # the planned figures: measured, and lowerBound for a group with no saturated reading; a lower bound is
    # no ground for another group's estimate
    idle = fleetplan.observe(FleetMemory(), [reading(a100, 1, tps=800.0, queues_empty=True)], now="t0")
    readings = [reading(a100, 1), reading("h100-fp8", 0)]
    assert fleetplan.plan_figures(readings, idle, CATALOG) == {
        a100: PlanFigure(
            800.0, "lowerBound", "steady reading over 1 replica(s) at bf16, t0, its queues empty"
        )
    }


def light_producer(replicas: dict[str, int], capacity: dict[str, float], sent: float) -> list[FleetReading]:
    """Each group's reading behind a producer that sends `sent` tokens/s in all, split in proportion to
    the groups' capacities (`capacity`: tokens/s per replica): a group makes what it is sent, and its
    queues are empty while that is below its capacity."""
    total = sum(capacity[g] * n for g, n in replicas.items())
    out = []
    for g, n in replicas.items():
        made = min(sent * capacity[g] * n / total, capacity[g] * n)
        out.append(reading(g, n, tps=made, queues_empty=made < capacity[g] * n))
    return out


def test_an_idle_fleet_is_planned_down_from_its_saturated_figures_not_up_from_what_it_was_sent() -> None:
    """The hand-solved fleet at (3, 1), read saturated once (4000 and 1000 tok/s per replica). Then the
    trainer takes 5000 tokens/s (50 episodes x 100 tokens per 1 s of training): demand 5000 x headroom 1.1
    = 5500 usable tokens/s, and the fleet makes what it is sent, 5000 (b200 12/13, a100 1/13 of it), its
    queues empty. Planned from those readings (1538 and 385 per replica), the fleet would go UP, to
    a100 x3 (3 x 1538 + 3 x 385 = 5769) - and every replica added lowers the readings again. Planned from the saturated figures the
    optimum for 5500 is b200 x1 + a100 x2 = 6000 tok/s at $9.57/h ((2, 0): $11.98; a100 alone makes at
    most 4000): Scaled from $19.76/h. Behind the same producer (1, 2) reads 3333 and 1667 in all, both
    idle: Kept, at the same figures."""
    capacity = {"b200-nvfp4": 4000.0, "a100-bf16": 1000.0}
    spec = optimize_spec(budgets={}, demand={"headroom": 1.1}, maxStepReplicas=4)
    trainer = {"episodes": 50.0, "response_length": 100.0, "time_train": 1.0}
    replicas = {"b200-nvfp4": 3, "a100-bf16": 1}
    memory = fleetplan.observe(FleetMemory(), light_producer(replicas, capacity, 20000.0), now="t0")
    assert memory.per_replica == capacity and all(f.saturated for f in memory.steady.values())

    def interval(memory: FleetMemory, replicas: dict[str, int], now: str):
        readings = light_producer(replicas, capacity, 5000.0)
        memory = fleetplan.observe(memory, readings, now=now)
        figures = fleetplan.plan_figures(readings, memory, CATALOG)
        per_replica = {g: f.tokens_per_second_per_replica for g, f in figures.items()}
        request, left_out = fleetplan.fleet_request(
            spec, "b200", REFERENCE, readings, per_replica, None, trainer, lower_bounds=set()
        )
        return readings, memory, fleetplan.decide(request, left_out, readings, {}, None, "derived", figures)

    readings, memory, first = interval(memory, replicas, "t1")
    assert all(r.queues_empty for r in readings)
    assert [r.tokens_per_second for r in readings] == pytest.approx(
        [5000.0 * 12 / 13, 5000.0 / 13], rel=1e-12
    )
    assert memory.per_replica == capacity
    assert first.decision == "Scaled" and first.changes() == {"b200-nvfp4": (3, 1), "a100-bf16": (1, 2)}
    assert first.status()["costPerHour"] == round(5.99 + 2 * 1.79, 4) == 9.57
    # the readings themselves as figures: what planning from delivered tokens did, a step UP
    as_read = {r.name: (r.tokens_per_second or 0.0) / r.replicas for r in readings}
    request, left_out = fleetplan.fleet_request(spec, "b200", REFERENCE, readings, as_read, None, trainer)
    up = fleetplan.decide(request, left_out, readings, {}, None, "derived")
    assert up.decision == "Scaled" and up.changes() == {"a100-bf16": (1, 3)}
    readings, memory, second = interval(memory, first.replicas, "t2")
    assert [r.tokens_per_second for r in readings] == pytest.approx(
        [5000.0 * 4 / 6, 5000.0 * 2 / 6], rel=1e-12
    )
    assert second.decision == "Kept" and second.replicas == {"b200-nvfp4": 1, "a100-bf16": 2}
    assert memory.per_replica == capacity


def test_a_group_never_read_saturated_keeps_its_replicas_and_the_reason_says_why() -> None:
    """b200 x3 read saturated (4000 per replica, its queue full); a100 x1 made 500 with its queue empty (the
    router sent it little): 500 is a lower bound. Demand 13000: planned from 500, a100 would go to 2
    replicas (12000 + 2 x 500); held at its 1 replica, 12500 is all the plan counts, so no plan meets the
    demand: Infeasible, nothing moves, the share policy's shares stand (they send a100 more, and its next
    reading tells its capacity)."""
    memory = FleetMemory(steady={"b200-nvfp4": SteadyFigure(4000.0, 3, "nvfp4", "t0")})
    readings = [
        reading("b200-nvfp4", 3, tps=12000.0),
        reading("a100-bf16", 1, tps=500.0, queues_empty=True),
    ]
    memory = fleetplan.observe(memory, readings, now="t1")
    figures = fleetplan.plan_figures(readings, memory, CATALOG)
    assert {g: f.basis for g, f in figures.items()} == {"b200-nvfp4": "measured", "a100-bf16": "lowerBound"}
    per_replica = {g: f.tokens_per_second_per_replica for g, f in figures.items()}
    spec = optimize_spec(budgets={})
    request, left_out = fleetplan.fleet_request(
        spec, "b200", REFERENCE, readings, per_replica, lower_bounds={"a100-bf16"}
    )
    assert request is not None
    a100 = next(g for g in request.groups if g.name == "a100-bf16")
    assert (a100.min_replicas, a100.max_replicas, a100.tokens_per_second_per_replica) == (1, 1, 500.0)
    decision = fleetplan.decide(request, left_out, readings, {}, None, "given", figures)
    assert decision.decision == "Infeasible" and decision.changes() == {}
    assert decision.reason.endswith(
        "; a100-bf16 keeps its 1 replica(s), planned at 500 tokens/s per replica: a lower bound (read only "
        "with its queues empty: it made what it was sent) until it is read with requests queued"
    )
    assert decision.status()["throughput"]["a100-bf16"]["basis"] == "lowerBound"
    # without the hold, the same figure would plan a100 up
    free, _ = fleetplan.fleet_request(spec, "b200", REFERENCE, readings, per_replica)
    planned = fleetplan.decide(free, {}, readings, {}, None, "given", figures)
    assert planned.changes() == {"a100-bf16": (1, 2)}


def test_a_group_without_a_figure_is_planned_at_an_estimate_from_the_catalogs_ratios(tmp_path) -> None:
    """A catalog whose ratios are round: b200 nvfp4 8, a100 bf16 2, h100 fp8 4 (TP 2). b200-nvfp4 measured
    at 4000 tok/s per (1-GPU) replica is 500 per unit of ratio: a100-bf16 is estimated at 2 x 500 = 1000
    per replica, h100-fp8 at 4 x 500 x 2 GPUs = 4000; a100-fp8 has no ratio here and gets no figure, nor
    does h100-bf16, which has replicas (its pods are about to be measured)."""
    path = tmp_path / "catalog.yaml"
    path.write_text(
        "classes:\n  b200: {decodeThroughput: {nvfp4: 8}}\n  a100: {decodeThroughput: {bf16: 2, fp8: null}}\n"
        "  h100: {decodeThroughput: {fp8: 4}}\n"
    )
    catalog = load_catalog(path)
    readings = [
        reading("b200-nvfp4", 1, tps=4000.0),
        reading("a100-bf16", 0),
        reading("h100-fp8", 0, gpus_per_replica=2),
        reading("a100-fp8", 0),
        reading("b200-bf16", 0, quarantined=True),
        reading("h100-bf16", 2, ready=1),
    ]
    memory = FleetMemory(steady={"b200-nvfp4": SteadyFigure(4000.0, 1, "nvfp4", "2026-12-05T10:00:00Z")})
    figures = fleetplan.plan_figures(readings, memory, catalog)
    assert figures == {
        "b200-nvfp4": PlanFigure(
            4000.0, "measured", "steady reading over 1 replica(s) at nvfp4, 2026-12-05T10:00:00Z"
        ),
        "a100-bf16": PlanFigure(
            1000.0,
            "estimated",
            "estimated from catalog throughput ratios (a100 bf16 against the measured b200-nvfp4)",
        ),
        "h100-fp8": PlanFigure(
            4000.0,
            "estimated",
            "estimated from catalog throughput ratios (h100 fp8 against the measured b200-nvfp4)",
        ),
    }
    assert (
        fleetplan.plan_figures(readings, FleetMemory(), catalog) == {}
    )  # nothing measured: nothing to carry
    # the hand-solved fleet with a100-bf16 at 0 replicas and never measured: planned at its estimate of
    # 1000, the same optimum as measured; the status and the reason say it is an estimate
    readings = [reading("b200-nvfp4", 2, tps=8000.0), reading("a100-bf16", 0)]
    figures = fleetplan.plan_figures(readings, memory, catalog)
    per_replica = {g: f.tokens_per_second_per_replica for g, f in figures.items()}
    request, left_out = fleetplan.fleet_request(
        optimize_spec(budgets={}), "b200", REFERENCE, readings, per_replica
    )
    decision = fleetplan.decide(request, left_out, readings, {}, catalog, "given", figures)
    assert decision.decision == "Scaled" and decision.changes() == {"b200-nvfp4": (2, 3), "a100-bf16": (0, 1)}
    assert decision.status()["throughput"] == {
        "b200-nvfp4": {
            "tokensPerSecondPerReplica": 4000.0,
            "basis": "measured",
            "detail": "steady reading over 1 replica(s) at nvfp4, 2026-12-05T10:00:00Z",
        },
        "a100-bf16": {
            "tokensPerSecondPerReplica": 1000.0,
            "basis": "estimated",
            "detail": "estimated from catalog throughput ratios (a100 bf16 against the measured b200-nvfp4)",
        },
    }
    assert decision.reason.endswith(
        "; a100-bf16 planned at an estimated 1000 tokens/s per replica (no steady reading "
        "of its own: estimated from catalog throughput ratios (a100 bf16 against the "
        "measured b200-nvfp4))"
    )


def test_the_request_maps_every_measured_figure_bound_and_budget_exactly() -> None:
    readings = [
        reading("b200-nvfp4", 1, tps=4000.0, kl=0.004, oor_fraction=0.05),
        reading("a100-bf16", 2, ready=1, kl=None, oor_fraction=None),  # no trainer report yet: 0
        reading(
            "h100-fp8", 2, gpus_per_replica=2, kl=0.001, oor_fraction=1.0
        ),  # not in optimize.groups: fixed
        reading("b200-bf16", 1),  # no figure yet
        reading("b200-fp8", 1, quarantined=True),
    ]
    per_replica = {"b200-nvfp4": 4000.0, "a100-bf16": 1000.0, "h100-fp8": 2500.0, "b200-fp8": 5000.0}
    request, left_out = fleetplan.fleet_request(optimize_spec(), "b200", REFERENCE, readings, per_replica)
    assert left_out == {"b200-bf16": "no throughput reading yet", "b200-fp8": "quarantined"}
    assert request == FleetPlanRequest(
        trainer_accelerator="b200",
        demand=Demand(usable_tokens_per_second=13000.0),
        budgets=Budgets(max_kl=0.01, group_max_oor_fraction=0.2),
        max_step_replicas=1,
        hysteresis=0.1,
        groups=[
            GroupFigures(
                name="b200-nvfp4",
                accelerator="b200",
                weight_format="nvfp4",
                cost_per_replica_hour=5.99,
                tokens_per_second_per_replica=4000.0,
                kl=0.004,
                oor_fraction=0.05,
                min_replicas=0,
                max_replicas=3,
                replicas=1,
            ),
            GroupFigures(
                name="a100-bf16",
                accelerator="a100",
                weight_format="bf16",
                cost_per_replica_hour=1.79,
                tokens_per_second_per_replica=1000.0,
                kl=0.0,
                oor_fraction=0.0,
                min_replicas=0,
                max_replicas=4,
                replicas=2,
                max_kl=0.05,
            ),
            GroupFigures(
                name="h100-fp8",
                accelerator="h100",
                weight_format="fp8",
                gpus_per_replica=2,
                cost_per_replica_hour=5.98,
                tokens_per_second_per_replica=2500.0,
                kl=0.001,
                oor_fraction=1.0,
                min_replicas=2,
                max_replicas=2,
                replicas=2,
            ),
        ],
        reference=Reference(
            accelerator="b200",
            gpus_per_replica=1,
            cost_per_replica_hour=5.99,
            tokens_per_second_per_replica=2500.0,
        ),
    )
    none, out = fleetplan.fleet_request(optimize_spec(), "b200", REFERENCE, [reading("b200-bf16", 1)], {})
    assert none is None and out == {"b200-bf16": "no throughput reading yet"}


# --- the decision -----------------------------------------------------------------------------------------


def decide(replicas: tuple[int, int], demand: float = 13000.0, **spec):
    readings = [
        reading("b200-nvfp4", replicas[0], tps=4000.0 * replicas[0]),
        reading("a100-bf16", replicas[1]),
    ]
    per_replica = {"b200-nvfp4": 4000.0, "a100-bf16": 1000.0}
    spec = {"budgets": {}, "demand": {"usableTokensPerSecond": demand}, **spec}
    request, left_out = fleetplan.fleet_request(
        optimize_spec(**spec), "b200", REFERENCE, readings, per_replica
    )
    return fleetplan.decide(request, left_out, readings, {"b200-nvfp4": 0.5, "a100-bf16": 0.5})


def test_out_of_reach_within_a_step_the_groups_below_the_unstepped_optimum_go_up_one_step() -> None:
    step = decide((1, 1))
    assert step.decision == "Stepping" and step.replicas == {"b200-nvfp4": 2, "a100-bf16": 1}
    assert step.changes() == {"b200-nvfp4": (1, 2)}
    assert step.shares is None and step.plan is None  # the share policy's shares stand
    assert "{'b200-nvfp4': 3, 'a100-bf16': 1}" in step.reason and "none goes down" in step.reason
    assert step.status() == {
        "decision": "Stepping",
        "reason": step.reason,
        "replicas": step.replicas,
        "binding": [],
    }


def test_then_the_hand_computed_optimum_its_shares_cost_and_binding_constraints() -> None:
    scaled = decide((2, 1))
    assert scaled.decision == "Scaled" and scaled.changes() == {"b200-nvfp4": (2, 3)}
    assert scaled.replicas == {"b200-nvfp4": 3, "a100-bf16": 1}
    # shares proportional to the planned tokens/s: 12000 / 13000 and 1000 / 13000
    assert scaled.shares == pytest.approx({"b200-nvfp4": 12 / 13, "a100-bf16": 1 / 13}, rel=1e-12)
    status = scaled.status()
    assert status["costPerHour"] == round(3 * 5.99 + 1.79, 4) == 19.76
    assert status["costPer1MUsableTokens"] == round(19.76 / 3600 / 13000 * 1e6, 4)  # 0.4222
    # only the demand binds: within a step of (2, 1) no bound stops a cheaper plan (b200 x4 is out of the
    # step and dearer, a100 x5 too), and without the step bound (3, 1) is still the optimum
    assert [b.split(":")[0] for b in status["binding"]] == ["usable tokens/s >= 13000"]
    assert "plan $19.76/h, $0.4222 per 1M usable tokens" in scaled.reason
    kept = decide((3, 1))
    assert (
        kept.decision == "Kept"
        and kept.changes() == {}
        and kept.replicas == {"b200-nvfp4": 3, "a100-bf16": 1}
    )


def test_hysteresis_keeps_a_plan_that_meets_the_demand_when_the_optimum_saves_too_little() -> None:
    # demand 12000: b200 x3 ($17.97) is the optimum; (3, 1) at $19.76 meets it and the optimum saves 9.06%
    assert decide((3, 1), demand=12000.0, hysteresis=0.1).decision == "Kept"
    moved = decide((3, 1), demand=12000.0, hysteresis=0.05)
    assert moved.decision == "Scaled" and moved.changes() == {"a100-bf16": (1, 0)}


def test_an_infeasible_demand_changes_nothing_and_says_why() -> None:
    decision = decide((3, 1), demand=20000.0)
    assert decision.decision == "Infeasible" and decision.changes() == {} and decision.shares is None
    # within a step of (3, 1): b200 <= 3, a100 <= 2: 14000; without the step bound 16000: neither is enough
    assert decision.reason.startswith(
        "no plan meets the budgets: demand 20000 usable tokens/s; the groups within "
        "budget make at most 14000 at their replica bounds"
    )
    assert decision.status()["decision"] == "Infeasible" and "costPerHour" not in decision.status()


def test_a_group_left_out_keeps_its_replicas_and_policy_share_and_the_plan_splits_the_rest() -> None:
    readings = [
        reading("b200-nvfp4", 3, tps=12000.0),
        reading("a100-bf16", 1),
        reading("b200-bf16", 2, ready=0),
    ]
    request, left_out = fleetplan.fleet_request(
        optimize_spec(), "b200", REFERENCE, readings, {"b200-nvfp4": 4000.0, "a100-bf16": 1000.0}
    )
    decision = fleetplan.decide(
        request, left_out, readings, {"b200-nvfp4": 0.6, "a100-bf16": 0.2, "b200-bf16": 0.2}
    )
    assert decision.replicas == {"b200-nvfp4": 3, "a100-bf16": 1, "b200-bf16": 2}
    assert decision.shares == pytest.approx(
        {"b200-nvfp4": 0.8 * 12 / 13, "a100-bf16": 0.8 / 13, "b200-bf16": 0.2}
    )
    assert decision.reason.endswith("b200-bf16 keeps its replicas (no throughput reading yet)")
    waiting = fleetplan.decide(None, {"a": "no throughput reading yet"}, [reading("b200-nvfp4", 2)], {})
    assert (waiting.decision, waiting.replicas, waiting.shares) == ("Waiting", {"b200-nvfp4": 2}, None)


def test_a_group_over_its_own_budget_is_drained_one_step_per_interval() -> None:
    readings = [reading("b200-nvfp4", 3, tps=12000.0), reading("a100-bf16", 3, kl=0.06)]  # a100's maxKl 0.05
    request, left_out = fleetplan.fleet_request(
        optimize_spec(demand={"usableTokensPerSecond": 12000}),
        "b200",
        REFERENCE,
        readings,
        {"b200-nvfp4": 4000.0, "a100-bf16": 1000.0},
    )
    decision = fleetplan.decide(request, left_out, readings, {})
    assert decision.changes() == {"a100-bf16": (3, 2)} and decision.shares == {
        "b200-nvfp4": 1.0,
        "a100-bf16": 0.0,
    }


def test_the_plans_shares_move_the_routers_shares_bounded_and_say_so() -> None:
    inputs = [
        GroupInput("a", 1, 1, 1.0, tokens_per_second=100.0, static_share=0.9),
        GroupInput("b", 1, 1, 1.0, tokens_per_second=100.0, static_share=0.1),
    ]
    result = rebalance(inputs, None, 0.0, RebalanceConfig(policy="plan", min_share=0.0, max_share_change=0.1))
    assert result.shares == pytest.approx({"a": 0.6, "b": 0.4})  # from 0.5 each toward 0.9 / 0.1, by 0.1
    assert result.changes == (
        "a: share 0.500 -> 0.600 (fleet plan 0.900; bounded toward 0.900)",
        "b: share 0.500 -> 0.400 (fleet plan 0.100; bounded toward 0.100)",
    )
    assert result.groups["a"].measured_tokens_per_second == 100.0


# --- the RLJob block ------------------------------------------------------------------------------------------


def test_the_block_is_off_by_default_and_refuses_what_it_cannot_plan() -> None:
    plain = copy.deepcopy(JOB)
    del plain["spec"]["router"]
    optimize = RLJob.from_manifest(plain).spec.router.optimize
    assert (
        optimize.enabled,
        optimize.demand,
        optimize.groups,
        optimize.max_step_replicas,
        optimize.hysteresis,
    ) == (False, None, {}, 1, 0.05)
    for change, message in (
        ({"demand": None}, "enabled needs demand.usableTokensPerSecond"),
        (
            {"groups": {"nope": {"maxReplicas": 1}}},
            r"every key must be the name of a group in samplerGroups \(unknown: nope\)",
        ),
        (
            {"groups": {"a100-bf16": {"minReplicas": 3, "maxReplicas": 2}}},
            r"minReplicas must be <= maxReplicas \(got 3 > 2\)",
        ),
    ):
        job = copy.deepcopy(JOB)
        job["spec"]["router"]["optimize"].update(change)
        if change.get("demand", 0) is None:
            del job["spec"]["router"]["optimize"]["demand"]
        with pytest.raises(ValidationError, match=message):
            RLJob.from_manifest(job)


# --- the demand derived from the trainer ------------------------------------------------------------------


def test_the_derived_demand_is_the_trainers_consumption_in_band_times_headroom() -> None:
    """64 episodes of 500 sampled tokens in 8 s of training, 10% out of band: 4000 tokens/s, 3600 usable,
    3960 with the default headroom 1.1. Nothing before the trainer's first step (or a step of 0 s)."""
    step = {"episodes": 64.0, "response_length": 500.0, "time_train": 8.0, "oor_fraction": 0.1}
    assert fleetplan.trainer_demand(step, 1.1) == pytest.approx(3960.0, rel=1e-12)
    assert fleetplan.trainer_demand({**step, "oor_fraction": 0.0}, 1.0) == 4000.0
    assert fleetplan.trainer_demand({k: v for k, v in step.items() if k != "oor_fraction"}, 1.0) == 4000.0
    for missing in ("episodes", "response_length", "time_train"):
        assert fleetplan.trainer_demand({k: v for k, v in step.items() if k != missing}, 1.1) is None
    assert fleetplan.trainer_demand({**step, "time_train": 0.0}, 1.1) is None
    assert optimize_spec(demand={}).demand.headroom == 1.1


def trainer_fleet_metrics(step_metrics: dict[str, float]) -> dict[str, float]:
    """A step's metrics as the operator reads them: through the trainer's real exporter and its parser."""
    from prometheus_client import generate_latest

    from rlfleet.operator.trainer_report import parse_trainer_report
    from rlfleet.trainer.metrics import PrometheusExporter

    exporter = PrometheusExporter(port=0)
    try:
        exporter.update(1, step_metrics)
        return dict(parse_trainer_report(generate_latest(exporter.registry).decode()).fleet)
    finally:
        exporter.close()


def test_a_derived_demand_plans_as_the_same_given_demand_and_waits_for_the_trainers_first_step() -> None:
    """52 episodes x 1000 tokens in 4 s, all in band, headroom 1: 13000 usable tokens/s, the given demand
    of the hand-solved fleet, so the same step; before any trainer step the optimizer waits, saying why."""
    readings = [reading("b200-nvfp4", 1, tps=4000.0), reading("a100-bf16", 1)]
    per_replica = {"b200-nvfp4": 4000.0, "a100-bf16": 1000.0}
    spec = optimize_spec(budgets={}, demand={"headroom": 1.0})
    trainer = trainer_fleet_metrics(
        {"episodes": 52.0, "response_length": 1000.0, "time/train": 4.0, "oor_fraction": 0.0}
    )
    request, left_out = fleetplan.fleet_request(spec, "b200", REFERENCE, readings, per_replica, None, trainer)
    assert request is not None and request.demand == Demand(usable_tokens_per_second=13000.0)
    _, source = fleetplan.demand_of(spec, trainer)
    derived = fleetplan.decide(
        request, left_out, readings, {"b200-nvfp4": 0.5, "a100-bf16": 0.5}, None, source
    )
    given = decide((1, 1))
    assert (
        (derived.decision, derived.replicas)
        == (given.decision, given.replicas)
        == ("Stepping", {"b200-nvfp4": 2, "a100-bf16": 1})
    )
    assert derived.reason.endswith(
        "; demand 13000 usable tokens/s derived: 52000 tokens per step over 4.00 s of training, "
        "x 1.000 in band x headroom 1"
    )

    request, left_out = fleetplan.fleet_request(spec, "b200", REFERENCE, readings, per_replica, None, {})
    _, source = fleetplan.demand_of(spec, {})
    waiting = fleetplan.decide(
        request, left_out, readings, {"b200-nvfp4": 0.5, "a100-bf16": 0.5}, None, source
    )
    assert (
        request is None
        and waiting.decision == "Waiting"
        and waiting.replicas == {"b200-nvfp4": 1, "a100-bf16": 1}
    )
    assert waiting.reason.startswith(
        "the demand is not known yet (derived from the trainer's steps, none reported yet)"
    )
