"""The precision autopilot (`spec.router.autopilot`). PURE: no I/O, no clock, no Kubernetes.

Per rebalance interval (rebalancer.py): a group whose own mismatch is over its budget (the trainer's
`kl_k3` > its maxKl, or `oor_fraction` > its maxOorFraction: `router.optimize.groups[name]`, else
`router.optimize.budgets.groupMaxKl` / `groupMaxOorFraction`) for `patience` intervals in a row moves one
step up the ladder nvfp4 -> fp8 -> bf16, to the next format its class runs (the catalog, with its
KV-cache dtype) and the weight channel publishes (the formats the RLJob's groups name: the trainer
publishes those views only); a group with no step left (at bf16, or at a format off the ladder such as
mxfp4) is quarantined. After a change the group is not judged for `patience` intervals (the trainer's
figures still hold the old format's tokens, and its pods restart): the hysteresis. Groups quarantined
already and groups without a budget or a report are not judged. The decisions (decide.py) hold a step
and a quarantine until the RLJob's own weightFormat for the group changes, a quarantine also until an
on-call human annotates the group rlfleet.dev/quarantined=false.

Back down (`StepDown`, spec `stepDown`): a group above its floor (the RLJob's own weightFormat for it)
that has stayed within its budget for a cool-down (`cooldownIntervals` judged intervals with a report,
none over) tries the next cheaper format down the ladder, never below the floor, within what its class
runs and the channel publishes. That step is on PROBATION until the group has stayed within budget for
a cool-down at the cheaper format: a breach before (over for `patience` intervals, as always) steps it
up again and DOUBLES its cool-down, up to `maxCooldownIntervals`, so a group that breaches at the
cheaper format tries it again ever later, at most once per `maxCooldownIntervals`: it cannot flap. A
probation passed resets the cool-down to `cooldownIntervals`; a breach not on probation keeps it. A
doubled cool-down and a probation (`cooldown_status`), like the counts, are kept in the RLJob's
`status.decisions` (decide.py) and read back from it after an operator restart.

Invalid answers: a group whose invalid share (1 - the trainer's `trained_fraction` of it: tokens it
sampled that failed validation, NaN / positive / out-of-support logprobs and the like, or that the
objective could not use) is over `maxInvalidFraction` for `patience` intervals in a row is quarantined
at once, at any format, with the share and the reason most of its invalid tokens failed in the reason: a
higher precision does not repair an engine that answers garbage.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rlfleet.api.router_spec import FleetOptimizeSpec
from rlfleet.catalog import Catalog, CatalogError, check_group

LADDER = ("nvfp4", "fp8", "bf16")  # lowest precision (cheapest, most mismatch) first


@dataclass(frozen=True)
class StepDown:
    """The step back down (module docstring): the cool-down in judged intervals, and its bound."""

    cooldown: int
    max_cooldown: int


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
    floor_format: str | None = None  # the RLJob's own weightFormat of the group: no step down below it
    # the share of its sampled tokens the trainer trained on (the rest answered invalid) and its invalid
    # tokens by validation reason (trainer/metrics.py); the bound on the invalid share (spec maxInvalidFraction)
    trained_fraction: float | None = None
    invalid_tokens: Mapping[str, float] = field(default_factory=dict)
    max_invalid_fraction: float | None = None


@dataclass
class AutopilotMemory:
    """Per group: consecutive intervals over budget; intervals still to wait after a change; consecutive
    judged intervals within budget; the cool-down in force when it is not the spec's (doubled); the
    groups whose last move was a step down not yet confirmed (probation)."""

    over: dict[str, int] = field(default_factory=dict)
    settling: dict[str, int] = field(default_factory=dict)
    within: dict[str, int] = field(default_factory=dict)
    cooldown: dict[str, int] = field(default_factory=dict)
    probation: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class AutopilotAction:
    group: str
    kind: Literal["step", "step-down", "quarantine"]  # step: up the ladder
    from_format: str
    to_format: str | None  # None: quarantine
    reason: str


def _first_runnable(
    candidates: Iterable[str],
    accelerator: str,
    kv_cache_dtype: str,
    published: Iterable[str],
    catalog: Catalog | None,
) -> str | None:
    """The first of `candidates` the channel publishes and the class runs with this KV-cache dtype."""
    views = set(published)
    for candidate in candidates:
        if candidate not in views:
            continue
        try:
            check_group(accelerator, candidate, kv_cache_dtype, catalog=catalog)
        except (CatalogError, KeyError):
            continue
        return candidate
    return None


def next_format(
    accelerator: str,
    weight_format: str,
    kv_cache_dtype: str,
    published: Iterable[str],
    catalog: Catalog | None = None,
) -> str | None:
    """The next format up the ladder that the class runs with this KV-cache dtype and the channel
    publishes; None: no step left (at the top, or off the ladder)."""
    if weight_format not in LADDER:
        return None
    above = LADDER[LADDER.index(weight_format) + 1 :]
    return _first_runnable(above, accelerator, kv_cache_dtype, published, catalog)


def cheaper_format(
    accelerator: str,
    weight_format: str,
    floor_format: str | None,
    kv_cache_dtype: str,
    published: Iterable[str],
    catalog: Catalog | None = None,
) -> str | None:
    """The next format down the ladder, not below `floor_format`, that the class runs with this KV-cache
    dtype and the channel publishes; None: none (at or below the floor, or either off the ladder)."""
    if weight_format not in LADDER or floor_format not in LADDER:
        return None
    below = reversed(LADDER[LADDER.index(floor_format) : LADDER.index(weight_format)])
    return _first_runnable(below, accelerator, kv_cache_dtype, published, catalog)


def invalid_breach(r: AutopilotReading) -> str | None:
    """Why the group's invalid share (1 - its trained fraction) is over `max_invalid_fraction`, naming the
    reason most of its invalid tokens failed (None: within it, or not reported)."""
    if r.max_invalid_fraction is None or r.trained_fraction is None:
        return None
    invalid = 1.0 - r.trained_fraction
    if invalid <= r.max_invalid_fraction:
        return None
    why = f"invalid share {invalid:g} > {r.max_invalid_fraction:g}"
    if r.invalid_tokens:
        reason, count = max(sorted(r.invalid_tokens.items()), key=lambda kv: kv[1])
        why += f" (top reason {reason}: {count:g} tokens)"
    return why


def within_budget(r: AutopilotReading) -> str | None:
    """The budgets the group reported within (None: no budget with a report to judge it by)."""
    within = []
    if r.max_kl is not None and r.kl is not None:
        within.append(f"KL {r.kl:g} <= {r.max_kl:g}")
    if r.max_oor_fraction is not None and r.oor_fraction is not None:
        within.append(f"out-of-range share {r.oor_fraction:g} <= {r.max_oor_fraction:g}")
    return ", ".join(within) or None


def over_budget(r: AutopilotReading) -> str | None:
    """Why the group is over its own budget (None: within it, or not reported, or no budget)."""
    over = []
    if r.max_kl is not None and r.kl is not None and r.kl > r.max_kl:
        over.append(f"KL {r.kl:g} > {r.max_kl:g}")
    if r.max_oor_fraction is not None and r.oor_fraction is not None and r.oor_fraction > r.max_oor_fraction:
        over.append(f"out-of-range share {r.oor_fraction:g} > {r.max_oor_fraction:g}")
    return ", ".join(over) or None


def autopilot(
    readings: Sequence[AutopilotReading],
    memory: AutopilotMemory,
    patience: int,
    published: Iterable[str],
    catalog: Catalog | None = None,
    step_down: StepDown | None = None,
) -> tuple[list[AutopilotAction], AutopilotMemory]:
    """This interval's actions and the memory after it (module docstring). `step_down` None: never down."""
    views = list(published)
    actions: list[AutopilotAction] = []
    out = AutopilotMemory()
    base = step_down.cooldown if step_down is not None else 0
    for r in readings:
        if r.quarantined:
            continue
        if memory.cooldown.get(r.name, base) != base:
            out.cooldown[r.name] = memory.cooldown[r.name]
        if r.name in memory.probation:
            out.probation.add(r.name)
        if memory.settling.get(r.name, 0) > 0:
            if memory.settling[r.name] > 1:
                out.settling[r.name] = memory.settling[r.name] - 1
            continue
        invalid = invalid_breach(r)
        why = invalid or over_budget(r)
        if why is None:
            action = _within(r, memory, out, views, catalog, step_down)
        else:  # invalid answers: no step up, a higher precision does not repair an engine answering garbage
            action = _over(r, why, memory, out, patience, views, catalog, step_down, step_up=invalid is None)
        if action is not None:
            actions.append(action)
            out.settling[r.name] = patience
    return actions, out


