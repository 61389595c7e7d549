"""`rlfleet ablate`: the correction ablation in miniature (method.md), seeded, same budget per arm.

Arms (objective): pg (uncorrected GRPO), mis, sc (full-vocabulary SC with the tail model over a
top-K head), pg+topp (uncorrected GRPO with top-p mask replay), sc_mis, sc_mis+topp. Each runs on a
homogeneous fleet (all B200 BF16) and on a mixed fleet with every precision of examples/rljob.yaml
(NVFP4 / FP8 / BF16 groups, one fp8 KV cache, a different kernel per GPU class).

The model (`--model`): the tiny dense Qwen3, or the tiny Qwen3-MoE of local mode (the same builder,
rlfleet/tiny_qwen3.py): then every sampler returns each token's routed experts, the trainer measures the
routing mismatch (trainer/backends/routing.py) in every run's metrics, and each arm has an R3 variant
(`<arm>+r3`: routing replay, RLJob `correction.routingReplay`).

How it runs (stated because it differs from local mode): in ONE process, without HTTP, with the
in-process emulated samplers of rlfleet/local/emulated.py (the reference server's engine itself, serving
the views the channel publishes, driven without HTTP), and deterministic
asynchrony: the samplers always serve the weights of `lag` steps ago (a fully asynchronous run on a
real fleet sees a spread of staleness; a fixed lag makes the arms comparable and the run seeded).
Kernels: bf16 activations with a per-GPU-class split-K reduction order, as the reference server
computes. Sessions are assigned to groups by the router's weighted rendezvous hash; multi-turn tasks
run turn by turn (`LockstepRollouts`). Each step trains on
`prompts` prompt groups of `samples` samples through the SAME composition root as local and cluster
runs (trainer/run.py `run_training`: version 0 first, then the loop with its batching, objective,
metrics and collapse detector); only the rollout source (`LockstepRollouts`) and where versions go
(`SnapshotSink`, in memory) differ.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import threading

    import torch

    from rlfleet.local.emulated import EmulatedSampler, SnapshotSink
    from rlfleet.sampler.protocol import SamplingConfig
    from rlfleet.tiny_qwen3 import TinyQwen3
    from rlfleet.trainer.backends.backend_hf import HFBackend
    from rlfleet.trainer.collapse import CollapseDetector
    from rlfleet.trainer.config import RunConfig
    from rlfleet.trainer.loop import TrainingLoop
    from rlfleet.trainer.rollout.driver import PromptGroup

ARMS: dict[str, tuple[str, bool]] = {  # arm -> (objective mode, top-p mask replay)
    "pg": ("pg", False),
    "mis": ("mis", False),
    "sc": ("sc", False),
    "pg+topp": ("pg", True),
    "sc_mis": ("sc_mis", False),
    "sc_mis+topp": ("sc_mis", True),
}
R3 = "+r3"
"""An arm's routing-replay variant, `<arm>+r3` (a mixture of experts only): the trainer routes each token
to the experts its sampler chose (trainer/backends/routing_replay.py), the arm otherwise unchanged."""
MODELS = ("qwen3", "qwen3_moe")
"""`--model`: the tiny dense Qwen3 or the tiny Qwen3-MoE (rlfleet/tiny_qwen3.py ARCHITECTURES)."""


def arm_parts(arm: str) -> tuple[str, bool, bool]:
    """An arm's (objective mode, top-p mask replay, routing replay): `ARMS`, or `<arm>+r3` with routing
    replay; KeyError for an unknown arm."""
    routing_replay = arm.endswith(R3)
    mode, replay = ARMS[arm.removesuffix(R3) if routing_replay else arm]
    return mode, replay, routing_replay


def unknown_arms(arms: Sequence[str], model: str) -> list[str]:
    """The arms of `arms` that `model` cannot run: not an arm, or an R3 variant of a dense model."""
    bad = []
    for arm in arms:
        try:
            routing_replay = arm_parts(arm)[2]
        except KeyError:
            bad.append(arm)
            continue
        if routing_replay and model != "qwen3_moe":
            bad.append(arm)
    return bad


# (name, accelerator, weight format, kv cache dtype)
FLEETS: dict[str, list[tuple[str, str, str, str]]] = {
    "homogeneous": [("b200-bf16-a", "b200", "bf16", "auto"), ("b200-bf16-b", "b200", "bf16", "auto")],
    # every precision / KV / kernel combination of examples/rljob.yaml's eight groups, one group each
    # (b300-nvfp4, h200-fp8, h200-bf16 and a100-bf16 duplicate a format + kernel already present)
    "mixed": [
        ("b200-nvfp4", "b200", "nvfp4", "auto"),
        ("h100-fp8", "h100", "fp8", "auto"),
        ("h100-bf16", "h100", "bf16", "auto"),
        ("rtx-pro-6000-bf16", "rtx-pro-6000", "bf16", "fp8_e4m3"),
    ],
    # the positive-control lever "most tokens from 4-bit groups": 3 of 4 groups NVFP4 (docs/ablation.md)
    "mixed_4bit": [
        ("b200-nvfp4", "b200", "nvfp4", "auto"),
        ("b300-nvfp4", "b300", "nvfp4", "auto"),
        ("b200-nvfp4-b", "b200", "nvfp4", "fp8_e4m3"),
        ("h100-fp8", "h100", "fp8", "auto"),
    ],
    # every token from NVFP4 (with --precision-error-scale: the fifth search of docs/ablation.md)
    "nvfp4": [("b200-nvfp4", "b200", "nvfp4", "auto"), ("b300-nvfp4", "b300", "nvfp4", "auto")],
}


@dataclass
class AblationConfig:
    steps: int = 120
    prompts: int = 8
    samples: int = 8
    max_new_tokens: int = 6
    lag: int = 4
    learning_rate: float = 2e-4
    top_p: float = 0.95
    head_size: int = 16
    task: str = "copy_digit"
    seed: int = 0
    # the tiny Qwen3 (rlfleet/tiny_qwen3.py), built once per seed into `model_cache`
    vocab_size: int = 64
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    head_dim: int = 64
    logit_std: float = 2.0
    # steps of on-policy GRPO every arm starts from (`start_checkpoint`); 0: the untrained tiny Qwen3
    warm_start: int = 0
    # the quantised groups' rounding error, times this (`scaled_view`); 1: the formats as they are
    precision_error_scale: float = 1.0
    model_cache: str | None = None  # default: rlfleet.model_source.default_cache_dir()
    # qwen3: the dense tiny Qwen3; qwen3_moe: the tiny Qwen3-MoE (TinyQwen3's expert sizes: 4 experts of
    # 128, top-2; intermediate_size unused), its routing returned by the samplers and measured by the trainer
    architecture: str = "qwen3"

    def __post_init__(self) -> None:
        if self.architecture not in MODELS:
            raise ValueError(f"architecture must be one of {', '.join(MODELS)}, got {self.architecture!r}")
        if self.architecture == "qwen3_moe" and self.precision_error_scale != 1.0:
            # scaled_view pairs the trainer's tensors with the view's by name; a Qwen3-MoE view names each
            # expert apart where the trainer keeps them fused (rlfleet/numerics/views.py)
            raise ValueError(
                "--precision-error-scale is for the dense model only (a Qwen3-MoE's formats run as they are)"
            )

    def tiny_model(self) -> TinyQwen3:
        from rlfleet.tiny_qwen3 import TinyQwen3

        return TinyQwen3(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_attention_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_seq_len,
            logit_std=self.logit_std,
            seed=self.seed,
            architecture=self.architecture,
        )

    @property
    def routed_experts_top_k(self) -> int:
        """What the samplers return per token (`SamplingConfig.routed_experts_top_k`): the Qwen3-MoE's
        experts per token, 0 for the dense model."""
        return self.tiny_model().num_experts_per_tok if self.architecture == "qwen3_moe" else 0

    @property
    def max_seq_len(self) -> int:
        """The tiny Qwen3's context: one reply after a short prompt, or (multi-turn: tool_add,
        retry_digit) every turn of an episode, each followed by the environment's answer (<= 3 ids)."""
        from rlfleet.trainer.envs.environments import load_environment

        turns = load_environment(self.task).max_turns
        if turns > 1:
            return max(32, 8 + turns * (self.max_new_tokens + 3))
        return max(32, 16 + self.max_new_tokens)


