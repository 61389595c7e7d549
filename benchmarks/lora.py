"""Benchmark: LoRA (RLJob `trainer.lora`, issue 42) against full fine-tuning of the same model, in the same run.
Prints ratios LoRA / full; nothing here is asserted (docs/benchmarks.md, "LoRA").

Step (`--only step`): ONE train step of the torch backend (trainer/backends/backend_hf.py
`HFBackend.train_step`: packed micro-batches, the fused lm_head + objective, clip, AdamW) on the same packed
batch (benchmarks/train_step.py `make_flat_batch`: lognormal lengths, a support of 8 candidates per sampled
token), full fine-tuning against LoRA rank 16 (alpha 32) on all seven projections and on the attention ones
only, on a Qwen3 of Qwen3-0.6B's layer geometry (hidden 1024, intermediate 3072, 16 heads, 8 KV heads, head
dim 128) with `--layers` layers and a `--vocab` vocabulary (untied), random init, built with transformers
(rlfleet/tiny_qwen3.py `build_tiny_qwen3`) into a temp dir. Every case runs in a FRESH subprocess: wall and CPU
seconds of a step (the minimum over `--reps` steps after one warm-up step on a 32-token batch, which makes the
AdamW moments), the resident set after the warm-up (the model, its gradients and the optimizer state), the
step's extra peak (Linux VmHWM reset through /proc/self/clear_refs just before the first timed step, minus
VmRSS then), the process's peak over the whole case (VmHWM at the end, which includes loading), and the
trained parameters and the optimizer state's bytes (every tensor AdamW holds).

Publish (`--only publish`): the trainer's `WeightPublisher` into a filesystem channel, `--versions` versions
of real training steps (`HFBackend.train_step` on a small batch between publishes; full at `--full-lr`,
LoRA at `--lora-lr`), the same base model as the step part: full fine-tuning publishes the views bf16, fp8,
nvfp4 of every version (deltas on, the RLJob defaults anchorEvery 16 / maxDeltaShare 0.5; nvfp4 calibrated
by the publisher), LoRA the `lora` view (the adapter) of every version and each base view once (at version
0). Per version: bytes stored, and the publish's wall time (`publish()` whole: calibration, conversion,
deltas, write + BLAKE3, manifest, pointer) with the publisher's own breakdown (`last_timings`).
Apply: one sidecar (sampler/syncer.py `Syncer.reconcile_once`, the real one) and one reference engine
(sampler/reference_engine.py behind sampler/http_app.py `start_reference_server`, in process, real HTTP on
localhost) per base view, the engine launched from version 0 of its view (LoRA: the base view, with the
LoRA flags: --enable-lora --max-lora-rank 16 --lora-target-modules of the job); then the newest version is
applied `--reps` times (the sidecar's cache emptied, and for LoRA the adapter unloaded, between reps):
`obtain` = the sidecar's obtain + verify of the version's view (full: the view rebuilt from the sidecar's
copy of the version before plus the delta, or downloaded when it is an anchor; LoRA: the `lora` view
downloaded) into its cache, `engine` = the engine calls (full: POST /update_weights_from_disk, the engine
reads the view, emulates its precision and loads it; LoRA: GET /v1/models, POST /load_lora_adapter, POST
/update_weight_version). Medians over the reps.

Mismatch (`--only mismatch`): `rlfleet run MANIFEST --local` (subprocesses, the same seed and `--steps`) on
examples/rljob-lora.yaml as is, and on the same manifest with `trainer.lora` removed (full fine-tuning) at
the same local learning rate (0.002) and at the local default of the non-LoRA examples (2e-4:
examples/rljob-cpu-torch.yaml sets no local.learningRate); each of the three as the example runs (staleness
unbounded: KL mixes the precision mismatch with staleness, which grows with the learning rate) and with
`staleness.maxSteps: 0` (`/on-policy`: every trained token sampled by the version trained, so KL is the
engines' precision alone: a quantized base with a bf16 adapter against a quantized fine-tuned model). From each run's report/metrics.json, per group
(bf16, fp8 + fp8 KV cache, nvfp4): KL(q || p) (`group/<g>/kl_k3`, the k3 estimate over the group's trained
tokens) and the out-of-range fraction (`group/<g>/oor_fraction`: the share of the group's tokens whose
importance ratio is outside the objective's band), token-weighted means over the whole run and over its
last `--last` steps; and the fleet's mean staleness (KL mixes quantization and staleness).

    .venv/bin/python benchmarks/lora.py --markdown                 # all three parts (about 10 minutes on 2 cores)
    .venv/bin/python benchmarks/lora.py --only step --markdown
    .venv/bin/python benchmarks/lora.py --only publish --layers 4
    .venv/bin/python benchmarks/lora.py --only mismatch --steps 20
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.append(str(HERE))  # train_step.py's batch builder (appended: the standard library stays first)

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION_TARGETS = ALL_TARGETS[:4]
CASES = {"full": None, "lora-all": ALL_TARGETS, "lora-attn": ATTENTION_TARGETS}
VIEWS = ["bf16", "fp8", "nvfp4"]
GROUP = "bench"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _table(header: list[str], rows: list[list[str]], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(str(x)) for x in column) for column in zip(header, *rows, strict=False)]
        for row in [header, *rows]:
            print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def _lora_spec(targets: list[str], rank: int):
    from rlfleet.api.lora_spec import LoraSpec

    return LoraSpec(rank=rank, alpha=2.0 * rank, dropout=0.0, target_modules=targets)  # type: ignore[arg-type]


def build_model(directory: Path, args: argparse.Namespace) -> Path:
    """The benchmark's Qwen3 checkpoint (config, safetensors, tokenizer) from a seeded random init."""
    from rlfleet.tiny_qwen3 import TinyQwen3, build_tiny_qwen3

    spec = TinyQwen3(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=max(2048, args.batch_max),
    )
    return build_tiny_qwen3(directory, spec)


