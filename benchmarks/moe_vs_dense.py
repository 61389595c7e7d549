"""Benchmark: the tiny Qwen3-MoE against a dense tiny Qwen3 with the same parameters active per token
(issue 29, item 8): one train step of the transformers backend, and a short local-mode run, each as
steps/s and peak memory, medians of several repetitions, and the MoE / dense ratios, in the same run.

    .venv/bin/python benchmarks/moe_vs_dense.py [--reps 3] [--steps 6] [--markdown]

The pair: the MoE is the local model of examples/rljob.yaml with `architecture: qwen3_moe` (rlfleet/
tiny_qwen3.py MOE_SIZES: 4 routed SwiGLU experts of intermediate 128 per layer, top 2, no shared
expert); the dense model is the same spec with `architecture: qwen3` and `intermediate_size` =
top_k x moe_intermediate_size (256), so that a token goes through the same MLP width. Active
parameters per token = embeddings (input and output) + attention (q, k, v, o) + norms (incl. QK-norm)
+ the MLP a token uses (the dense MLP, or top_k of each MoE layer's experts) + the MoE router (every
token's router logits: num_experts x hidden per layer, which the dense model has no counterpart for).
Both counts are summed from the real models' parameters (transformers' Qwen3ForCausalLM and
Qwen3MoeForCausalLM, experts' fused [experts, ...] tensors counted top_k / num_experts) and checked
against a hand count from the config; the difference (the routers) is printed.

(a) `step`: `HFBackend.train_step` (trainer/backends/backend_hf.py: packed micro-batches, fused lm_head +
objective, for the MoE the router's load-balancing loss, clip, AdamW) on the same batch for both
models (benchmarks/train_step.py `make_flat_batch`: --trajectories trajectories, lognormal lengths,
seeded), each repetition in a fresh process (dense and MoE alternating, so the shared machine's load
falls on both): a warm-up step on a 32-token batch (the AdamW moments exist from then on), then
--step-reps timed steps: the fastest's wall seconds (steps/s, tokens/s) and the fewest CPU seconds
(user + sys of the process: less sensitive to the shared machine's load than wall time; one torch
thread by default, so that CPU time is the step's work, not threads spinning), the median of those
over the processes. Memory: the Linux peak resident set during the first timed
step (VmHWM, reset through /proc/self/clear_refs just before it) minus the resident set before it:
the step's extra memory (gradients, activations, the experts' dispatch buffers), not torch's
allocator statistics (torch has none for CPU). A third column runs the MoE with transformers' `eager`
experts (a loop over the experts a batch hits) instead of the model's default implementation (what
the trainer runs: `grouped_mm` in transformers 5), to separate the cost of routing from the kernel's.

(b) `local`: `run_local` (what `rlfleet run <manifest> --local` runs) on examples/rljob.yaml with two
sampler groups (bf16, nvfp4: as benchmarks/loop.py --groups 2) and --steps steps, in a fresh process
per repetition (alternating): steps/s = 1 / the mean of the loop's own step timers (wait for rollouts
+ train + publish) over steps 2..N (step 1 includes the fleet's first weight load), also the mean
train time per step; peak memory: the trainer process's own peak resident set (VmHWM at the end of
the run, the fleet host is a separate process) and the fleet host's (the waited-for child's
ru_maxrss, where the reference engines serve the views).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml
from objective import _print_table, _reset_peak, _status_kib
from train_step import batch_lengths, make_flat_batch

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "rljob.yaml"
ARCHITECTURES = ("qwen3", "qwen3_moe")  # the dense baseline first
GROUPS = [
    {"name": "h100-bf16", "accelerator": "h100", "replicas": 1, "weightFormat": "bf16"},
    {"name": "b200-nvfp4", "accelerator": "b200", "replicas": 1, "weightFormat": "nvfp4"},
]
PARTS = ("embeddings", "attention", "norms", "mlp", "router")


# ----------------------------------------------------------------------------------------------
# The pair of models and their active parameters.
# ----------------------------------------------------------------------------------------------


def manifest(architecture: str) -> dict[str, Any]:
    """examples/rljob.yaml with two sampler groups and the local model `architecture`; the dense model's
    intermediateSize is the MoE's numExpertsPerTok x moeIntermediateSize (the equal-active pair)."""
    from rlfleet.tiny_qwen3 import TinyQwen3

    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["samplerGroups"] = GROUPS
    model = doc["spec"]["local"]["model"]
    model["architecture"] = architecture
    if architecture == "qwen3":
        moe = TinyQwen3(architecture="qwen3_moe")  # the MoE's defaults (the manifest does not set them)
        model["intermediateSize"] = moe.num_experts_per_tok * moe.moe_intermediate_size
    return doc


