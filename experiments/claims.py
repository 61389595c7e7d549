"""The correction ablation's pre-registered statistics and claims (docs/ablation.md, "Pre-registered
claims"): pure functions of the runs' per-step metrics, independent of the model that produced them.

Input: one `RunRecord` per (arm, fleet, seed, lag) run, holding the training loop's per-step metrics
(`trainer/loop.py` history, keys of `trainer/metrics.py`: `step` 1, 2, ..., `reward_mean`, `kl_k3`,
optionally `entropy`), and a `CollapseDefinition` carrying the task's chance-level reward.

Definitions (exact; docs/ablation.md states the same):
- `final_reward`: mean reward of the last `tail_steps(n) = max(1, n // 10)` steps ("the last 10%").
- `kl_growth(kls, lag)`: mean kl_k3 of the last `tail_steps(n)` steps over the mean kl_k3 of steps
  lag+1..lag+3 (the first three steps whose samples are `lag` versions old).
- `collapse_step`: the first step t whose rolling-`window` mean reward is below half of the running
  peak of that rolling mean at t, and stays below that half until the end of the run, where the peak
  is at least chance + peak_margin; None if there is no such step.
- on-policy KL: kl_k3 of step 1 (the samplers serve version 0, the trainer's own weights).
- A seed that never collapses counts as collapsing at steps + 1 ("censored") in mean collapse steps.

`paper_claims` turns method.md's ablation into claims C1..C7 with seed-count thresholds; a claim whose
cells are missing (or hold fewer than `min_seeds` seeds) is "not run", neither PASS nor FAIL. Arm and
fleet names are those of `experiments/ablation.py` (`ARMS`, `FLEETS`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import combinations
from statistics import median

HOMOGENEOUS, MIXED = "homogeneous", "mixed"
FLEET_ORDER = (HOMOGENEOUS, MIXED)
ARM_ORDER = ("pg", "mis", "sc", "pg+topp", "sc_mis", "sc_mis+topp")
SINGLE_CORRECTIONS = ("mis", "sc", "pg+topp")
STABLE_ARMS = ("sc_mis", "sc_mis+topp")
# the null-arm control: on the homogeneous fleet at lag 0 these four are the same objective in expectation
# (the samplers serve the trainer's own weights within bf16 rounding, so every ratio is close to 1 up to
# the top-p kept mass: MIS masks almost nothing, SC's centering term is close to 0), so their
# differences measure seed noise
NULL_ARMS = ("pg", "mis", "sc", "sc_mis")
NULL_FLEET = HOMOGENEOUS
NULL_LAG = 0

WINDOW = 10
# Rewards lie in [0, 1]. With 8 prompts per step a step's mean reward moves by about +-0.2 (docs/ablation.md),
# so a rolling-10 mean has a standard deviation of about 0.2 / sqrt(10) = 0.06 and its running maximum over
# a few hundred steps of a policy that learns nothing sits about 2.5 of those (0.16) above its mean. A peak
# at least 0.2 above chance is therefore learning, not the running maximum of noise, and "below half of it"
# is then a fall of at least 0.1 + chance / 2.
PEAK_MARGIN = 0.2
MIN_SEEDS = 5  # issue 16: at least 5 seeds per cell


def tail_steps(n: int) -> int:
    """The number of final steps "the last 10%" averages: max(1, n // 10) (120 -> 12, 25 -> 2, 9 -> 1)."""
    if n < 1:
        raise ValueError("a run needs at least one step")
    return max(1, n // 10)


def final_reward(rewards: Sequence[float]) -> float:
    """Mean reward of the last tail_steps(len(rewards)) steps."""
    k = tail_steps(len(rewards))
    return math.fsum(rewards[-k:]) / k


def kl_growth(kls: Sequence[float], lag: int) -> float:
    """Mean kl_k3 of the last tail_steps(n) steps over the mean kl_k3 of steps lag+1..lag+3 (1-based;
    `kls[lag:lag + 3]`): how much the sampler/trainer mismatch grew after the first stale steps.
    ValueError when the run has fewer than lag+3 steps or that start mean is 0 (growth undefined)."""
    if lag < 0:
        raise ValueError(f"lag must be >= 0, got {lag}")
    n = len(kls)
    if n < lag + 3:
        raise ValueError(f"kl_growth needs steps {lag + 1}..{lag + 3} (lag {lag}); the run has {n} steps")
    start = math.fsum(kls[lag : lag + 3]) / 3
    if not start > 0:
        raise ValueError(f"mean kl_k3 of steps {lag + 1}..{lag + 3} is {start}: growth undefined")
    k = tail_steps(n)
    return (math.fsum(kls[-k:]) / k) / start


def rolling_means(values: Sequence[float], window: int) -> list[float]:
    """Means of every full window: element j is the mean of values[j : j + window], i.e. the rolling mean
    at step j + window (1-based). Empty when there are fewer than `window` values."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return [math.fsum(values[j : j + window]) / window for j in range(len(values) - window + 1)]


def collapse_step(
    rewards: Sequence[float], window: int = WINDOW, *, chance: float, peak_margin: float = PEAK_MARGIN
) -> int | None:
    """The first step t (1-based, t >= window) such that, with m the rolling-`window` mean reward and
    P_t = max(m_window..m_t) its running peak: P_t >= chance + peak_margin and m_u < P_t / 2 for every
    u from t to the end of the run. None if no step qualifies (also when the run is shorter than `window`).

    Once m stays below P_t / 2 the peak cannot rise again, so "half of that peak" is well defined; a run
    that falls and recovers to at least half its peak has not collapsed; rewards are assumed >= 0.
    Default peak_margin 0.2: see PEAK_MARGIN (a peak that high above chance is learning, not noise)."""
    if not (math.isfinite(chance) and chance >= 0):
        raise ValueError(f"chance must be a finite reward >= 0, got {chance}")
    if not (math.isfinite(peak_margin) and peak_margin >= 0):
        raise ValueError(f"peak_margin must be finite and >= 0, got {peak_margin}")
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError("rewards must be finite")
    means = rolling_means(rewards, window)
    suffix_max = list(means)
    for j in range(len(means) - 2, -1, -1):
        suffix_max[j] = max(means[j], suffix_max[j + 1])
    peak = -math.inf
    for j, m in enumerate(means):
        peak = max(peak, m)
        if peak >= chance + peak_margin and suffix_max[j] < peak / 2:
            return j + window
    return None


def lock_step(uniform_fractions: Sequence[float | None], min_steps: int = WINDOW) -> int | None:
    """The first step t (1-based) from which every step to the end of the run has
    `uniform_group_fraction` 1.0 (every prompt group scored alike, so every advantage and the gradient
    are 0: learning has stopped for good), when that lasts at least `min_steps` steps; else None.
    Reported beside the collapse definition, not part of it (docs/ablation.md: a run can lock in
    before it ever learns). A step without the metric counts as not uniform."""
    if min_steps < 1:
        raise ValueError(f"min_steps must be >= 1, got {min_steps}")
    n = len(uniform_fractions)
    t = n
    while t > 0 and uniform_fractions[t - 1] == 1.0:
        t -= 1
    return t + 1 if n - t >= min_steps else None


@dataclass(frozen=True)
class CollapseDefinition:
    """The pre-registered collapse definition: the task's chance-level reward (e.g. 0.1 for a 10-way
    digit), the rolling window and the margin the peak must clear above chance."""

    chance: float
    window: int = WINDOW
    peak_margin: float = PEAK_MARGIN

    def __post_init__(self) -> None:
        collapse_step([], self.window, chance=self.chance, peak_margin=self.peak_margin)  # validates

    def step(self, rewards: Sequence[float]) -> int | None:
        return collapse_step(rewards, self.window, chance=self.chance, peak_margin=self.peak_margin)


@dataclass(frozen=True)
class RunRecord:
    """One run of one arm on one fleet: `history` is the training loop's per-step metrics, steps 1..n."""

    arm: str
    fleet: str
    seed: int
    lag: int
    history: list[dict[str, float]]

    def __post_init__(self) -> None:
        if not self.arm or not self.fleet:
            raise ValueError(f"a run record needs an arm and a fleet, got {self.arm!r} / {self.fleet!r}")
        if self.lag < 0:
            raise ValueError(f"{self.cell}: lag must be >= 0")
        if not self.history:
            raise ValueError(f"{self.cell} seed {self.seed}: empty history")
        for i, h in enumerate(self.history):
            if h.get("step") != i + 1:
                raise ValueError(
                    f"{self.cell} seed {self.seed}: history entry {i} has step {h.get('step')}, "
                    f"expected {i + 1} (a run's steps are 1..n)"
                )
            for key in ("reward_mean", "kl_k3"):
                if not isinstance(h.get(key), (int, float)) or not math.isfinite(h[key]):
                    raise ValueError(f"{self.cell} seed {self.seed}: step {i + 1} has no finite {key!r}")

    @property
    def cell(self) -> str:
        return cell_name(self.arm, self.fleet, self.lag)

    @property
    def steps(self) -> int:
        return len(self.history)

    @property
    def uniform_fractions(self) -> list[float | None]:
        return [h.get("uniform_group_fraction") for h in self.history]

    @property
    def rewards(self) -> list[float]:
        return [float(h["reward_mean"]) for h in self.history]

    @property
    def kls(self) -> list[float]:
        return [float(h["kl_k3"]) for h in self.history]


def cell_name(arm: str, fleet: str, lag: int) -> str:
    return f"{arm}/{fleet}/lag {lag}"


def censored_collapse_step(record: RunRecord, definition: CollapseDefinition) -> int:
    """The run's collapse step, or steps + 1 when it never collapses."""
    step = definition.step(record.rewards)
    return record.steps + 1 if step is None else step


def on_policy_kl(record: RunRecord) -> float:
    """kl_k3 at step 1: the samplers serve version 0, the trainer's own weights (precision and kernels only)."""
    return float(record.history[0]["kl_k3"])


def record_final_reward(record: RunRecord) -> float:
    return final_reward(record.rewards)


def _mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs)