@dataclass
class ArmResult:
    arm: str
    fleet: str
    final_reward: float
    peak_reward: float
    kl_start: float
    kl_peak_ratio: float
    kl_mean: float
    oor_fraction: float
    first_alert_step: int | None
    """The collapse detector's first alert (None: it never fired); not the pre-registered collapse
    (`claims.collapse_step`), which is computed from `history`."""
    alert_signals: list[str]
    """Every signal the detector raised over the run."""
    max_sc_tail_ratio: float | None
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)
    routing_mismatch_tokens: float | None = None
    """A mixture of experts: the share of compared tokens (trainer/backends/routing.py: sampled at the trainer's
    version) whose routed experts differ from the trainer's in some layer, over the whole run (steps
    weighted by their compared tokens); None for the dense model or when no token was compared."""
    routing_mismatch_layers: float | None = None
    """The same, the share of compared (token, layer) pairs."""


class LockstepRollouts:
    """The ablation's rollout source in place of the HTTP rollout driver: when the loop takes a step's
    prompt groups, they are generated right then by the in-process emulated samplers serving the
    weights of `lag` versions before the trainer's (deterministic asynchrony). A `RolloutSource` of the
    loop (trainer/loop.py), as the HTTP driver is."""

    def __init__(
        self, cfg: AblationConfig, rc: RunConfig, sink: SnapshotSink, samplers: dict[str, EmulatedSampler]
    ) -> None:
        from rlfleet.trainer.config import build_environment
        from rlfleet.trainer.envs.prompts import GeneratedPromptSource

        self.cfg, self.rc, self.sink, self.samplers = cfg, rc, sink, samplers
        self.env = build_environment(rc)
        self.prompts = GeneratedPromptSource(rc.environment, rc.seed)
        self.serving = -1
        self.next_position = 0

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def check(self) -> None:
        pass

    def take(self, n: int, timeout: float, stop: threading.Event | None = None) -> list[PromptGroup]:
        from rlfleet.local.emulated import Request
        from rlfleet.numerics.views import view_weights
        from rlfleet.router.hashing import pick
        from rlfleet.trainer.rollout.driver import Episode, PromptGroup, Rollout, turn_stop_ids

        cfg, env, sampling = self.cfg, self.env, self.rc.sampling
        step = self.sink.latest_version() or 0  # the trainer's version = steps done
        version = max(0, step - cfg.lag)
        if version != self.serving:
            snapshot = self.sink.snapshots[version]
            views = {
                fmt: scaled_view(snapshot, view_weights(snapshot, fmt), fmt, cfg.precision_error_scale)
                for fmt in self.rc.views
            }
            for g in self.rc.groups:
                self.samplers[g.name].load_weights(snapshot, version, view=views[g.weight_format])
            self.serving = version
            for old in [v for v in self.sink.snapshots if v < version]:
                del self.sink.snapshots[old]
        batch_prompts = [self.prompts.get(self.next_position + i) for i in range(n)]
        self.next_position += n
        shares = {g.name: 1.0 for g in self.rc.groups}
        episodes = {
            (pi, k): Episode(env, Rollout(prompt=p, sample=k))
            for pi, p in enumerate(batch_prompts)
            for k in range(self.rc.samples_per_prompt)
        }
        # a session stays on its group for every turn (the router's rendezvous hash of `p<index>/<k>`)
        group_of = {key: pick(e.rollout.uid, shares) for key, e in episodes.items()}
        stop_ids = tuple(turn_stop_ids(env, sampling))
        max_seq_len = cfg.max_seq_len
        for _turn_index in range(env.max_turns):
            # one batched turn per sampler group over the episodes that go on (multi-turn tasks)
            budgets = {
                key: e.budget(sampling.max_new_tokens, max_seq_len)
                for key, e in episodes.items()
                if not e.done
            }
            going = {key: b for key, b in budgets.items() if b > 0}
            if not going:
                break
            for name in self.samplers:
                keys = [key for key in going if group_of[key] == name]
                if not keys:
                    continue
                reqs = [Request(list(episodes[key].ids), going[key], stop_ids) for key in keys]
                for key, turn in zip(keys, self.samplers[name].generate_batch(reqs, sampling), strict=True):
                    episodes[key].add_turn(turn)
        for e in episodes.values():
            e.score()  # exactly once per trajectory, whatever ended it
        return [
            PromptGroup(p, [episodes[(pi, k)].rollout for k in range(self.rc.samples_per_prompt)])
            for pi, p in enumerate(batch_prompts)
        ]


