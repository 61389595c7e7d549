"""The weight-sync sidecar against a real HTTP engine and real stores.

The engine here is a small aiohttp server in the test speaking the SGLang weight-update API: its
`/update_weights_from_disk` loads the directory with `rlfleet.numerics.views.load_view`, exactly
as the reference sampler server does, and it records every request (contract test)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from aiohttp import web
from support.moto import make_bucket
from support.ports import free_port
from support.sglang_launches import QUANTIZATION_CONFIGS, argv_printing_path, launch_of, launch_quantization
from support.waits import eventually, wait_for
from support.weight_sync import engineless_syncer, fetch_only

from rlfleet.channel import POINTER_KEY, SubscriberReport, WeightChannel, manifest_key, now_iso
from rlfleet.numerics import formats
from rlfleet.numerics.views import load_view
from rlfleet.sampler.engine_clients import DiskEngine
from rlfleet.sampler.sync import serve
from rlfleet.sampler.sync_http import sidecar_app
from rlfleet.sampler.sync_state import SyncConfig
from rlfleet.sampler.syncer import Syncer
from rlfleet.store import FilesystemStore, S3Store, Store, StoreUnavailableError
from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model
from rlfleet.trainer.publish.publisher import WeightPublisher


def tiny_state(seed: int) -> dict[str, torch.Tensor]:
    """The HF-named tensors of the tiny Qwen3 (rlfleet/tiny_qwen3.py, the shape of the `tiny_qwen3_dir`
    checkpoint the publishers here complete their views from: hidden 128, q/k/v 128 rows) from `seed`."""
    model = tiny_model(TinyQwen3(seed=seed))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def activation_amax(state: dict[str, torch.Tensor]) -> dict[str, float]:
    """The calibrated input amax per linear of `state` (an nvfp4 HF view's input_scale needs it)."""
    from rlfleet.numerics.views import calibrate_activation_amax

    model = tiny_model(TinyQwen3())
    model.load_state_dict(state)
    return calibrate_activation_amax(model, [torch.arange(32).reshape(2, 16)])


class RecordingEngine:
    """Real HTTP server with the SGLang weight-update endpoints; records requests."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.version: str | None = None
        self.weights: dict[str, torch.Tensor] | None = None
        self.view: str | None = None
        self.fail_next: dict[str, int] = {}
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        path = request.path
        body = await request.json() if request.can_read_body else {}
        self.requests.append((path, body))
        if self.fail_next.get(path, 0) > 0:
            self.fail_next[path] -= 1
            return web.json_response({"success": False, "message": f"injected failure of {path}"}, status=400)
        if path == "/update_weights_from_disk":
            view, weights = await asyncio.to_thread(load_view, body["model_path"])
            self.view, self.weights, self.version = view, weights, body["weight_version"]
            return web.json_response(
                {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
            )
        if path == "/update_weights_from_distributed":
            self.version = body["weight_version"]
        return web.json_response({"success": True, "message": "ok"})

    async def _model_info(self, _: web.Request) -> web.Response:
        return web.json_response({"model_path": "tiny", "weight_version": self.version})

    async def start(self) -> RecordingEngine:
        app = web.Application()
        for path in (
            "/update_weights_from_disk",
            "/init_weights_update_group",
            "/pause_generation",
            "/begin_weight_update",
            "/update_weights_from_distributed",
            "/end_weight_update",
            "/continue_generation",
        ):
            app.router.add_post(path, self._handle)
        app.router.add_get("/model_info", self._model_info)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()


@pytest.fixture
async def engine() -> Any:
    e = await RecordingEngine().start()
    yield e
    await e.stop()


def make_syncer(
    store: Store, engine: RecordingEngine, client: httpx.AsyncClient, tmp_path: Path, view: str = "fp8"
) -> Syncer:
    config = SyncConfig(
        store="unused",
        view=view,
        engine_url=engine.url,
        group="h100-fp8",
        replica="pod-0",
        cache_dir=tmp_path / "cache",
        poll_interval=0.05,
        backoff_base=0.05,
        backoff_max=0.5,
    )
    return Syncer(config, store, DiskEngine(client))


@contextlib.asynccontextmanager
async def fp8_sidecar(
    engine: RecordingEngine, tmp_path: Path, base_checkpoint: Path
) -> AsyncIterator[tuple[FilesystemStore, WeightPublisher, Syncer]]:
    """A filesystem channel, its fp8 publisher (nothing published yet) and the sidecar of `make_syncer` on
    it in front of `engine` (its HTTP client open until exit)."""
    store = FilesystemStore(tmp_path / "store", create=True)
    publisher = WeightPublisher(store, views=["fp8"], base_checkpoint=base_checkpoint)
    async with httpx.AsyncClient(base_url=engine.url) as client:
        yield store, publisher, make_syncer(store, engine, client, tmp_path)


def expected_fp8(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        k: formats.fake_quantize(v, "fp8_block")
        if k.endswith("_proj.weight")
        else v.to(torch.bfloat16).float()
        for k, v in state.items()
    }


async def test_sidecar_applies_versions_in_order(
    engine: RecordingEngine, tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    store = FilesystemStore(tmp_path / "store", create=True)
    publisher = WeightPublisher(store, views=["bf16", "fp8"], base_checkpoint=tiny_qwen3_dir)
    async with httpx.AsyncClient(base_url=engine.url) as client:
        syncer = make_syncer(store, engine, client, tmp_path)
        assert await syncer.reconcile_once() is False  # nothing published yet
        assert syncer.state.phase == "waiting"
        for version, seed in enumerate([1, 2]):
            state = tiny_state(seed)
            assert publisher.publish(state).version == version
            assert await syncer.reconcile_once() is True
            assert engine.version == str(version) and engine.view == "fp8"
            assert engine.weights is not None
            # what the publisher wrote, read back by the channel on its own: from version 1 on the fp8
            # publisher keeps a block's previous scale while its values fit (docs/weights.md, "Kept scales"),
            # so only the first version is a fresh quantization of the state
            oracle = (
                WeightChannel(store).obtain_view(version, "fp8", tmp_path / "oracle" / str(version)).directory
            )
            published = load_view(oracle)[1]
            if version == 0:
                assert published.keys() == expected_fp8(state).keys()
                assert all(torch.equal(published[k], v) for k, v in expected_fp8(state).items())
            for name, expected in published.items():
                assert torch.equal(engine.weights[name], expected), name
        report_before = store.get("subscribers/h100-fp8/pod-0.json")
        assert await syncer.reconcile_once() is False  # in sync: no further request ...
        assert store.get("subscribers/h100-fp8/pod-0.json") == report_before  # ... and no report rewrite
    disk = [b for p, b in engine.requests if p == "/update_weights_from_disk"]
    assert [b["weight_version"] for b in disk] == ["0", "1"]
    assert disk[-1] == {
        "model_path": str(tmp_path / "cache" / "v1-fp8"),
        "weight_version": "1",
        "flush_cache": True,
        "abort_all_requests": False,
    }
    status = syncer.status()
    assert (status["applied_version"], status["latest_version"], status["lag"], status["phase"]) == (
        1,
        1,
        0,
        "in-sync",
    )
    assert status["last_apply"]["version"] == 1 and status["last_apply"]["bytes"] > 0
    [report] = WeightChannel(store).subscribers()
    assert (report.group, report.replica, report.view, report.applied_version, report.in_use) == (
        "h100-fp8",
        "pod-0",
        "fp8",
        1,
        [1],
    )
    # the publisher follows subscribed views: a group reporting nvfp4 gets it from the next version on
    WeightChannel(store).report(type(report)("b200", "pod-0", "nvfp4", None, []))
    state = tiny_state(3)
    published = publisher.publish(state, activation_amax=activation_amax(state))  # nvfp4 needs input_scale
    assert set(published.manifest.views) == {"bf16", "fp8", "nvfp4"}


async def test_tampered_file_refused_counted_old_version_kept(
    engine: RecordingEngine, tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    async with fp8_sidecar(engine, tmp_path, tiny_qwen3_dir) as (store, publisher, syncer):
        first = tiny_state(1)
        publisher.publish(first)
        assert await syncer.reconcile_once()
        publisher.publish(tiny_state(2))
        key = "v1/fp8/model.safetensors"
        data = bytearray(store.get(key))
        data[len(data) // 2] ^= 0x01  # a single flipped bit inside the tensor bytes
        store.put(key, bytes(data))
        for attempt in (1, 2):
            assert await syncer.reconcile_once() is False
            assert syncer.state.failures["checksum"] == attempt
        assert syncer.state.applied_version == 0 and engine.version == "0"
        assert engine.weights is not None and torch.equal(
            engine.weights["lm_head.weight"], first["lm_head.weight"].to(torch.bfloat16).float()
        )
        assert [p for p, _ in engine.requests].count(
            "/update_weights_from_disk"
        ) == 1  # the engine never saw v1
        assert not (tmp_path / "cache" / "v1-fp8").exists()
        assert syncer.backoff_seconds() <= syncer.config.backoff_base * 2  # 2 failures: base * 2^1, jittered
        body = (await _get_metrics(syncer)).decode()
        assert 'rlfleet_weight_sync_failures_total{group="h100-fp8",reason="checksum",view="fp8"} 2.0' in body
        assert 'rlfleet_weight_sync_applied_version{group="h100-fp8",view="fp8"} 0.0' in body
        assert "checksum" in (syncer.status()["last_error"] or "")
        publisher.publish(tiny_state(3))  # the trainer moves on: v2 is clean
        assert await syncer.reconcile_once() is True
        assert syncer.state.applied_version == 2 and syncer.state.consecutive_failures == 0


async def test_unknown_digest_algorithm_refused_as_checksum_old_version_kept(
    engine: RecordingEngine, tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    """A manifest consistent with the pointer (as a newer publisher would write it) whose file entry
    names a digest algorithm this sidecar cannot verify: refused before download, counted as
    reason="checksum", the engine keeps v0 and nothing lands in the cache."""
    async with fp8_sidecar(engine, tmp_path, tiny_qwen3_dir) as (store, publisher, syncer):
        publisher.publish(tiny_state(1))
        assert await syncer.reconcile_once()
        publisher.publish(tiny_state(2))
        raw = json.loads(store.get(manifest_key(1)))
        raw["views"]["fp8"]["files"]["model.safetensors"]["digest"] = "md5:" + "0" * 32
        manifest_bytes = json.dumps(raw).encode()
        store.put(manifest_key(1), manifest_bytes)
        pointer = WeightChannel(store).latest()
        assert pointer is not None and pointer.version == 1
        rewritten = replace(pointer, manifest_sha256=hashlib.sha256(manifest_bytes).hexdigest())
        store.put(POINTER_KEY, rewritten.to_bytes())
        assert await syncer.reconcile_once() is False
        assert syncer.state.failures["checksum"] == 1 and syncer.state.failures["store"] == 0
        assert "unknown digest algorithm 'md5'" in (syncer.state.last_error or "")
        assert syncer.state.applied_version == 0 and engine.version == "0"
        assert not (tmp_path / "cache" / "v1-fp8").exists()


async def _get_metrics(syncer: Syncer) -> bytes:
    runner = web.AppRunner(sidecar_app(syncer), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with httpx.AsyncClient() as c:
            return (await c.get(f"http://127.0.0.1:{port}/metrics")).content
    finally:
        await runner.cleanup()


async def test_engine_restart_is_detected_and_reapplied(
    engine: RecordingEngine, tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    """The engine container restarts with its initial weights: the sidecar notices (/model_info
    weight_version) and brings it back to the pointer instead of believing its own bookkeeping."""
    async with fp8_sidecar(engine, tmp_path, tiny_qwen3_dir) as (store, publisher, syncer):
        publisher.publish(tiny_state(1))
        publisher.publish(tiny_state(2))
        assert await syncer.reconcile_once() and engine.version == "1"
        engine.version, engine.weights = "0", None  # restarted with --weight-version 0
        assert await syncer.reconcile_once() is True
        assert engine.version == "1" and engine.weights is not None
        assert syncer.state.applied_version == 1
        disk = [b["weight_version"] for p, b in engine.requests if p == "/update_weights_from_disk"]
        assert disk == ["1", "1"]


async def test_engine_failure_keeps_old_version_then_retries(
    engine: RecordingEngine, tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    async with fp8_sidecar(engine, tmp_path, tiny_qwen3_dir) as (store, publisher, syncer):
        publisher.publish(tiny_state(1))
        assert await syncer.reconcile_once()
        publisher.publish(tiny_state(2))
        engine.fail_next["/update_weights_from_disk"] = 1
        assert await syncer.reconcile_once() is False
        assert (syncer.state.applied_version, syncer.state.failures["engine"]) == (0, 1)
        assert "injected failure" in (syncer.state.last_error or "")
        assert await syncer.reconcile_once() is True
        assert syncer.state.applied_version == 1 and engine.version == "1"


class TcpProxy:
    """A real TCP forwarder we can take down and bring back: the store 'unreachable then back'."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for w in self._writers:
            w.close()
        self._writers.clear()
        await self._server.wait_closed()


async def test_store_unreachable_then_back(
    engine: RecordingEngine, s3_endpoint: str, tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    bucket = make_bucket(s3_endpoint)
    direct = S3Store(bucket, "job", endpoint_url=s3_endpoint)
    publisher = WeightPublisher(direct, views=["fp8"], base_checkpoint=tiny_qwen3_dir)
    proxy = TcpProxy(int(s3_endpoint.rsplit(":", 1)[1]))
    await proxy.start()
    sidecar_store = S3Store(
        bucket,
        "job",
        endpoint_url=f"http://127.0.0.1:{proxy.port}",
        max_attempts=1,
        connect_timeout=1,
        read_timeout=5,
    )
    try:
        async with httpx.AsyncClient(base_url=engine.url) as client:
            syncer = make_syncer(sidecar_store, engine, client, tmp_path)
            publisher.publish(tiny_state(1))
            assert await syncer.reconcile_once() and syncer.state.applied_version == 0
            await proxy.stop()  # the store goes away
            publisher.publish(tiny_state(2))  # the trainer still reaches it
            delays = []
            for attempt in (1, 2, 3):
                assert await syncer.reconcile_once() is False
                assert syncer.state.failures["store"] == attempt
                delays.append(syncer.config.backoff_base * 2 ** (attempt - 1))
            assert syncer.state.applied_version == 0 and engine.version == "0"
            assert syncer.status()["phase"] == "backoff" and "store" in (syncer.status()["last_error"] or "")
            assert min(syncer.config.backoff_max, delays[-1]) * 0.5 <= syncer.backoff_seconds() <= delays[-1]
            await proxy.start()  # back
            assert await syncer.reconcile_once() is True
            assert syncer.state.applied_version == 1 and engine.version == "1"
            assert syncer.state.consecutive_failures == 0
    finally:
        sidecar_store.close()
        direct.close()


def published_bf16(tmp_path: Path, base_checkpoint: Path) -> Path:
    """A filesystem channel holding version 0 of the bf16 view; its directory."""
    store_dir = tmp_path / "store"
    store = FilesystemStore(store_dir, create=True)
    WeightPublisher(store, views=["bf16"], base_checkpoint=base_checkpoint).publish(tiny_state(1))
    return store_dir


@contextlib.asynccontextmanager
async def serving_sidecar(
    store_dir: Path, engine: RecordingEngine, cache: Path, group: str = "a100", replica: str = "pod-9"
) -> AsyncIterator[list[int]]:
    """The sidecar as its pod runs it (`serve`: the sync loop and its HTTP endpoints on a free port) on the
    bf16 view of the channel in `store_dir`, in front of `engine`: yields the list its port is appended to
    once it listens; stopped (SIGTERM's path) at exit."""
    config = SyncConfig(
        store=str(store_dir),
        view="bf16",
        engine_url=engine.url,
        group=group,
        replica=replica,
        cache_dir=cache,
        host="127.0.0.1",
        port=0,
        poll_interval=0.05,
    )
    stop = asyncio.Event()
    ports: list[int] = []
    task = asyncio.create_task(serve(config, stop=stop, ready=ports.append))
    try:
        yield ports
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_serve_exposes_metrics_and_status(
    engine: RecordingEngine, tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    store_dir = published_bf16(tmp_path, tiny_qwen3_dir)
    engine.version = None
    async with serving_sidecar(store_dir, engine, tmp_path / "cache") as ports:
        async with httpx.AsyncClient() as client:
            for _ in range(200):
                if ports and engine.version == "0":
                    break
                await asyncio.sleep(0.05)
            assert engine.version == "0"
            status = (await client.get(f"http://127.0.0.1:{ports[0]}/status")).json()
            assert (status["applied_version"], status["view"], status["mode"]) == (0, "bf16", "disk")
            metrics = (await client.get(f"http://127.0.0.1:{ports[0]}/metrics")).text
            assert 'rlfleet_weight_sync_applied_version{group="a100",view="bf16"} 0.0' in metrics
            assert 'rlfleet_weight_sync_applies_total{group="a100",view="bf16"} 1.0' in metrics
            assert "rlfleet_weight_sync_apply_seconds_bucket" in metrics
            assert (await client.get(f"http://127.0.0.1:{ports[0]}/health")).json() == {"ok": True}


async def test_a_replica_that_stops_cleanly_removes_its_own_report(
    engine: RecordingEngine, tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    """SIGTERM (its pod deleted or replaced) stops the sidecar: its report goes with it, so a replaced
    pod pins no version and counts in no status; another replica's report stays."""
    store_dir = published_bf16(tmp_path, tiny_qwen3_dir)
    channel = WeightChannel(FilesystemStore(store_dir))
    channel.report(
        SubscriberReport(
            group="a100", replica="pod-8", view="bf16", applied_version=0, in_use=[0], updated_at=now_iso()
        )
    )
    async with serving_sidecar(store_dir, engine, tmp_path / "cache"):
        for _ in range(200):
            if any(r.replica == "pod-9" and r.applied_version == 0 for r in channel.subscribers()):
                break
            await asyncio.sleep(0.05)
        assert {(r.replica, r.applied_version) for r in channel.subscribers()} == {("pod-8", 0), ("pod-9", 0)}
    assert [r.replica for r in channel.subscribers()] == ["pod-8"]


async def test_initial_version_from_engine_is_not_reapplied(
    engine: RecordingEngine, tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    store_dir = published_bf16(tmp_path, tiny_qwen3_dir)
    engine.version = "0"  # the engine was started with --weight-version 0
    async with serving_sidecar(store_dir, engine, tmp_path / "cache", group="g", replica="r") as ports:
        async with httpx.AsyncClient() as client:

            async def in_sync_at_v0() -> bool:  # it has compared v0 with what the engine serves
                if not ports:
                    return False
                status = (await client.get(f"http://127.0.0.1:{ports[0]}/status")).json()
                return (status["phase"], status["applied_version"], status["latest_version"]) == (
                    "in-sync",
                    0,
                    0,
                )

            await eventually(in_sync_at_v0, "the sidecar in sync at v0", 30)
    assert ports and not [p for p, _ in engine.requests if p == "/update_weights_from_disk"]


def sync_argv(*extra: str, **flags: str | None) -> list[str]:
    """Arguments of `rlfleet sampler sync`: a valid set (store /tmp/x, view fp8, engine URL http://x, group
    g, replica r) with `flags` replaced (engine_url is --engine-url; None leaves the flag out), then `extra`."""
    valid: dict[str, str | None] = {
        "store": "/tmp/x",
        "view": "fp8",
        "engine_url": "http://x",
        "group": "g",
        "replica": "r",
    }
    argv = [
        part
        for name, value in (valid | flags).items()
        if value is not None
        for part in ("--" + name.replace("_", "-"), value)
    ]
    return argv + list(extra)


@pytest.mark.parametrize(
    "argv, message",
    [
        (sync_argv(store=None), "--store"),
        (sync_argv(view="int3"), "invalid choice"),
        (sync_argv(store="gs://b"), "unsupported store URI"),
        (
            sync_argv("--in-place", store="s3://bucket/job"),
            "--in-place needs a filesystem store (a path or file://), not s3://bucket/job",
        ),
        (sync_argv(engine_url="localhost:1"), "http(s) URL"),
        (sync_argv(group="../g"), "invalid group"),
    ],
)
def test_cli_bad_input_is_one_clear_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlfleet.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["sampler", "sync", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("rlfleet sampler sync: error:")


def test_cli_help_runs_without_torch() -> None:
    """The sidecar image path: `rlfleet sampler sync --help` works and never imports torch."""
    import subprocess

    code = "import sys; from rlfleet.cli import main\ntry:\n    main(['sampler','sync','--help'])\nexcept SystemExit as e:\n    assert e.code == 0\nassert 'torch' not in sys.modules, 'torch imported'\nprint('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--engine-url" in result.stdout and result.stdout.strip().endswith("ok")


# --- launch: the init container fetches the newest version of the pod's view before SGLang starts ------

HF_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16"}


def hf_view(state: dict[str, torch.Tensor], view: str, directory: Path, declared: str | None = None) -> Path:
    """A view directory with the checkpoint's config.json (declaring `declared`'s quantization)."""
    import json

    from rlfleet.numerics.views import save_view

    save_view(state, view, directory)
    quant = QUANTIZATION_CONFIGS[declared or view]
    config = {**HF_CONFIG, **({"quantization_config": quant} if quant else {})}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def publish_hf(store: Store, state: dict[str, torch.Tensor], views: list[str], tmp: Path) -> int:
    import uuid

    base = tmp / f"views-{uuid.uuid4().hex[:6]}"
    return WeightChannel(store).publish({v: hf_view(state, v, base / v) for v in views}).version


def test_fetch_only_waits_for_version_0_then_writes_the_launch_file(tmp_path: Path) -> None:
    """The real CLI as the init container runs it: it waits (reporting in the store) until version 0
    exists, downloads + verifies the fp8 view, checks it is a block-FP8 checkpoint, writes the launch
    file and exits 0."""
    import json

    from rlfleet.catalog import LAUNCH_FILE
    from rlfleet.sampler.launch_checkpoint import read_launch_file

    store = FilesystemStore(tmp_path / "store", create=True)
    cache = tmp_path / "cache"
    proc = fetch_only(str(tmp_path / "store"), cache)
    try:
        # waiting is visible: its subscriber report exists, with nothing applied and nothing in use
        wait_for(
            "the waiting init container's report",
            lambda: WeightChannel(store).subscribers(),
            timeout=30,
            interval=0.05,
            running=[proc],
        )
        [report] = WeightChannel(store).subscribers()
        assert (report.view, report.applied_version, report.in_use) == ("fp8", None, [])
        assert proc.poll() is None and not (cache / LAUNCH_FILE).exists()
        state = tiny_state(1)
        publish_hf(store, state, ["bf16", "fp8"], tmp_path)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert read_launch_file(cache) == (0, cache / "v0-fp8")
    assert (cache / LAUNCH_FILE).read_text() == f"0 {cache / 'v0-fp8'}\n"
    config = json.loads((cache / "v0-fp8" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    view, weights = load_view(cache / "v0-fp8")
    assert view == "fp8"
    for name, expected in expected_fp8(state).items():
        assert torch.equal(weights[name], expected), name
    # retention keeps what the pod launches from
    [report] = WeightChannel(store).subscribers()
    assert report.in_use == [0] and report.applied_version is None


async def test_fetch_refuses_a_bf16_checkpoint_published_as_the_fp8_view(tmp_path: Path) -> None:
    """A BF16 checkpoint under the fp8 view would make SGLang quantize online (no later update could
    load): it never reaches the launch file."""
    from rlfleet.catalog import LAUNCH_FILE

    store = FilesystemStore(tmp_path / "store", create=True)
    WeightChannel(store).publish({"fp8": hf_view(tiny_state(1), "bf16", tmp_path / "bf16")})
    async with engineless_syncer(store, tmp_path / "cache", backoff_base=0.05, backoff_max=0.1) as syncer:
        stop = asyncio.Event()
        task = asyncio.create_task(syncer.fetch_for_launch(stop))
        for _ in range(400):
            if syncer.state.failures["checksum"] >= 2:
                break
            await asyncio.sleep(0.025)
        stop.set()
        assert await asyncio.wait_for(task, 10) is None
    assert syncer.state.failures["checksum"] >= 2
    assert (
        "quantization method fp8" in (syncer.state.last_error or "")
        and "declares none" in syncer.state.last_error
    )
    assert not (tmp_path / "cache" / LAUNCH_FILE).exists() and not (tmp_path / "cache" / "v0-fp8").exists()


@pytest.mark.parametrize("architecture", ["qwen3_moe", "qwen3"])
async def test_the_launch_file_carries_a_moe_checkpoints_flag_into_the_sglang_launch(
    tmp_path: Path, tiny_qwen3_factory: Any, architecture: str
) -> None:
    """The real publisher publishes the tiny Qwen3-MoE's (or dense Qwen3's) bf16 view, the init
    container's fetch (`Syncer.fetch_for_launch`) writes the launch file, and the SGLang engine
    container's script (`launch_from_file` as the operator builds it for an SGLang group) runs for real
    under /bin/sh with `python3` a stub printing its argv: `--enable-return-routed-experts` is on the
    command line exactly for the mixture of experts."""
    import json
    import subprocess

    from rlfleet.catalog import LAUNCH_FILE, MODEL_DIR_REF, WEIGHT_VERSION_REF, launch_from_file, load_catalog

    store = FilesystemStore(tmp_path / "store", create=True)
    base = tiny_qwen3_factory(architecture=architecture)
    state = {
        k: v.detach().clone()
        for k, v in tiny_model(TinyQwen3(architecture=architecture)).state_dict().items()
    }
    assert WeightPublisher(store, views=["bf16"], base_checkpoint=base).publish(state).version == 0
    async with engineless_syncer(
        store, tmp_path / "cache", view="bf16", group="h100-bf16", require_checkpoint=True
    ) as syncer:
        fetched = await syncer.fetch_for_launch(asyncio.Event())
    assert fetched == (0, tmp_path / "cache" / "v0-bf16")
    target = fetched[1]
    moe = architecture == "qwen3_moe"
    flags = ["--enable-return-routed-experts"] if moe else []
    assert (tmp_path / "cache" / LAUNCH_FILE).read_text() == f"0 {target}\n" + (
        "--enable-return-routed-experts\n" if moe else ""
    )

    h100 = load_catalog(None).get("h100")
    placeholder = launch_of(h100, "bf16", MODEL_DIR_REF, WEIGHT_VERSION_REF)
    script = launch_from_file(placeholder.argv, str(tmp_path / "cache" / LAUNCH_FILE), checkpoint_flags=True)
    env = argv_printing_path(tmp_path / "bin")  # the stub engine: prints the argv it was started with
    argv = json.loads(subprocess.run(script, capture_output=True, text=True, env=env, check=True).stdout)
    direct = launch_of(h100, "bf16", target)
    assert argv == [*direct.argv[1:], *flags]


def test_check_launchable_per_view(tmp_path: Path) -> None:
    from rlfleet.numerics.views import save_view
    from rlfleet.sampler.launch_checkpoint import NotLaunchableError, check_launchable

    state = tiny_state(1)
    for view, method in (("bf16", None), ("fp8", "fp8"), ("nvfp4", "modelopt_fp4"), ("mxfp4", "mxfp4")):
        hf_view(state, view, tmp_path / view)
        assert check_launchable(tmp_path / view, view) == method
        for other in {"bf16", "fp8", "nvfp4", "mxfp4"} - {view}:
            with pytest.raises(NotLaunchableError, match=f"view {other} needs"):
                check_launchable(tmp_path / view, other)
    save_view(state, "fp8", tmp_path / "bare")  # no config.json: the reference engine's own view files
    with pytest.raises(NotLaunchableError, match="no config.json"):
        check_launchable(tmp_path / "bare", "fp8")
    assert check_launchable(tmp_path / "bare", "fp8", require_config=False) is None


def test_newest_version_of_view_skips_versions_without_it(tmp_path: Path) -> None:
    from rlfleet.channel import newest_version_of_view

    store = FilesystemStore(tmp_path / "store", create=True)
    channel = WeightChannel(store)
    assert newest_version_of_view(channel, "fp8") is None
    assert publish_hf(store, tiny_state(1), ["bf16", "fp8"], tmp_path) == 0
    assert publish_hf(store, tiny_state(2), ["bf16"], tmp_path) == 1
    version, manifest = newest_version_of_view(channel, "fp8")
    assert version == 0 and "fp8" in manifest.views
    assert newest_version_of_view(channel, "bf16")[0] == 1
    assert newest_version_of_view(channel, "nvfp4") is None


async def test_sidecar_starts_from_the_launch_file_and_rewrites_it(
    engine: RecordingEngine, tmp_path: Path
) -> None:
    """The engine is still loading (it reports no version): the sidecar believes the launch file, does
    not re-apply v0, applies v1 and names it in the launch file (a restarted engine container starts
    from v1 with --weight-version 1)."""
    from rlfleet.sampler.launch_checkpoint import read_launch_file, write_launch_file

    store = FilesystemStore(tmp_path / "store", create=True)
    publish_hf(store, tiny_state(1), ["fp8"], tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    write_launch_file(cache, 0, cache / "v0-fp8")
    config = SyncConfig(
        store=str(tmp_path / "store"),
        view="fp8",
        engine_url=engine.url,
        group="g",
        replica="r",
        cache_dir=cache,
        host="127.0.0.1",
        port=0,
        poll_interval=0.05,
        require_checkpoint=True,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(serve(config, stop=stop))
    try:
        publish_hf(store, tiny_state(2), ["fp8"], tmp_path)
        for _ in range(400):
            if engine.version == "1":
                break
            await asyncio.sleep(0.025)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    disk = [b["weight_version"] for p, b in engine.requests if p == "/update_weights_from_disk"]
    assert disk == ["1"]
    assert read_launch_file(cache) == (1, cache / "v1-fp8")
    assert (cache / "v1-fp8" / "config.json").is_file()  # what the launch file names is kept


async def test_prune_keeps_the_newest_local_versions_and_the_launch_checkpoint(
    engine: RecordingEngine, tmp_path: Path
) -> None:
    from rlfleet.sampler.launch_checkpoint import read_launch_file

    store = FilesystemStore(tmp_path / "store", create=True)
    async with httpx.AsyncClient(base_url=engine.url) as client:
        syncer = make_syncer(store, engine, client, tmp_path)
        syncer.config.keep_local = 1
        for seed in (1, 2, 3):
            publish_hf(store, tiny_state(seed), ["fp8"], tmp_path)
            assert await syncer.reconcile_once() is True
    cache = tmp_path / "cache"
    assert sorted(p.name for p in cache.glob("v*-fp8")) == ["v2-fp8"]
    assert read_launch_file(cache) == (2, cache / "v2-fp8")


@pytest.mark.parametrize("view", ["bf16", "fp8", "nvfp4"])
async def test_fetch_launches_from_the_publishers_real_hf_checkpoint(view: str, tmp_path: Path) -> None:
    """Version 0 as the trainer publishes it from a real (tiny) Qwen3 HF checkpoint (WeightPublisher,
    rlfleet/numerics/views.py): the init container's fetch accepts it for its own view, the launch dir is
    a complete checkpoint (config.json whose quantization is the catalog's --quantization for the view,
    tokenizer files) and the other quantized views' checkpoints are refused for this view."""
    import json

    from test_weights_sglang_loaders import CALIBRATION, build_model, build_tokenizer

    from rlfleet.catalog import load_catalog
    from rlfleet.numerics.views import calibrate_activation_amax
    from rlfleet.sampler.launch_checkpoint import NotLaunchableError, check_launchable, read_launch_file

    base = tmp_path / "base"
    build_model("dense", seed=0).save_pretrained(base)
    build_tokenizer(base)
    store = FilesystemStore(tmp_path / "store", create=True)
    model = build_model("dense", seed=1)
    amax = calibrate_activation_amax(model, [CALIBRATION])
    WeightPublisher(store, views=["bf16", "fp8", "nvfp4"], base_checkpoint=base).publish(
        model.state_dict(), activation_amax=amax
    )
    async with engineless_syncer(store, tmp_path / "cache", view=view, require_checkpoint=True) as syncer:
        fetched = await syncer.fetch_for_launch(asyncio.Event())
    assert fetched == (0, tmp_path / "cache" / f"v0-{view}") == read_launch_file(tmp_path / "cache")
    directory = fetched[1]
    assert (directory / "tokenizer.json").is_file() and (directory / "tokenizer_config.json").is_file()
    assert check_launchable(directory, view) == launch_quantization(
        load_catalog(None).get("b200"), view, directory
    )
    declared = json.loads((directory / "config.json").read_text()).get("quantization_config")
    assert (declared is None) == (view == "bf16")
    for other in {"fp8", "nvfp4"} - {view}:
        WeightChannel(store).obtain_view(0, other, tmp_path / other)
        with pytest.raises(NotLaunchableError):
            check_launchable(tmp_path / other, view)


class FlakyStore(FilesystemStore):
    """A filesystem store whose subscriber-report writes fail while `fail_reports` is set (as on a
    read-only mount or a store that refuses writes), whose downloads take `download_delay` seconds per
    file, and which records when each report was written."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, create=True, fsync=False)
        self.fail_reports = False
        self.download_delay = 0.0
        self.report_writes: list[float] = []
        self.downloads: list[tuple[float, float]] = []

    def put(self, key: str, data: bytes) -> None:
        if key.startswith("subscribers/"):
            if self.fail_reports:
                raise StoreUnavailableError(f"injected: cannot write {key}")
            self.report_writes.append(time.monotonic())
        super().put(key, data)

    def get_file(self, key: str, path: Path, **kwargs: Any) -> Any:
        start = time.monotonic()
        time.sleep(self.download_delay)
        try:
            return super().get_file(key, path, **kwargs)
        finally:
            self.downloads.append((start, time.monotonic()))


async def test_a_failing_report_write_warns_once_per_streak_and_is_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="rlfleet.sampler.sync")
    store = FlakyStore(tmp_path / "store")
    # report_interval 0: every step writes its report
    async with engineless_syncer(store, tmp_path / "cache", report_interval=0.0) as syncer:

        def failures() -> float | None:
            return syncer.metrics.registry.get_sample_value(
                "rlfleet_weight_sync_report_failures_total", {"group": "g", "view": "fp8"}
            )

        def warnings() -> list[str]:
            return [
                r.getMessage()
                for r in caplog.records
                if r.levelno == logging.WARNING and "could not write the subscriber report" in r.getMessage()
            ]

        assert failures() == 0.0
        store.fail_reports = True
        for _ in range(3):
            await syncer.reconcile_once()  # nothing published: "waiting", and a report each step
        assert syncer.state.phase == "waiting"
        assert (syncer.state.report_failures, syncer.state.report_failure_streak) == (3, 3)
        assert syncer.status()["report_failures"] == 3 and failures() == 3.0
        [warning] = warnings()
        assert "subscribers/g/pod-0.json" in warning and "injected: cannot write" in warning
        assert WeightChannel(store).subscribers() == []
        store.fail_reports = False
        await syncer.reconcile_once()
        assert (syncer.state.report_failures, syncer.state.report_failure_streak) == (3, 0)
        [report] = WeightChannel(store).subscribers()
        assert (report.group, report.replica, report.applied_version) == ("g", "pod-0", None)
        assert any(
            "written again after 3 failed attempts" in r.getMessage() and r.levelno == logging.INFO
            for r in caplog.records
        )
        store.fail_reports = True  # a second streak warns again, once
        await syncer.reconcile_once()
        await syncer.reconcile_once()
        assert len(warnings()) == 2 and failures() == 5.0 and syncer.status()["report_failures"] == 5


async def test_the_report_is_rewritten_during_a_long_download(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    """The heartbeat keeps a downloading replica's report fresh (so retention keeps the version it
    downloads and readers do not age it out), however long the download takes."""
    store = FlakyStore(tmp_path / "store")
    WeightPublisher(store, views=["fp8"], base_checkpoint=tiny_qwen3_dir).publish(tiny_state(1))
    store.download_delay = 0.25
    async with engineless_syncer(store, tmp_path / "cache", report_interval=0.2) as syncer:
        syncer.channel.download_workers = 1  # one file at a time: the download lasts 0.25 s per file
        assert await syncer.fetch_for_launch(asyncio.Event()) is not None
    first_get, last_get = store.downloads[0][0], store.downloads[-1][1]
    assert last_get - first_get >= 0.25 * len(store.downloads) >= 1.0
    during = [t for t in store.report_writes if first_get < t < last_get]
    assert len(during) >= 3, (len(during), last_get - first_get)  # one write per ~report_interval
    [report] = WeightChannel(store).subscribers()
    assert (report.applied_version, report.in_use) == (None, [0])  # the downloaded version stays pinned
