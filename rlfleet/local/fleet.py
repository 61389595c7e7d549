"""The local sampler fleet: one process hosting, on one asyncio loop, a REAL reference sampler server per
sampler group (HTTP, SGLang API subset, the group's emulated weight format, KV dtype and kernel), the
router (HTTP, session-affine, weighted) in front of them, and one weight-sync sidecar loop per group
(the real `rlfleet.sampler.syncer.Syncer`: reads the channel pointer, verifies the group's view and
applies it with `/update_weights_from_disk`).

As on a cluster, each engine STARTS from the newest version of its group's view (the sidecar's
`--fetch-only` step, `Syncer.fetch_for_launch`): the trainer publishes version 0 before it starts
this host, so an engine loads its weights once before the first rollout. The channel is a directory
every engine of this process sees, so the sidecars verify each version's files where the channel holds
them and load that directory in place (`SyncConfig.in_place`): nothing is copied into the cache
directory, which holds only each group's launch file (docs/weights.md, "Loading in place").

Why one process and not one per group: on a 2-core machine eight torch processes would mostly fight
for the cores; the servers are still separate HTTP endpoints with their own engines and ports, and
the trainer talks to them only through the router. `rlfleet run --local` starts this host as ONE
subprocess (`python -m rlfleet.local.fleet SPEC.json`), reads one JSON line with the URLs from its
stdout, and stops it with SIGTERM; the host also exits when its stdin closes, so it can never outlive
the trainer (no orphans, even on SIGKILL of the parent).

The engine API is closed with a key, as a cluster's is (docs/sampler.md, "The engine API"): the run's
key comes in this process's environment as RLFLEET_API_KEY (`rlfleet run --local` makes a random one per
run; never on a command line, in SPEC.json or in a log). Every engine requires it (`--api-key`: all but
/health, /health_generate and /metrics answer 401 without it), the sync loops present it, the router
requires it from its clients and presents it to the engines. Started without the variable (by hand),
the host serves open.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfleet.api.common import ENGINE_API_KEY_ENV

if TYPE_CHECKING:
    from rlfleet.sampler.reference_engine import ReferenceEngine

log = logging.getLogger("rlfleet.fleet")

# A different split-K reduction order per GPU class: kernels differ across generations even in bf16.
SPLIT_K = {"a100": 1, "h100": 2, "h200": 2, "b200": 4, "b300": 4, "rtx-pro-6000": 3}
ADMIN_TOKEN_ENV = "RLFLEET_ROUTER_ADMIN_TOKEN"


@dataclass
class GroupSpec:
    name: str
    accelerator: str
    weight_format: str  # bf16 | fp8 | nvfp4 | mxfp4 (RLJob)
    kv_cache_dtype: str = "auto"
    share: float = 1.0
    quarantined: bool = False
    lora: dict[str, Any] | None = None  # trainer.lora (LoraSpec, wire form): the engine serves its adapters


@dataclass
class FleetSpec:
    groups: list[GroupSpec]
    store: str  # channel store (local directory)
    cache_dir: str  # per group: the sidecar's launch file
    model_path: str  # the base Hugging Face checkpoint (the trainer publishes it as version 0; engines start from the channel)
    seed: int = 0
    max_running_requests: int = 64
    poll_interval: float = 0.2
    threads: int = 1
    # 0: any free port. A caller that must hand the router's URL to a trainer before the fleet is ready
    # fixes it (the engines start only once version 0 is published, and the trainer publishes it)
    router_port: int = 0

    @classmethod
    def from_json(cls, text: str) -> FleetSpec:
        raw = json.loads(text)
        raw["groups"] = [GroupSpec(**g) for g in raw["groups"]]
        return cls(**raw)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


@dataclass
class RunningFleet:
    router_url: str
    servers: dict[str, str] = field(default_factory=dict)  # group -> server URL
    api_key: str | None = None  # the run's engine key: every server and the router require it
    closers: list[Any] = field(default_factory=list)


class FleetStopped(Exception):
    """The host was stopped before every group had a version of its view to start from."""


async def start_fleet(spec: FleetSpec, stop: asyncio.Event) -> tuple[RunningFleet, list[asyncio.Task]]:
    import httpx
    import torch

    from rlfleet.router.config import GroupConfig, RouterConfig
    from rlfleet.router.service import start_service
    from rlfleet.sampler.engine_clients import DiskEngine, LoraEngine
    from rlfleet.sampler.http_app import start_reference_server
    from rlfleet.sampler.sync import engine_headers
    from rlfleet.sampler.sync_state import SyncConfig
    from rlfleet.sampler.syncer import Syncer
    from rlfleet.store import open_store

    torch.set_num_threads(max(1, spec.threads))
    api_key = os.environ.get(ENGINE_API_KEY_ENV) or None  # the run's key (module docstring)

    def sync_config(g: GroupSpec, engine_url: str, initial_version: int | None) -> SyncConfig:
        # in place: the channel is a directory this process sees (docs/weights.md, "Loading in place")
        return SyncConfig(
            store=spec.store,
            view=g.weight_format,
            engine_url=engine_url,
            group=g.name,
            replica=f"{g.name}-0",
            cache_dir=Path(spec.cache_dir) / g.name,
            poll_interval=spec.poll_interval,
            backoff_base=spec.poll_interval,
            initial_version=initial_version,
            in_place=True,
            lora=g.lora is not None,
            api_key=api_key,
        )

    def engine_client(g: GroupSpec, client: httpx.AsyncClient) -> DiskEngine | LoraEngine:
        return LoraEngine(client) if g.lora is not None else DiskEngine(client)

    fleet = RunningFleet(router_url="", api_key=api_key)
    store = open_store(spec.store)
    fleet.closers.append(store.close)
    # one client per group, for its sync loop (presenting the key); base_url set once its server listens
    clients = [
        httpx.AsyncClient(timeout=120.0, headers=engine_headers(sync_config(g, "", None)))
        for g in spec.groups
    ]
    fleet.closers.extend(c.aclose for c in clients)
    # As a pod's init container (`--fetch-only`): the newest version of each group's view, verified, its
    # launch file written. The engine is not up yet and the fetch never calls it (engine_url "").
    fetchers = [
        Syncer(sync_config(g, "", None), store, engine_client(g, c))
        for g, c in zip(spec.groups, clients, strict=True)
    ]
    launches = await asyncio.gather(*(f.fetch_for_launch(stop) for f in fetchers))
    ready = [launch for launch in launches if launch is not None]
    if len(ready) < len(spec.groups):
        raise FleetStopped
    engines = await asyncio.gather(
        *(
            asyncio.to_thread(_engine, spec, i, g, launch)
            for i, (g, launch) in enumerate(zip(spec.groups, ready, strict=True))
        )
    )
    tasks: list[asyncio.Task] = []
    for g, engine, client in zip(spec.groups, engines, clients, strict=True):
        server = await start_reference_server(engine, "127.0.0.1", 0, api_key=api_key)
        fleet.servers[g.name] = server.url
        fleet.closers.append(server.stop)
        client.base_url = httpx.URL(server.url)
        # with LoRA the engine serves its base and no adapter yet: the sidecar loads the newest version's
        initial = None if g.lora is not None else engine.weight_version
        syncer = Syncer(sync_config(g, server.url, initial), store, engine_client(g, client))
        tasks.append(asyncio.create_task(syncer.run(stop), name=f"sync-{g.name}"))
    router, runner, port = await start_service(
        RouterConfig(
            host="127.0.0.1",
            port=spec.router_port,
            groups=[
                GroupConfig(
                    name=g.name, share=g.share, replicas=[fleet.servers[g.name]], quarantined=g.quarantined
                )
                for g in spec.groups
            ],
            admin_token_env=ADMIN_TOKEN_ENV,
            api_key_env=ENGINE_API_KEY_ENV,  # required from the trainer, presented to the engines
            health_interval_seconds=1.0,
        )
    )
    fleet.router_url = f"http://127.0.0.1:{port}"
    fleet.closers.insert(0, router.close)
    fleet.closers.insert(0, runner.cleanup)
    return fleet, tasks


def _engine(spec: FleetSpec, index: int, g: GroupSpec, launch: tuple[int, Path]) -> ReferenceEngine:
    """Group `g`'s reference engine, loaded once from the verified launch checkpoint (version, dir)."""
    from rlfleet.catalog.launch import LORA_MAX_LOADED_LORAS, LORA_MAX_LORAS_PER_BATCH
    from rlfleet.numerics.engine_model import KernelConfig, load_checkpoint
    from rlfleet.sampler.reference_engine import ENGINE_KV, EngineConfig, LoraSettings, ReferenceEngine

    version, directory = launch
    view, model_cfg, weights = load_checkpoint(directory)
    lora = (  # the flags a pod's engine gets (rlfleet.catalog.launch lora_engine_flags)
        None
        if g.lora is None
        else LoraSettings(
            max_lora_rank=int(g.lora["rank"]),
            target_modules=tuple(g.lora["targetModules"]),
            max_loras_per_batch=LORA_MAX_LORAS_PER_BATCH,
            max_loaded_loras=LORA_MAX_LOADED_LORAS,
        )
    )
    return ReferenceEngine(
        EngineConfig(
            model=model_cfg,
            weight_format=g.weight_format,  # the view's name: the engine serves the channel's view as stored
            kv_cache_dtype=ENGINE_KV[g.kv_cache_dtype],
            kernel=KernelConfig(act_dtype="bfloat16", split_k=SPLIT_K.get(g.accelerator, 1)),
            max_running_requests=spec.max_running_requests,
            served_model_name=g.name,
            model_path=str(directory),
            weight_version=version,
            seed=spec.seed + index,
            lora=lora,
        ),
        weights,
        view,
    )