def scaled_view(
    weights: dict[str, torch.Tensor], view: dict[str, torch.Tensor], weight_format: str, scale: float
) -> dict[str, torch.Tensor]:
    """`view` (`view_weights`: the published view of `weights` in `weight_format`) with the quantised tensors'
    rounding error times `scale`: weights + scale * (view - weights) where the format quantises
    (`is_quantizable`: the projections of an fp8 / nvfp4 / mxfp4 view), the view elsewhere; `view` itself at scale 1
    and for bf16. A lever of the ablation, not a format any GPU runs: the rounding error keeps its own
    direction (which weights round which way) at `scale` times its size (docs/ablation.md, fifth search)."""
    from rlfleet.numerics.engine_model import is_quantizable

    if scale == 1.0 or weight_format == "bf16":
        return view
    return {
        name: weights[name] + scale * (v - weights[name]) if is_quantizable(name, weights[name]) else v
        for name, v in view.items()
    }


def start_checkpoint(cfg: AblationConfig) -> Path:
    """The checkpoint every arm of `cfg` starts from: the seed's untrained tiny Qwen3, or (warm_start
    > 0) that model after `warm_start` steps of on-policy GRPO (arm pg, homogeneous fleet, lag 0, the
    same task and hyperparameters). Why (docs/ablation.md, fourth search): the paper's runs start from
    a capable base model, so a run can learn first and then fall, which is what the pre-registered
    collapse definition counts; from the untrained model a run that goes wrong never learned. Built
    once per config under the model cache (`model_source.build_once`, like the untrained model); the
    trainer then loads it as any bf16 checkpoint."""

    from rlfleet.model_source import build_once, default_cache_dir, spec_digest
    from rlfleet.tiny_qwen3 import cached_tiny_qwen3

    root = Path(cfg.model_cache or default_cache_dir())
    base = cached_tiny_qwen3(root, cfg.tiny_model())
    if cfg.warm_start == 0:
        return base
    # the warm start's own config; model_cache=None keeps the cache's location out of its digest
    # (it trains on the bf16 fleet, so the precision lever stays out of it too)
    warm = replace(
        cfg, steps=cfg.warm_start, lag=0, warm_start=0, model_cache=None, precision_error_scale=1.0
    )

    def build(tmp: Path) -> None:
        import shutil

        from transformers import PreTrainedModel

        backend, _, _ = train_arm("pg", "homogeneous", replace(warm, model_cache=cfg.model_cache), base)
        shutil.copytree(base, tmp, dirs_exist_ok=True)  # tokenizer and generation config
        model = backend.model
        if not isinstance(model, PreTrainedModel):  # from_pretrained built it: a transformers model
            raise TypeError(f"the warm start trained a {type(model).__name__}, not a transformers model")
        model.bfloat16().save_pretrained(tmp, safe_serialization=True)  # Module.bfloat16 == .to(bf16)

    return build_once(root / f"tiny-qwen3-warm-{spec_digest(warm)}", build)


