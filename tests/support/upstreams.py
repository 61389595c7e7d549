"""Small real HTTP upstreams speaking the SGLang subset the router needs (test helper, not a mock:
real aiohttp servers on 127.0.0.1, real sockets).

`/generate` answers an SGLang-shaped JSON body (`text`, `output_ids`, `meta_info` with
`prompt_tokens`, `completion_tokens`, `weight_version`, ...). Capacity is modelled like a saturated
GPU: the replica delivers at most `tokens_per_second` (requests are served back to back on an
absolute schedule) and a queue forms beyond that. `/metrics` exposes
`sglang:generation_tokens_total`, `sglang:num_requests_total`, `sglang:gen_throughput` and
`sglang:num_running_reqs` with SGLang's label names.

`SubprocessUpstream` runs this module (`python -m support.upstreams --tps 2000` in tests/) as a process a
test can SIGKILL. `serving(app)` serves any aiohttp app on a free port for the length of a block: the
tests' own small fakes of an engine, Prometheus or the router's admin API.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from collections import deque
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from support.processes import die_with_parent

if TYPE_CHECKING:
    from rlfleet.operator.rebalance import GroupInput

TESTS = Path(__file__).resolve().parents[1]  # the folder `python -m support.upstreams` runs in


@dataclass
class UpstreamState:
    name: str
    tokens_per_second: float | None = None  # None: answer at once
    tokens_per_request: int = 16
    weight_version: int = 0
    fail_status: int | None = None  # answer every /generate with this status (e.g. 503)
    check_min_version: bool = False  # answer 409 to X-Min-Weight-Version above the served version
    api_key: str | None = None  # like SGLang --api-key: /generate and /model_info need the bearer token
    # An engine whose scheduler hangs: /health still answers, /generate and /health_generate never do.
    hung: bool = False
    started: int = 0  # /generate requests received (with a body)
    cancelled: int = 0  # /generate requests whose client closed the connection before the answer
    stall_stream: bool = False  # a stream hangs after its first chunk (and so does the engine: hung)
    probe_status: int = 200  # the /health_generate answer (503: SGLang starting or draining)
    bodies: list[tuple[int | None, int]] = field(default_factory=list)  # (Content-Length header, bytes read)
    authorizations: list[str] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))  # (time, tokens)


class _Counters(Collector):
    """SGLang counts generated tokens as decoding proceeds, not when a request ends: the counter at
    scrape time includes the finished part of the request being decoded (exact on the schedule)."""

    def __init__(self, state: UpstreamState, clock: dict[str, float]) -> None:
        self.state = state
        self.clock = clock

    def collect(self):
        labels = ["model_name", "tp_rank"]
        values = ["tiny", "0"]
        now = asyncio.get_running_loop().time()
        remaining = max(0.0, self.clock["busy_until"] - now) * (self.state.tokens_per_second or 0.0)
        generated = CounterMetricFamily("sglang:generation_tokens", "generated tokens", labels=labels)
        generated.add_metric(values, self.clock["scheduled_tokens"] - remaining)
        requests = CounterMetricFamily("sglang:num_requests", "finished requests", labels=labels)
        requests.add_metric(values, self.clock["finished"])
        window = [n for t, n in self.state.recent if now - t <= 2.0]
        throughput = GaugeMetricFamily("sglang:gen_throughput", "tokens/s", labels=labels)
        throughput.add_metric(values, sum(window) / 2.0)
        running = GaugeMetricFamily("sglang:num_running_reqs", "running", labels=labels)
        running.add_metric(values, self.clock["running"])
        yield from (generated, requests, throughput, running)


def make_app(state: UpstreamState) -> web.Application:
    registry = CollectorRegistry()
    clock = {"busy_until": 0.0, "scheduled_tokens": 0.0, "finished": 0.0, "running": 0.0}
    registry.register(_Counters(state, clock))

    async def generate(request: web.Request) -> web.Response:
        state.authorizations.append(request.headers.get("Authorization", ""))
        if state.api_key and request.headers.get("Authorization") != f"Bearer {state.api_key}":
            return web.json_response({"error": {"message": "unauthorized"}}, status=401)
        raw = await request.read()
        state.bodies.append((request.content_length, len(raw)))
        body = json.loads(raw)
        state.sessions.append(request.headers.get("X-Session-Id", ""))
        state.started += 1
        if state.hung:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:  # the client closed its connection (handler_cancellation)
                state.cancelled += 1
                raise
        if state.fail_status is not None:
            return web.json_response({"error": "failing on purpose"}, status=state.fail_status)
        wanted = request.headers.get("X-Min-Weight-Version")
        if state.check_min_version and wanted is not None and int(wanted) > state.weight_version:
            return web.json_response({"error": {"message": "weight version behind"}}, status=409)
        n_tokens = int(body.get("sampling_params", {}).get("max_new_tokens", state.tokens_per_request))
        prompt = body.get("input_ids") or []
        loop = asyncio.get_running_loop()
        clock["scheduled_tokens"] += n_tokens
        clock["running"] += 1
        try:
            if state.tokens_per_second:
                # A pipe of fixed capacity: requests finish one after another, each taking its
                # tokens / capacity, on an absolute schedule (a late wake-up of this event loop does
                # not lower the delivered rate: a saturated upstream delivers exactly its capacity).
                clock["busy_until"] = (
                    max(clock["busy_until"], loop.time()) + n_tokens / state.tokens_per_second
                )
                await asyncio.sleep(max(0.0, clock["busy_until"] - loop.time()))
        finally:
            clock["running"] -= 1
        clock["finished"] += 1
        state.recent.append((loop.time(), n_tokens))
        if body.get("stream") is True:
            # SGLang streams server-sent events: cumulative JSON chunks, then [DONE].
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for i in range(1, 4):
                chunk = {"text": "x" * i, "meta_info": {"completion_tokens": i, "upstream": state.name}}
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if state.stall_stream:
                    state.hung = True
                    try:
                        await asyncio.Event().wait()
                    except asyncio.CancelledError:  # the router closed the connection
                        state.cancelled += 1
                        raise
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        return web.json_response(
            {
                "text": "x" * n_tokens,
                "output_ids": list(range(n_tokens)),
                "meta_info": {
                    "id": "r",
                    "finish_reason": {"type": "length", "length": n_tokens},
                    "prompt_tokens": len(prompt),
                    "weight_version": str(state.weight_version),
                    "completion_tokens": n_tokens,
                    "cached_tokens": 0,
                    "upstream": state.name,
                },
            }
        )

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def health_generate(request: web.Request) -> web.Response:
        if state.hung:
            await asyncio.Event().wait()
        return web.Response(status=state.probe_status)

    async def model_info(request: web.Request) -> web.Response:
        if state.api_key and request.headers.get("Authorization") != f"Bearer {state.api_key}":
            return web.json_response({"error": {"message": "unauthorized"}}, status=401)
        return web.json_response({"model_path": "tiny", "weight_version": str(state.weight_version)})

    app = web.Application(client_max_size=64 * 1024 * 1024)  # the router bounds bodies; SGLang has no limit
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/model_info", model_info)
    return app


class InProcessUpstream:
    def __init__(self, state: UpstreamState, host: str = "127.0.0.1") -> None:
        self.state = state
        self.host = host  # any 127.x.y.z: several upstreams can share one port, as pods of one Service do
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, port: int = 0) -> InProcessUpstream:
        # handler_cancellation: a client that closes its connection cancels the handler, as SGLang aborts
        self.runner = web.AppRunner(make_app(self.state), access_log=None, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


async def rebalance_inputs(http: aiohttp.ClientSession, urls: Mapping[str, str]) -> list[GroupInput]:
    """The rebalancer's inputs from each group's one replica at `urls` (group -> base URL): its /metrics
    scraped and parsed as the operator's rebalancer reads them, 1 ready replica of 1 GPU at $1/h."""
    # imported here: an upstream process (`python -m support.upstreams`) starts without the operator
    from rlfleet.operator.rebalance import GroupInput, parse_sglang_metrics

    inputs = []
    for name, url in urls.items():
        async with http.get(url + "/metrics") as response:
            sample = parse_sglang_metrics(await response.text())
        inputs.append(GroupInput(name, ready_replicas=1, gpus=1, price_per_gpu_hour=1.0, pods={url: sample}))
    return inputs