def local_spec(architecture: str) -> Any:
    """The TinyQwen3 that local mode builds from `manifest(architecture)` (resolve_run(local=True))."""
    from rlfleet.api import load_rljob
    from rlfleet.trainer.config import resolve_run

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rljob.yaml"
        path.write_text(yaml.safe_dump(manifest(architecture)))
        rc = resolve_run(load_rljob(path), local=True)
    assert rc.model is not None  # local=True: the manifest's tiny model
    return rc.model


def active_parameters(model: Any) -> dict[str, int]:
    """Parameters a token goes through, per part, summed from `model.named_parameters()`: each MoE
    layer's fused expert tensors ([num_experts, ...]) count num_experts_per_tok / num_experts of their size."""
    config = model.config
    counts = dict.fromkeys(PARTS, 0)
    for name, param in model.named_parameters():
        size = param.numel()
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            part = "embeddings"
        elif name.endswith("norm.weight"):
            part = "norms"
        elif ".self_attn." in name:
            part = "attention"
        elif name.endswith(".mlp.gate.weight"):
            part = "router"
        elif ".mlp.experts." in name:
            part = "mlp"
            if param.shape[0] != config.num_experts:
                raise ValueError(
                    f"{name}: expected [num_experts={config.num_experts}, ...], got {tuple(param.shape)}"
                )
            size = size // config.num_experts * config.num_experts_per_tok
        elif ".mlp." in name:
            part = "mlp"
        else:
            raise ValueError(f"parameter {name} belongs to no part of {PARTS}")
        counts[part] += size
    return counts


def hand_count(spec: Any) -> dict[str, int]:
    """The same parts from the spec's sizes (the Qwen3 layout: no biases, QK-norm, SwiGLU gate/up/down)."""
    h, layers = spec.hidden_size, spec.num_hidden_layers
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    moe = spec.architecture == "qwen3_moe"
    mlp_width = spec.num_experts_per_tok * spec.moe_intermediate_size if moe else spec.intermediate_size
    return {
        "embeddings": spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2),
        "attention": layers * (2 * h * q + 2 * h * kv),
        "norms": layers * (2 * h + 2 * spec.head_dim) + h,
        "mlp": layers * 3 * h * mlp_width,
        "router": layers * spec.num_experts * h if moe else 0,
    }


def parameter_table(markdown: bool) -> None:
    from rlfleet.tiny_qwen3 import tiny_model

    rows, active = [], {}
    for arch in ARCHITECTURES:
        spec = replace(local_spec(arch), warm_start="none")  # the count does not depend on the weights
        model = tiny_model(spec)
        counts = active_parameters(model)
        if counts != hand_count(spec):
            raise SystemExit(f"{arch}: parameters {counts} differ from the hand count {hand_count(spec)}")
        total = sum(p.numel() for p in model.parameters())
        active[arch] = sum(counts.values())
        mlp = (
            f"intermediate {spec.intermediate_size}"
            if arch == "qwen3"
            else (
                f"{spec.num_experts} experts x {spec.moe_intermediate_size}, top {spec.num_experts_per_tok}"
            )
        )
        rows.append([arch, mlp, *(f"{counts[p]:,}" for p in PARTS), f"{active[arch]:,}", f"{total:,}"])
    print(
        "\nParameters active per token (from the models' parameters; equal to the hand count from the config)"
    )
    _print_table(["model", "MLP", *PARTS, "active", "total"], rows, markdown)
    dense, moe = active["qwen3"], active["qwen3_moe"]
    print(f"active MoE - dense = {moe - dense:,} (the routers), MoE / dense = {moe / dense:.4f}")


