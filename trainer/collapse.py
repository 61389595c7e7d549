"""Collapse detector: watches method.md's precursors in the per-step metrics and decides an action.

Signals (compared with running baselines the detector keeps itself; after warmup a step that raises a
signal does not update that signal's baseline, so a surge cannot hide itself):
1. `reward_cliff`: the mean reward of the last `window` steps falls below its running peak by more than
   max(cliff_abs, cliff_rel * |peak|) (with the defaults: to half the peak, as docs/ablation.md's collapse
   definition). A window, not one step: one step's reward is a few prompts, and a batch of hard prompts
   is not a cliff (docs/ablation.md, "Collapse detector calibration"). A sudden cliff is seen once it
   fills about half the window.
2. `kl_surge` (fleet and per group): kl_k3 > kl_ratio x baseline AND oor_fraction > oor_ratio x
   baseline (method.md: "> 3x its running baseline (and oor_fraction > 10x)"). While the samples'
   `staleness_max` reaches a new high (the first `lag` steps of a run fill the pipeline) the baseline is
   that step's value and nothing is raised: staleness is most of the mismatch, so the baseline is the
   mismatch at the staleness the run settles at.
3. `tool_calls_stop`: no-tool-call terminations or empty final replies exceed an absolute rate and
   3x their baseline (trajectory length is deliberately NOT a signal).
4. `entropy_collapse`: entropy of p below an absolute floor.
5. `grad_norm_spike`: grad_norm > grad_ratio x baseline (plain GRPO spiked 20x). A step that trains
   nothing (every prompt group scored alike, `uniform_group_fraction` 1, so the gradient is 0) is not
   a gradient-norm observation: it neither raises the signal nor pulls the baseline toward 0.
6. `rho_blowup`: sc_tail_ratio above rho_max (reference run: 1.2 -> 52 before collapse).
7. `format_errors_repeat`: the share of episodes with a malformed turn (`format_error_rate`) exceeds
   an absolute rate and 3x its baseline, by signal 3's rule. Its own signal, not part of 3: the
   reference collapse stopped calling tools with empty replies (only 6% of its failed replies were
   malformed), so a policy that keeps calling but garbles its calls is another failure, and its healthy
   level sits far below 3's threshold of 0.5 (format_abs: measured in docs/ablation.md, "Agentic
   precursors"). Fleet-wide only: a group serves a few episodes a step, too few for a rate.
8. `invalid_tokens` (per group): the share of a group's sampled tokens the trainer could not train on
   (1 - its `trained_fraction`: answers failing validation, NaN / positive / out-of-support logprobs and
   the like) above `invalid_max`. Absolute, no baseline: a healthy engine answers none, and the objective
   never sees the dropped tokens, so no other signal moves (issue 39: training stayed safe in 8 garbage
   modes while the group's GPUs made nothing).
A signal must hold `patience` consecutive steps, and nothing fires during `warmup_steps`.

Actions (RLJob `safety.action`): `alert` (report only), `quarantine-group` (per-group signals
quarantine that group: the router sends it no new sessions; a fleet-wide KL surge quarantines the
groups whose share of out-of-range tokens exceeds `oor_share_factor` x their token share), `pause`
(training stops stepping; the run reports why). Metrics are the flat dict of `rlfleet.trainer.metrics`
(`kl_k3`, `group/<name>/kl_k3`, ...).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from rlfleet.records import INVALID_METRIC_PREFIX

ACTIONS = ("alert", "quarantine-group", "pause")


@dataclass
class CollapseThresholds:
    warmup_steps: int = 5
    window: int = 10  # steps in the reward window (RLJob safety.windowSteps)
    patience: int = 2
    ema_decay: float = 0.8
    cliff_abs: float = 0.25
    cliff_rel: float = 0.5
    kl_ratio: float = 3.0
    oor_ratio: float = 10.0
    oor_floor: float = 5e-3  # baseline OOR is at least this (a 0 baseline would make any OOR "10x")
    kl_floor: float = 1e-4
    rate_abs: float = 0.5  # empty-reply / no-tool-call rate that counts as "tool calls stopped"
    rate_ratio: float = 3.0  # ... and this x its baseline (+0.05): signals 3 and 7
    format_abs: float = 0.2  # format-error rate that counts as repeated format errors (measured)
    entropy_min: float = 0.02  # nats
    grad_ratio: float = 10.0
    rho_max: float = 5.0
    oor_share_factor: float = 2.0  # quarantine picks groups whose OOR share > this x their token share
    invalid_max: float = 0.05  # a group's share of sampled tokens not trained on (invalid answers): signal 8

    @classmethod
    def from_safety(cls, safety: Any) -> CollapseThresholds:
        """From the RLJob `safety` block (rlfleet.api SafetySpec): klSurgeFactor -> kl_ratio,
        scTailRatioMax -> rho_max, windowSteps -> the reward window and the EMA window (decay
        1 - 2 / (window + 1))."""
        return cls(
            window=int(safety.window_steps),
            kl_ratio=float(safety.kl_surge_factor),
            rho_max=float(safety.sc_tail_ratio_max),
            ema_decay=1.0 - 2.0 / (int(safety.window_steps) + 1),
            oor_share_factor=float(safety.oor_share_factor),
        )


@dataclass
class Alert:
    step: int
    signal: str
    value: float
    baseline: float
    group: str | None = None  # set for per-group signals
    message: str = ""


@dataclass
class Decision:
    alerts: list[Alert] = field(default_factory=list)
    quarantine: list[str] = field(default_factory=list)
    pause: bool = False

    @property
    def fired(self) -> bool:
        return bool(self.alerts)


def _finite(metrics: dict[str, float], key: str) -> float | None:
    """The metric as a float, or None when it is absent or not finite (a missing signal skips its check)."""
    v = metrics.get(key)
    return float(v) if v is not None and math.isfinite(float(v)) else None


class CollapseDetector:
    def __init__(self, thresholds: CollapseThresholds | None = None, action: str = "alert") -> None:
        if action not in ACTIONS:
            raise ValueError(f"unknown safety action {action!r} (use one of {ACTIONS})")
        self.t = thresholds or CollapseThresholds()
        self.action = action
        self.steps_seen = 0
        self.baselines: dict[str, float] = {}
        self.streaks: dict[str, int] = {}
        self.history: list[Alert] = []
        self.quarantined: set[str] = set()
        self.rewards: list[float] = []  # reward_mean of the last `window` steps
        self.reward_peak: float | None = None  # running peak of their mean
        self.staleness_high: float | None = None  # the highest staleness_max seen

    # -- state (checkpointed with the run) --
    def state_dict(self) -> dict[str, Any]:
        return {
            "steps_seen": self.steps_seen,
            "baselines": dict(self.baselines),
            "streaks": dict(self.streaks),
            "history": [asdict(a) for a in self.history],
            "quarantined": sorted(self.quarantined),
            "rewards": list(self.rewards),
            "reward_peak": self.reward_peak,
            "staleness_high": self.staleness_high,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps_seen = int(state["steps_seen"])
        self.baselines = dict(state["baselines"])
        self.streaks = dict(state["streaks"])
        self.history = [Alert(**a) for a in state["history"]]
        self.quarantined = set(state["quarantined"])
        # a checkpoint written before the reward window and the staleness ramp existed restarts them
        self.rewards = [float(r) for r in state.get("rewards", [])]
        self.reward_peak = state.get("reward_peak")
        self.staleness_high = state.get("staleness_high")

    # -- helpers --
    def _warming(self) -> bool:
        """During warmup baselines always learn (nothing fires yet; early steps are not representative)."""
        return self.steps_seen <= self.t.warmup_steps

    def _ema(self, key: str, value: float) -> None:
        if not math.isfinite(value):
            return
        old = self.baselines.get(key)
        self.baselines[key] = (
            value if old is None else self.t.ema_decay * old + (1 - self.t.ema_decay) * value
        )

    def _check(self, key: str, raised: bool) -> bool:
        """Count consecutive raised steps; True once the streak reaches `patience` (after warmup)."""
        self.streaks[key] = self.streaks.get(key, 0) + 1 if raised else 0
        return self.steps_seen > self.t.warmup_steps and self.streaks[key] >= self.t.patience

    def observe(self, step: int, metrics: dict[str, float]) -> Decision:
        """Feed one step's flat metrics; returns the alerts that fired this step and the action."""
        self.steps_seen += 1
        alerts: list[Alert] = []
        alerts += self._reward_cliff(step, metrics)
        alerts += self._kl_surges(step, metrics)
        alerts += self._tool_call_rates(step, metrics)
        alerts += self._entropy_collapse(step, metrics)
        alerts += self._grad_norm_spike(step, metrics)
        alerts += self._rho_blowup(step, metrics)
        alerts += self._format_errors(step, metrics)
        alerts += self._invalid_tokens(step, metrics)
        return self._decide(alerts, metrics)

    # -- the eight signals, in the order observe checks them --
    def _reward_cliff(self, step: int, metrics: dict[str, float]) -> list[Alert]:
        """1. reward cliff: the window's mean reward against its running peak."""
        t = self.t
        reward = _finite(metrics, "reward_mean")
        if reward is None:
            return []
        self.rewards = (self.rewards + [reward])[-t.window :]
        if len(self.rewards) < t.window:
            return []
        alerts: list[Alert] = []
        mean = sum(self.rewards) / t.window
        peak = self.reward_peak
        raised = peak is not None and (peak - mean) > max(t.cliff_abs, t.cliff_rel * abs(peak))
        if self._check("reward_cliff", raised):
            alerts.append(
                Alert(
                    step,
                    "reward_cliff",
                    mean,
                    peak or 0.0,
                    message=f"mean reward of the last {t.window} steps {mean:.3f} fell "
                    f"below its peak {peak:.3f}",
                )
            )
        self.reward_peak = mean if peak is None else max(peak, mean)
        return alerts

    def _staleness_ramped(self, metrics: dict[str, float]) -> bool:
        """True when staleness_max reached a new high this step (and record it)."""
        staleness = _finite(metrics, "staleness_max")
        ramp = staleness is not None and (self.staleness_high is None or staleness > self.staleness_high)
        if ramp:
            self.staleness_high = staleness
        return ramp

    def _kl_surges(self, step: int, metrics: dict[str, float]) -> list[Alert]:
        """2. KL surge with OOR surge, fleet-wide and per group."""
        ramp = self._staleness_ramped(metrics)
        prefixes = [""] + sorted({k.split("/")[1] for k in metrics if k.startswith("group/")})
        alerts: list[Alert] = []
        for g in prefixes:
            alerts += self._kl_surge(step, metrics, g, ramp)
        return alerts

    def _kl_surge(self, step: int, metrics: dict[str, float], g: str, ramp: bool) -> list[Alert]:
        """One group's (or, for g == "", the fleet's) KL-with-OOR surge check and baseline update."""
        t = self.t
        pre = f"group/{g}/" if g else ""
        kl, oor = _finite(metrics, pre + "kl_k3"), _finite(metrics, pre + "oor_fraction")
        if kl is None or oor is None:
            return []
        alerts: list[Alert] = []
        kl_base = self.baselines.get(pre + "kl_k3")
        oor_base = self.baselines.get(pre + "oor_fraction")
        raised = (
            not ramp
            and kl_base is not None
            and oor_base is not None
            and kl > t.kl_ratio * max(kl_base, t.kl_floor)
            and oor > t.oor_ratio * max(oor_base, t.oor_floor)
        )
        if self._check(pre + "kl_surge", raised):
            alerts.append(
                Alert(
                    step,
                    "kl_surge",
                    kl,
                    kl_base or 0.0,
                    group=g or None,
                    message=f"{'group ' + g if g else 'fleet'} KL {kl:.4g} > {t.kl_ratio}x "
                    f"baseline {kl_base:.4g} with OOR {oor:.3g} > {t.oor_ratio}x {oor_base:.3g}",
                )
            )
        if ramp:  # the samples just got older: the baseline is this step's mismatch
            self.baselines[pre + "kl_k3"], self.baselines[pre + "oor_fraction"] = kl, oor
        elif not raised or self._warming():
            self._ema(pre + "kl_k3", kl)
            self._ema(pre + "oor_fraction", oor)
        return alerts

    def _rate_surge(
        self, step: int, metrics: dict[str, float], key: str, signal: str, rate_abs: float
    ) -> list[Alert]:
        """A share of episodes (`key`) above `rate_abs` and rate_ratio x its baseline + 0.05 (the 0.05 so
        that a baseline of 0 does not make every small rate a surge); signals 3 and 7."""
        t = self.t
        rate = _finite(metrics, key)
        if rate is None:
            return []
        alerts: list[Alert] = []
        base = self.baselines.get(key)
        raised = base is not None and rate > rate_abs and rate > t.rate_ratio * base + 0.05
        if self._check(key, raised):
            alerts.append(
                Alert(step, signal, rate, base or 0.0, message=f"{key} {rate:.2f} (baseline {base:.2f})")
            )
        if not raised or self._warming():
            self._ema(key, rate)
        return alerts

    def _tool_call_rates(self, step: int, metrics: dict[str, float]) -> list[Alert]:
        """3. tool calls stop / empty replies."""
        alerts: list[Alert] = []
        for key in ("no_tool_call_rate", "empty_reply_rate"):
            alerts += self._rate_surge(step, metrics, key, "tool_calls_stop", self.t.rate_abs)
        return alerts

    def _entropy_collapse(self, step: int, metrics: dict[str, float]) -> list[Alert]:
        """4. entropy collapse."""
        t = self.t
        ent = _finite(metrics, "entropy")
        if ent is not None and self._check("entropy_collapse", ent < t.entropy_min):
            return [Alert(step, "entropy_collapse", ent, t.entropy_min, message=f"entropy {ent:.4f} nats")]
        return []

    def _grad_norm_spike(self, step: int, metrics: dict[str, float]) -> list[Alert]:
        """5. grad-norm spike, on the steps that trained something."""
        t = self.t
        gn = _finite(metrics, "grad_norm")
        if gn is None or gn <= 0 or _finite(metrics, "uniform_group_fraction") == 1.0:
            return []
        alerts: list[Alert] = []
        base = self.baselines.get("grad_norm")
        raised = base is not None and base > 0 and gn > t.grad_ratio * base
        if self._check("grad_norm_spike", raised):
            alerts.append(
                Alert(
                    step,
                    "grad_norm_spike",
                    gn,
                    base or 0.0,
                    message=f"grad norm {gn:.3g} > {t.grad_ratio}x baseline {base:.3g}",
                )
            )
        if not raised or self._warming():
            self._ema("grad_norm", gn)
        return alerts

    def _rho_blowup(self, step: int, metrics: dict[str, float]) -> list[Alert]:
        """6. rho blow-up."""
        t = self.t
        rho = _finite(metrics, "sc_tail_ratio")
        if rho is not None and self._check("rho_blowup", rho > t.rho_max):
            return [
                Alert(step, "rho_blowup", rho, t.rho_max, message=f"sc_tail_ratio {rho:.3g} > {t.rho_max}")
            ]
        return []

    def _format_errors(self, step: int, metrics: dict[str, float]) -> list[Alert]:
        """7. format errors repeat: malformed turns in more episodes than the run's baseline."""
        return self._rate_surge(step, metrics, "format_error_rate", "format_errors_repeat", self.t.format_abs)

    def _invalid_tokens(self, step: int, metrics: dict[str, float]) -> list[Alert]:
        """8. invalid tokens, per group that sampled tokens this step (its `trained_fraction`)."""
        alerts: list[Alert] = []
        groups = sorted(
            {k.split("/")[1] for k in metrics if k.startswith("group/") and k.endswith("/trained_fraction")}
        )
        for g in groups:
            trained = _finite(metrics, f"group/{g}/trained_fraction")
            invalid = 1.0 - trained if trained is not None else 0.0
            if self._check(f"group/{g}/invalid_tokens", invalid > self.t.invalid_max):
                prefix = f"group/{g}/{INVALID_METRIC_PREFIX}"
                reasons = sorted((k[len(prefix) :], v) for k, v in metrics.items() if k.startswith(prefix))
                top = max(reasons, key=lambda kv: kv[1], default=None)
                alerts.append(
                    Alert(
                        step,
                        "invalid_tokens",
                        invalid,
                        self.t.invalid_max,
                        group=g,
                        message=f"group {g}: {invalid:.1%} of its sampled tokens not trained on (invalid)"
                        + (f", top reason {top[0]}: {top[1]:g} tokens" if top else ""),
                    )
                )
        return alerts

    # -- the action --
    def _decide(self, alerts: list[Alert], metrics: dict[str, float]) -> Decision:
        """Record this step's alerts and turn them into the configured action."""
        decision = Decision(alerts=alerts)
        if not alerts:
            return decision
        self.history.extend(alerts)
        if self.action == "pause":
            decision.pause = True
        elif self.action == "quarantine-group":
            groups = sorted(self._culprit_groups(alerts, metrics) - self.quarantined)
            decision.quarantine = groups
            self.quarantined.update(groups)
        return decision

    def _culprit_groups(self, alerts: list[Alert], metrics: dict[str, float]) -> set[str]:
        """The groups to quarantine: those named by a per-group alert and, on a fleet-wide KL surge,
        the groups over-represented among out-of-range tokens."""
        culprits = {a.group for a in alerts if a.group}
        if any(a.signal == "kl_surge" and a.group is None for a in alerts):
            culprits |= {
                k.split("/")[1]
                for k in metrics
                if k.startswith("group/")
                and k.endswith("/oor_share")
                and metrics[k]
                > self.t.oor_share_factor * metrics.get(k.replace("/oor_share", "/token_share"), 1.0)
            }
        return culprits

    @property
    def first_alert_step(self) -> int | None:
        return self.history[0].step if self.history else None

    @property
    def signals_raised(self) -> list[str]:
        """Every signal that fired over the run, sorted."""
        return sorted({a.signal for a in self.history})
