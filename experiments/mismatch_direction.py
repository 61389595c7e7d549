"""Research script: the direction of the sampler/trainer mismatch, low precision against staleness.

Why (docs/ablation.md, "Fifth search"): uncorrected pg's expected logit update at a context whose
mean advantage is A carries a drift term lr * A * (q - p) (docs/objective.md). Staleness gives
q - p = p(t - L) - p(t), minus the direction training just moved, so the drift repeats the last
updates at every step. Whether low precision can drive the same drift depends on whether its
q - p has a direction that lasts across steps, or changes from version to version. This script
measures that on a real trajectory, instead of assuming it.

How: one trajectory of on-policy pg (homogeneous fleet, lag 0; `rlfleet ablate`'s `train_arm`) from
the ablation's warm start keeps every version. A fixed probe set (the first step's episodes, sampled
by the homogeneous fleet at version 0 through the ablation's `LockstepRollouts`) is scored at every
version t by the trainer (transformers' Qwen3, fp32) and by each sampler group of the mixed fleet
(the reference engine's Qwen3 on the group's published view (`view_weights`), its kernel, its KV cache dtype). At
every sampled position the difference d(t) = q(t) - p(t) over the vocabulary; for staleness L the
q is the trainer's own p(t - L). Printed per source:

- kl: mean over probe positions of KL(q || p) (nats); tv: mean total variation 0.5 * |q - p|_1;
- cos k: mean cosine between d(t) and d(t + k) (the whole probe set as one vector): does the error
  keep its direction k steps on;
- coherence W: |sum of d over W consecutive steps| / (sum of |d|), mean over windows: 1 when the
  drift adds up in one direction, about 1/sqrt(W) when its direction is random;
- along stale: mean cosine between d(t) and p(t - 8) - p(t), the direction staleness pulls (1 for
  stale 8 by construction).
- for the quantised formats, in weight space: the cosine between the projections' rounding error
  (precision view - weight) at versions t and t + k.

    .venv/bin/python experiments/mismatch_direction.py --seeds 2 --steps 100
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from rlfleet.local.emulated import SnapshotSink
from rlfleet.numerics.engine_model import is_quantizable
from rlfleet.numerics.views import view_weights
from rlfleet.sampler.reference_engine import ENGINE_KV
from rlfleet_experiments.ablation import (
    FLEETS,
    AblationConfig,
    LockstepRollouts,
    fleet_samplers,
    parse_seeds,
    run_config,
    start_checkpoint,
    train_arm,
)

STALE_REFERENCE = 8  # the staleness whose direction "along stale" compares with


class KeepingSink(SnapshotSink):
    """A SnapshotSink that also keeps every published version (the rollouts drop old snapshots)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: dict[int, dict[str, torch.Tensor]] = {}

    def publish(self, weights: dict, version: int, *, step: int) -> None:
        super().publish(weights, version, step=step)
        self.kept[version] = weights


def probe_set(
    cfg: AblationConfig, start: Path, version0: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, np.ndarray]:
    """The first step's episodes at version 0: ids [B, S] (right-padded with 0) and the (row, column)
    of every position whose logits predicted a sampled token [N, 2]."""
    sink = SnapshotSink()
    sink.publish(version0, 0, step=0)
    rollouts = LockstepRollouts(
        cfg,
        run_config("pg", "homogeneous", cfg),
        sink,  # pg's samples
        fleet_samplers("homogeneous", cfg, start),
    )
    episodes = [r for g in rollouts.take(cfg.prompts, timeout=0) for r in g.rollouts]
    width = max(len(r.token_ids()) for r in episodes)
    ids = torch.zeros(len(episodes), width, dtype=torch.long)
    where = []
    for b, r in enumerate(episodes):
        tokens = r.token_ids()
        ids[b, : len(tokens)] = torch.from_numpy(tokens)
        where += [(b, i - 1) for i in np.flatnonzero(r.loss_mask())]  # logits at i-1 predict token i
    return ids, np.asarray(where)