def _model_line(args: argparse.Namespace) -> str:
    return (
        f"Qwen3 hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, {args.heads} heads / "
        f"{args.kv_heads} KV heads of {args.head_dim}, vocab {args.vocab} (untied), random init"
    )


# ------------------------------------------------------------------------------------------------ step


def run_step_case(args: argparse.Namespace) -> dict[str, Any]:
    """One case in this (fresh) process: the backend on the checkpoint, a warm-up step, `--reps` timed steps."""
    import torch
    from train_step import batch_lengths, make_flat_batch

    from rlfleet.trainer.backends.backend_common import OptimConfig
    from rlfleet.trainer.backends.backend_hf import HFBackend
    from rlfleet.trainer.objective import ObjectiveConfig

    torch.set_num_threads(args.threads)
    targets = CASES[args.case]
    lengths = batch_lengths(args.batch_seqs, args.batch_median, 1.0, args.batch_max, seed=0)
    flat, warm = make_flat_batch(lengths, args.vocab, seed=1), make_flat_batch([32], args.vocab, seed=2)
    rss_start = _status_kib("VmRSS")
    backend = HFBackend.from_pretrained(
        args.model_dir,
        ObjectiveConfig(),
        optim=OptimConfig(learning_rate=1e-5),
        device="cpu",
        lora=None if targets is None else _lora_spec(targets, args.rank),
    )
    rss_model = _status_kib("VmRSS")
    backend.train_step(warm, {GROUP: 0})  # gradients and AdamW moments exist from here on
    rss_before = _status_kib("VmRSS")
    _reset_peak()
    times = []
    for _ in range(args.reps):
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        backend.train_step(flat, {GROUP: 0})
        times.append((time.process_time() - start_cpu, time.perf_counter() - start_wall))
        if len(times) == 1:
            peak = _status_kib("VmHWM")
    optimizer_bytes = sum(
        t.numel() * t.element_size()
        for state in backend.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t)
    )
    trained = sum(p.numel() for p in backend.trainable)
    total = sum(p.numel() for p in backend.model.parameters())
    return {
        "case": args.case,
        "tokens": int(sum(lengths)),
        "sequences": len(lengths),
        "cpu_s": min(c for c, _ in times),
        "wall_s": min(w for _, w in times),
        "trained_params": trained,
        "total_params": total,
        "optimizer_bytes": optimizer_bytes,
        "model_rss_bytes": (rss_model - rss_start) * 1024,
        "rss_before_bytes": rss_before * 1024,
        "extra_peak_bytes": (peak - rss_before) * 1024,
        "process_peak_bytes": _status_kib("VmHWM") * 1024,  # since the reset: the timed steps' peak
    }