def _within(
    r: AutopilotReading,
    memory: AutopilotMemory,
    out: AutopilotMemory,
    views: Sequence[str],
    catalog: Catalog | None,
    step_down: StepDown | None,
) -> AutopilotAction | None:
    """An interval not over budget: the cool-down counts (with a report), and once it is over, a
    probation passes and the group tries the next cheaper format (module docstring)."""
    within = memory.within.get(r.name, 0) + (within_budget(r) is not None)
    out.over[r.name] = 0
    cooldown = out.cooldown.get(r.name, step_down.cooldown) if step_down is not None else 0
    if step_down is None or within < cooldown:
        out.within[r.name] = within
        return None
    if r.name in out.probation:  # a cool-down within budget at the cheaper format: the step down holds
        out.probation.discard(r.name)
        out.cooldown.pop(r.name, None)
        cooldown = step_down.cooldown
    target = cheaper_format(r.accelerator, r.weight_format, r.floor_format, r.kv_cache_dtype, views, catalog)
    if target is None:
        out.within[r.name] = within
        return None
    out.probation.add(r.name)
    return AutopilotAction(
        r.name,
        "step-down",
        r.weight_format,
        target,
        f"within its budget ({within_budget(r)}) for {within} intervals (the cool-down {cooldown}): "
        f"weightFormat {r.weight_format} -> {target}; back to {r.weight_format} if over it again "
        f"within the next {cooldown} intervals, with the cool-down doubled",
    )