@torch.no_grad()
def trainer_probs(
    model: torch.nn.Module, weights: dict, ids: torch.Tensor, where: np.ndarray
) -> torch.Tensor:
    loaded = model.load_state_dict(weights, strict=False)  # a tied lm_head is stored once
    if loaded.unexpected_keys or set(loaded.missing_keys) - {"lm_head.weight"}:
        raise ValueError(f"weights do not fit the trainer's model: {loaded}")
    logits = model(input_ids=ids).logits.float()
    return torch.softmax(logits[where[:, 0], where[:, 1]], dim=-1)


@torch.no_grad()
def sampler_probs(sampler: object, view: dict, ids: torch.Tensor, where: np.ndarray) -> torch.Tensor:
    """The group's engine on its precision view, prefilled through its KV cache (so an fp8 cache
    rounds K and V as it does when sampling)."""
    model = sampler.model  # type: ignore[attr-defined]
    model.load_weights(view)
    kv_dtype = sampler.engine.config.kv_cache_dtype  # type: ignore[attr-defined]
    cache = model.new_cache(ids.shape[0], capacity=ids.shape[1], kv_dtype=kv_dtype)
    logits = model(ids, cache, rows=torch.arange(ids.shape[0]))
    return torch.softmax(logits[where[:, 0], where[:, 1]].float(), dim=-1)


def kl(q: torch.Tensor, p: torch.Tensor) -> float:
    return float((q * (q.clamp_min(1e-30).log() - p.clamp_min(1e-30).log())).sum(-1).mean())


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.flatten() @ b.flatten()) / (a.norm() * b.norm()).clamp_min(1e-30))


def rounding_error_cosine(weights: list[dict], views: list[dict], k: int) -> float:
    """Mean over t of the cosine between the projection weights' rounding error (view - weight) at
    version t and at t + k: does the weights' quantisation error keep its direction as they train."""
    errors = [
        torch.cat([(view[n] - w[n]).flatten() for n in sorted(w) if is_quantizable(n, w[n])])
        for w, view in zip(weights, views, strict=True)
    ]
    return float(np.mean([cosine(errors[t], errors[t + k]) for t in range(len(errors) - k)]))