def _run_case(case: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any] | None:
    command = [sys.executable, os.path.abspath(__file__), "--case", case, "--model-dir", str(model_dir)]
    for flag in ("vocab", "threads", "reps", "rank", "batch_seqs", "batch_median", "batch_max"):
        command += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=args.case_timeout)
    if completed.returncode != 0:
        print(f"  {case} failed (exit {completed.returncode}):\n{completed.stderr[-2000:]}", file=sys.stderr)
        return None
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    print(
        f"  done {case}: {result['wall_s']:.2f} s wall, extra peak {_mib(result['extra_peak_bytes'])} MiB",
        file=sys.stderr,
    )
    return result


def step_part(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    results = {case: _run_case(case, model_dir, args) for case in CASES}
    step_table(results, args)
    return results


def step_table(results: dict[str, Any], args: argparse.Namespace) -> None:
    """The step part's table (also from a `--json` of an earlier run: `step_table(json["step"], args)`)."""
    full = results["full"]
    any_result = next((r for r in results.values() if r), None)
    if any_result is None:
        return
    print(
        f"\nOne train step: {_model_line(args)}; {any_result['total_params'] / 1e6:.1f}M parameters; batch "
        f"{any_result['sequences']} trajectories, {any_result['tokens']} tokens; float32 CPU, {args.threads} threads; "
        f"min of {args.reps} steps; LoRA rank {args.rank}, alpha {2 * args.rank}. RSS before = after the warm-up "
        f"step (model, gradients, AdamW moments, runtime); extra = the step's peak above it; peak = the step's "
        f"peak RSS (before + extra)"
    )
    header = [
        "case",
        "trained params",
        "optimizer state MiB",
        "RSS before MiB",
        "extra MiB",
        "peak MiB",
        "wall s",
        "CPU s",
        "wall / full",
        "RSS before / full",
        "extra / full",
        "peak / full",
    ]
    rows = []
    for case, r in results.items():
        if r is None:
            rows.append([case, *["-"] * (len(header) - 1)])
            continue

        def ratio(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key] / full[key]:.2f}x" if full else "-"

        rows.append(
            [
                case,
                f"{r['trained_params']:,} ({r['trained_params'] / r['total_params']:.2%})",
                _mib(r["optimizer_bytes"]),
                _mib(r["rss_before_bytes"]),
                _mib(r["extra_peak_bytes"]),
                _mib(r["process_peak_bytes"]),
                f"{r['wall_s']:.2f}",
                f"{r['cpu_s']:.2f}",
                ratio("wall_s"),
                ratio("rss_before_bytes"),
                ratio("extra_peak_bytes"),
                ratio("process_peak_bytes"),
            ]
        )
    _table(header, rows, args.markdown)


# ------------------------------------------------------------------------------------------------ publish


def _publish_run(
    args: argparse.Namespace, model_dir: Path, store_dir: Path, targets: list[str] | None
) -> dict[str, Any]:
    """`--versions` + 1 versions (0 = the initial weights), a train step between publishes."""
    import torch
    from train_step import make_flat_batch

    from rlfleet.lora import adapter_config
    from rlfleet.store import FilesystemStore
    from rlfleet.trainer.backends.backend_common import OptimConfig
    from rlfleet.trainer.backends.backend_hf import HFBackend
    from rlfleet.trainer.objective import ObjectiveConfig
    from rlfleet.trainer.publish.publisher import WeightPublisher

    lora = None if targets is None else _lora_spec(targets, args.rank)
    backend = HFBackend.from_pretrained(
        model_dir,
        ObjectiveConfig(),
        optim=OptimConfig(learning_rate=args.full_lr if lora is None else args.lora_lr),
        device="cpu",
        lora=lora,
    )
    config = (
        None
        if lora is None
        else adapter_config(
            rank=lora.rank,
            alpha=lora.alpha,
            dropout=0.0,
            target_modules=lora.target_modules,
            base_model="bench",
        )
    )
    publisher = WeightPublisher(
        FilesystemStore(store_dir, create=True),
        views=VIEWS,
        keep_versions=None,
        base_checkpoint=model_dir,
        follow_subscribers=False,
        lora=config,
    )
    versions = []
    try:
        for version in range(args.versions + 1):
            weights = backend.weights()
            start = time.perf_counter()
            publisher.publish(weights, version=version)
            seconds = time.perf_counter() - start
            timings = publisher.last_timings
            versions.append(
                {
                    "version": version,
                    "publish_s": seconds,
                    "timings": None if timings is None else dict(timings.__dict__),
                    "views": {
                        view: {"kind": p.kind, "stored": p.stored_bytes, "full": p.full_bytes}
                        for view, p in publisher.last_published.items()
                    },
                }
            )
            stored = sum(p.stored_bytes for p in publisher.last_published.values())
            print(
                f"  {'full' if lora is None else 'lora'} v{version}: {stored / 1e6:.2f} MB stored in {seconds:.2f} s",
                file=sys.stderr,
            )
            if version < args.versions:
                torch.manual_seed(version)
                batch = make_flat_batch([64] * 4, args.vocab, seed=10 + version)
                backend.train_step(batch, {GROUP: 0})
    finally:
        publisher.close()
    return {"versions": versions, "trained_params": sum(p.numel() for p in backend.trainable)}


