"""The weight-sync sidecar (sampler/syncer.py) as the weight tests drive it: in process on a store the test
holds, with no engine behind it, or as the init container's real CLI (`rlfleet sampler sync --fetch-only`)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from rlfleet.sampler.engine_clients import DiskEngine
from rlfleet.sampler.sync_state import SyncConfig
from rlfleet.sampler.syncer import Syncer
from rlfleet.store import Store

NO_ENGINE = "http://127.0.0.1:9"
"""An engine URL nothing listens on (the discard port): for the paths that never call the engine."""


@asynccontextmanager
async def engineless_syncer(
    store: Store,
    cache_dir: Path,
    *,
    view: str = "fp8",
    group: str = "g",
    replica: str = "pod-0",
    **fields: Any,
) -> AsyncIterator[Syncer]:
    """A sidecar of `group`'s replica `replica` on `store`'s `view`, its cache `cache_dir`, no engine behind it
    (NO_ENGINE): the launch fetch, the subscriber reports, the store's side of a step. `fields`: other
    SyncConfig fields. Its HTTP client is open until the block's end."""
    config = SyncConfig(
        store="unused",
        view=view,
        engine_url=NO_ENGINE,
        group=group,
        replica=replica,
        cache_dir=cache_dir,
        **fields,
    )
    async with httpx.AsyncClient() as client:
        yield Syncer(config, store, DiskEngine(client))


def fetch_only(store_uri: str, cache: Path, *flags: str) -> subprocess.Popen[str]:
    """The init container's real CLI: replica pod-0 of group h100-fp8 obtains the newest version of the
    store's fp8 view into `cache` (polling every 0.1 s), writes the launch file and exits; `flags` are
    added. Its output (stderr too) is text on its stdout pipe."""
    return subprocess.Popen(
        [
            str(Path(sys.executable).parent / "rlfleet"),
            "sampler",
            "sync",
            "--fetch-only",
            "--store",
            store_uri,
            "--view",
            "fp8",
            "--engine-url",
            NO_ENGINE,
            "--group",
            "h100-fp8",
            "--replica",
            "pod-0",
            "--cache-dir",
            str(cache),
            "--poll-interval",
            "0.1",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