def fleet_samplers(fleet: str, cfg: AblationConfig, model_dir: Path) -> dict[str, EmulatedSampler]:
    """{group name: EmulatedSampler} of `fleet`: each group's weight format, KV cache dtype and GPU
    class's kernel (bf16 activations, its split-K reduction order), seeded from cfg.seed."""
    from rlfleet.local.emulated import EmulatedSampler
    from rlfleet.local.fleet import SPLIT_K
    from rlfleet.numerics.engine_model import KernelConfig, ModelShape

    model_cfg = ModelShape.from_checkpoint(model_dir)
    return {
        name: EmulatedSampler(
            name,
            fmt,
            kv,
            model_cfg,
            seed=cfg.seed + i,
            kernel=KernelConfig(act_dtype="bfloat16", split_k=SPLIT_K.get(acc, 1)),
            max_running_requests=cfg.prompts * cfg.samples,
        )
        for i, (name, acc, fmt, kv) in enumerate(FLEETS[fleet])
    }


def run_config(arm: str, fleet: str, cfg: AblationConfig) -> RunConfig:
    """The training spec of `arm` on `fleet` (the RunConfig local and cluster runs resolve from an RLJob):
    the arm's objective, a default RLJob's safety thresholds, and the samplers' request parameters:
    temperature 1, cfg's top_p, and the candidates the records carry (the kept support under mask
    replay, else a top-`head_size` head for SC)."""
    from rlfleet.api.common import views_to_publish
    from rlfleet.api.rljob import SafetySpec
    from rlfleet.records import HEAD_MODE, SUPPORT_MODE
    from rlfleet.sampler.protocol import SamplingConfig
    from rlfleet.trainer.backends.backend_common import OptimConfig
    from rlfleet.trainer.config import GroupSpec, RunConfig
    from rlfleet.trainer.envs.environments import load_environment
    from rlfleet.trainer.objective import ObjectiveConfig

    mode, replay, routing_replay = arm_parts(arm)
    sampling: SamplingConfig = SamplingConfig(
        temperature=1.0,
        top_p=cfg.top_p,
        top_k=-1,
        max_new_tokens=cfg.max_new_tokens,
        candidate_mode=SUPPORT_MODE if replay else HEAD_MODE,
        head_size=cfg.head_size,
        routed_experts_top_k=cfg.routed_experts_top_k,
    )
    return RunConfig(
        job_name=f"ablation-{arm}-{fleet}",
        steps=cfg.steps,
        prompts_per_step=cfg.prompts,
        samples_per_prompt=cfg.samples,
        sampling=sampling,
        objective=ObjectiveConfig(mode=mode, replay=replay),
        optim=OptimConfig(learning_rate=cfg.learning_rate),
        max_staleness=None,
        environment=cfg.task,
        max_turns=load_environment(cfg.task).max_turns,
        dataset=None,
        seed=cfg.seed,
        model=cfg.tiny_model(),
        views=views_to_publish(fmt for _, _, fmt, _ in FLEETS[fleet]),
        groups=[GroupSpec(name, acc, fmt, kv) for name, acc, fmt, kv in FLEETS[fleet]],
        safety=SafetySpec(),
        routing_replay=routing_replay,
    )


def train_arm(
    arm: str,
    fleet: str,
    cfg: AblationConfig,
    model_dir: Path,
    progress: bool = False,
    sink: SnapshotSink | None = None,
) -> tuple[HFBackend, TrainingLoop, CollapseDetector]:
    """Train `arm` on `fleet` from `model_dir` for cfg.steps: (backend, loop, collapse detector).
    `sink`: where versions go (default a fresh SnapshotSink; experiments/mismatch_direction.py passes
    one that keeps every version)."""
    import torch

    from rlfleet.local.emulated import SnapshotSink
    from rlfleet.trainer.backends.backend_hf import HFBackend
    from rlfleet.trainer.collapse import CollapseDetector, CollapseThresholds, Decision
    from rlfleet.trainer.run import run_training

    torch.manual_seed(cfg.seed)
    rc = run_config(arm, fleet, cfg)
    backend = HFBackend.from_pretrained(
        model_dir, rc.objective, optim=rc.optim, routing_replay=rc.routing_replay
    )
    samplers = fleet_samplers(fleet, cfg, model_dir)
    detector = CollapseDetector(CollapseThresholds.from_safety(rc.safety))
    snapshots = sink if sink is not None else SnapshotSink()

    def on_step(metrics: dict[str, float], decision: Decision, step_groups: list[PromptGroup]) -> None:
        if progress and int(metrics["step"]) % 10 == 0:
            print(
                f"  {arm}/{fleet} step {int(metrics['step'])}: reward {metrics.get('reward_mean', 0):.3f} "
                f"kl {metrics.get('kl_k3', 0):.4f}",
                flush=True,
            )

    loop = run_training(
        rc,
        backend,
        snapshots,
        detector,
        lambda position: LockstepRollouts(cfg, rc, snapshots, samplers),
        checkpoint=None,
        on_step=on_step,
    )
    return backend, loop, detector