async def _apply_times(
    args: argparse.Namespace, store_dir: Path, view: str, work: Path, lora_targets: list[str] | None
) -> dict[str, float]:
    """Launch a reference engine from version 0 of `view`, then apply the newest version `--reps` times
    through the real sidecar; medians of (obtain, engine) seconds."""
    import httpx

    from rlfleet.channel import WeightChannel
    from rlfleet.sampler import server as srv_mod
    from rlfleet.sampler.engine_clients import DiskEngine, LoraEngine
    from rlfleet.sampler.http_app import start_reference_server
    from rlfleet.sampler.sync_state import SyncConfig
    from rlfleet.sampler.syncer import Syncer
    from rlfleet.store import FilesystemStore

    store = FilesystemStore(store_dir)
    channel = WeightChannel(store, publisher_id="bench-launch")
    launch = channel.obtain_view(0, view, work / f"launch-{view}").directory
    # one running request: the engine's KV cache is sized by it (32 x the 2K context of this model: GBs)
    flags = ["--model-path", str(launch), "--weight-format", view, "--threads", str(args.threads)]
    flags += ["--max-running-requests", "1"]
    if lora_targets is not None:
        flags += ["--enable-lora", "--max-lora-rank", str(args.rank), "--lora-target-modules", *lora_targets]
    engine, _ = srv_mod._reference_engine(srv_mod._parser().parse_args(flags))
    obtain, apply, read = [], [], []
    async with (
        await start_reference_server(engine) as server,
        httpx.AsyncClient(base_url=server.url, timeout=600) as client,
    ):
        for rep in range(args.reps):
            cache = work / f"cache-{view}-{rep}"
            config = SyncConfig(
                store=str(store_dir),
                view=view,
                engine_url=server.url,
                group="bench",
                replica=f"r{rep}",
                cache_dir=cache,
                lora=lora_targets is not None,
                keep_local=args.versions + 2,
            )
            syncer = Syncer(
                config, store, LoraEngine(client) if lora_targets is not None else DiskEngine(client)
            )
            if lora_targets is None:
                # a replica in step: it holds the version before (a delta version is rebuilt from it)
                newest = channel.versions()[-1]
                channel.obtain_view(newest - 1, view, cache / f"v{newest - 1}-{view}")
                syncer.state.applied_version = newest - 1
            ok = await syncer.reconcile_once()
            last = syncer.state.last_apply
            assert ok and last is not None, syncer.state.last_error
            obtain.append(last.download_seconds)
            apply.append(last.apply_seconds)
            read.append(last.read_bytes)
            if lora_targets is not None:  # the next rep loads it again
                response = await client.post("/unload_lora_adapter", json={"lora_name": f"v{last.version}"})
                assert response.is_success, response.text
            shutil.rmtree(cache, ignore_errors=True)
    del engine, server
    gc.collect()
    return {
        "obtain_s": statistics.median(obtain),
        "engine_s": statistics.median(apply),
        "read_bytes": statistics.median(read),
    }


def _apply_sync(*apply_args: Any) -> dict[str, float]:
    import torch

    torch.set_num_threads(apply_args[0].threads)
    return asyncio.run(_apply_times(*apply_args))