@asynccontextmanager
async def serving(app: web.Application, **runner: Any) -> AsyncIterator[str]:
    """`app` served on a free 127.0.0.1 port while the block runs: yields its base URL. `runner`: the
    AppRunner's options (access_log=None, ...)."""
    app_runner = web.AppRunner(app, **runner)
    await app_runner.setup()
    await web.TCPSite(app_runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{app_runner.addresses[0][1]}"
    finally:
        await app_runner.cleanup()


class SubprocessUpstream:
    """An upstream in its own process, so a test can kill it like a crashed pod (SIGKILL)."""

    def __init__(
        self, name: str, tokens_per_second: float | None = None, weight_version: int = 0, port: int = 0
    ) -> None:
        self.name = name
        args = [sys.executable, "-m", "support.upstreams", "--name", name, "--version", str(weight_version)]
        args += ["--port", str(port)]
        if tokens_per_second:
            args += ["--tps", str(tokens_per_second)]
        self.process = subprocess.Popen(
            args, stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent, cwd=TESTS
        )
        line = self.process.stdout.readline()
        self.port = int(json.loads(line)["port"])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


async def _main(args: argparse.Namespace) -> None:
    upstream = InProcessUpstream(
        UpstreamState(args.name, tokens_per_second=args.tps, weight_version=args.version)
    )
    await upstream.start(args.port)
    print(json.dumps({"port": upstream.port}), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="upstream")
    parser.add_argument("--tps", type=float, default=None)
    parser.add_argument("--version", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    asyncio.run(_main(parser.parse_args()))