@dataclass(frozen=True)
class PairedDifference:
    """measure(a) - measure(b) per seed, for two arms on one fleet at one lag."""

    a: str
    b: str
    fleet: str
    lag: int
    seeds: tuple[int, ...]
    differences: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.differences)

    @property
    def mean(self) -> float:
        return _mean(self.differences)

    @property
    def variance(self) -> float:
        """Sample variance (n - 1 in the denominator); NaN for one seed."""
        if self.n < 2:
            return math.nan
        m = self.mean
        return math.fsum((d - m) ** 2 for d in self.differences) / (self.n - 1)

    @property
    def std(self) -> float:
        return math.sqrt(self.variance)

    @property
    def min(self) -> float:
        return min(self.differences)

    @property
    def max(self) -> float:
        return max(self.differences)

    def describe(self) -> str:
        return (
            f"{self.a} - {self.b} on {self.fleet}/lag {self.lag} over seeds {list(self.seeds)}: mean {self.mean:.3f}, "
            f"std {self.std:.3f}, min {self.min:.3f}, max {self.max:.3f}, n {self.n}"
        )


class _Index:
    """Records by (arm, fleet, lag) and seed; one record per seed and cell."""

    def __init__(self, records: Sequence[RunRecord]) -> None:
        self.runs: dict[tuple[str, str, int], dict[int, RunRecord]] = {}
        for r in records:
            cell = self.runs.setdefault((r.arm, r.fleet, r.lag), {})
            if r.seed in cell:
                raise ValueError(f"two runs of {r.cell} with seed {r.seed}")
            cell[r.seed] = r

    def seeds(self, cells: Sequence[tuple[str, str, int]]) -> list[int]:
        """The seeds every one of `cells` has."""
        common: set[int] | None = None
        for c in cells:
            have = set(self.runs.get(c, {}))
            common = have if common is None else common & have
        return sorted(common or ())

    def missing(self, cells: Sequence[tuple[str, str, int]], min_seeds: int) -> list[str]:
        """Cells absent or with fewer than min_seeds seeds, then (if all are there) too few common seeds."""
        out = []
        for c in cells:
            n = len(self.runs.get(c, {}))
            if n == 0:
                out.append(f"{cell_name(*c)} (no runs)")
            elif n < min_seeds:
                out.append(f"{cell_name(*c)} ({n} seeds < {min_seeds})")
        if not out and len(cells) > 1 and len(self.seeds(cells)) < min_seeds:
            out.append(
                f"{', '.join(cell_name(*c) for c in cells)} share {len(self.seeds(cells))} seeds < {min_seeds}"
            )
        return out

    def get(self, cell: tuple[str, str, int], seeds: Sequence[int]) -> list[RunRecord]:
        return [self.runs[cell][s] for s in seeds]


