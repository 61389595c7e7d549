"""The weight-sync sidecar's HTTP endpoints: `/metrics` (Prometheus), `/status` (JSON) and `/health`."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from rlfleet.sampler.syncer import Syncer

SYNCER = web.AppKey("syncer", Syncer)


async def metrics(request: web.Request) -> web.Response:
    registry = request.app[SYNCER].metrics.registry
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def status(request: web.Request) -> web.Response:
    return web.json_response(request.app[SYNCER].status())


async def health(_: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def sidecar_app(syncer: Syncer) -> web.Application:
    app = web.Application()
    app[SYNCER] = syncer
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/status", status)
    app.router.add_get("/health", health)
    return app
