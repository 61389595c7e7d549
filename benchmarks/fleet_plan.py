"""The fleet-mix optimizer (rlfleet/fleet.py, docs/economics.md) on a simulated fleet of the catalog's
classes: its cost per usable token against (a) throughput-proportional shares at the current replicas
and (b) the all-bf16 reference (every token on the trainer's b200 at bf16), and its decision time.

    .venv/bin/python benchmarks/fleet_plan.py [--repeats 20] [--scale 1,4,10]

The fleet: one group per (class, format) the built-in catalog runs natively, priced at the catalog's
cost per GPU-hour. Throughput per replica is SIMULATED (illustrative relative decode rates of one
model, not measurements); KL per format is the measured one of docs/benchmarks.md "Mismatch
direction" (bf16 6.6e-5, fp8 7.6e-4, nvfp4 9.1e-3); out-of-range shares are assumed. The current
replicas are what a fleet sized without the optimizer looks like: the same count in every group, the
smallest that meets the demand. Throughput-proportional shares do not change what a replica costs or
makes, so (a) is the current fleet's cost per usable token; the optimizer changes the replicas, with
no change bound and no hysteresis here (the optimum itself). Decision time: `plan_fleet` wall time,
median of `--repeats`, without the binding list (`explain=False`: one MILP) and with it (one more MILP
per constraint, about two per group); `--scale k` repeats the fleet k times (k pools of every class)
to show how it grows. The first call (scipy's import) is not timed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from rlfleet.catalog import get_catalog
from rlfleet.fleet import FleetPlanRequest, fleet_cost_per_1m_usable_tokens, plan_fleet, request_from_mapping

# (class, format): simulated decode tokens/s of one replica
THROUGHPUT = {
    ("b200", "bf16"): 6000,
    ("b200", "fp8"): 9000,
    ("b200", "nvfp4"): 11000,
    ("b300", "bf16"): 7000,
    ("b300", "nvfp4"): 13000,
    ("h200", "bf16"): 3800,
    ("h200", "fp8"): 5000,
    ("h100", "bf16"): 3200,
    ("h100", "fp8"): 4200,
    ("a100", "bf16"): 1800,
    ("rtx-pro-6000", "fp8"): 2600,
    ("rtx-pro-6000", "nvfp4"): 3500,
}
MISMATCH = {
    "bf16": (6.6e-5, 0.002),
    "fp8": (7.6e-4, 0.01),
    "nvfp4": (9.1e-3, 0.06),
}  # (KL, out-of-range share)


def fleet_spec(demand: float, scale: int, budgets: dict[str, float]) -> dict[str, Any]:
    groups: list[dict[str, Any]] = []
    for pool in range(scale):
        for (accelerator, fmt), tps in THROUGHPUT.items():
            kl, oor = MISMATCH[fmt]
            groups.append(
                {
                    "name": f"{accelerator}-{fmt}-{pool}",
                    "accelerator": accelerator,
                    "weightFormat": fmt,
                    "tokensPerSecondPerReplica": tps,
                    "kl": kl,
                    "oorFraction": oor,
                    "maxReplicas": 16,
                }
            )
    usable_per_round = sum(g["tokensPerSecondPerReplica"] * (1 - g["oorFraction"]) for g in groups)
    current = -(-demand // usable_per_round)  # the same count everywhere, the fewest meeting the demand
    for g in groups:
        g["replicas"] = int(current)
    return {
        "trainerAccelerator": "b200",
        "demand": {"usableTokensPerSecond": demand},
        "budgets": budgets,
        "hysteresis": 0.0,
        "groups": groups,
    }


def current_figures(spec: dict[str, Any]) -> tuple[float | None, float]:
    """The current fleet with throughput-proportional shares: its cost per 1M usable tokens and its
    token-weighted out-of-range share. A group over its own KL budget gets no share (as in a plan)."""
    catalog = get_catalog()
    max_kl = spec["budgets"].get("groupMaxKl", float("inf"))
    served = [g for g in spec["groups"] if g["kl"] <= max_kl]
    cost = fleet_cost_per_1m_usable_tokens(
        (
            g["tokensPerSecondPerReplica"] if g in served else 0.0,
            g["replicas"],
            catalog.get(g["accelerator"]).cost_per_gpu_hour,
            g["oorFraction"],
        )
        for g in spec["groups"]
    )
    tokens = sum(g["tokensPerSecondPerReplica"] * g["replicas"] for g in served)
    oor = sum(g["tokensPerSecondPerReplica"] * g["replicas"] * g["oorFraction"] for g in served) / tokens
    return cost, oor


def median_seconds(request: FleetPlanRequest, explain: bool, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan_fleet(request, explain=explain)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--scale", default="1,4,10")
    parser.add_argument("--demand", type=float, default=150_000.0, help="usable tokens/s per pool")
    args = parser.parse_args()
    cases = [
        ("no mismatch budget", {}),
        ("fleet out-of-range <= 0.03", {"maxOorFraction": 0.03}),
        ("nvfp4 out (group KL <= 0.005)", {"groupMaxKl": 0.005}),
    ]
    print(
        "| fleet | budget | current (throughput shares) $/1M usable | optimizer $/1M usable | all-bf16 b200 $/1M usable | vs current | vs bf16 | out-of-range current -> plan | replicas current -> plan | decide ms | with binding ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for scale in (int(s) for s in args.scale.split(",")):
        for label, budgets in cases:
            spec = fleet_spec(args.demand * scale, scale, budgets)
            request = request_from_mapping(spec)
            plan = plan_fleet(request)
            assert plan.cost_per_1m_usable_tokens is not None
            decide = median_seconds(request, False, args.repeats)
            explained = median_seconds(request, True, args.repeats)
            base, base_oor = current_figures(spec)
            assert base is not None and plan.oor_fraction is not None
            ref = plan.reference_cost_per_1m_usable_tokens
            opt = plan.cost_per_1m_usable_tokens
            print(
                f"| {len(spec['groups'])} groups | {label} | {base:.4f} | {opt:.4f} | {ref:.4f} | "
                f"{1 - opt / base:+.1%} | {1 - opt / ref:+.1%} | {base_oor:.4f} -> {plan.oor_fraction:.4f} | "
                f"{sum(g['replicas'] for g in spec['groups'])} -> {sum(plan.replicas().values())} | "
                f"{decide * 1e3:.0f} | {explained * 1e3:.0f} |"
            )


if __name__ == "__main__":
    main()