def paired_difference(
    records: Sequence[RunRecord],
    a: str,
    b: str,
    fleet: str,
    lag: int,
    measure: Callable[[RunRecord], float] = record_final_reward,
) -> PairedDifference:
    """measure(arm a) - measure(arm b) on `fleet` at `lag`, paired by seed over the seeds both arms have
    (final reward by default). ValueError when they share no seed."""
    index = _Index(records)
    cells = [(a, fleet, lag), (b, fleet, lag)]
    seeds = index.seeds(cells)
    if not seeds:
        raise ValueError(f"{cell_name(*cells[0])} and {cell_name(*cells[1])} share no seed")
    ra, rb = index.get(cells[0], seeds), index.get(cells[1], seeds)
    return PairedDifference(
        a, b, fleet, lag, tuple(seeds), tuple(measure(x) - measure(y) for x, y in zip(ra, rb, strict=True))
    )


@dataclass(frozen=True)
class NoiseFloor:
    """The null-arm control: final-reward paired differences between every two of NULL_ARMS on the
    homogeneous fleet at lag 0, over the seeds all four share."""

    pairs: tuple[PairedDifference, ...]

    @property
    def max_abs_mean(self) -> float:
        """The largest |mean paired difference| among the null pairs: the floor an effect must clear."""
        return max(abs(p.mean) for p in self.pairs)

    @property
    def pooled_std(self) -> float:
        """sqrt(sum (n_i - 1) s_i^2 / sum (n_i - 1)) over the null pairs; NaN with one seed."""
        df = sum(p.n - 1 for p in self.pairs)
        if df == 0:
            return math.nan
        return math.sqrt(math.fsum((p.n - 1) * p.variance for p in self.pairs) / df)

    def describe(self) -> str:
        return (
            f"null-arm floor ({', '.join(NULL_ARMS)} on {NULL_FLEET}/lag {NULL_LAG}, {len(self.pairs)} pairs over seeds "
            f"{list(self.pairs[0].seeds)}): largest absolute mean paired difference {self.max_abs_mean:.3f}, pooled std {self.pooled_std:.3f}"
        )