# ----------------------------------------------------------------------------------------------
# One case, inside its own process.
# ----------------------------------------------------------------------------------------------


def step_case(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from rlfleet.tiny_qwen3 import tiny_model
    from rlfleet.trainer.backends.backend_common import OptimConfig
    from rlfleet.trainer.backends.backend_hf import HFBackend
    from rlfleet.trainer.objective import ObjectiveConfig

    torch.set_num_threads(args.threads)
    lengths = batch_lengths(args.trajectories, args.median, 1.0, args.max_len, seed=0)
    spec = replace(local_spec(args.architecture), warm_start="none", max_position_embeddings=args.max_len)
    vocab = spec.vocab_size
    flat, warm = make_flat_batch(lengths, vocab, seed=1), make_flat_batch([32], vocab, seed=2)
    model = tiny_model(spec).train()
    if args.experts:
        model.set_experts_implementation(args.experts)
    backend = HFBackend(model, ObjectiveConfig(), optim=OptimConfig(learning_rate=1e-5), device="cpu")
    groups = {"bench": 0}
    backend.train_step(warm, groups)
    rss_before_kib = _status_kib("VmRSS")
    _reset_peak()
    times = []
    for i in range(args.step_reps):
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        backend.train_step(flat, groups)
        times.append((time.perf_counter() - start_wall, time.process_time() - start_cpu))
        if i == 0:
            peak_kib = _status_kib("VmHWM")
    step_s = min(wall for wall, _ in times)  # the least disturbed step (the machine is shared)
    return {
        "steps_per_s": 1 / step_s,
        "tokens_per_s": sum(lengths) / step_s,
        "cpu_s": min(cpu for _, cpu in times),
        "extra_peak_mib": (peak_kib - rss_before_kib) / 1024,
    }


def local_case(args: argparse.Namespace) -> dict[str, float]:
    from rlfleet.api import load_rljob
    from rlfleet.local.main import run_local
    from rlfleet.trainer.config import resolve_run

    with tempfile.TemporaryDirectory(prefix="rlfleet-moe-bench-") as tmp:
        path = Path(tmp) / "rljob.yaml"
        path.write_text(yaml.safe_dump(manifest(args.architecture)))
        rc = resolve_run(load_rljob(path), local=True)
        rc.steps = args.steps
        run_local(rc, Path(tmp) / "run", live=False)
        rows = json.loads((Path(tmp) / "run" / "report" / "metrics.json").read_text())["steps"]
    if len(rows) != args.steps:
        raise RuntimeError(f"the run reported {len(rows)} steps, not {args.steps}")
    rows = rows[1:]  # step 1 includes the fleet's first weight load and warm-up
    step = statistics.mean(r["time/wait_rollouts"] + r["time/train"] + r["time/publish"] for r in rows)
    return {
        "steps_per_s": 1 / step,
        "train_s": statistics.mean(r["time/train"] for r in rows),
        "wait_s": statistics.mean(r["time/wait_rollouts"] for r in rows),
        "publish_s": statistics.mean(r["time/publish"] for r in rows),
        "trainer_peak_mib": _status_kib("VmHWM") / 1024,
        "fleet_peak_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


# ----------------------------------------------------------------------------------------------
# The driver.
# ----------------------------------------------------------------------------------------------


STEP_VARIANTS = {
    "dense qwen3": ("qwen3", ""),
    "qwen3_moe": ("qwen3_moe", ""),
    "qwen3_moe, eager experts": ("qwen3_moe", "eager"),
}
"""(architecture, transformers experts implementation; "" = the model's default, what the trainer runs)."""
LOCAL_VARIANTS = {"dense qwen3": ("qwen3", ""), "qwen3_moe": ("qwen3_moe", "")}


def _run(case: str, variant: tuple[str, str], args: argparse.Namespace) -> dict[str, float]:
    arch, experts = variant
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--case",
        case,
        "--architecture",
        arch,
        "--experts",
        experts,
        "--steps",
        str(args.steps),
        "--step-reps",
        str(args.step_reps),
        "--threads",
        str(args.threads),
        "--trajectories",
        str(args.trajectories),
        "--median",
        str(args.median),
        "--max-len",
        str(args.max_len),
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if done.returncode != 0:
        raise SystemExit(
            f"{case} {variant} failed (exit {done.returncode}):\n{done.stdout[-1500:]}{done.stderr[-3000:]}"
        )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rounded = {k: round(v, 3) for k, v in result.items()}
    print(f"  {case} {arch} {experts}: {json.dumps(rounded)}", file=sys.stderr, flush=True)
    return result


def compare(
    case: str, variants: dict[str, tuple[str, str]], metrics: dict[str, str], args: argparse.Namespace
) -> None:
    """--reps fresh processes per variant (interleaved: dense, MoE, ..., dense, MoE, ...); the medians, and
    each variant's / the first's (the dense baseline)."""
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in variants}
    for _ in range(args.reps):
        for label, variant in variants.items():
            runs[label].append(_run(case, variant, args))
    median = {label: {k: statistics.median(r[k] for r in runs[label]) for k in metrics} for label in variants}
    baseline, *others = variants
    rows = [
        [
            name,
            *(f"{median[label][k]:.3f}" for label in variants),
            *(f"{median[label][k] / median[baseline][k]:.2f}x" for label in others),
        ]
        for k, name in metrics.items()
    ]
    header = ["metric (median)", *variants, *(f"{label} / dense" for label in others)]
    _print_table(header, rows, args.markdown)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--reps", type=int, default=3, help="fresh processes per model and measurement (medians)"
    )
    parser.add_argument("--steps", type=int, default=6, help="local-mode steps per run (step 1 excluded)")
    parser.add_argument(
        "--step-reps", type=int, default=5, help="timed train steps per process (the fastest)"
    )
    parser.add_argument("--trajectories", type=int, default=32, help="trajectories in the train-step batch")
    parser.add_argument("--median", type=int, default=64, help="median trajectory length of the batch")
    parser.add_argument("--max-len", type=int, default=256, help="longest trajectory of the batch")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the train-step case")
    parser.add_argument("--no-local", action="store_true", help="skip the local-mode runs")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument(
        "--case", choices=("step", "local"), help=argparse.SUPPRESS
    )  # internal: one case, JSON
    parser.add_argument("--architecture", choices=ARCHITECTURES, help=argparse.SUPPRESS)
    parser.add_argument("--experts", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 is excluded)")
    if args.case:
        print(json.dumps((step_case if args.case == "step" else local_case)(args)))
        return 0
    parameter_table(args.markdown)
    tokens = sum(batch_lengths(args.trajectories, args.median, 1.0, args.max_len, seed=0))
    print(
        f"\n(a) One train step (HFBackend.train_step, {args.trajectories} trajectories, {tokens} tokens, "
        f"{args.threads} torch threads; {args.reps} processes x fastest of {args.step_reps} steps)"
    )
    compare(
        "step",
        STEP_VARIANTS,
        {
            "steps_per_s": "steps/s",
            "tokens_per_s": "tokens/s",
            "cpu_s": "CPU s/step",
            "extra_peak_mib": "step's extra peak RSS (MiB)",
        },
        args,
    )
    if not args.no_local:
        print(
            f"\n(b) Local mode (examples/rljob.yaml, 2 groups, {args.steps} steps, step 1 excluded; "
            f"{args.reps} runs per model)"
        )
        compare(
            "local",
            LOCAL_VARIANTS,
            {
                "steps_per_s": "steps/s",
                "train_s": "train s/step",
                "wait_s": "wait for rollouts s/step",
                "publish_s": "publish s/step",
                "trainer_peak_mib": "trainer peak RSS (MiB)",
                "fleet_peak_mib": "fleet host peak RSS (MiB)",
            },
            args,
        )
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