async def wait_until_serving(
    fleet: RunningFleet,
    version: int,
    timeout: float = 120.0,
    alive: Callable[[], bool] | None = None,
    adapters: bool = False,
) -> None:
    """Block until every server reports serving at least `version` (the trainer's first publish), or
    until `alive()` says the host is gone (the caller says how it ended). `adapters` (LoRA): until every
    server holds the adapter of `version` or a newer one (its /v1/models), not merely its base."""
    import httpx

    from rlfleet.lora import adapter_version

    async def serves(client: httpx.AsyncClient, url: str) -> bool:
        if adapters:
            cards = (await client.get(url + "/v1/models")).json().get("data") or []
            held = [
                adapter_version(str(c.get("id"))) for c in cards if isinstance(c, dict) and c.get("parent")
            ]
            return any(v is not None and v >= version for v in held)
        v = (await client.get(url + "/model_info")).json().get("weight_version")
        return v is not None and int(v) >= version

    headers = {"Authorization": f"Bearer {fleet.api_key}"} if fleet.api_key else {}
    async with httpx.AsyncClient(timeout=5.0, headers=headers) as client:
        deadline = asyncio.get_running_loop().time() + timeout
        pending = dict(fleet.servers)
        while pending and (alive is None or alive()):
            for name, url in list(pending.items()):
                with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError):
                    if await serves(client, url):
                        pending.pop(name)
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"groups {sorted(pending)} did not load weight version {version}")
            await asyncio.sleep(0.1)