NULL_CELLS = [(arm, NULL_FLEET, NULL_LAG) for arm in NULL_ARMS]


def null_noise_floor(records: Sequence[RunRecord]) -> NoiseFloor:
    """The null-arm noise floor; ValueError when a null cell is missing or the four share no seed."""
    index = _Index(records)
    absent = index.missing(NULL_CELLS, 1)
    if absent:
        raise ValueError(f"null-arm control needs {', '.join(absent)}")
    seeds = index.seeds(NULL_CELLS)
    runs = {arm: index.get((arm, NULL_FLEET, NULL_LAG), seeds) for arm in NULL_ARMS}
    pairs = tuple(
        PairedDifference(
            a,
            b,
            NULL_FLEET,
            NULL_LAG,
            tuple(seeds),
            tuple(
                record_final_reward(x) - record_final_reward(y) for x, y in zip(runs[a], runs[b], strict=True)
            ),
        )
        for a, b in combinations(NULL_ARMS, 2)
    )
    return NoiseFloor(pairs)


# ------------------------------------------------------------------------------------------- claims
@dataclass(frozen=True)
class ClaimResult:
    """passed None = not run (`missing` names the cells that were missing or too small)."""

    passed: bool | None
    evidence: str
    missing: tuple[str, ...] = ()

    @property
    def status(self) -> str:
        return "not run" if self.passed is None else ("PASS" if self.passed else "FAIL")


@dataclass(frozen=True)
class Claim:
    id: str
    text: str
    evaluate: Callable[[Sequence[RunRecord]], ClaimResult]


def _not_run(missing: Sequence[str]) -> ClaimResult:
    return ClaimResult(None, "missing: " + "; ".join(missing), tuple(missing))


def _two_thirds(k: int, n: int) -> bool:
    """k of n seeds is at least 2/3, decided in integers: 3 k >= 2 n (5 seeds: 4; 3 seeds: 2)."""
    return 3 * k >= 2 * n


def _steps_text(steps: Sequence[int | None], seeds: Sequence[int]) -> str:
    return ", ".join(f"{s}: {'never' if t is None else t}" for s, t in zip(seeds, steps, strict=True))