def measure(
    cfg: AblationConfig, lags: list[int], gaps: list[int], windows: list[int]
) -> dict[str, dict] | None:
    from rlfleet.trainer.backends.backend_hf import HFBackend
    from rlfleet.trainer.objective import ObjectiveConfig

    start = start_checkpoint(replace(cfg, lag=0))
    sink = KeepingSink()
    t0 = time.monotonic()
    train_arm("pg", "homogeneous", replace(cfg, lag=0), start, sink=sink)
    print(
        f"seed {cfg.seed}: {cfg.steps} steps of pg (homogeneous, lag 0) in {time.monotonic() - t0:.0f} s",
        flush=True,
    )
    versions = [sink.kept[v] for v in sorted(sink.kept)]
    ids, where = probe_set(cfg, start, versions[0])
    trainer = HFBackend.from_pretrained(start, ObjectiveConfig(mode="pg")).model.eval()
    p = [trainer_probs(trainer, w, ids, where) for w in versions]
    if all(torch.equal(x, p[0]) for x in p):  # every group scores alike from the start: no gradient
        print(
            f"seed {cfg.seed}: the policy never moves (locked in from the warm start): left out", flush=True
        )
        return None

    d: dict[str, list[torch.Tensor | None]] = {}
    weight_cos: dict[str, dict[int, float]] = {}
    samplers = {**fleet_samplers("homogeneous", cfg, start), **fleet_samplers("mixed", cfg, start)}
    views_of: dict[str, list[dict]] = {}  # weight format -> its view of every version (bf16 serves 3 groups)
    for name, accelerator, fmt, kv in [FLEETS["homogeneous"][0]] + FLEETS["mixed"]:
        sampler = samplers[name]
        if fmt not in views_of:
            views_of[fmt] = [view_weights(w, fmt) for w in versions]
        views = views_of[fmt]
        label = f"{fmt} {accelerator}" + (f" kv {kv}" if ENGINE_KV[kv] not in ("auto", "bf16") else "")
        d[label] = [sampler_probs(sampler, view, ids, where) - p[t] for t, view in enumerate(views)]
        if fmt in ("fp8", "nvfp4"):
            weight_cos[label] = {k: rounding_error_cosine(versions, views, k) for k in gaps}
    for lag in lags:
        d[f"stale {lag}"] = [p[t - lag] - p[t] if t >= lag else None for t in range(len(p))]

    out: dict[str, dict] = {}
    for label, all_diffs in d.items():
        # the versions this row has a difference for (a stale row has none before its lag)
        diffs = {t: x for t, x in enumerate(all_diffs) if x is not None and t >= STALE_REFERENCE}
        ts = sorted(diffs)
        row: dict[str, float] = {
            "kl": float(np.mean([kl(diffs[t] + p[t], p[t]) for t in ts])),
            "tv": float(np.mean([0.5 * float(diffs[t].abs().sum(-1).mean()) for t in ts])),
            "along stale": float(np.mean([cosine(diffs[t], p[t - STALE_REFERENCE] - p[t]) for t in ts])),
        }
        for k in gaps:
            row[f"cos {k}"] = float(np.mean([cosine(diffs[t], diffs[t + k]) for t in ts if t + k in diffs]))
        for w in windows:
            chunks = [ts[i : i + w] for i in range(0, len(ts) - w + 1, w)]
            row[f"coherence {w}"] = (
                float(
                    np.mean(
                        [
                            float(torch.stack([diffs[t] for t in c]).sum(0).norm())
                            / sum(float(diffs[t].norm()) for t in c)
                            for c in chunks
                        ]
                    )
                )
                if chunks
                else float("nan")
            )
        out[label] = {"row": row, "weight_cos": weight_cos.get(label, {})}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1", help="N: seeds 0..N-1, or a comma list (as rlfleet ablate)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--task", default="retry_digit")
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--warm-start", type=int, default=150)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--logit-std", type=float, default=2.0, help="std of the untrained model's logits")
    parser.add_argument("--lags", default="1,4,8,16")
    parser.add_argument("--gaps", default="1,10,50", help="k of 'cos k', in logit and in weight space")
    parser.add_argument("--windows", default="10,50")
    args = parser.parse_args()
    torch.set_num_threads(2)
    lags, gaps, windows = ([int(x) for x in s.split(",")] for s in (args.lags, args.gaps, args.windows))
    per_seed = []
    for seed in parse_seeds(args.seeds):
        cfg = AblationConfig(
            task=args.task,
            max_new_tokens=args.max_new_tokens,
            warm_start=args.warm_start,
            learning_rate=args.lr,
            logit_std=args.logit_std,
            steps=args.steps,
            seed=seed,
        )
        measured = measure(cfg, lags, gaps, windows)
        if measured is not None:
            per_seed.append(measured)
    if not per_seed:
        raise SystemExit("no seed's policy moved: nothing to measure")
    labels = list(per_seed[0])
    columns = list(per_seed[0][labels[0]]["row"])
    print(
        f"\nmismatch direction, mean over {len(per_seed)} seeds of {args.seeds} ({args.task}, logit std {args.logit_std}, "
        f"warm start {args.warm_start}, "
        f"{args.steps} steps of on-policy pg; random directions give coherence W ~ 1/sqrt(W): "
        + ", ".join(f"{1 / math.sqrt(w):.2f} at {w}" for w in windows)
        + ")\n"
    )
    print("| source | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for label in labels:
        values = [np.mean([s[label]["row"][c] for s in per_seed]) for c in columns]
        print(
            f"| {label} | "
            + " | ".join(
                f"{v:.2e}" if c in ("kl", "tv") else f"{v:.2f}" for c, v in zip(columns, values, strict=True)
            )
            + " |"
        )
    print("\nweights' rounding error: cosine between (view - weight) of the projections at t and t + k\n")
    print("| format | " + " | ".join(f"k = {k}" for k in gaps) + " |")
    print("|---" * (len(gaps) + 1) + "|")
    for label in labels:
        if per_seed[0][label]["weight_cos"]:
            print(
                f"| {label} | "
                + " | ".join(f"{np.mean([s[label]['weight_cos'][k] for s in per_seed]):.2f}" for k in gaps)
                + " |"
            )


if __name__ == "__main__":
    main()