async def _host(spec: FleetSpec) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)

    def watch_stdin() -> None:  # the parent holds our stdin: EOF means it is gone
        with contextlib.suppress(Exception):
            sys.stdin.read()
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=watch_stdin, daemon=True).start()
    try:
        fleet, tasks = await start_fleet(spec, stop)
    except FleetStopped:
        return 0
    log.info(
        "serving: router %s, servers %s (%s)",
        fleet.router_url,
        fleet.servers,
        "closed with the run's key" if fleet.api_key else f"open: no {ENGINE_API_KEY_ENV}",
    )
    print(json.dumps({"router": fleet.router_url, "servers": fleet.servers}), flush=True)
    await stop.wait()
    await stop_fleet(fleet, tasks)
    return 0


async def stop_fleet(fleet: RunningFleet, tasks: list[asyncio.Task], grace_seconds: float = 10.0) -> None:
    """Once `stop` is set: let each sync loop finish the step it is in (a version being verified is
    applied: the trainer's last publish is served) and withdraw its report, then close the router,
    servers, clients and store, in that order. A loop still busy after `grace_seconds` is cancelled."""
    if tasks:
        _, busy = await asyncio.wait(tasks, timeout=grace_seconds)
        for t in busy:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for close in fleet.closers:
        with contextlib.suppress(Exception):
            result = close()
            if asyncio.iscoroutine(result):
                await result


def main(argv: list[str]) -> int:
    # INFO: <out>/fleet.log (docs/local.md) records every group's weight loads; httpx would add a line per
    # health check and request, drowning them
    logging.basicConfig(
        level=os.environ.get("RLFLEET_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    spec = FleetSpec.from_json(Path(argv[0]).read_text())
    return asyncio.run(_host(spec))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