@dataclass(frozen=True)
class _PaperClaims:
    """The evaluators of paper_claims' C1..C7 over the cells at `lag` (see paper_claims)."""

    definition: CollapseDefinition
    lag: int
    min_seeds: int
    low_fleet: str

    @property
    def fleets(self) -> tuple[str, str]:
        return (HOMOGENEOUS, self.low_fleet)

    def _cell(self, arm: str, fleet: str) -> tuple[str, str, int]:
        return (arm, fleet, self.lag)

    def _collapses(
        self, index: _Index, c: tuple[str, str, int], seeds: Sequence[int]
    ) -> tuple[list[int | None], int, float]:
        """Collapse step per seed, collapsed count, mean censored collapse step."""
        runs = index.get(c, seeds)
        steps = [self.definition.step(r.rewards) for r in runs]
        censored = [r.steps + 1 if t is None else t for r, t in zip(runs, steps, strict=True)]
        return steps, sum(t is not None for t in steps), _mean(censored)

    def c1(self, records: Sequence[RunRecord]) -> ClaimResult:
        index, c = _Index(records), self._cell("pg", self.low_fleet)
        if missing := index.missing([c], self.min_seeds):
            return _not_run(missing)
        seeds = index.seeds([c])
        steps, k, _ = self._collapses(index, c, seeds)
        return ClaimResult(
            _two_thirds(k, len(seeds)),
            f"{cell_name(*c)} collapsed in {k}/{len(seeds)} seeds (need 3k >= 2n); "
            f"collapse step by seed: {_steps_text(steps, seeds)}",
        )

    def c2(self, records: Sequence[RunRecord]) -> ClaimResult:
        index = _Index(records)
        cells = [self._cell("pg", HOMOGENEOUS), self._cell("pg", self.low_fleet)]
        if missing := index.missing(cells, self.min_seeds):
            return _not_run(missing)
        seeds = index.seeds(cells)
        (sh, kh, mh), (sm, km, mm) = (self._collapses(index, c, seeds) for c in cells)
        return ClaimResult(
            mh > mm or kh < km,
            f"pg over seeds {seeds}: homogeneous collapsed {kh}/{len(seeds)}, mean step {mh:.1f} (by seed: "
            f"{_steps_text(sh, seeds)}); {self.low_fleet} collapsed {km}/{len(seeds)}, mean step {mm:.1f} "
            f"(by seed: {_steps_text(sm, seeds)}); never = steps + 1 in the means",
        )

    def c3(self, records: Sequence[RunRecord]) -> ClaimResult:
        index = _Index(records)
        cells = [self._cell(arm, fleet) for arm in STABLE_ARMS for fleet in self.fleets]
        if missing := index.missing(cells, self.min_seeds):
            return _not_run(missing)
        parts, ok = [], True
        for c in cells:
            seeds = index.seeds([c])
            steps, k, _ = self._collapses(index, c, seeds)
            ok = ok and k == 0
            parts.append(
                f"{cell_name(*c)} {k}/{len(seeds)}" + (f" ({_steps_text(steps, seeds)})" if k else "")
            )
        return ClaimResult(ok, "collapsed: " + "; ".join(parts))

    def c4(self, records: Sequence[RunRecord]) -> ClaimResult:
        index = _Index(records)
        arms = ("pg", "sc_mis", *SINGLE_CORRECTIONS)
        cells = [self._cell(arm, self.low_fleet) for arm in arms]
        if missing := index.missing(cells, self.min_seeds):
            return _not_run(missing)
        seeds = index.seeds(cells)
        stats = {arm: self._collapses(index, self._cell(arm, self.low_fleet), seeds)[1:] for arm in arms}
        (kp, mp), (ks, ms) = stats["pg"], stats["sc_mis"]
        interval = kp > ks or mp < ms
        between = {arm: kp >= stats[arm][0] >= ks and mp <= stats[arm][1] <= ms for arm in SINGLE_CORRECTIONS}
        text = "; ".join(
            f"{arm} {stats[arm][0]}/{len(seeds)} collapsed, mean step {stats[arm][1]:.1f}"
            + ("" if arm in ("pg", "sc_mis") else (" (between)" if between[arm] else " (NOT between)"))
            for arm in arms
        )
        note = "" if interval else "; pg is no worse than sc_mis, so there is nothing in between"
        return ClaimResult(
            interval and all(between.values()),
            f"{self.low_fleet}/lag {self.lag} over seeds {seeds}: {text}{note}",
        )

    def c5(self, records: Sequence[RunRecord]) -> ClaimResult:
        index = _Index(records)
        both = sorted(
            {
                a
                for (a, f, g) in index.runs
                if g == self.lag
                and (a, HOMOGENEOUS, self.lag) in index.runs
                and (a, self.low_fleet, self.lag) in index.runs
            }
            | {"pg"},
            key=_arm_key,
        )
        missing = [
            m for a in both for m in index.missing([self._cell(a, f) for f in self.fleets], self.min_seeds)
        ]
        if missing:
            return _not_run(missing)
        ratios: list[float] = []
        low: list[str] = []
        for a in both:
            seeds = index.seeds([self._cell(a, HOMOGENEOUS), self._cell(a, self.low_fleet)])
            for s, h, m in zip(
                seeds,
                index.get(self._cell(a, HOMOGENEOUS), seeds),
                index.get(self._cell(a, self.low_fleet), seeds),
                strict=True,
            ):
                kh, km = on_policy_kl(h), on_policy_kl(m)
                ratio = km / kh if kh > 0 else (math.inf if km > 0 else math.nan)
                ratios.append(ratio)
                if not ratio > 1:
                    low.append(f"{a} seed {s}: {ratio:.3g}")
        return ClaimResult(
            not low,
            f"step-1 kl_k3 {self.low_fleet} / homogeneous over {len(ratios)} (arm, seed) pairs of "
            f"{', '.join(both)}: median {median(ratios):.3g}x, range {min(ratios):.3g}x..{max(ratios):.3g}x "
            f"(paper, run mean on real GPUs: 4.7x)" + (f"; not > 1: {', '.join(low)}" if low else ""),
        )

    def c6(self, records: Sequence[RunRecord]) -> ClaimResult:
        index = _Index(records)
        cells = [self._cell("sc_mis+topp", self.low_fleet), self._cell("pg", self.low_fleet)]
        missing = index.missing(cells, self.min_seeds) + index.missing(NULL_CELLS, self.min_seeds)
        if missing:
            return _not_run(missing)
        diff = paired_difference(records, "sc_mis+topp", "pg", self.low_fleet, self.lag)
        floor = null_noise_floor(records)
        passed = diff.mean > 0 and diff.mean > floor.max_abs_mean
        return ClaimResult(passed, f"final reward {diff.describe()}; {floor.describe()}")

    def c7(self, records: Sequence[RunRecord]) -> ClaimResult:
        index = _Index(records)
        cells = [self._cell("pg", self.low_fleet), self._cell("sc_mis", self.low_fleet)]
        if missing := index.missing(cells, self.min_seeds):
            return _not_run(missing)
        seeds = index.seeds(cells)
        growth: dict[str, list[float]] = {}
        for arm, c in zip(("pg", "sc_mis"), cells, strict=True):
            try:
                growth[arm] = [kl_growth(r.kls, r.lag) for r in index.get(c, seeds)]
            except ValueError as e:
                return _not_run([f"{cell_name(*c)}: {e}"])
        k = sum(p > s for p, s in zip(growth["pg"], growth["sc_mis"], strict=True))
        by_seed = ", ".join(
            f"{s}: {p:.2f}x vs {q:.2f}x"
            for s, p, q in zip(seeds, growth["pg"], growth["sc_mis"], strict=True)
        )
        return ClaimResult(
            _two_thirds(k, len(seeds)),
            f"{self.low_fleet}/lag {self.lag}: pg's kl_growth > sc_mis's in {k}/{len(seeds)} seeds (need 3k >= 2n); "
            f"median pg {median(growth['pg']):.2f}x, sc_mis {median(growth['sc_mis']):.2f}x; by seed: {by_seed}",
        )