def run_arm(arm: str, fleet: str, cfg: AblationConfig, progress: bool = False) -> ArmResult:
    import numpy as np

    t0 = time.monotonic()
    _, loop, detector = train_arm(arm, fleet, cfg, start_checkpoint(cfg), progress)
    hist = loop.state.history
    rewards = np.array([h.get("reward_mean", 0.0) for h in hist])
    kls = np.array([h.get("kl_k3", 0.0) for h in hist])
    start = max(
        1e-9, float(kls[cfg.lag : cfg.lag + 3].mean()) if len(kls) > cfg.lag else float(kls[:3].mean())
    )
    rhos = [h["sc_tail_ratio_max"] for h in hist if "sc_tail_ratio_max" in h]
    tail = max(1, len(rewards) // 10)
    compared = [h for h in hist if h.get("routing_tokens", 0) > 0]
    count = sum(h["routing_tokens"] for h in compared)
    routing = {
        key: sum(h[key] * h["routing_tokens"] for h in compared) / count if count else None
        for key in ("routing_mismatch_tokens", "routing_mismatch_layers")
    }
    return ArmResult(
        arm=arm,
        fleet=fleet,
        final_reward=float(rewards[-tail:].mean()),
        peak_reward=float(rewards.max()),
        kl_start=start,
        kl_peak_ratio=float(kls.max() / start),
        kl_mean=float(kls.mean()),
        oor_fraction=float(np.mean([h.get("oor_fraction", 0.0) for h in hist])),
        first_alert_step=detector.first_alert_step,
        alert_signals=detector.signals_raised,
        max_sc_tail_ratio=float(max(rhos)) if rhos else None,
        seconds=time.monotonic() - t0,
        history=hist,
        **routing,
    )


def claims_fleet(fleets: Sequence[str]) -> str:
    """The fleet the claims hold against the homogeneous one: `mixed` when it runs, else the first other
    low-precision fleet of `fleets` (e.g. `--fleets homogeneous,nvfp4`), else `mixed` (its claims are
    then not run, for want of runs)."""
    others = [f for f in fleets if f != "homogeneous"]
    return "mixed" if "mixed" in others or not others else others[0]


def runs_table(results: list[ArmResult]) -> str:
    """Markdown, one row per run. "mixed/homog. KL": the arm's mean KL on a low-precision fleet over its mean KL
    on the homogeneous fleet (staleness included), and at step 1 (on-policy: precision and kernels only)."""
    by = {(r.arm, r.fleet): r for r in results}
    lines = [
        "| arm | fleet | final reward | peak reward | peak KL / start | mean KL | OOR fraction | detector's first alert (step: signals raised) | max sc_tail_ratio | mixed/homog. KL (run / step 1) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        other = by.get((r.arm, "homogeneous"))
        ratio = ""
        if r.fleet != "homogeneous" and other and other.kl_mean > 0:
            first = (
                (r.history[0].get("kl_k3", 0.0) / other.history[0]["kl_k3"])
                if other.history and other.history[0].get("kl_k3")
                else float("nan")
            )
            ratio = f"{r.kl_mean / other.kl_mean:.1f}x / {first:.1f}x"
        alert = (
            f"{r.first_alert_step}: {', '.join(r.alert_signals)}" if r.first_alert_step is not None else "no"
        )
        rho = f"{r.max_sc_tail_ratio:.2f}" if r.max_sc_tail_ratio is not None else "-"
        lines.append(
            f"| {r.arm} | {r.fleet} | {r.final_reward:.3f} | {r.peak_reward:.3f} | {r.kl_peak_ratio:.1f}x | {r.kl_mean:.4f} | "
            f"{r.oor_fraction:.2%} | {alert} | {rho} | {ratio} |"
        )
    return "\n".join(lines)


def routing_table(results: list[ArmResult], cfgs: list[AblationConfig]) -> str:
    """Markdown, one row per (arm, fleet, lag) cell of a mixture of experts' runs: the routing mismatch
    (`ArmResult.routing_mismatch_tokens` / `_layers`) mean and range over the cell's seeds, and at step 1
    (on-policy: the samplers serve the trainer's own weights through their precision and kernels)."""
    cells: dict[tuple[str, str, int], list[ArmResult]] = {}
    for r, c in zip(results, cfgs, strict=True):
        cells.setdefault((r.arm, r.fleet, c.lag), []).append(r)
    lines = [
        "| arm | fleet | lag | seeds | routing mismatch, tokens: mean (min-max) | layers: mean | step 1, tokens: mean (min-max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (arm, fleet, lag), runs in cells.items():
        tokens = [r.routing_mismatch_tokens for r in runs if r.routing_mismatch_tokens is not None]
        layers = [r.routing_mismatch_layers for r in runs if r.routing_mismatch_layers is not None]
        first = [
            r.history[0]["routing_mismatch_tokens"]
            for r in runs
            if r.history and "routing_mismatch_tokens" in r.history[0]
        ]
        lines.append(
            f"| {arm} | {fleet} | {lag} | {len(runs)} | {_mean_range(tokens)} | "
            f"{f'{sum(layers) / len(layers):.2%}' if layers else '-'} | {_mean_range(first)} |"
        )
    return "\n".join(lines)


def _mean_range(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{sum(values) / len(values):.2%} ({min(values):.2%}-{max(values):.2%})"


def plots(results: list[ArmResult], out: Path, low_fleet: str = "mixed") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key, title in (
        ("reward_mean", "reward"),
        ("kl_k3", "sampler/trainer KL (k3)"),
        ("oor_fraction", "OOR fraction"),
        ("grad_norm", "grad norm"),
        ("entropy", "entropy"),
        ("sc_tail_ratio", "sc_tail_ratio"),
    ):
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
        for ax, fleet in zip(axes, ("homogeneous", low_fleet), strict=True):
            for r in results:
                if r.fleet != fleet:
                    continue
                xs = [h["step"] for h in r.history if key in h]
                ys = [h[key] for h in r.history if key in h]
                if ys:
                    ax.plot(xs, ys, label=r.arm, linewidth=1.2)
            ax.set_title(f"{title}: {fleet} fleet")
            ax.set_xlabel("step")
            if key in ("kl_k3", "grad_norm", "sc_tail_ratio"):
                ax.set_yscale("log")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"ablation_{key}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


TASK_CHANCE = {
    "copy_digit": 0.1,
    "same_parity": 0.5,
    "tool_add": 0.0,
    "retry_digit": 0.1 * (1 + 1 / 2 + 1 / 3 + 1 / 4),
}
"""Chance-level reward of each ablation task: what a policy ignoring the prompt earns (copy_digit: a
uniformly random digit, 0.1; same_parity: any digits, 0.5; retry_digit: four distinct guesses, 0.208).
tool_add (multi-turn): 0, since the protocol itself is what is learned (a uniformly random reply
earns ~0.02; docs/ablation.md)."""


def _quiet_worker() -> None:
    """A worker process of the ablation: 1 torch thread (the workers share the cores), no progress bars."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)


def _pool_map(fn: Callable[[Any], Any], items: list, workers: int) -> list:
    """fn over items, `workers` processes at a time (spawned: no torch state is forked), in order."""
    if workers <= 1:
        _quiet_worker()
        return [fn(x) for x in items]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(
        max_workers=workers, mp_context=multiprocessing.get_context("spawn"), initializer=_quiet_worker
    ) as pool:
        return list(pool.map(fn, items))


def start_checkpoints(cfgs: list[AblationConfig], workers: int) -> list[Path]:
    """`start_checkpoint` of every config (warm starts in parallel)."""
    if not any(c.warm_start for c in cfgs):
        return [start_checkpoint(c) for c in cfgs]
    return _pool_map(start_checkpoint, cfgs, workers)


def _run_job(job: tuple[str, str, AblationConfig]) -> ArmResult:
    arm, fleet, cfg = job
    return run_arm(arm, fleet, cfg)


def run_grid(jobs: list[tuple[str, str, AblationConfig]], workers: int) -> list[ArmResult]:
    """Every (arm, fleet, config) run, `workers` processes at a time; results in job order."""
    return _pool_map(_run_job, jobs, workers)


def grid(
    arms: list[str], fleets: list[str], seeds: list[int], cfg: AblationConfig, null_control: bool
) -> list[tuple[str, str, AblationConfig]]:
    """The runs of an ablation: every arm x fleet x seed at `cfg.lag`, plus (null_control) the null-arm
    cells (experiments/claims.py NULL_ARMS on the homogeneous fleet at lag 0) unless they are already in."""
    from rlfleet_experiments.claims import NULL_ARMS, NULL_FLEET, NULL_LAG

    jobs = [(arm, fleet, replace(cfg, seed=seed)) for seed in seeds for fleet in fleets for arm in arms]
    if null_control and cfg.lag != NULL_LAG:
        jobs += [
            (arm, NULL_FLEET, replace(cfg, seed=seed, lag=NULL_LAG)) for seed in seeds for arm in NULL_ARMS
        ]
    return jobs


def records_of(results: list[ArmResult], cfgs: list[AblationConfig]) -> list[Any]:
    from rlfleet_experiments.claims import RunRecord

    return [
        RunRecord(arm=r.arm, fleet=r.fleet, seed=c.seed, lag=c.lag, history=r.history)
        for r, c in zip(results, cfgs, strict=True)
    ]


def parse_seeds(text: str) -> list[int]:
    """ "5" -> seeds 0..4; "0,3,7" -> those seeds."""
    parts = [p for p in text.split(",") if p.strip()]
    if len(parts) == 1 and "," not in text:
        n = int(parts[0])
        if n < 1:
            raise ValueError("--seeds N needs N >= 1")
        return list(range(n))
    seeds = [int(p) for p in parts]
    if len(set(seeds)) != len(seeds) or any(x < 0 for x in seeds):
        raise ValueError("--seeds: distinct non-negative seeds")
    return seeds


DOCS_BEGIN, DOCS_END = "<!-- rlfleet ablate: begin -->", "<!-- rlfleet ablate: end -->"


def write_docs_block(path: Path, body: str) -> None:
    """Replace what stands between the two markers of `path` (they must be there, once each)."""
    text = path.read_text()
    if text.count(DOCS_BEGIN) != 1 or text.count(DOCS_END) != 1:
        raise SystemExit(f"rlfleet ablate: {path} needs the lines {DOCS_BEGIN} and {DOCS_END} once each")
    head, rest = text.split(DOCS_BEGIN)
    _, tail = rest.split(DOCS_END)
    path.write_text(f"{head}{DOCS_BEGIN}\n{body}\n{DOCS_END}{tail}")


def cli(argv: Sequence[str]) -> int:
    d = AblationConfig()
    p = argparse.ArgumentParser(
        prog="rlfleet ablate",
        description="Correction ablation: pg, mis, sc, pg+topp, sc_mis, sc_mis+topp on a homogeneous and a mixed fleet, several seeds, pre-registered claims (docs/ablation.md).",
    )
    p.add_argument(
        "--arms",
        default=",".join(ARMS),
        help=f"comma list of {', '.join(ARMS)}; with --model qwen3_moe also each arm's R3 variant <arm>{R3}",
    )
    p.add_argument(
        "--model",
        default=d.architecture,
        choices=MODELS,
        help="the tiny dense Qwen3 or the tiny Qwen3-MoE (routing mismatch measured, R3 arms offered)",
    )
    p.add_argument(
        "--fleets",
        default="homogeneous,mixed",
        help=f"comma list of {', '.join(FLEETS)}; the claims compare homogeneous with mixed, "
        "or with the first other fleet when mixed does not run",
    )
    p.add_argument("--seeds", default="5", help="N (seeds 0..N-1) or a comma list of seeds (default 5)")
    p.add_argument("--jobs", type=int, default=None, help="parallel worker processes (default: CPU cores)")
    p.add_argument(
        "--no-null-control", action="store_true", help="skip the null-arm cells (homogeneous, lag 0)"
    )
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--prompts", type=int, default=d.prompts)
    p.add_argument("--samples", type=int, default=d.samples)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--lag", type=int, default=d.lag, help="sampler weights are this many steps old")
    p.add_argument("--lr", type=float, default=d.learning_rate)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--head-size", type=int, default=d.head_size)
    p.add_argument("--logit-std", type=float, default=d.logit_std, help="std of the untrained model's logits")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="the tiny Qwen3's vocabulary (>= 32)")
    p.add_argument(
        "--hidden-size",
        type=int,
        default=d.hidden_size,
        help="the tiny Qwen3's hidden size (a multiple of 128, so every precision view publishes; MLP 2x)",
    )
    p.add_argument("--layers", type=int, default=d.num_hidden_layers, help="the tiny Qwen3's decoder layers")
    p.add_argument("--task", default=d.task, choices=tuple(TASK_CHANCE))
    p.add_argument(
        "--warm-start",
        type=int,
        default=d.warm_start,
        help="every arm starts from the tiny Qwen3 after this many steps of on-policy GRPO (default 0: untrained)",
    )
    p.add_argument(
        "--precision-error-scale",
        type=float,
        default=d.precision_error_scale,
        help="multiply the fp8/nvfp4 groups' rounding error by this (default 1: the formats as they are)",
    )
    p.add_argument("--out", default="rlfleet-ablation")
    p.add_argument(
        "--docs", help="also write the results between the ablation markers of this file (docs/ablation.md)"
    )
    args = p.parse_args(list(argv))
    arms = [a for a in args.arms.split(",") if a]
    fleets = [f for f in args.fleets.split(",") if f]
    bad = unknown_arms(arms, args.model) + [f for f in fleets if f not in FLEETS]
    if bad:
        print(
            f"rlfleet ablate: unknown arm/fleet {', '.join(bad)} (arms: {', '.join(ARMS)}, and <arm>{R3} with "
            f"--model qwen3_moe; fleets: {', '.join(FLEETS)})",
            file=sys.stderr,
        )
        return 2
    if args.model == "qwen3_moe" and args.precision_error_scale != 1.0:
        print("rlfleet ablate: --precision-error-scale is for --model qwen3 only", file=sys.stderr)
        return 2
    if (
        args.steps < 4
        or args.prompts < 1
        or args.samples < 2
        or args.lag < 0
        or not 0 < args.top_p <= 1
        or args.vocab_size < 32
        or args.max_new_tokens < 1
        or args.hidden_size < 128
        or args.hidden_size % 128
        or args.layers < 1
        or args.warm_start < 0
        or not 0 <= args.precision_error_scale < float("inf")
    ):
        print(
            "rlfleet ablate: need --steps >= 4, --prompts >= 1, --samples >= 2, --lag >= 0, 0 < --top-p <= 1, "
            "--vocab-size >= 32, --max-new-tokens >= 1, --hidden-size a multiple of 128, --layers >= 1, --warm-start >= 0, "
            "a finite --precision-error-scale >= 0",
            file=sys.stderr,
        )
        return 2
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as exc:
        print(f"rlfleet ablate: {exc}", file=sys.stderr)
        return 2
    import os

    from transformers.utils import logging as hf_logging

    from rlfleet_experiments.claims import (
        CollapseDefinition,
        DetectorAlerts,
        claims_table,
        detector_table,
        evaluate_claims,
        paper_claims,
        score_detector,
        summary_table,
    )

    cfg = AblationConfig(
        steps=args.steps,
        prompts=args.prompts,
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        lag=args.lag,
        learning_rate=args.lr,
        top_p=args.top_p,
        head_size=args.head_size,
        task=args.task,
        logit_std=args.logit_std,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.layers,
        warm_start=args.warm_start,
        precision_error_scale=args.precision_error_scale,
        architecture=args.model,
    )
    hf_logging.disable_progress_bar()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = grid(arms, fleets, seeds, cfg, null_control=not args.no_null_control)
    workers = max(1, args.jobs or os.cpu_count() or 1)
    print(
        f"rlfleet ablate: {len(jobs)} runs ({len(arms)} arms x {len(fleets)} fleets x {len(seeds)} seeds"
        f"{' + null-arm control' if len(jobs) > len(arms) * len(fleets) * len(seeds) else ''}), {workers} workers",
        flush=True,
    )
    t0 = time.monotonic()
    # every seed's start checkpoint once, here, before the workers race for it (warm starts in parallel)
    start_checkpoints([replace(cfg, seed=seed) for seed in seeds], workers)
    warm_wall = time.monotonic() - t0
    results = run_grid(jobs, workers)
    wall = time.monotonic() - t0
    records = records_of(results, [c for _, _, c in jobs])
    definition = CollapseDefinition(chance=TASK_CHANCE[cfg.task])
    low_fleet = claims_fleet(fleets)
    claims = evaluate_claims(paper_claims(definition, lag=cfg.lag, low_fleet=low_fleet), records)
    first_seed_runs = [
        r for r, (_, _, c) in zip(results, jobs, strict=True) if c.seed == seeds[0] and c.lag == cfg.lag
    ]
    cpu = sum(r.seconds for r in results)
    md = "\n\n".join(
        [
            f"Runs: {len(jobs)}; wall {wall / 60:.1f} min with {workers} workers"
            + (
                f" ({warm_wall / 60:.1f} of them training the warm starts: every arm starts from {cfg.warm_start} steps "
                "of on-policy pg)"
                if cfg.warm_start
                else ""
            )
            + f"; {cpu / 60:.1f} CPU-minutes of runs.",
            "### Claims\n\n"
            + (f"The mixed fleet of the claims: `{low_fleet}`.\n\n" if low_fleet != "mixed" else "")
            + claims_table(claims),
            "### Per cell (all seeds)\n\n" + summary_table(records, definition),
            "### Collapse detector against the pre-registered definition\n\n"
            + detector_table(
                score_detector(
                    records,
                    [DetectorAlerts(r.first_alert_step, tuple(r.alert_signals)) for r in results],
                    definition,
                )
            ),
            f"### Seed {seeds[0]}, lag {cfg.lag}\n\n" + runs_table(first_seed_runs),
        ]
        + (
            [
                "### Routing mismatch (Qwen3-MoE), per cell over its seeds\n\n"
                + routing_table(results, [c for _, _, c in jobs])
            ]
            if cfg.architecture == "qwen3_moe"
            else []
        )
    )
    print(md)
    (out / "ablation.md").write_text(md + "\n")
    if args.docs:
        command = "rlfleet ablate " + " ".join(argv)
        write_docs_block(
            Path(args.docs), f"Generated by `{command}` (load average {os.getloadavg()[0]:.1f}).\n\n{md}"
        )
    (out / "ablation.json").write_text(
        json.dumps(
            {
                "config": asdict(cfg),
                "seeds": seeds,
                "claims_fleet": low_fleet,
                "runs": [
                    {"seed": c.seed, "lag": c.lag, **asdict(r)}
                    for r, (_, _, c) in zip(results, jobs, strict=True)
                ],
                "claims": [{"id": c.id, "status": res.status, "evidence": res.evidence} for c, res in claims],
            },
            indent=1,
        )
    )
    plots(first_seed_runs, out, low_fleet)
    return 0