def _apply_in_child(*apply_args: Any) -> dict[str, float]:
    """`_apply_times` in a fresh (spawned) process: each engine's memory (its emulated weights, several
    copies of the model in fp32 while it converts) goes back to the system when it exits."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_apply_sync, *apply_args).result()


def publish_part(args: argparse.Namespace, model_dir: Path, work: Path) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    out: dict[str, Any] = {}
    for name, targets in (("full", None), ("lora", ALL_TARGETS)):
        out[name] = _publish_run(args, model_dir, work / f"store-{name}", targets)
        gc.collect()
    later = {name: r["versions"][1:] for name, r in out.items()}  # versions after the first

    def stored(name: str, view: str | None = None) -> list[int]:
        return [
            sum(v["stored"] for k, v in ver["views"].items() if view is None or k == view)
            for ver in later[name]
        ]

    full_bytes = {view: out["full"]["versions"][0]["views"][view]["full"] for view in VIEWS}
    base_once = sum(out["lora"]["versions"][0]["views"][view]["stored"] for view in VIEWS)
    adapter = statistics.mean(stored("lora", "lora"))
    full_mean = statistics.mean(stored("full"))
    print(
        f"\nBytes and publish time per version: {_model_line(args)}; {args.versions} versions after v0, each "
        f"after one train step (full lr {args.full_lr:g}, LoRA lr {args.lora_lr:g}; batch 4 x 64 tokens); "
        f"full: views {', '.join(VIEWS)} with deltas (anchorEvery 16, maxDeltaShare 0.5); LoRA rank {args.rank} on "
        f"all 7 projections: the adapter, the base views once at v0 ({base_once / 1e6:.1f} MB)"
    )
    header = ["", "full fine-tuning", "LoRA", "LoRA / full"]
    rows = [
        [
            "bytes stored per version (mean of v1..)",
            f"{full_mean / 1e6:.2f} MB",
            f"{adapter / 1e6:.3f} MB",
            f"{adapter / full_mean:.4f}x",
        ],
        [
            "the complete views of a version (no deltas)",
            f"{sum(full_bytes.values()) / 1e6:.2f} MB",
            f"{adapter / 1e6:.3f} MB",
            f"{adapter / sum(full_bytes.values()):.4f}x",
        ],
    ]
    for view in VIEWS:
        shares = [b / full_bytes[view] for b in stored("full", view)]
        rows.append(
            [
                f"{view}: stored / complete view (mean of v1..; kinds)",
                f"{statistics.mean(shares):.1%} ({', '.join(sorted({v['views'][view]['kind'] for v in later['full']}))})",
                "base once at v0",
                "",
            ]
        )
    for name in ("full", "lora"):
        ts = [v["publish_s"] for v in later[name]]
        out[name]["publish_s_median"] = statistics.median(ts)
    rows.append(
        [
            "publish wall s per version (median of v1..)",
            f"{out['full']['publish_s_median']:.2f}",
            f"{out['lora']['publish_s_median']:.3f}",
            f"{out['lora']['publish_s_median'] / out['full']['publish_s_median']:.4f}x",
        ]
    )
    for key in ("calibrate_seconds", "convert_seconds", "encode_seconds", "upload_seconds"):
        med = {
            name: statistics.median(v["timings"][key] for v in later[name] if v["timings"]) for name in out
        }
        rows.append(
            [f"  of which {key.replace('_seconds', '')}", f"{med['full']:.2f}", f"{med['lora']:.3f}", ""]
        )
    rows.append(
        [
            "publish wall s of v0 (LoRA: the three base views + the adapter)",
            f"{out['full']['versions'][0]['publish_s']:.2f}",
            f"{out['lora']['versions'][0]['publish_s']:.2f}",
            "",
        ]
    )
    _table(header, rows, args.markdown)

    print(
        f"\nApply one version (the newest, v{args.versions}) on a reference engine through the sidecar, median of "
        f"{args.reps}: obtain = obtain + verify into the sidecar's cache (full: from its copy of the version "
        f"before + the delta, or the anchor downloaded; LoRA: the adapter downloaded); engine = full: "
        f"/update_weights_from_disk; LoRA: /v1/models + /load_lora_adapter + /update_weight_version"
    )
    header = [
        "view",
        "full: read MB",
        "full: obtain s",
        "full: engine s",
        "full: total s",
        "LoRA: read MB",
        "LoRA: obtain s",
        "LoRA: engine s",
        "LoRA: total s",
        "LoRA / full total",
    ]
    rows = []
    out["apply"] = {}
    for view in VIEWS:
        f = _apply_in_child(args, work / "store-full", view, work / "apply-full", None)
        lo = _apply_in_child(args, work / "store-lora", view, work / "apply-lora", ALL_TARGETS)
        out["apply"][view] = {"full": f, "lora": lo}
        ft, lt = f["obtain_s"] + f["engine_s"], lo["obtain_s"] + lo["engine_s"]
        rows.append(
            [
                view,
                f"{f['read_bytes'] / 1e6:.2f}",
                f"{f['obtain_s']:.3f}",
                f"{f['engine_s']:.3f}",
                f"{ft:.3f}",
                f"{lo['read_bytes'] / 1e6:.3f}",
                f"{lo['obtain_s']:.3f}",
                f"{lo['engine_s']:.3f}",
                f"{lt:.3f}",
                f"{lt / ft:.3f}x",
            ]
        )
        print(f"  applied {view}", file=sys.stderr)
    _table(header, rows, args.markdown)
    return out


# ------------------------------------------------------------------------------------------------ mismatch


def _manifests(args: argparse.Namespace, work: Path) -> dict[str, tuple[Path, float]]:
    """The LoRA example as is, and without trainer.lora at its learning rate and at the local default; each
    as the example runs (staleness unbounded) and with `staleness.maxSteps: 0` (`<name>/on-policy`)."""
    import yaml

    docs = list(yaml.safe_load_all((REPO / "examples" / "rljob-lora.yaml").read_text()))
    out: dict[str, tuple[Path, float]] = {}
    job = next(d for d in docs if d.get("kind") == "RLJob")
    lora_lr = float(job["spec"]["local"]["learningRate"])
    default_lr = _local_default_lr()
    for name, lora, lr in (
        ("lora", True, lora_lr),
        ("full-same-lr", False, lora_lr),
        ("full-default-lr", False, default_lr),
    ):
        for on_policy in (False, True):
            variant = json.loads(json.dumps(job))
            variant["metadata"]["name"] = f"bench-{name}{'-0' if on_policy else ''}"
            if not lora:
                del variant["spec"]["trainer"]["lora"]
            variant["spec"]["local"].update({"steps": args.steps, "learningRate": lr, "seed": args.seed})
            if on_policy:
                variant["spec"]["staleness"] = {"maxSteps": 0}
            key = f"{name}/on-policy" if on_policy else name
            path = work / f"{key.replace('/', '-')}.yaml"
            path.write_text(yaml.safe_dump(variant, sort_keys=False))
            out[key] = (path, lr)
    return out


def _local_default_lr() -> float:
    from rlfleet.api.rljob import LocalSpec

    return float(LocalSpec().learning_rate)


def _group_means(steps: list[dict[str, Any]], group: str) -> dict[str, float]:
    """Token-weighted means of a group's kl_k3 and oor_fraction over `steps`."""
    p = f"group/{group}/"
    n = [float(s.get(p + "num_tokens", 0.0)) for s in steps]
    total = sum(n)
    out = {"tokens": total}
    for key in ("kl_k3", "oor_fraction"):
        out[key] = (
            sum(w * float(s.get(p + key, 0.0)) for w, s in zip(n, steps, strict=True)) / total
            if total
            else 0.0
        )
    return out