def paper_claims(
    definition: CollapseDefinition, lag: int, min_seeds: int = MIN_SEEDS, low_fleet: str = MIXED
) -> list[Claim]:
    """method.md's ablation as claims C1..C7 on the runs at `lag` (the null-arm control at lag 0).
    Every cell a claim reads needs >= min_seeds seeds, and cells compared with each other are paired
    over the seeds they share (>= min_seeds too); otherwise the claim is not run. `low_fleet`: the
    fleet the claims call "the mixed fleet" and hold against the homogeneous one (default `mixed`;
    `rlfleet ablate --fleets homogeneous,nvfp4` compares the all-4-bit fleet)."""
    if min_seeds < 1:
        raise ValueError("min_seeds must be >= 1")
    if low_fleet == HOMOGENEOUS:
        raise ValueError(
            "the claims hold a low-precision fleet against the homogeneous one, not against itself"
        )
    claims = _PaperClaims(definition, lag, min_seeds, low_fleet)

    return [
        Claim(
            "C1",
            "Positive control: uncorrected pg on the mixed fleet collapses in at least 2/3 of seeds.",
            claims.c1,
        ),
        Claim(
            "C2",
            "pg on the homogeneous fleet collapses later than on the mixed fleet on average (mean collapse "
            "step, a seed that never collapses counted at steps + 1), or in fewer seeds.",
            claims.c2,
        ),
        Claim(
            "C3",
            "sc_mis and sc_mis+topp never collapse on either fleet (0 of N seeds in each of the four cells).",
            claims.c3,
        ),
        Claim(
            "C4",
            "Single corrections (mis, sc, pg+topp) on the mixed fleet are in between: each collapses in no "
            "more seeds than pg and no earlier on average (censored), and in no fewer seeds than sc_mis and no "
            "later on average; and pg is worse than sc_mis on at least one of the two (else nothing is in between).",
            claims.c4,
        ),
        Claim(
            "C5",
            "On-policy KL (step 1, before any staleness), mixed over homogeneous, is > 1 for every seed of "
            "every arm run on both fleets (reported: median and range; the paper's 4.7x is for reference).",
            claims.c5,
        ),
        Claim(
            "C6",
            "Final reward on the mixed fleet, sc_mis+topp minus pg paired by seed: the mean difference is "
            "> 0 and > the null-arm noise floor (the largest absolute mean paired difference among the null pairs).",
            claims.c6,
        ),
        Claim(
            "C7",
            "KL growth on the mixed fleet: pg's kl_growth exceeds sc_mis's in at least 2/3 of seeds "
            "(paired by seed).",
            claims.c7,
        ),
    ]


