"""Research script: the collapse detector's hits and false alarms on recorded ablation runs.

`rlfleet ablate --out DIR` writes DIR/ablation.json: every run's per-step metrics (the training loop's
history, exactly the dicts the loop fed to the detector) and the alerts the detector of that commit
raised live. This script scores both against the pre-registered collapse definition
(`experiments/claims.py` `score_detector`, the table `rlfleet ablate` prints):

- baseline: the alerts recorded when the runs were made (the detector of the commit that made them);
- current: the same histories replayed through this commit's `CollapseDetector` with a default
  RLJob's thresholds (`CollapseThresholds.from_safety(SafetySpec())`, what `rlfleet ablate` and a
  default local or cluster run use).

Training does not depend on the detector (`safety.action: alert`), so a replay is what a fresh run
with this commit's detector would report, at no training cost.

    .venv/bin/python experiments/detector.py /tmp/abl_warm/ablation.json /tmp/ablfull3/ablation.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlfleet.api.rljob import SafetySpec
from rlfleet.trainer.collapse import CollapseDetector, CollapseThresholds
from rlfleet_experiments.ablation import TASK_CHANCE
from rlfleet_experiments.claims import (
    CollapseDefinition,
    DetectorAlerts,
    DetectorScore,
    RunRecord,
    score_detector,
)


def replay(history: list[dict[str, float]], thresholds: CollapseThresholds) -> DetectorAlerts:
    detector = CollapseDetector(thresholds)
    for metrics in history:
        detector.observe(int(metrics["step"]), metrics)
    return DetectorAlerts(detector.first_alert_step, tuple(detector.signals_raised))


def recorded(run: dict) -> DetectorAlerts:
    """The alerts a run of `ablation.json` recorded live (`ArmResult.first_alert_step`, `alert_signals`)."""
    return DetectorAlerts(run["first_alert_step"], tuple(run["alert_signals"]))


def line(name: str, s: DetectorScore) -> str:
    signals = ", ".join(f"{k} {v}" for k, v in s.false_alarm_signals.items()) or "none"
    return (
        f"| {name} | {s.collapsed_fired}/{s.collapsed} ({s.collapsed_ahead} ahead) | {s.locked_fired}/{s.locked} "
        f"| {s.stable_fired}/{s.stable} | {s.other_fired}/{s.other} | {signals} |"
    )


def total(scores: list[DetectorScore]) -> DetectorScore:
    signals: dict[str, int] = {}
    for s in scores:
        for k, v in s.false_alarm_signals.items():
            signals[k] = signals.get(k, 0) + v
    fields = [f for f in DetectorScore.__dataclass_fields__ if f != "false_alarm_signals"]
    return DetectorScore(
        **{f: sum(getattr(s, f) for s in scores) for f in fields},
        false_alarm_signals=dict(sorted(signals.items(), key=lambda kv: (-kv[1], kv[0]))),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="ablation.json files written by rlfleet ablate --out")
    args = ap.parse_args()
    thresholds = CollapseThresholds.from_safety(SafetySpec())
    rows: dict[str, list[tuple[str, DetectorScore]]] = {"baseline": [], "current": []}
    for path in args.runs:
        data = json.loads(path.read_text())
        cfg = data["config"]
        definition = CollapseDefinition(chance=TASK_CHANCE[cfg["task"]])
        runs = data["runs"]
        records = [RunRecord(r["arm"], r["fleet"], r["seed"], r["lag"], r["history"]) for r in runs]
        replayed = [replay(r["history"], thresholds) for r in runs]
        name = f"{path.parent.name}: {cfg['task']}, lag {cfg['lag']}, {cfg['steps']} steps" + (
            f", warm start {cfg['warm_start']}" if cfg.get("warm_start") else ""
        )
        rows["baseline"].append((name, score_detector(records, [recorded(r) for r in runs], definition)))
        rows["current"].append((name, score_detector(records, replayed, definition)))
    for which, scored in rows.items():
        print(
            f"\n{which}: "
            + (
                "alerts recorded when the runs were made"
                if which == "baseline"
                else "histories replayed through this commit's detector (default RLJob thresholds)"
            )
        )
        print(
            "\n| runs | collapsed: fired | locked in: fired | stable: fired (false alarms) | other: fired "
            "| signals in the false alarms |\n|---|---|---|---|---|---|"
        )
        for name, score in scored:
            print(line(name, score))
        print(line("**all**", total([s for _, s in scored])))


if __name__ == "__main__":
    main()
