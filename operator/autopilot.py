"""The precision autopilot (`spec.router.autopilot`). PURE: no I/O, no clock, no Kubernetes.

Per rebalance interval (rebalancer.py): a group whose own mismatch is over its budget (the trainer's
`kl_k3` > its maxKl, or `oor_fraction` > its maxOorFraction: `router.optimize.groups[name]`, else
`router.optimize.budgets.groupMaxKl` / `groupMaxOorFraction`) for `patience` intervals in a row moves one
step up the ladder nvfp4 -> fp8 -> bf16, to the next format its class runs (the catalog, with its
KV-cache dtype) and the weight channel publishes (the formats the RLJob's groups name: the trainer
publishes those views only); a group with no step left (at bf16, or at a format off the ladder such as
mxfp4) is quarantined. After a change the group is not judged for `patience` intervals (the trainer's
figures still hold the old format's tokens, and its pods restart): the hysteresis. Never down: a group
goes back when the RLJob's own weightFormat for it changes (the override ends, operator/builders.py) or
an on-call human removes the quarantine annotation. Groups quarantined already and groups without a
budget or a report are not judged.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from rlfleet.api.rljob import FleetOptimizeSpec
from rlfleet.catalog import Catalog, CatalogError, check_group

LADDER = ("nvfp4", "fp8", "bf16")  # lowest precision (cheapest, most mismatch) first


@dataclass(frozen=True)
class AutopilotReading:
    """One group at one interval."""

    name: str
    accelerator: str
    weight_format: str  # the SamplerGroup's (the autopilot's override, or the RLJob's)
    kv_cache_dtype: str
    kl: float | None
    oor_fraction: float | None
    max_kl: float | None
    max_oor_fraction: float | None
    quarantined: bool


@dataclass
class AutopilotMemory:
    """Per group: consecutive intervals over budget; intervals still to wait after a change."""

    over: dict[str, int] = field(default_factory=dict)
    settling: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class AutopilotAction:
    group: str
    kind: Literal["step", "quarantine"]
    from_format: str
    to_format: str | None  # None: quarantine
    reason: str


def next_format(accelerator: str, weight_format: str, kv_cache_dtype: str, published: Iterable[str],
                catalog: Catalog | None = None) -> str | None:  # fmt: skip
    """The next format up the ladder that the class runs with this KV-cache dtype and the channel
    publishes; None: no step left (at the top, or off the ladder)."""
    if weight_format not in LADDER:
        return None
    views = set(published)
    for candidate in LADDER[LADDER.index(weight_format) + 1 :]:
        if candidate not in views:
            continue
        try:
            check_group(accelerator, candidate, kv_cache_dtype, catalog=catalog)
        except (CatalogError, KeyError):
            continue
        return candidate
    return None


def over_budget(r: AutopilotReading) -> str | None:
    """Why the group is over its own budget (None: within it, or not reported, or no budget)."""
    over = []
    if r.max_kl is not None and r.kl is not None and r.kl > r.max_kl:
        over.append(f"KL {r.kl:g} > {r.max_kl:g}")
    if r.max_oor_fraction is not None and r.oor_fraction is not None and r.oor_fraction > r.max_oor_fraction:
        over.append(f"out-of-range share {r.oor_fraction:g} > {r.max_oor_fraction:g}")
    return ", ".join(over) or None


def autopilot(
    readings: Sequence[AutopilotReading], memory: AutopilotMemory, patience: int, published: Iterable[str],
    catalog: Catalog | None = None,
) -> tuple[list[AutopilotAction], AutopilotMemory]:  # fmt: skip
    """This interval's actions and the memory after it (module docstring)."""
    views = list(published)
    actions: list[AutopilotAction] = []
    out = AutopilotMemory()
    for r in readings:
        if r.quarantined:
            continue
        if memory.settling.get(r.name, 0) > 0:
            if memory.settling[r.name] > 1:
                out.settling[r.name] = memory.settling[r.name] - 1
            continue
        why = over_budget(r)
        count = memory.over.get(r.name, 0) + 1 if why else 0
        if why is None or count < patience:
            out.over[r.name] = count
            continue
        target = next_format(r.accelerator, r.weight_format, r.kv_cache_dtype, views, catalog)
        held = f"{why} for {count} intervals"
        if target is None:
            actions.append(AutopilotAction(r.name, "quarantine", r.weight_format, None,
                                           f"{held}, no step up from {r.weight_format} (the ladder "
                                           f"{' -> '.join(LADDER)} within what {r.accelerator} runs and the "
                                           f"channel publishes: {', '.join(views)}): quarantined"))  # fmt: skip
        else:
            actions.append(AutopilotAction(r.name, "step", r.weight_format, target,
                                           f"{held}: weightFormat {r.weight_format} -> {target}"))  # fmt: skip
        out.settling[r.name] = patience
    return actions, out


def group_budgets(optimize: FleetOptimizeSpec, name: str) -> tuple[float | None, float | None]:
    """A group's own (maxKl, maxOorFraction): `router.optimize.groups[name]`'s, else the budgets'."""
    bounds = optimize.groups.get(name)
    max_kl = bounds.max_kl if bounds is not None else None
    max_oor = bounds.max_oor_fraction if bounds is not None else None
    return (max_kl if max_kl is not None else optimize.budgets.group_max_kl,
            max_oor if max_oor is not None else optimize.budgets.group_max_oor_fraction)  # fmt: skip