def evaluate_claims(claims: Sequence[Claim], records: Sequence[RunRecord]) -> list[tuple[Claim, ClaimResult]]:
    return [(c, c.evaluate(records)) for c in claims]


def _cell_text(text: str) -> str:
    return text.replace("|", "\\|")


def claims_table(results: Sequence[tuple[Claim, ClaimResult]]) -> str:
    """Markdown: claim id, statement, PASS / FAIL / not run, evidence."""
    lines = ["| claim | statement | result | evidence |", "|---|---|---|---|"]
    for claim, result in results:
        lines.append(
            f"| {claim.id} | {_cell_text(claim.text)} | {result.status} | {_cell_text(result.evidence)} |"
        )
    return "\n".join(lines)


def _arm_key(arm: str) -> tuple[int, str]:
    return (ARM_ORDER.index(arm) if arm in ARM_ORDER else len(ARM_ORDER), arm)


def _fleet_key(fleet: str) -> tuple[int, str]:
    return (FLEET_ORDER.index(fleet) if fleet in FLEET_ORDER else len(FLEET_ORDER), fleet)


def _growth_or_none(record: RunRecord) -> float | None:
    try:
        return kl_growth(record.kls, record.lag)
    except ValueError:
        return None


def _final_entropy(record: RunRecord) -> float | None:
    k = tail_steps(record.steps)
    values = [h.get("entropy") for h in record.history[-k:]]
    if any(not isinstance(v, (int, float)) for v in values):
        return None
    return math.fsum(values) / k  # type: ignore[arg-type]


def _median_text(values: Sequence[float | None], fmt: str) -> str:
    have = [v for v in values if v is not None]
    if not have:
        return "-"
    text = format(median(have), fmt)
    return text if len(have) == len(values) else f"{text} ({len(values) - len(have)} undefined)"


