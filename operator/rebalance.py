"""Routing shares from live throughput, cost and mismatch. PURE: no I/O, no clock, no Kubernetes.

One call per rebalance interval:

    result = rebalance(groups, state, now, RebalanceConfig(policy="throughput", ...))

`groups` carry each group's parsed SGLang /metrics per pod (`parse_sglang_metrics`), its ready
replicas, GPUs and price per GPU-hour (from the catalog), and the trainer's per-group KL and
out-of-range fraction; `state` is the previous result's `state` (None the first time). The result
holds the new shares (push them to the router), per-group status fields (patch SamplerGroup status),
a bounded share history with reasons, and the fleet's blended cost per 1M usable tokens (inside the
MIS band) against the reference fleet's: every token made at bf16 on the class the RLJob's
`spec.router.reference` names (default the trainer's; with no bf16 group of that class, estimated from
the other groups by the catalog's throughput ratios). The cost formula is rlfleet/fleet.py's, the one
`rlfleet fleet plan` uses.

The rules, in order:
1. Throughput per group = decode tokens/s as SGLang exports them per interval, summed over pods: the
   rate of `sglang:realtime_tokens_total{mode="decode"}` (counted every decode step) since the
   previous scrape; a pod without a previous sample, or whose counter went down (restarted), gives its
   `sglang:gen_throughput` gauge. `sglang:generation_tokens_total` is NOT used: SGLang counts it when
   a request FINISHES, so a busy group with long rollouts would read 0 for minutes. Then an EMA
   (`smoothing` = weight of the newest sample).
2. Capacity per group (`capacities`), tokens/s: a saturated group's smoothed tokens/s (1.). A
   DEMAND-LIMITED group (`queues_empty`: every pod read reports `sglang:num_queue_reqs` and none has a
   request waiting, at this interval and at the `demand_limited_intervals` - 1 before it in a row,
   `GroupMemory.empty_queue_intervals`: the gauge is read once per interval, and one reading that
   catches every queue empty for a moment - after a weight-version switch, between rollout bursts -
   must not move shares) made what it was sent, a lower bound: max(smoothed tokens/s, k x prior), prior =
   the catalog's relative decode throughput of its (accelerator, weight_format) (H100 bf16 = 1) x the
   GPUs of the pods read (`_serving_gpus`), k = the median over the eligible saturated groups with a
   prior and a positive reading of tokens/s / prior; with none, the largest tokens/s / prior of the
   eligible demand-limited groups (the least k none of their readings exceeds: their capacities are
   proportional to their priors, in tokens/s next to the readings of groups without a prior). Unknown
   queue (a pod without the gauge, no pods, a direct `tokens_per_second` reading), no catalog ratio,
   or no k: the smoothed tokens/s, exactly as without this rule; so is a group whose queues have read
   empty for fewer intervals in a row (a saturated or unknown reading starts the count again).
3. Target shares by policy over eligible groups (not quarantined, >= 1 ready replica):
   `throughput`: proportional to capacity; `cost`: proportional to USEFUL capacity (capacity x
   (1 - oor_fraction): out-of-range tokens are masked by MIS and teach nothing) times
   cheapest_cost / own_cost, where cost = USD per 1M useful tokens at that capacity (the reported
   cost stays the measured one) - the cheapest group gets its full capacity share, a group twice as
   expensive half of it; `static`: the configured shares; `plan`: the fleet-mix optimizer's shares
   (operator/fleetplan.py, `spec.router.optimize`). A group weighed by its estimate says so in its
   reason ("capacity estimated N tok/s: no queue"); its reported tokens/s stay the measured ones.
   Every eligible group gets at least `min_share`. Ineligible groups get 0.
   A group with an egress price (`egressPricePerGb`, a group in another region than the weight store)
   pays for its weight traffic: the rate of the trainer's `rlfleet_trainer_weights_stored_bytes_total
   {view}` (the bytes the channel stored for its view over every version: what each of its replicas
   reads) since the previous reading, smoothed alike (a counter that went down: the trainer restarted,
   what it stored since), x 3600 / 1e9 x the price x its ready replicas, USD/h; part of its cost per
   hour and per usable token (so the `cost` policy weighs it). No price, or no reading yet: 0.
4. Quarantined or replica-less groups drop to 0 at once; everything else moves from the current
   shares toward the target along a straight line, as far as `max_share_change` allows for the
   group that moves most (so shares keep summing to 1 and no share moves more than the bound).
Delivered throughput equals capacity when groups are busy (asynchronous RL keeps samplers saturated).
Behind a light producer (slime with few concurrent requests) each group delivers what its share sends
it, so shares from delivered throughput would be a fixed point: a group at 0 when it joined would start
at `min_share` and creep up only by that floor (toward equal shares, never toward its capacity). Rule 2
breaks it where the catalog knows the group's class; a group without a catalog figure starved of
sessions is still raised by nothing but `min_share`. Rule 2 also corrects itself: a group sent more
than it can do queues requests, counts as saturated, and is weighed (and calibrates k) by its reading.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families

from rlfleet.catalog import Catalog
from rlfleet.fleet import (
    BYTES_PER_GB,
    REFERENCE_WEIGHT_FORMAT,
    SECONDS_PER_HOUR,
    FleetEconomics,
    MeasuredGroup,
    fleet_cost_per_1m_usable_tokens,
    measured_economics,
)
from rlfleet.lora import LORA_VIEW
from rlfleet.operator.status import present

# "plan": the fleet-mix optimizer's shares (operator/fleetplan.py), carried in GroupInput.static_share
Policy = Literal["throughput", "cost", "static", "plan"]

TOKENS_COUNTER = "sglang:generation_tokens"  # the parser strips `_total` from counter family names
DECODE_COUNTER = "sglang:realtime_tokens"  # labelled mode=prefill_compute | prefill_cache | decode
DECODE_MODE = "decode"
THROUGHPUT_GAUGE = "sglang:gen_throughput"
RUNNING_GAUGE = "sglang:num_running_reqs"
QUEUE_GAUGE = "sglang:num_queue_reqs"
REQUESTS_COUNTER = "sglang:num_requests"
# the trainer's bytes stored per view over every version it published (trainer/metrics.py `update_published`)
WEIGHTS_STORED_COUNTER = "rlfleet_trainer_weights_stored_bytes_total"


# --- parsing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodSample:
    """What one sampler pod's /metrics says (summed over its label sets, i.e. DP ranks)."""

    generation_tokens_total: float | None = None  # counted when requests finish (not a rate source)
    realtime_decode_tokens_total: float | None = None  # sglang:realtime_tokens_total{mode="decode"}
    gen_throughput: float | None = None
    num_running_reqs: float | None = None
    num_queue_reqs: float | None = None
    num_requests_total: float | None = None