def mismatch_part(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    manifests = _manifests(args, work)
    rlfleet = Path(sys.executable).with_name("rlfleet")
    runs: dict[str, Any] = {}
    for name, (path, lr) in manifests.items():
        out = work / f"run-{name.replace('/', '-')}"
        start = time.perf_counter()
        completed = subprocess.run(
            [str(rlfleet), "run", str(path), "--local", "--out", str(out), "--no-live", "--force"],
            capture_output=True,
            text=True,
            timeout=args.case_timeout,
        )
        if completed.returncode != 0:
            print(f"  {name} failed:\n{completed.stdout[-1500:]}{completed.stderr[-1500:]}", file=sys.stderr)
            continue
        report = json.loads((out / "report" / "metrics.json").read_text())
        steps = report["steps"]
        runs[name] = {
            "lr": lr,
            "wall_s": time.perf_counter() - start,
            "steps": len(steps),
            "staleness_mean": statistics.mean(float(s.get("staleness_mean", 0.0)) for s in steps),
            "reward_first_last": (float(steps[0]["reward_mean"]), float(steps[-1]["reward_mean"])),
            "entropy_last": statistics.mean(float(s.get("entropy", 0.0)) for s in steps[-args.last :]),
            "groups": {
                g: {"run": _group_means(steps, g), "last": _group_means(steps[-args.last :], g)}
                for g in VIEWS
            },
            "fleet": {
                "kl_k3": statistics.mean(float(s.get("kl_k3", 0.0)) for s in steps),
                "stale01_kl": statistics.mean(float(s.get("staleness/0-1/kl_k3", 0.0)) for s in steps),
            },
        }
        print(f"  ran {name} ({len(steps)} steps, {runs[name]['wall_s']:.0f} s)", file=sys.stderr)
    for suffix, what in (
        ("", "as the example runs (staleness unbounded)"),
        ("/on-policy", "staleness.maxSteps 0"),
    ):
        names = [n for n in runs if n.endswith(suffix) and (suffix or "/" not in n)]
        lora = "lora" + suffix
        if lora not in names:
            continue
        fulls = [n for n in names if n != lora]
        print(
            f"\nTrain/sample mismatch per group, `rlfleet run --local` {args.steps} steps, seed {args.seed}, {what}: "
            + "; ".join(
                f"{name} (lr {runs[name]['lr']:g}, mean staleness {runs[name]['staleness_mean']:.2f}, reward "
                f"{runs[name]['reward_first_last'][0]:.3f} -> {runs[name]['reward_first_last'][1]:.3f}, policy "
                f"entropy over the last {args.last} steps {runs[name]['entropy_last']:.3f} nats/token)"
                for name in names
            )
        )
        short = {n: n.removesuffix(suffix) for n in names}
        header = ["group", "window", "LoRA KL"]
        header += [f"{short[n]} KL" for n in fulls] + [f"LoRA / {short[n]} KL" for n in fulls]
        header += ["LoRA oor"] + [f"{short[n]} oor" for n in fulls]
        rows = []
        for g in VIEWS:
            for window in ("run", "last"):
                lo = runs[lora]["groups"][g][window]
                row = [g, "whole run" if window == "run" else f"last {args.last} steps", f"{lo['kl_k3']:.2e}"]
                row += [f"{runs[n]['groups'][g][window]['kl_k3']:.2e}" for n in fulls]
                for n in fulls:
                    fk = runs[n]["groups"][g][window]["kl_k3"]
                    row.append(f"{lo['kl_k3'] / fk:.2f}x" if fk else "-")
                row += [f"{lo['oor_fraction']:.2%}"]
                row += [f"{runs[n]['groups'][g][window]['oor_fraction']:.2%}" for n in fulls]
                rows.append(row)
        _table(header, rows, args.markdown)
    return runs


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", choices=["step", "publish", "mismatch"], default=None, help="one part (default: all)"
    )
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the machine is shared)")
    parser.add_argument(
        "--reps", type=int, default=2, help="timed steps per case / applies per view (min / median)"
    )
    parser.add_argument("--batch-seqs", type=int, default=8, help="trajectories of the step's batch")
    parser.add_argument("--batch-median", type=int, default=128)
    parser.add_argument("--batch-max", type=int, default=512)
    parser.add_argument("--versions", type=int, default=5, help="published versions after v0 (publish)")
    parser.add_argument(
        "--full-lr", type=float, default=1e-6, help="full fine-tuning's learning rate (publish)"
    )
    parser.add_argument("--lora-lr", type=float, default=1e-5, help="LoRA's learning rate (publish)")
    parser.add_argument("--steps", type=int, default=20, help="local.steps of each run (mismatch)")
    parser.add_argument("--seed", type=int, default=0, help="local.seed of each run (mismatch)")
    parser.add_argument("--last", type=int, default=5, help="the last steps' window (mismatch)")
    parser.add_argument("--case-timeout", type=float, default=900.0)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--dir", type=Path, default=None, help="where the files go (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)  # internal: one step case
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_step_case(args)))
        return 0
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rlfleet-lora-", dir=args.dir) as tmp:
        work = Path(tmp)
        model_dir = None
        if args.only in (None, "step", "publish"):
            model_dir = build_model(work / "model", args)
        if args.only in (None, "step"):
            assert model_dir is not None
            results["step"] = step_part(args, model_dir)
        if args.only in (None, "publish"):
            assert model_dir is not None
            results["publish"] = publish_part(args, model_dir, work / "publish")
        if args.only in (None, "mismatch"):
            (work / "mismatch").mkdir()
            results["mismatch"] = mismatch_part(args, work / "mismatch")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