def summary_table(records: Sequence[RunRecord], definition: CollapseDefinition) -> str:
    """Markdown, one row per (arm, fleet, lag): seeds, collapsed k/n, locked in k/n (`lock_step`), mean
    collapse step (never = steps + 1),
    final reward mean ± sample std over seeds, and medians over seeds of kl_growth, on-policy (step-1)
    KL and final entropy (mean entropy of the last 10% of steps)."""
    index = _Index(records)
    lines = [
        "| arm | fleet | lag | seeds | collapsed | locked in | mean collapse step (censored) | final reward (mean ± std) "
        "| kl_growth (median) | on-policy KL (median) | final entropy (median) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, fleet, lag in sorted(index.runs, key=lambda c: (c[2], _fleet_key(c[1]), _arm_key(c[0]))):
        runs = index.get((arm, fleet, lag), sorted(index.runs[(arm, fleet, lag)]))
        n = len(runs)
        collapsed = sum(definition.step(r.rewards) is not None for r in runs)
        locked = sum(lock_step(r.uniform_fractions) is not None for r in runs)
        censored = _mean([censored_collapse_step(r, definition) for r in runs])
        finals = [record_final_reward(r) for r in runs]
        mean = _mean(finals)
        std = math.sqrt(math.fsum((f - mean) ** 2 for f in finals) / (n - 1)) if n > 1 else math.nan
        lines.append(
            f"| {arm} | {fleet} | {lag} | {n} | {collapsed}/{n} | {locked}/{n} | {censored:.1f} | {mean:.3f} ± {std:.3f} | "
            f"{_median_text([_growth_or_none(r) for r in runs], '.2f')} | {median(on_policy_kl(r) for r in runs):.3g} | "
            f"{_median_text([_final_entropy(r) for r in runs], '.3f')} |"
        )
    return "\n".join(lines)


def is_stable_run(record: RunRecord) -> bool:
    """A run the collapse detector should stay quiet on: an arm the paper finds stable (`STABLE_ARMS`),
    or a null-arm cell (homogeneous fleet, lag 0: no mismatch for a correction to matter)."""
    return record.arm in STABLE_ARMS or (
        record.fleet == NULL_FLEET and record.lag == NULL_LAG and record.arm in NULL_ARMS
    )


@dataclass(frozen=True)
class DetectorAlerts:
    """What the collapse detector said about one run: its first alert's step (None: it never fired) and
    every signal it raised over the run."""

    first_alert_step: int | None
    signals: tuple[str, ...]


@dataclass(frozen=True)
class DetectorScore:
    """The collapse detector against the pre-registered definition, run by run. Each run is in exactly
    one row, taken in this order: `collapsed` (by the definition; `collapsed_ahead`: the detector fired
    at or before the collapse step), `locked` (not collapsed, `lock_step` set: learning stopped for good,
    which the detector may rightly report), `stable` (neither, and `is_stable_run`: every alert is a
    false alarm), `other` (the rest: pg and the single corrections, whose deep dips are not collapses by
    the definition but are what the detector exists to flag). `*_fired`: how many of the row fired;
    `false_alarm_signals`: signal -> stable runs that raised it."""

    collapsed: int
    collapsed_ahead: int
    collapsed_fired: int
    locked: int
    locked_fired: int
    stable: int
    stable_fired: int
    other: int
    other_fired: int
    false_alarm_signals: dict[str, int]


def score_detector(
    records: Sequence[RunRecord], alerts: Sequence[DetectorAlerts], definition: CollapseDefinition
) -> DetectorScore:
    if len(records) != len(alerts):
        raise ValueError(f"{len(records)} runs but {len(alerts)} detector results")
    n = dict.fromkeys(
        (
            "collapsed",
            "collapsed_ahead",
            "collapsed_fired",
            "locked",
            "locked_fired",
            "stable",
            "stable_fired",
            "other",
            "other_fired",
        ),
        0,
    )
    signals: dict[str, int] = {}
    for record, alert in zip(records, alerts, strict=True):
        fired = alert.first_alert_step is not None
        collapsed_at = definition.step(record.rewards)
        if collapsed_at is not None:
            row = "collapsed"
            n["collapsed_ahead"] += (
                alert.first_alert_step is not None and alert.first_alert_step <= collapsed_at
            )
        elif lock_step(record.uniform_fractions) is not None:
            row = "locked"
        elif is_stable_run(record):
            row = "stable"
            for sig in alert.signals:
                signals[sig] = signals.get(sig, 0) + 1
        else:
            row = "other"
        n[row] += 1
        n[row + "_fired"] += fired
    return DetectorScore(
        **n, false_alarm_signals=dict(sorted(signals.items(), key=lambda kv: (-kv[1], kv[0])))
    )


def detector_table(score: DetectorScore) -> str:
    s = score
    by_signal = ", ".join(f"{k} {v}" for k, v in s.false_alarm_signals.items()) or "none"
    return (
        "| runs | detector fired |\n|---|---|\n"
        f"| collapsed by the definition: {s.collapsed} | {s.collapsed_fired} "
        f"({s.collapsed_ahead} at or before the collapse step) |\n"
        f"| locked in, not collapsed: {s.locked} | {s.locked_fired} |\n"
        f"| stable arms (sc_mis, sc_mis+topp) and null cells, neither: {s.stable} | {s.stable_fired} "
        "(false alarms) |\n"
        f"| other arms, neither: {s.other} | {s.other_fired} |\n\n"
        f"Signals in the false alarms (runs): {by_signal}."
    )
