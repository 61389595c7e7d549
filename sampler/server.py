"""`rlfleet sampler serve`: the reference sampler server (an SGLang 0.5.23 emulator) or the real SGLang launcher.

`--engine reference` serves the reference engine (reference_engine.py: a Qwen3 checkpoint on CPU) over a real
aiohttp HTTP server speaking the part of SGLang 0.5.23's API rlfleet uses, with SGLang's keys, shapes,
defaults, validation order, error bodies, status codes and metrics (each checked against SGLang's own
code in tests/sglang_contract/test_sglang_reference_sampler.py; docs/sampler.md lists what). The
server is made of modules that each answer one question:
- http_app.py: the application (routes, bearer auth, the engine's lifetime) and an in-process server;
- serving_routes.py: /generate, /health, /health_generate, /model_info, /server_info, /metrics, /v1/models;
- admin_routes.py: /update_weights_from_disk, /update_weight_version, /load_lora_adapter,
  /unload_lora_adapter, /pause_generation, /continue_generation, /flush_cache;
- request_gate.py: SGLang's /generate validation, in its order; sglang_errors.py: its error bodies;
- server_metrics.py: SGLang's Prometheus metrics; server_context.py: what handlers read from the app.

`--engine sglang` builds the production command line with `rlfleet.catalog.sglang_launch`, plus the flags a
local `--model-path` checkpoint calls for (`launch_checkpoint.checkpoint_flags_of`), and execs
`python -m sglang.launch_server ...` (SGLang is only in the sampler image; here only the argv is tested).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rlfleet.lora import TARGET_MODULES
from rlfleet.sampler.http_app import start_reference_server

if TYPE_CHECKING:
    from rlfleet.sampler.reference_engine import ReferenceEngine


class CliError(Exception):
    pass


def lora_flags(args: argparse.Namespace) -> list[str]:
    """The LoRA flags of `args` as SGLang's command line spells them (none without --enable-lora)."""
    if not args.enable_lora:
        return []
    flags = ["--enable-lora", "--max-loras-per-batch", str(args.max_loras_per_batch)]
    if args.max_lora_rank is not None:
        flags += ["--max-lora-rank", str(args.max_lora_rank)]
    if args.lora_target_modules:
        flags += ["--lora-target-modules", *args.lora_target_modules]
    if args.max_loaded_loras is not None:
        flags += ["--max-loaded-loras", str(args.max_loaded_loras)]
    return flags


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlfleet sampler serve", description="Serve a sampler: reference engine or real SGLang."
    )
    p.add_argument("--engine", choices=("reference", "sglang"), default="reference")
    p.add_argument("--host", default=None, help="default 127.0.0.1 (reference) / 0.0.0.0 (sglang, in a pod)")
    p.add_argument(
        "--port", type=int, default=30000, help="0 = any free port (printed, and written to --port-file)"
    )
    p.add_argument("--port-file", help="write the bound port here once listening")
    p.add_argument(
        "--model-path",
        help="Hugging Face checkpoint or weight view directory (Qwen3); reference default: the tiny Qwen3 "
        "(rlfleet/tiny_qwen3.py) initialised from --seed",
    )
    p.add_argument("--served-model-name", default="tiny-qwen3")
    p.add_argument(
        "--weight-format",
        default="bf16",
        help="reference: fp32|bf16|fp8|fp8_block|nvfp4|mxfp4; sglang: bf16|fp8|nvfp4|mxfp4",
    )
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--weight-version", type=int, default=0)
    p.add_argument("--sampling-mask-max-tokens", type=int, default=4096)
    p.add_argument(
        "--sampling-backend",
        choices=("pytorch", "flashinfer"),
        default="pytorch",
        help="reference: whose kept sets to emulate (SGLang's CPU pytorch path, or its CUDA flashinfer path)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("RLFLEET_SAMPLER_API_KEY"),
        help="bearer token (env RLFLEET_SAMPLER_API_KEY)",
    )
    ref = p.add_argument_group("reference engine")
    ref.add_argument("--seed", type=int, default=0)
    ref.add_argument("--vocab-size", type=int, default=64, help="tiny Qwen3 without --model-path")
    ref.add_argument("--hidden-size", type=int, default=128, help="tiny Qwen3 without --model-path")
    ref.add_argument("--num-hidden-layers", type=int, default=2, help="tiny Qwen3 without --model-path")
    ref.add_argument("--num-attention-heads", type=int, default=2, help="tiny Qwen3 without --model-path")
    ref.add_argument("--head-dim", type=int, default=64, help="tiny Qwen3 without --model-path")
    ref.add_argument("--context-length", type=int, default=256, help="tiny Qwen3 without --model-path")
    ref.add_argument("--kernel-act-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ref.add_argument("--kernel-split-k", type=int, default=1)
    ref.add_argument("--max-running-requests", type=int, default=32)
    ref.add_argument(
        "--max-tokens-per-second", type=float, default=None, help="throttle (emulates a slower GPU)"
    )
    ref.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    lora = p.add_argument_group("LoRA (SGLang 0.5.23's flags and meaning; docs/sampler.md, 'LoRA')")
    lora.add_argument("--enable-lora", action="store_true", help="serve adapters (/load_lora_adapter)")
    lora.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank (required)")
    lora.add_argument(
        "--lora-target-modules",
        nargs="*",
        default=None,
        choices=(*TARGET_MODULES, "all"),
        help="projections adapters may target (required); q/k/v and gate/up enable each other (fused)",
    )
    lora.add_argument(
        "--max-loras-per-batch",
        type=int,
        default=8,
        help="distinct adapters in a batch, the base one of them",
    )
    lora.add_argument(
        "--max-loaded-loras", type=int, default=None, help="over it the least recently used is unloaded"
    )
    sg = p.add_argument_group("sglang engine")
    sg.add_argument("--accelerator", help="catalog class (a100, h100, h200, b200, b300, rtx-pro-6000)")
    sg.add_argument("--tensor-parallel", type=int, default=None)
    sg.add_argument("--python", default=sys.executable)
    sg.add_argument(
        "--print-argv", action="store_true", help="print the SGLang command line instead of exec'ing it"
    )
    sg.add_argument("extra", nargs=argparse.REMAINDER, help="after --: extra SGLang arguments")
    return p


def sglang_argv(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The SGLang launch command line and env for these CLI args (via rlfleet.catalog)."""
    if not args.accelerator:
        raise CliError("--engine sglang needs --accelerator (a catalog class, e.g. h100)")
    if not args.model_path:
        raise CliError("--engine sglang needs --model-path")
    try:
        from rlfleet import catalog
    except ImportError as exc:
        raise CliError(f"rlfleet.catalog unavailable: {exc}") from None
    from rlfleet.sampler.launch_checkpoint import NotLaunchableError, checkpoint_flags_of

    extra = [a for a in (args.extra or []) if a != "--"]
    model_dir = Path(args.model_path)
    try:
        # the flags the checkpoint itself calls for (a mixture of experts: --enable-return-routed-experts),
        # the same as a cluster group's launch file carries; a hub id (no local directory) has none
        own = checkpoint_flags_of(model_dir) if model_dir.is_dir() else []
    except NotLaunchableError as exc:
        raise CliError(str(exc)) from None
    extra = [*(f for f in own if f not in extra), *lora_flags(args), *extra]
    try:
        accel = catalog.get_catalog().get(args.accelerator)
        launch = catalog.sglang_launch(
            accelerator=accel,
            weight_format=args.weight_format,
            kv_cache_dtype=args.kv_cache_dtype,
            tensor_parallel=args.tensor_parallel,
            extra_args=tuple(extra),
            model_path=args.model_path,
            served_model_name=args.served_model_name,
            host=args.host,
            port=args.port,
            sampling_mask_max_tokens=args.sampling_mask_max_tokens,
            weight_version=args.weight_version,
            python=args.python,
        )
    except (KeyError, ValueError) as exc:
        raise CliError(str(exc).strip("'\"")) from None
    argv = list(launch.argv)
    if args.api_key and "--api-key" not in argv:
        argv += ["--api-key", args.api_key]
    return argv, dict(launch.env)


def _reference_engine(args: argparse.Namespace) -> tuple[ReferenceEngine, str]:
    import torch

    from rlfleet.numerics.engine_model import KernelConfig, load_checkpoint
    from rlfleet.sampler.reference_engine import EngineConfig, LoraSettings, ReferenceEngine, tiny_shape

    torch.set_num_threads(max(1, args.threads))
    weights, view = None, "fp32"
    if args.model_path:
        try:
            view, model_cfg, weights = load_checkpoint(args.model_path)
        except (OSError, ValueError, KeyError) as exc:
            raise CliError(f"cannot load --model-path {args.model_path}: {exc}") from None
    else:
        try:
            model_cfg = tiny_shape(
                vocab_size=args.vocab_size,
                hidden_size=args.hidden_size,
                intermediate_size=2 * args.hidden_size,
                num_hidden_layers=args.num_hidden_layers,
                num_attention_heads=args.num_attention_heads,
                num_key_value_heads=args.num_attention_heads,
                head_dim=args.head_dim,
                max_position_embeddings=args.context_length,
            )
        except ValueError as exc:
            raise CliError(str(exc)) from None
    lora = None
    if args.enable_lora:  # LoraSettings checks them as SGLang's check_lora_server_args does
        lora = LoraSettings(
            max_lora_rank=args.max_lora_rank or 0,
            target_modules=tuple(args.lora_target_modules or ()),
            max_loras_per_batch=args.max_loras_per_batch,
            max_loaded_loras=args.max_loaded_loras,
        )
    cfg = EngineConfig(
        model=model_cfg,
        weight_format=args.weight_format,
        kv_cache_dtype=args.kv_cache_dtype,
        kernel=KernelConfig(act_dtype=args.kernel_act_dtype, split_k=args.kernel_split_k),
        max_running_requests=args.max_running_requests,
        max_tokens_per_second=args.max_tokens_per_second,
        sampling_mask_max_tokens=args.sampling_mask_max_tokens,
        sampling_backend=args.sampling_backend,
        weight_version=args.weight_version,
        served_model_name=args.served_model_name,
        model_path=args.model_path,
        seed=args.seed,
        lora=lora,
    )
    return ReferenceEngine(cfg, weights, view), view


async def _serve(engine: ReferenceEngine, args: argparse.Namespace) -> None:
    server = await start_reference_server(engine, args.host, args.port, args.api_key, args.model_path)
    print(f"rlfleet reference sampler listening on {server.url}", flush=True)
    if args.port_file:
        Path(args.port_file).write_text(str(server.settings.port))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


def cli(argv: Sequence[str]) -> int:
    parser = _parser()
    args = parser.parse_args(list(argv))
    if args.host is None:
        args.host = "0.0.0.0" if args.engine == "sglang" else "127.0.0.1"
    try:
        if args.engine == "sglang":
            argv_out, env = sglang_argv(args)
            if args.print_argv:
                print(" ".join(argv_out))
                return 0
            os.execvpe(argv_out[0], argv_out, {**os.environ, **env})
        try:
            engine, _ = _reference_engine(args)
        except ValueError as exc:  # bad model / engine settings
            raise CliError(str(exc)) from None
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        asyncio.run(_serve(engine, args))
    except CliError as exc:
        print(f"rlfleet sampler serve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. port in use
        print(f"rlfleet sampler serve: {exc}", file=sys.stderr)
        return 1
    return 0