def parse_sglang_metrics(text: str) -> PodSample:
    """Parse SGLang's Prometheus text. Raises ValueError on text that is not exposition format."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # Counter samples are `<family>_total`; `_created` timestamps are not values.
            if sample.name.endswith("_created"):
                continue
            name = sample.name[: -len("_total")] if sample.name.endswith("_total") else sample.name
            if name == DECODE_COUNTER:
                if sample.labels.get("mode") != DECODE_MODE:
                    continue
            if math.isfinite(sample.value):
                sums[name] = sums.get(name, 0.0) + sample.value
    return PodSample(
        generation_tokens_total=sums.get(TOKENS_COUNTER),
        realtime_decode_tokens_total=sums.get(DECODE_COUNTER),
        gen_throughput=sums.get(THROUGHPUT_GAUGE),
        num_running_reqs=sums.get(RUNNING_GAUGE),
        num_queue_reqs=sums.get(QUEUE_GAUGE),
        num_requests_total=sums.get(REQUESTS_COUNTER),
    )


def parse_trainer_group_metrics(text: str) -> dict[str, dict[str, float]]:
    """Per-group trainer metrics from the trainer's exporter (`rlfleet_trainer_<metric>{scope="group",
    key="<group>"}`): {group: {"kl_k3": .., "oor_fraction": .., "token_share": .., "oor_share": ..,
    "routing_mismatch_tokens": .. (a mixture of experts)}}."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("scope") != "group" or not sample.name.startswith("rlfleet_trainer_"):
                continue
            if not math.isfinite(sample.value):
                continue
            metric = sample.name[len("rlfleet_trainer_") :]
            out.setdefault(sample.labels.get("key", ""), {})[metric] = sample.value
    return out


def parse_trainer_stored_bytes(text: str) -> dict[str, float]:
    """The trainer's `rlfleet_trainer_weights_stored_bytes_total{view}`: {view: bytes the channel stored
    for it over every version this trainer process published} (empty: it published none yet)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == WEIGHTS_STORED_COUNTER
                and math.isfinite(sample.value)
                and "view" in sample.labels
            ):
                out[sample.labels["view"]] = sample.value
    return out


# --- inputs, state, outputs -------------------------------------------------------------------


@dataclass(frozen=True)
class GroupInput:
    name: str
    ready_replicas: int
    gpus: int  # GPUs the group pays for (replicas x tensor parallel)
    price_per_gpu_hour: float  # from the catalog; 0 = unknown
    pods: Mapping[str, PodSample] = field(default_factory=dict)  # pod name -> sample taken at `now`
    accelerator: str = ""
    weight_format: str = REFERENCE_WEIGHT_FORMAT
    kl: float | None = None  # trainer's kl_k3 for this group's tokens
    oor_fraction: float | None = None  # share of this group's tokens outside the MIS band
    token_share: float | None = None  # trainer's view: share of trained tokens from this group
    oor_share: float | None = None  # trainer's view: share of all out-of-range tokens
    # a mixture of experts: share of this group's tokens routed to other experts than the trainer's
    # (the trainer's routing_mismatch_tokens, trainer/backends/routing.py); None for a dense model
    routing_mismatch: float | None = None
    # trainer's view: share of the tokens this group sampled that were trained on (the rest answered
    # invalid), and its invalid tokens by validation reason at the trainer's latest step (trainer/metrics.py)
    trained_fraction: float | None = None
    invalid_tokens: Mapping[str, float] = field(default_factory=dict)
    quarantined: bool = False
    static_share: float | None = None
    tokens_per_second: float | None = None  # a direct reading (e.g. from Prometheus) instead of pods
    # USD per GB of weights its replicas read (SamplerGroup spec.egressPricePerGb); None: its traffic is free.
    # Its replicas read the view of its weight_format (the trainer's stored bytes of that view) and, when it
    # serves LoRA adapters (spec.lora), every version's adapter (the `lora` view; its base is stored once)
    egress_price_per_gb: float | None = None
    lora: bool = False
    # GPUs per replica; with it a demand-limited group's catalog prior counts the GPUs of the pods read
    # (`_serving_gpus`), not those it pays for (a group scaling up serves from its ready replicas only)
    tensor_parallel: int | None = None


@dataclass
class GroupMemory:
    """What the rebalancer remembers about a group between intervals (JSON-serialisable)."""

    counters: dict[str, float] = field(default_factory=dict)  # pod -> realtime_decode_tokens_total
    time: float | None = None
    ema_tokens_per_second: float | None = None
    share: float | None = None  # the share computed last time (what the router was told)
    recorded_share: float | None = None  # the share of the last history entry
    history: list[dict[str, object]] = field(default_factory=list)
    # intervals in a row, up to this one, at which its queues read empty (`queues_empty`); a state written
    # before this field loads with 0
    empty_queue_intervals: int = 0


@dataclass
class ViewMemory:
    """The trainer's stored bytes of one view at the last reading, and their smoothed rate (JSON-serialisable)."""

    counter: float | None = None  # rlfleet_trainer_weights_stored_bytes_total{view}
    time: float | None = None
    ema_bytes_per_second: float | None = None


@dataclass
class RebalanceState:
    groups: dict[str, GroupMemory] = field(default_factory=dict)
    views: dict[str, ViewMemory] = field(default_factory=dict)  # view -> the trainer's stored bytes

    def to_dict(self) -> dict[str, object]:
        return {
            "groups": {name: asdict(m) for name, m in self.groups.items()},
            "views": {view: asdict(m) for view, m in self.views.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object] | None) -> RebalanceState:
        if not data:
            return cls()
        groups = data.get("groups", {})
        views = data.get("views", {})
        assert isinstance(groups, Mapping) and isinstance(views, Mapping)
        return cls(
            groups={name: GroupMemory(**dict(m)) for name, m in groups.items()},
            views={view: ViewMemory(**dict(m)) for view, m in views.items()},
        )


@dataclass(frozen=True)
class RebalanceConfig:
    policy: Policy = "throughput"
    max_share_change: float = 0.1
    min_share: float = 0.02
    smoothing: float = 0.5
    history_length: int = 5
    history_min_change: float = 0.005  # smaller moves are not worth a history entry
    # the reference fleet (RLJob spec.router.reference): every token made on this class at bf16
    reference_accelerator: str = "b200"
    reference_price_per_gpu_hour: float | None = None
    reference_tokens_per_gpu_second: float | None = None  # given: wins over the class's bf16 groups
    reference_oor_fraction: float | None = None  # given: wins over the class's bf16 groups (else 0)
    # given: a reference class without a bf16 group is estimated from the other groups by its ratios
    catalog: Catalog | None = None
    # a group is demand-limited (its capacity may be the catalog estimate) once its queues read empty at
    # this many intervals in a row (1: at a single reading)
    demand_limited_intervals: int = 2

    def __post_init__(self) -> None:
        if self.policy not in ("throughput", "cost", "static", "plan"):
            raise ValueError(f"unknown policy {self.policy!r} (throughput | cost | static | plan)")
        if not 0.0 < self.max_share_change <= 1.0:
            raise ValueError("max_share_change must be in (0, 1]")
        if not 0.0 <= self.min_share <= 0.5:
            raise ValueError("min_share must be in [0, 0.5]")
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError("smoothing must be in (0, 1]")
        if self.demand_limited_intervals < 1:
            raise ValueError("demand_limited_intervals must be >= 1")


@dataclass(frozen=True)
class GroupResult:
    name: str
    tokens_per_second: float | None
    share: float
    previous_share: float | None
    target_share: float
    reason: str
    cost_per_hour: (
        float | None
    )  # USD per hour of the group's GPUs and its weight traffic (None: no GPU price)
    usable_fraction: (
        float  # the share of its tokens trained on and inside the MIS band, as its costs count them
    )
    cost_per_1m_tokens: float | None  # USD per 1M tokens, all tokens
    cost_per_1m_useful_tokens: float | None  # USD per 1M in-band tokens
    token_share: float | None
    oor_share: float | None
    kl: float | None
    oor_fraction: float | None
    routing_mismatch: float | None
    quarantined: bool
    history: tuple[dict[str, object], ...]
    trained_fraction: float | None = None  # GroupInput's
    invalid_tokens: Mapping[str, float] = field(default_factory=dict)  # GroupInput's
    # this interval's own reading, before the EMA (None: none this interval): the fleet-mix optimizer's
    # tokens/s per replica, which an EMA across a replica change would mix up
    measured_tokens_per_second: float | None = None
    # USD per hour of its replicas' weight traffic, part of cost_per_hour (None: no egress price or no reading yet)
    egress_cost_per_hour: float | None = None
    # the tokens/s the `throughput` and `cost` policies weigh it by (`capacities`): its smoothed reading,
    # or for a demand-limited group the catalog estimate where that is higher (None: no reading, no estimate)
    capacity_tokens_per_second: float | None = None
    capacity_estimated: bool = False  # capacity_tokens_per_second is the estimate, above the reading

    @property
    def reported(self) -> bool:
        """Whether the trainer reported this group's tokens (its figures are measured, not defaults)."""
        return self.trained_fraction is not None or self.oor_fraction is not None

    def status_patch(self) -> dict[str, object]:
        """The SamplerGroup status fields the rebalancer owns (camelCase, None dropped)."""
        fields: dict[str, object | None] = {
            "tokensPerSecond": _round(self.tokens_per_second, 1),
            "share": _round(self.share, 4),
            "costPerHour": _round(self.cost_per_hour, 4),
            "egressCostPerHour": _round(self.egress_cost_per_hour, 4),
            "costPer1MTokens": _round(self.cost_per_1m_useful_tokens, 4),
            "kl": _round(self.kl, 6),
            "oorFraction": _round(self.oor_fraction, 6),
            "tokenShare": _round(self.token_share, 4),
            "oorShare": _round(self.oor_share, 4),
            "routingMismatch": _round(self.routing_mismatch, 6),
            # only once the trainer reported the group (else the default 1.0 would claim a measurement)
            "usableFraction": _round(self.usable_fraction, 4) if self.reported else None,
            "invalidTokens": _most_invalid(self.invalid_tokens) or None,
            "quarantined": self.quarantined,
            "shareHistory": [dict(h) for h in self.history],
        }
        return present(fields)


INVALID_STATUS_REASONS = 16  # the status keeps a group's most frequent reasons (its schema allows 64)


def _most_invalid(counts: Mapping[str, float]) -> dict[str, int]:
    """SamplerGroup `status.invalidTokens`: the INVALID_STATUS_REASONS reasons with the most tokens (ties
    by name), by name. The reasons come from the trainer's exporter text: more than the schema allows
    would make the API server refuse the group's whole status."""
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:INVALID_STATUS_REASONS]
    return {k: int(v) for k, v in sorted(top)}


@dataclass(frozen=True)
class RebalanceResult:
    shares: dict[str, float]
    groups: dict[str, GroupResult]
    state: RebalanceState
    economics: FleetEconomics  # the interval's costs (rlfleet/fleet.py `measured_economics`)
    changes: tuple[str, ...]  # one human-readable line per group whose share moved (for Events)

    @property
    def changed(self) -> bool:
        return bool(self.changes)

    @property
    def fleet_cost_per_1m_usable_tokens(self) -> float | None:
        return self.economics.cost_per_1m_usable_tokens

    @property
    def baseline_cost_per_1m_usable_tokens(self) -> float | None:
        """The reference fleet's: every token made on `RebalanceConfig.reference_accelerator` at bf16."""
        return self.economics.reference_cost_per_1m_usable_tokens

    @property
    def saving(self) -> float | None:
        """1 - fleet / reference cost per usable token (negative: the fleet costs more). None: either unknown."""
        return self.economics.saving


# --- the computation ----------------------------------------------------------------------------


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, digits)


def group_rate(pods: Mapping[str, PodSample], memory: GroupMemory, now: float) -> float | None:
    """Decode tokens/s of a group since the last scrape: the realtime decode counter's increase per pod
    (SGLang bumps it every decode step, finished requests or not); the `gen_throughput` gauge for a pod
    seen the first time or restarted (counter went down). None when no pod reports either."""
    elapsed = now - memory.time if memory.time is not None else None
    total = 0.0
    known = False
    for pod, sample in pods.items():
        previous = memory.counters.get(pod)
        counter = sample.realtime_decode_tokens_total
        if (
            counter is not None
            and previous is not None
            and elapsed is not None
            and elapsed > 0
            and counter >= previous
        ):
            total += (counter - previous) / elapsed
            known = True
        elif sample.gen_throughput is not None:
            total += sample.gen_throughput
            known = True
        elif counter is not None and previous is not None and elapsed is not None and elapsed > 0:
            total += counter / elapsed  # restarted and no gauge: what it decoded since the restart
            known = True
    return total if known else None


def view_rate(counter: float | None, memory: ViewMemory, now: float) -> float | None:
    """Bytes/s the trainer stored for a view since the last reading: the counter's increase over the
    elapsed time; a counter that went down (the trainer restarted) counts what it stored since the
    restart. None: no reading now, or none before."""
    if counter is None or memory.counter is None or memory.time is None or now <= memory.time:
        return None
    increase = counter - memory.counter if counter >= memory.counter else counter
    return increase / (now - memory.time)


def egress_cost_per_hour(bytes_per_second: float, price_per_gb: float, replicas: int) -> float:
    """USD per hour of a group's weight traffic: each of its replicas reads its view's stored bytes,
    `bytes_per_second` x 3600 / 1e9 GB per hour at `price_per_gb`."""
    return bytes_per_second * SECONDS_PER_HOUR / BYTES_PER_GB * price_per_gb * max(replicas, 0)


def _observe_views(
    stored_bytes: Mapping[str, float] | None,
    previous_state: RebalanceState,
    new_state: RebalanceState,
    now: float,
    config: RebalanceConfig,
) -> None:
    """Each view's stored bytes/s (EMA, as the groups' tokens/s) into `new_state`; a view not read this
    interval keeps its memory (a trainer unreadable this tick)."""
    new_state.views = dict(previous_state.views)
    for view, counter in (stored_bytes or {}).items():
        memory = previous_state.views.get(view, ViewMemory())
        rate, ema = view_rate(counter, memory, now), memory.ema_bytes_per_second
        if rate is not None:
            ema = rate if ema is None else config.smoothing * rate + (1.0 - config.smoothing) * ema
        new_state.views[view] = ViewMemory(counter=counter, time=now, ema_bytes_per_second=ema)


def replica_egress_cost_per_hour(
    price_per_gb: float | None, view: str, state: RebalanceState, *, lora: bool = False
) -> float | None:
    """USD per hour ONE replica reading `view` pays for its weight traffic at `price_per_gb`: the view's
    smoothed stored bytes/s in `state` (`egress_cost_per_hour` of one replica), plus with `lora` (a group
    serving LoRA adapters) the adapters' (the `lora` view's: a replica reads every version's adapter). None:
    no price, or a rate not read yet. The share policy charges it per ready replica (`_egress`), the
    fleet-mix optimizer per planned replica (rebalancer.py `plan_fleet_mix`)."""
    if not price_per_gb:
        return None
    rates = []
    for read in (view, LORA_VIEW) if lora else (view,):
        memory = state.views.get(read)
        rates.append(memory.ema_bytes_per_second if memory is not None else None)
    if any(rate is None for rate in rates):
        return None
    return egress_cost_per_hour(sum(r for r in rates if r is not None), price_per_gb, 1)


def _egress(g: GroupInput, state: RebalanceState) -> float | None:
    """The group's weight traffic, USD/h: its ready replicas' (None: no price, or its view's rate not read yet)."""
    per_replica = replica_egress_cost_per_hour(g.egress_price_per_gb, g.weight_format, state, lora=g.lora)
    return None if per_replica is None else per_replica * max(g.ready_replicas, 0)


def queues_empty(g: GroupInput) -> bool:
    """Whether the group had less work than it could do at this reading: every pod read reports
    `sglang:num_queue_reqs` and none has a request waiting. Unknown (a pod without the gauge, no pod read,
    a direct `tokens_per_second` reading such as Prometheus's) is not: the group counts as saturated. An
    instantaneous gauge: the group is demand-limited once this held `demand_limited_intervals` in a row."""
    if g.tokens_per_second is not None or not g.pods:
        return False
    return all(s.num_queue_reqs is not None and s.num_queue_reqs <= 0 for s in g.pods.values())


def _serving_gpus(g: GroupInput) -> int:
    """The GPUs its reading comes from: the pods read x its tensor parallelism where both are known, else
    the GPUs it pays for."""
    if g.tensor_parallel and g.tensor_parallel > 0 and g.pods:
        return g.tensor_parallel * len(g.pods)
    return g.gpus


def _prior(g: GroupInput, catalog: Catalog | None) -> float | None:
    """The catalog's relative decode throughput of the group (H100 at bf16 per GPU = 1) x its serving GPUs;
    None: no catalog, no ratio for its class and format, or no GPU."""
    ratio = catalog.decode_throughput(g.accelerator, g.weight_format) if catalog is not None else None
    gpus = _serving_gpus(g)
    return ratio * gpus if ratio is not None and gpus > 0 else None


@dataclass(frozen=True)
class Capacities:
    """What the `throughput` and `cost` policies weigh each group by, tokens/s (`capacities`)."""

    tokens_per_second: dict[str, float | None]
    estimated: frozenset[str]  # groups whose capacity is the catalog estimate, above their reading
    scale: float | None  # k: tokens/s per unit of catalog prior (None: no group to scale by)


def capacities(
    inputs: Sequence[GroupInput],
    tps: Mapping[str, float | None],
    eligible: Iterable[str],
    catalog: Catalog | None,
    demand_limited: Iterable[str],
) -> Capacities:
    """Each group's decode capacity, tokens/s. A saturated group (or one of unknown queue, or whose queues
    have not read empty long enough: not in `demand_limited`, the groups `rebalance` counts as demand-limited)
    makes what it can: its smoothed reading `tps`. A demand-limited group made what it was sent, a LOWER
    bound: max(its reading, k x its prior), prior = `_prior`, k in tokens/s per unit of prior = the median
    over the eligible saturated groups with a prior and a positive reading of reading / prior; with none,
    the largest reading / prior of the eligible demand-limited groups with a prior (the least k none of
    their readings exceeds: their capacities come out proportional to their priors, in tokens/s, next to
    the readings of groups without a prior). A group without a prior, an ineligible one, or no k (no
    positive reading to scale by): its reading, as for a saturated group."""
    names = set(eligible)
    priors = {g.name: _prior(g, catalog) for g in inputs}
    limited = set(demand_limited)

    def per_unit(group_names: Iterable[str]) -> list[float]:
        out = []
        for n in group_names:
            prior, rate = priors[n], tps.get(n)
            if n in names and prior is not None and rate is not None and rate > 0:
                out.append(rate / prior)
        return out

    saturated = per_unit(g.name for g in inputs if g.name not in limited)
    lower = per_unit(g.name for g in inputs if g.name in limited)
    scale = statistics.median(saturated) if saturated else (max(lower) if lower else None)
    out: dict[str, float | None] = {}
    estimated: set[str] = set()
    for g in inputs:
        rate, prior = tps.get(g.name), priors[g.name]
        out[g.name] = rate
        if (
            g.name in limited & names
            and prior is not None
            and scale is not None
            and scale * prior > (rate or 0.0)
        ):
            out[g.name] = scale * prior
            estimated.add(g.name)
    return Capacities(out, frozenset(estimated), scale)


def _target_shares(
    eligible: list[str],
    raw: Mapping[str, float],
    min_share: float,
) -> dict[str, float]:
    """raw weights -> shares with a floor: floor + (1 - n floor) * raw / sum(raw)."""
    n = len(eligible)
    if n == 0:
        return {}
    floor = min(min_share, 1.0 / n)
    total = sum(max(raw.get(g, 0.0), 0.0) for g in eligible)
    if total <= 1e-12:  # nothing measurable (also keeps denormal rounding out of the division)
        return {g: 1.0 / n for g in eligible}
    return {g: floor + (1.0 - n * floor) * (max(raw.get(g, 0.0), 0.0) / total) for g in eligible}


def rebalance(
    groups: Iterable[GroupInput],
    state: RebalanceState | None,
    now: float,
    config: RebalanceConfig,
    current_shares: Mapping[str, float] | None = None,
    weights_stored_bytes: Mapping[str, float] | None = None,
) -> RebalanceResult:
    """One rebalance step. `now` is epoch seconds; `current_shares` (optional) are the router's
    shares if known (else the previous result's, else equal); `weights_stored_bytes` the trainer's
    `rlfleet_trainer_weights_stored_bytes_total` per view read now (`parse_trainer_stored_bytes`; None:
    not read this interval), whose rate prices the weight traffic of groups with an egress price."""
    inputs = list(groups)
    previous_state = state or RebalanceState()
    new_state = RebalanceState()

    # 1. Throughput (EMA) per group; the weights stored per view (EMA) and each group's egress.
    readings = {g.name: _observe_throughput(g, previous_state, new_state, now, config) for g in inputs}
    tps = {name: smoothed for name, (_, smoothed) in readings.items()}
    _observe_views(weights_stored_bytes, previous_state, new_state, now, config)
    egress = {g.name: _egress(g, new_state) for g in inputs}

    # 2.-3. Capacities, targets by policy.
    names = [g.name for g in inputs]
    by_name = {g.name: g for g in inputs}
    eligible = [g.name for g in inputs if not g.quarantined and g.ready_replicas > 0]
    economics = measured_economics(
        [
            MeasuredGroup(
                g.name,
                g.accelerator,
                g.weight_format,
                g.gpus,
                g.price_per_gpu_hour,
                tps[g.name],
                g.oor_fraction,
                g.trained_fraction,
                egress[g.name] or 0.0,
            )
            for g in inputs
        ],
        config.reference_accelerator,
        config.reference_price_per_gpu_hour,
        config.reference_tokens_per_gpu_second,
        config.reference_oor_fraction,
        config.catalog,
    )
    useful_cost = {n: economics.groups[n].cost_per_1m_usable_tokens for n in names}
    # what the throughput and cost policies weigh: capacity (a demand-limited group's may be estimated);
    # the cost policy's cost per useful token at that capacity (the status keeps the measured cost)
    limited = [
        n for n in names if new_state.groups[n].empty_queue_intervals >= config.demand_limited_intervals
    ]
    capacity = capacities(inputs, tps, eligible, config.catalog, limited)
    cap = capacity.tokens_per_second
    useful = {n: (cap[n] or 0.0) * economics.groups[n].usable_fraction for n in names}
    weighed_cost = dict(useful_cost)
    for n in capacity.estimated:
        cost_per_hour = economics.groups[n].cost_per_hour
        weighed_cost[n] = (
            None
            if cost_per_hour is None
            else fleet_cost_per_1m_usable_tokens(
                [(cap[n] or 0.0, 1, cost_per_hour, 1.0 - economics.groups[n].usable_fraction)]
            )
        )
    raw = _policy_weights(eligible, by_name, cap, useful, weighed_cost, config.policy)
    target = {n: 0.0 for n in names}
    target.update(_target_shares(eligible, raw, config.min_share))

    # 4. Bounded move from the current shares.
    old = _old_shares(names, current_shares, previous_state)
    shares, step = _bounded_move(names, eligible, old, target, config.max_share_change)

    # 5. Status, history, costs.
    old_total = sum(old.values())
    old_normalised = {n: (old[n] / old_total if old_total > 0 else 0.0) for n in names}
    total_tps = sum(tps[n] or 0.0 for n in names)
    total_oor_tokens = sum((tps[n] or 0.0) * (by_name[n].oor_fraction or 0.0) for n in names)
    timestamp = datetime.fromtimestamp(now, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    results: dict[str, GroupResult] = {}
    changes: list[str] = []
    for name in names:
        g = by_name[name]
        memory = new_state.groups[name]
        reason = _share_reason(g, tps[name], useful_cost[name], config.policy)
        if name in capacity.estimated and name in eligible and config.policy in ("throughput", "cost"):
            reason += f"; capacity estimated {cap[name] or 0.0:.0f} tok/s: no queue"
        if step < 1.0 and name in eligible:
            reason += f"; bounded toward {target[name]:.3f}"
        change = _record_share(memory, shares[name], old_normalised[name], reason, timestamp, config)
        if change is not None:
            changes.append(f"{name}: {change}")
        token_share, oor_share = _traffic_shares(g, tps[name], total_tps, total_oor_tokens)
        results[name] = GroupResult(
            name=name,
            tokens_per_second=tps[name],
            share=shares[name],
            previous_share=old_normalised[name] if old_total > 0 else None,
            target_share=target[name],
            reason=reason,
            cost_per_hour=economics.groups[name].cost_per_hour,
            usable_fraction=economics.groups[name].usable_fraction,
            cost_per_1m_tokens=economics.groups[name].cost_per_1m_tokens,
            cost_per_1m_useful_tokens=useful_cost[name],
            token_share=token_share,
            oor_share=oor_share,
            kl=g.kl,
            oor_fraction=g.oor_fraction,
            routing_mismatch=g.routing_mismatch,
            quarantined=g.quarantined,
            history=tuple(memory.history),
            trained_fraction=g.trained_fraction,
            invalid_tokens=dict(g.invalid_tokens),
            measured_tokens_per_second=readings[name][0],
            egress_cost_per_hour=egress[name],
            capacity_tokens_per_second=cap[name],
            capacity_estimated=name in capacity.estimated,
        )

    return RebalanceResult(
        shares=shares,
        groups=results,
        state=new_state,
        economics=economics,
        changes=tuple(changes),
    )


def _observe_throughput(
    g: GroupInput,
    previous_state: RebalanceState,
    new_state: RebalanceState,
    now: float,
    config: RebalanceConfig,
) -> tuple[float | None, float | None]:
    """The group's tokens/s read this interval and smoothed after this reading (None: no reading this
    interval / yet); records its counters and for how many intervals in a row its queues read empty, and
    carries its memory into `new_state`."""
    memory = previous_state.groups.get(g.name, GroupMemory())
    observed = g.tokens_per_second if g.tokens_per_second is not None else group_rate(g.pods, memory, now)
    ema = memory.ema_tokens_per_second
    if observed is not None:
        ema = observed if ema is None else config.smoothing * observed + (1.0 - config.smoothing) * ema
    counters = {
        pod: s.realtime_decode_tokens_total
        for pod, s in g.pods.items()
        if s.realtime_decode_tokens_total is not None
    }
    new_state.groups[g.name] = GroupMemory(
        counters=counters,
        time=now,
        ema_tokens_per_second=ema,
        share=memory.share,
        recorded_share=memory.recorded_share,
        history=list(memory.history),
        # a saturated or unknown reading starts the count again
        empty_queue_intervals=memory.empty_queue_intervals + 1 if queues_empty(g) else 0,
    )
    return observed, ema


def _policy_weights(
    eligible: list[str],
    by_name: Mapping[str, GroupInput],
    tps: Mapping[str, float | None],
    useful: Mapping[str, float],
    useful_cost: Mapping[str, float | None],
    policy: Policy,
) -> dict[str, float]:
    """The raw weight of each eligible group under the policy (static share, throughput, or useful
    throughput scaled by how close its cost per useful token is to the cheapest)."""
    known = [n for n in eligible if tps[n] is not None]
    neutral = sum(tps[n] or 0.0 for n in known) / len(known) if known else 1.0
    if policy in ("static", "plan"):
        return {n: max(by_name[n].static_share or 0.0, 0.0) for n in eligible}
    if policy == "throughput":
        # A group without a reading yet (just added) gets the average until it has one.
        return {n: (t if (t := tps[n]) is not None else neutral) for n in eligible}
    # cost
    costs = [c for n in eligible if (c := useful_cost[n]) is not None]
    cheapest = min(costs) if costs else None
    raw: dict[str, float] = {}
    for n in eligible:
        rate = useful[n] if tps[n] is not None else neutral
        cost = useful_cost[n]
        raw[n] = rate * (cheapest / cost) if cheapest is not None and cost is not None else rate
    return raw


def _old_shares(
    names: list[str], current_shares: Mapping[str, float] | None, previous_state: RebalanceState
) -> dict[str, float]:
    """The shares the move starts from: the router's if known, else the previous result's, else equal."""
    if current_shares is not None:
        return {n: max(float(current_shares.get(n, 0.0)), 0.0) for n in names}
    previous = {n: (previous_state.groups[n].share if n in previous_state.groups else None) for n in names}
    if all(v is None for v in previous.values()):
        return {n: 1.0 for n in names}
    return {n: (v if v is not None else 0.0) for n, v in previous.items()}


def _bounded_move(
    names: list[str],
    eligible: list[str],
    old: Mapping[str, float],
    target: Mapping[str, float],
    max_share_change: float,
) -> tuple[dict[str, float], float]:
    """Move from the old shares (renormalised over the eligible groups) toward the targets, no share
    by more than max_share_change: (the new shares, the fraction of the way moved)."""
    base = {n: (old[n] if n in eligible else 0.0) for n in names}
    base_total = sum(base.values())
    base = {
        n: (v / base_total if base_total > 0 else (1.0 / len(eligible) if n in eligible else 0.0))
        for n, v in base.items()
    }
    if not eligible:
        base = {n: 0.0 for n in names}
    largest = max((abs(target[n] - base[n]) for n in names), default=0.0)
    step = 1.0 if largest <= max_share_change else max_share_change / largest
    return {n: base[n] + step * (target[n] - base[n]) for n in names}, step


def _share_reason(g: GroupInput, tps: float | None, useful_cost: float | None, policy: Policy) -> str:
    """Why the group has its share: out of rotation, or the policy's reading."""
    if g.quarantined:
        return "quarantined"
    if g.ready_replicas <= 0:
        return "no ready replicas"
    if policy == "static":
        return "static"
    if policy == "plan":
        return f"fleet plan {g.static_share or 0.0:.3f}"
    if policy == "throughput":
        return f"throughput {tps:.0f} tok/s" if tps is not None else "throughput (no reading yet)"
    return f"cost ${useful_cost:.3f}/1M useful tokens" if useful_cost is not None else "cost (no reading yet)"


def _record_share(
    memory: GroupMemory,
    share: float,
    old_normalised: float,
    reason: str,
    timestamp: str,
    config: RebalanceConfig,
) -> str | None:
    """Set the group's share in its memory and, when it moved at least history_min_change from the
    last recorded one, append it to the history: the change ("share a -> b (reason)"), or None."""
    previous_recorded = memory.recorded_share if memory.recorded_share is not None else old_normalised
    change = None
    if abs(share - previous_recorded) >= config.history_min_change:
        memory.history.append(
            {"time": timestamp, "from": round(previous_recorded, 4), "to": round(share, 4), "reason": reason}
        )
        memory.history = memory.history[-config.history_length :]
        change = f"share {previous_recorded:.3f} -> {share:.3f} ({reason})"
        memory.recorded_share = share
    elif memory.recorded_share is None:
        memory.recorded_share = share
    memory.share = share
    return change


def _traffic_shares(
    g: GroupInput, tps: float | None, total_tps: float, total_oor_tokens: float
) -> tuple[float | None, float | None]:
    """The group's share of the fleet's tokens and of its out-of-range tokens: as the trainer
    reported them, else estimated from the throughputs."""
    token_share = (
        g.token_share if g.token_share is not None else ((tps or 0.0) / total_tps if total_tps else None)
    )
    if g.oor_share is not None:
        oor_share: float | None = g.oor_share
    elif total_oor_tokens > 0:
        oor_share = (tps or 0.0) * (g.oor_fraction or 0.0) / total_oor_tokens
    else:
        oor_share = None
    return token_share, oor_share
