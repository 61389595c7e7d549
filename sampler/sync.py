"""`rlfleet sampler sync`: the weight-sync sidecar, which reconciles its pod's engine to the weight
channel's pointer.

    rlfleet sampler sync --store /mnt/weights/job --view fp8 --engine-url http://127.0.0.1:30000 \\
        --group h100-fp8 --replica $POD_NAME --cache-dir /weights-cache --port 9400 [--fetch-only]

With RLFLEET_API_KEY in the environment (the operator passes the job's key Secret by reference), every
call to the engine presents it as `Authorization: Bearer` (the engine runs with `--api-key`).

Launch (`--fetch-only`, the pod's init container): SGLang must START from a checkpoint already in the
group's format (docs/weights.md), so before SGLang starts the init container waits for the newest
version of this pod's view, obtains it verified (BLAKE3 per file) and checks its config.json declares
the view's quantization (what SGLang auto-detects), writes the cache's launch file ("<version> <dir>",
rlfleet.catalog.LAUNCH_FILE) and exits. The engine container execs SGLang with `--model-path <dir>
--weight-version <version>` from that file; the sidecar starts from the same version and rewrites the
file after every applied version, so a restarted engine container launches from what it served.

This module composes the process; each part answers one question:
- syncer.py: the reconcile loop (which version, verified how, applied when, retried how);
- engine_clients.py: how a verified directory reaches the engine (`/update_weights_from_disk`, or with
  `--lora` `/load_lora_adapter`);
- launch_checkpoint.py: which version of the view, whether SGLang would load it, the launch file;
- sync_report.py: the subscriber report retention and the operator read;
- sync_state.py: configuration, state and Prometheus metrics; sync_http.py: /metrics /status /health.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
from aiohttp import web

from rlfleet.api.common import ENGINE_API_KEY_ENV
from rlfleet.channel import VIEW_NAMES, check_name
from rlfleet.cli import OneLineErrorParser
from rlfleet.sampler.engine_clients import DiskEngine, LoraEngine, engine_weight_version
from rlfleet.sampler.launch_checkpoint import read_launch_file
from rlfleet.sampler.sync_http import sidecar_app
from rlfleet.sampler.sync_state import SyncConfig
from rlfleet.sampler.syncer import Syncer
from rlfleet.store import FilesystemStore, open_store

log = logging.getLogger("rlfleet.sampler.sync")


async def serve(
    config: SyncConfig,
    *,
    stop: asyncio.Event | None = None,
    ready: Callable[[int], None] | None = None,
) -> None:
    """Run the sidecar until `stop` is set (or forever)."""
    stop = stop or asyncio.Event()
    store = open_store(config.store)
    async with httpx.AsyncClient(
        base_url=config.engine_url.rstrip("/"), timeout=config.request_timeout, headers=engine_headers(config)
    ) as client:
        if config.initial_version is None and not config.lora:  # the version SGLang launched from
            launched = read_launch_file(config.cache_dir)
            config.initial_version = launched[0] if launched else await engine_weight_version(client)
        syncer = Syncer(config, store, LoraEngine(client) if config.lora else DiskEngine(client))
        runner = web.AppRunner(sidecar_app(syncer), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, config.host, config.port).start()
        port = runner.addresses[0][1]  # the bound port (--port 0: the one the OS chose)
        log.info("weight sync sidecar for %s/%s (%s) on :%d", config.group, config.replica, config.view, port)
        if ready is not None:
            ready(port)
        try:
            await syncer.run(stop)
        finally:
            await runner.cleanup()
            store.close()


async def fetch(config: SyncConfig, *, stop: asyncio.Event | None = None) -> tuple[int, Path] | None:
    """Init-container mode (`--fetch-only`): the launch checkpoint, or None if stopped first."""
    store = open_store(config.store)
    try:
        async with httpx.AsyncClient(
            base_url=config.engine_url.rstrip("/"), headers=engine_headers(config)
        ) as client:
            syncer = Syncer(config, store, DiskEngine(client))
            return await syncer.fetch_for_launch(stop or asyncio.Event())
    finally:
        store.close()


def engine_headers(config: SyncConfig) -> dict[str, str]:
    """The engine's bearer key on every call (SGLang's `--api-key` leaves only /health* and /metrics open)."""
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


def _parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="rlfleet sampler sync",
        description="Weight-sync sidecar: reconcile an engine to the weight channel.",
    )
    p.add_argument(
        "--store",
        required=True,
        help="channel store: a path, file://path or s3://bucket/prefix[?endpoint=URL]",
    )
    p.add_argument("--view", required=True, choices=VIEW_NAMES, help="precision view this engine loads")
    p.add_argument("--engine-url", required=True, help="engine base URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--group", required=True, help="SamplerGroup name")
    p.add_argument("--replica", required=True, help="replica (pod) name")
    p.add_argument(
        "--cache-dir", default="/tmp/rlfleet-weights", help="local directory shared with the engine"
    )
    p.add_argument("--host", default="0.0.0.0", help="bind address of /metrics /status /health")
    p.add_argument(
        "--port", type=int, default=9400, help="port of /metrics /status /health (0: any free port)"
    )
    p.add_argument("--port-file", default=None, help="write the bound port here once listening")
    p.add_argument(
        "--poll-interval", type=float, default=2.0, help="seconds between pointer reads when in sync"
    )
    p.add_argument(
        "--backoff-max", type=float, default=60.0, help="cap of the exponential retry backoff (seconds)"
    )
    p.add_argument(
        "--initial-version",
        type=int,
        default=None,
        help="version the engine starts with (default: ask /model_info)",
    )
    p.add_argument(
        "--fetch-only",
        action="store_true",
        help="init container: wait for the newest version of the view, download + verify it into "
        "--cache-dir, write the launch file SGLang starts from, exit (implies --require-checkpoint)",
    )
    p.add_argument(
        "--in-place",
        action="store_true",
        help="filesystem store only: verify the view's files where the store holds them and load that "
        "directory (no copy into --cache-dir); the engine must mount the store at the same path",
    )
    p.add_argument(
        "--lora",
        action="store_true",
        help="the engine serves LoRA adapters: --view is the base it launches from (--fetch-only), and each "
        "version's adapter is loaded with /load_lora_adapter (docs/weights.md, 'LoRA')",
    )
    p.add_argument(
        "--require-checkpoint",
        action="store_true",
        help="load only views that are HF checkpoints (config.json whose quantization matches the view)",
    )
    return p


# the flags that are SyncConfig's fields of the same name, as given
_CONFIG_FLAGS = (
    "store",
    "view",
    "engine_url",
    "group",
    "replica",
    "host",
    "port",
    "poll_interval",
    "backoff_max",
    "initial_version",
    "in_place",
    "lora",
)


def _checked_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parsed arguments; anything wrong is one line on stderr and exit 2 (parser.error)."""
    args = parser.parse_args(argv)
    try:
        check_name("group", args.group)
        check_name("replica", args.replica)
        store = open_store(args.store)
    except ValueError as e:
        parser.error(str(e))
    if args.in_place and not isinstance(store, FilesystemStore):
        parser.error("--in-place needs a filesystem store (a path or file://), not " + args.store)
    if not args.engine_url.startswith(("http://", "https://")):
        parser.error(f"--engine-url must be an http(s) URL, got {args.engine_url!r}")
    if not 0 <= args.port <= 65535:
        parser.error("--port must be in 0..65535")
    return args


def cli(argv: list[str]) -> int:
    parser = _parser()
    args = _checked_args(parser, argv)
    config = SyncConfig(
        **{name: getattr(args, name) for name in _CONFIG_FLAGS},
        cache_dir=Path(args.cache_dir),
        require_checkpoint=args.require_checkpoint or args.fetch_only,
        api_key=os.environ.get(ENGINE_API_KEY_ENV) or None,
    )
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )

    async def main() -> int:
        import signal

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)  # finish the current step, then exit cleanly

        if args.fetch_only:
            return 0 if await fetch(config, stop=stop) is not None else 1

        def ready(port: int) -> None:
            if args.port_file:
                Path(args.port_file).write_text(str(port))

        await serve(config, stop=stop, ready=ready)
        return 0

    return asyncio.run(main())