def _over(
    r: AutopilotReading,
    why: str,
    memory: AutopilotMemory,
    out: AutopilotMemory,
    patience: int,
    views: Sequence[str],
    catalog: Catalog | None,
    step_down: StepDown | None,
    step_up: bool = True,
) -> AutopilotAction | None:
    """An interval over budget: after `patience` in a row a step up (its cool-down doubled when it breaches
    on probation), or a quarantine with no step left or none to take (`step_up` False: invalid answers)."""
    count = memory.over.get(r.name, 0) + 1
    if count < patience:
        out.over[r.name] = count
        return None
    held = f"{why} for {count} intervals"
    if r.name in out.probation and step_down is not None:
        cooldown = out.cooldown.get(r.name, step_down.cooldown)
        doubled = min(2 * cooldown, step_down.max_cooldown)
        bound = " (its bound)" if doubled == step_down.max_cooldown else ""
        held += f" after a step down: the cool-down doubles, {cooldown} -> {doubled} intervals{bound}"
        out.probation.discard(r.name)
        out.cooldown[r.name] = doubled
    target = (
        next_format(r.accelerator, r.weight_format, r.kv_cache_dtype, views, catalog) if step_up else None
    )
    if not step_up:
        return AutopilotAction(
            r.name,
            "quarantine",
            r.weight_format,
            None,
            f"{held}: quarantined (invalid answers are not a precision to step up from)",
        )
    if target is None:
        return AutopilotAction(
            r.name,
            "quarantine",
            r.weight_format,
            None,
            f"{held}, no step up from {r.weight_format} (the ladder {' -> '.join(LADDER)} within "
            f"what {r.accelerator} runs and the channel publishes: {', '.join(views)}): quarantined",
        )
    return AutopilotAction(
        r.name, "step", r.weight_format, target, f"{held}: weightFormat {r.weight_format} -> {target}"
    )


def cooldown_status(memory: AutopilotMemory, group: str) -> dict[str, Any] | None:
    """SamplerGroup `status.precisionCooldown` of a group: its doubled cool-down and whether it is on
    probation (None: neither, the spec's cool-down)."""
    if group not in memory.cooldown and group not in memory.probation:
        return None
    out: dict[str, Any] = {"onProbation": group in memory.probation}
    if group in memory.cooldown:
        out["cooldownIntervals"] = memory.cooldown[group]
    return out


def group_budgets(optimize: FleetOptimizeSpec, name: str) -> tuple[float | None, float | None]:
    """A group's own (maxKl, maxOorFraction): `router.optimize.groups[name]`'s, else the budgets'."""
    bounds = optimize.groups.get(name)
    max_kl = bounds.max_kl if bounds is not None else None
    max_oor = bounds.max_oor_fraction if bounds is not None else None
    return (
        max_kl if max_kl is not None else optimize.budgets.group_max_kl,
        max_oor if max_oor is not None else optimize.budgets.group_max_oor_fraction,
    )
