"""The sync sidecar over a channel of anchors and deltas (issue 40; docs/weights.md, "Rebuilding a view").

Versions of the tiny Qwen3's fp8 view are published as the trainer publishes them with deltas: real HF
views (`save_view` with the base checkpoint), an anchor every few versions, every other version a delta
(`rlfleet.deltas.encode_delta` against the previous version's files) through `WeightChannel.publish(deltas=)`.
The real sidecar (`Syncer`) obtains them against the recording SGLang-API engine of test_weights_sync.py
(its `/update_weights_from_disk` loads the directory it is given), on a filesystem store and on S3
(moto_server). Every applied directory is compared file by file with the complete files the publisher
wrote, and hashed against the manifest; every fault is refused by digest (or as a broken chain) and
recovered from an anchor, with its one-line reason in `last_error`, the log and the metrics."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from s3_fault_proxy import S3FaultProxy
from support.moto import make_bucket
from support.weight_sync import fetch_only
from test_weights_sync import (  # noqa: F401 - engine: fixture
    RecordingEngine,
    _get_metrics,
    engine,
    tiny_state,
)

from rlfleet.catalog import LAUNCH_FILE
from rlfleet.channel import (
    POINTER_KEY,
    ChannelError,
    DeltaSource,
    Manifest,
    WeightChannel,
    manifest_key,
)
from rlfleet.deltas import DELTA_SUFFIX, encode_delta
from rlfleet.numerics.views import load_view, save_view
from rlfleet.sampler.engine_clients import DiskEngine
from rlfleet.sampler.launch_checkpoint import read_launch_file
from rlfleet.sampler.sync_state import SyncConfig
from rlfleet.sampler.syncer import Syncer
from rlfleet.store import FilesystemStore, S3Store, Store, hash_file

VIEW = "fp8"


class DeltaPublisher:
    """Publishes versions of the tiny Qwen3's fp8 view the way the trainer does with deltas: an anchor
    (every file whole) or a delta against the previous version's files. Each version's weights drift a
    little from the last (a training step's worth: a few rows change); its complete files stay here
    (`source`), what every reader must end up with byte for byte."""

    def __init__(self, store: Store, work: Path, base_checkpoint: Path) -> None:
        self.channel = WeightChannel(store, publisher_id="trainer/test")
        self.work = work
        self.base_checkpoint = base_checkpoint
        self.state = tiny_state(1)
        self.source: dict[int, Path] = {}
        self.manifests: dict[int, Manifest] = {}

    def publish(self, version: int, *, anchor: bool) -> Manifest:
        with torch.no_grad():
            for name in ("lm_head.weight", "model.layers.0.mlp.down_proj.weight"):
                self.state[name][version % 7, :16] += 0.01 * (version + 1)
        directory = self.work / f"v{version}" / VIEW
        save_view(self.state, VIEW, directory, base_checkpoint=self.base_checkpoint)
        deltas = None
        if not anchor:
            payloads = {}
            for shard in sorted(directory.glob("*.safetensors")):
                out = self.work / f"v{version}-payloads" / (shard.name + DELTA_SUFFIX)
                out.parent.mkdir(parents=True, exist_ok=True)
                if encode_delta(self.source[version - 1] / shard.name, shard, out) is not None:
                    payloads[shard.name] = out
            assert payloads, "consecutive versions of one view have the same safetensors headers"
            deltas = {VIEW: DeltaSource(version - 1, payloads)}
        manifest = self.channel.publish({VIEW: directory}, version=version, deltas=deltas).manifest
        assert (manifest.views[VIEW].delta is None) == anchor
        self.source[version] = directory
        self.manifests[version] = manifest
        return manifest

    def publish_chain(self, versions: range, anchors: set[int]) -> None:
        for version in versions:
            self.publish(version, anchor=version in anchors)

    def stored_bytes(self, *versions: int) -> int:
        return sum(self.manifests[v].views[VIEW].stored_bytes for v in versions)


@pytest.fixture
def publisher(store: Store, tmp_path: Path, tiny_qwen3_dir: Path) -> DeltaPublisher:
    """The trainer's side on the `store` fixture's channel (a filesystem store and an S3 one)."""
    return DeltaPublisher(store, tmp_path / "published", tiny_qwen3_dir)


@contextlib.asynccontextmanager
async def delta_syncer(
    store: Store, engine_url: str, cache: Path, replica: str = "pod-0"
) -> AsyncIterator[Syncer]:
    """A sidecar of group h100-fp8 on `store`'s fp8 view, its cache `cache`, in front of the engine at
    `engine_url` (its HTTP client open until exit)."""
    config = SyncConfig(
        store="unused",
        view=VIEW,
        engine_url=engine_url,
        group="h100-fp8",
        replica=replica,
        cache_dir=cache,
        poll_interval=0.05,
        backoff_base=0.05,
        backoff_max=0.5,
    )
    async with httpx.AsyncClient(base_url=engine_url) as client:
        yield Syncer(config, store, DiskEngine(client))


@pytest.fixture
async def syncer(store: Store, engine: RecordingEngine, tmp_path: Path) -> AsyncIterator[Syncer]:  # noqa: F811
    """The sidecar (`delta_syncer`) on the `store` fixture's channel in front of `engine`, its cache
    tmp_path / "cache"."""
    async with delta_syncer(store, engine.url, tmp_path / "cache") as made:
        yield made


async def serving_v1(publisher: DeltaPublisher, syncer: Syncer) -> None:
    """Anchor v0 and delta v1 published; the sidecar applies v1 (its own copy of v1 is in its cache)."""
    publisher.publish_chain(range(2), anchors={0})
    assert await syncer.reconcile_once() is True


def vouch_for_manifest(store: Store, version: int, raw: dict) -> None:
    """Write `raw` as the manifest of `version` and the pointer's digest of it: what anyone who can write
    the store can do (digests consistent, only the content lies)."""
    manifest_bytes = json.dumps(raw).encode()
    store.put(manifest_key(version), manifest_bytes)
    pointer = json.loads(store.get(POINTER_KEY))
    pointer["manifest_sha256"] = hashlib.sha256(manifest_bytes).hexdigest()
    store.put(POINTER_KEY, json.dumps(pointer).encode())


def assert_bit_exact(directory: Path, publisher: DeltaPublisher, version: int) -> None:
    """`directory` holds exactly version `version`'s complete files: each hashes to the manifest's digest
    and equals, byte for byte, the file the publisher wrote."""
    files = publisher.manifests[version].views[VIEW].files
    present = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    assert present == sorted(files), (version, present)
    for rel, entry in files.items():
        assert hash_file(directory / rel, entry.algorithm) == entry, (version, rel)
        assert (directory / rel).read_bytes() == (publisher.source[version] / rel).read_bytes(), (
            version,
            rel,
        )


def assert_engine_serves(recording: RecordingEngine, publisher: DeltaPublisher, version: int) -> None:
    """The engine was told `version` and loaded exactly the weights of the publisher's complete files."""
    assert recording.version == str(version) and recording.weights is not None
    _, expected = load_view(publisher.source[version])
    assert recording.weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(recording.weights[name], tensor), (version, name)


def cache_entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir())


def metric(body: str, name: str, **labels: str) -> float:
    """The value of one sample of the sidecar's /metrics (group h100-fp8, view fp8)."""
    wanted = {"group": "h100-fp8", "view": VIEW, **labels}
    for line in body.splitlines():
        if m := re.match(rf"^{name}\{{(.*)\}} (\S+)$", line):
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            if got == wanted:
                return float(m.group(2))
    raise AssertionError(f"no sample {name}{wanted}")


async def test_deltas_are_applied_in_order_bit_exact(
    engine: RecordingEngine,  # noqa: F811 - the fixture
    publisher: DeltaPublisher,
    syncer: Syncer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Anchor v0, deltas v1 v2, anchor v3, delta v4, each applied as it is published: a delta version is
    rebuilt from the sidecar's own copy of the version before (only its payloads are read from the store;
    the files it stores whole but that did not change are copied from that copy), an anchor downloaded.
    Every applied directory is the publisher's complete checkpoint, byte for byte."""
    caplog.set_level(logging.INFO, logger="rlfleet.sampler.sync")
    cache = syncer.config.cache_dir
    sources = {
        0: "anchor v0",
        1: "local v0 + delta v1",
        2: "local v1 + delta v2",
        3: "anchor v3",
        4: "local v3 + delta v4",
    }
    for version in range(5):
        publisher.publish(version, anchor=version in (0, 3))
        assert await syncer.reconcile_once() is True
        assert_engine_serves(engine, publisher, version)
        assert_bit_exact(cache / f"v{version}-{VIEW}", publisher, version)
        assert syncer.status()["last_apply"]["source"] == sources[version]
        delta = publisher.manifests[version].views[VIEW].delta
        # an anchor is read whole; a delta version only its payloads (its other files did not change)
        expected = publisher.stored_bytes(version) if delta is None else delta.bytes
        assert syncer.status()["last_apply"]["read_bytes"] == expected
        # the sidecar's log line: how it was obtained and the bytes it read, per kind
        kinds = (expected, 0) if delta is None else (0, expected)
        line = (
            f"applied weights v{version} (fp8) from {sources[version]}, {expected} bytes read "
            f"(anchor {kinds[0]}, delta {kinds[1]}, whole-file 0): obtain "
        )
        assert any(line in r.getMessage() for r in caplog.records), line
        assert read_launch_file(cache) == (version, cache / f"v{version}-{VIEW}")
    body = (await _get_metrics(syncer)).decode()
    assert [b["weight_version"] for p, b in engine.requests if p == "/update_weights_from_disk"] == list(
        "01234"
    )
    payloads = sum(publisher.manifests[v].views[VIEW].delta.bytes for v in (1, 2, 4))  # type: ignore[union-attr]
    read = {"anchor": publisher.stored_bytes(0, 3), "delta": payloads, "whole-file": 0}
    assert syncer.status()["read_bytes"] == read
    for kind, nbytes in read.items():
        assert metric(body, "rlfleet_weight_sync_read_bytes_total", kind=kind) == nbytes
    assert payloads < publisher.stored_bytes(0) / 10  # a few rows changed: the deltas are small
    assert cache_entries(cache) == [LAUNCH_FILE, f"v3-{VIEW}", f"v4-{VIEW}"]  # keep_local 2, no partials
    assert sum(syncer.state.failures.values()) == 0


async def test_a_replica_started_at_v7_seeds_from_anchor_v4_and_the_deltas_after_it(
    store: Store,
    engine: RecordingEngine,  # noqa: F811 - the fixture
    tmp_path: Path,
    publisher: DeltaPublisher,
) -> None:
    """Anchors v0 and v4, deltas between. A new replica (an empty cache) and one that applied v1 and was
    down across v2..v7 both obtain v7 from the newest anchor at or below it, v4, plus deltas v5 v6 v7: they
    read v4 whole and three payloads, never the older chain."""
    publisher.publish_chain(range(2), anchors={0})
    async with delta_syncer(store, engine.url, tmp_path / "cache-returning", "pod-1") as returning:
        assert await returning.reconcile_once() is True and engine.version == "1"
        publisher.publish_chain(range(2, 8), anchors={4})
        fresh_engine = await RecordingEngine().start()
        try:
            async with delta_syncer(store, fresh_engine.url, tmp_path / "cache-new", "pod-2") as fresh:
                assert await fresh.reconcile_once() is True
                assert_engine_serves(fresh_engine, publisher, 7)
        finally:
            await fresh_engine.stop()
        assert await returning.reconcile_once() is True
        assert_engine_serves(engine, publisher, 7)
    payloads = sum(publisher.manifests[v].views[VIEW].delta.bytes for v in (5, 6, 7))  # type: ignore[union-attr]
    for syncer in (fresh, returning):
        cache = syncer.config.cache_dir
        assert_bit_exact(cache / f"v7-{VIEW}", publisher, 7)
        assert syncer.status()["last_apply"]["source"] == "anchor v4 + deltas v5, v6, v7"
        assert syncer.status()["last_apply"]["read_bytes"] == publisher.stored_bytes(4) + payloads
    assert fresh.status()["read_bytes"] == {
        "anchor": publisher.stored_bytes(4),
        "delta": payloads,
        "whole-file": 0,
    }
    assert cache_entries(fresh.config.cache_dir) == [LAUNCH_FILE, f"v7-{VIEW}"]  # no intermediate left


def flip_a_bit(data: bytes) -> bytes:
    damaged = bytearray(data)
    damaged[-1] ^= 0x01  # the last value's bits: the payload still parses, only its digest tells
    return bytes(damaged)


FAULTS = {
    # fault: (how the payload is damaged in the store, the failure reason, what the one line says)
    "flipped-bit": (lambda s, k: s.put(k, flip_a_bit(s.get(k))), "checksum", "v2/fp8/model.safetensors.delta: blake3:"),
    "missing": (lambda s, k: s.delete(k), "delta", "v2/fp8/model.safetensors.delta is gone from the channel"),
    "truncated": (lambda s, k: s.put(k, s.get(k)[: len(s.get(k)) // 2]), "checksum", "v2/fp8/model.safetensors.delta: blake3:"),
}  # fmt: skip


@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_a_damaged_delta_is_refused_and_the_next_anchor_recovers(
    fault: str,
    store: Store,
    engine: RecordingEngine,  # noqa: F811 - the fixture
    publisher: DeltaPublisher,
    syncer: Syncer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """v2's payload damaged in the store (a flipped bit, deleted, truncated): v2, and v3 whose chain runs
    through it, are refused with a one-line reason, nothing reaches the engine or the cache, the engine
    keeps serving v1; the next anchor, v4, is applied, bit exact."""
    damage, reason, message = FAULTS[fault]
    caplog.set_level(logging.WARNING, logger="rlfleet.sampler.sync")
    cache = syncer.config.cache_dir
    await serving_v1(publisher, syncer)
    publisher.publish(2, anchor=False)
    damage(store, f"v2/{VIEW}/model.safetensors{DELTA_SUFFIX}")
    for attempt, version in ((1, 2), (2, 3)):
        if version == 3:
            publisher.publish(3, anchor=False)
        assert await syncer.reconcile_once() is False
        assert syncer.state.failures[reason] == attempt and sum(syncer.state.failures.values()) == attempt
        error = syncer.status()["last_error"]
        assert error.startswith(f"{reason}: v{version}: ") and message in error and "\n" not in error
        # the payload lies on every way to v2, so the anchor is not read again to try another
        assert "before that" not in error and syncer.state.read_bytes["anchor"] == publisher.stored_bytes(0)
        assert any(message in r.getMessage() for r in caplog.records)
        assert engine.version == "1" and syncer.state.applied_version == 1
        assert cache_entries(cache) == [LAUNCH_FILE, f"v1-{VIEW}"]  # nothing half-built left
    assert_engine_serves(engine, publisher, 1)
    body = (await _get_metrics(syncer)).decode()
    assert metric(body, "rlfleet_weight_sync_failures_total", reason=reason) == 2
    publisher.publish(4, anchor=True)
    assert await syncer.reconcile_once() is True
    assert_engine_serves(engine, publisher, 4)
    assert_bit_exact(cache / f"v4-{VIEW}", publisher, 4)
    assert syncer.status()["last_apply"]["source"] == "anchor v4"
    assert syncer.status()["last_error"] is None and syncer.state.consecutive_failures == 0


async def test_a_torn_local_copy_is_refused_by_digest_and_reseeded_from_the_anchor(
    engine: RecordingEngine,  # noqa: F811 - the fixture
    tmp_path: Path,
    tiny_qwen3_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The sidecar's own copy of v1 is damaged on the pod's volume after it was verified: rebuilding v2 from
    it gives a file whose digest the manifest refuses, so v2 is rebuilt from the anchor v0 and the deltas
    after it instead, in the same step; the fallback is counted (reason checksum) and logged in one line."""
    caplog.set_level(logging.WARNING)
    store = FilesystemStore(tmp_path / "store", create=True)
    publisher = DeltaPublisher(store, tmp_path / "published", tiny_qwen3_dir)
    cache = tmp_path / "cache"
    async with delta_syncer(store, engine.url, cache) as syncer:
        await serving_v1(publisher, syncer)
        torn = cache / f"v1-{VIEW}" / "model.safetensors"
        torn.write_bytes(flip_a_bit(torn.read_bytes()))
        publisher.publish(2, anchor=False)
        assert await syncer.reconcile_once() is True
        assert_engine_serves(engine, publisher, 2)
        body = (await _get_metrics(syncer)).decode()
    assert_bit_exact(cache / f"v2-{VIEW}", publisher, 2)
    assert syncer.status()["last_apply"]["source"] == "anchor v0 + deltas v1, v2"
    assert (
        syncer.state.failures["checksum"] == 1
        and metric(body, "rlfleet_weight_sync_failures_total", reason="checksum") == 1
    )
    [line] = [r.getMessage() for r in caplog.records if "reseeding from the anchor v0" in r.getMessage()]
    assert (
        "rebuilding from the local copy of v1 failed" in line
        and "v2/fp8/model.safetensors rebuilt from v1" in line
    )
    assert (
        syncer.state.read_bytes["anchor"] == publisher.stored_bytes(0) * 2
    )  # v0 for v0, again for the reseed


async def test_an_anchor_deleted_under_a_subscriber(
    store: Store,
    engine: RecordingEngine,  # noqa: F811 - the fixture
    tmp_path: Path,
    publisher: DeltaPublisher,
) -> None:
    """The anchor v0 is deleted from the channel while a replica serves v1 (rebuilt from it). That replica
    rebuilds v2 from its own copy of v1 and needs no anchor; a new replica cannot rebuild v2 (its chain is
    broken: reason delta, one line, nothing applied) until the anchor v3 is published, then it seeds from
    v3 (v4 = anchor v3 + delta v4), as does the first replica."""
    publisher.publish_chain(range(2), anchors={0})
    async with delta_syncer(store, engine.url, tmp_path / "cache-serving", "pod-1") as serving:
        assert await serving.reconcile_once() is True
        store.delete_many(sorted(store.list("v0/"), key=lambda k: k != manifest_key(0)))
        assert WeightChannel(store).versions() == [1]
        publisher.publish(2, anchor=False)
        assert await serving.reconcile_once() is True
        assert serving.status()["last_apply"]["source"] == "local v1 + delta v2"
        assert_engine_serves(engine, publisher, 2)
        new_engine = await RecordingEngine().start()
        try:
            async with delta_syncer(store, new_engine.url, tmp_path / "cache-new", "pod-2") as new:
                assert await new.reconcile_once() is False
                error = new.status()["last_error"]
                assert (
                    error == "delta: v2: v2/fp8: v0, the base of v1, is gone from the channel (no manifest)"
                )
                assert new.state.failures["delta"] == 1 and new_engine.version is None
                assert cache_entries(tmp_path / "cache-new") == []
                publisher.publish_chain(range(3, 5), anchors={3})
                assert await new.reconcile_once() is True
                assert_engine_serves(new_engine, publisher, 4)
                assert new.status()["last_apply"]["source"] == "anchor v3 + delta v4"
        finally:
            await new_engine.stop()
        assert await serving.reconcile_once() is True
        assert_engine_serves(engine, publisher, 4)
        assert serving.status()["last_apply"]["source"] == "anchor v3 + delta v4"


async def test_a_payload_that_does_not_fit_its_base_is_refused_in_one_line(
    engine: RecordingEngine,  # noqa: F811 - the fixture
    tmp_path: Path,
    tiny_qwen3_dir: Path,
) -> None:
    """An attack by whoever writes the store: a payload whose indices point past its tensor, with a manifest
    and pointer that vouch for it (consistent digests). It is never applied: reason delta, one line, the
    engine keeps v1 and nothing is written outside a hidden work directory, which is gone."""
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file

    store = FilesystemStore(tmp_path / "store", create=True)
    publisher = DeltaPublisher(store, tmp_path / "published", tiny_qwen3_dir)
    cache = tmp_path / "cache"
    async with delta_syncer(store, engine.url, cache) as syncer:
        await serving_v1(publisher, syncer)
        publisher.publish(2, anchor=False)
        key = f"v2/{VIEW}/model.safetensors{DELTA_SUFFIX}"
        real = tmp_path / "real.delta"
        real.write_bytes(store.get(key))
        with safe_open(str(real), framework="numpy") as d:
            metadata = d.metadata()
            tensors = {k: d.get_tensor(k) for k in d.keys()}
        index_name = next(k for k in tensors if k.endswith(":gap"))
        # 2^20 bytes 0 in front: the first gap grows by 255 * 2^20, every index far past the tensor's elements
        tensors[index_name] = np.concatenate([np.zeros(1 << 20, dtype=np.uint8), tensors[index_name]])
        forged = tmp_path / "forged.delta"
        save_file(tensors, str(forged), metadata=metadata)
        store.put(key, forged.read_bytes())
        raw = json.loads(store.get(manifest_key(2)))
        digest = hash_file(forged)
        raw["views"][VIEW]["delta"]["files"]["model.safetensors.delta"] = {
            "digest": f"{digest.algorithm}:{digest.hexdigest}",
            "bytes": digest.bytes,
        }
        vouch_for_manifest(store, 2, raw)
        assert await syncer.reconcile_once() is False
    error = syncer.status()["last_error"]
    assert (
        error.startswith("delta: v2: v2/fp8/model.safetensors.delta does not fit v1: ") and "\n" not in error
    )
    assert f"entry of {index_name.removesuffix(':gap')!r} does not fit its tensor" in error
    assert engine.version == "1" and cache_entries(cache) == [LAUNCH_FILE, f"v1-{VIEW}"]


@pytest.mark.parametrize(
    "path",
    [
        "/etc/escape.safetensors",
        "../escape.safetensors",
        "a/../../escape.safetensors",
        "",
        "./a",
        "a//b",
        "a\\..\\b",
    ],
)
def test_a_manifest_path_that_is_not_a_plain_relative_name_is_refused(path: str) -> None:
    """A store writer's manifest naming a file outside the view's directory: refused when the manifest is
    read, in one line, before any reader creates a path from it."""
    entry = {"digest": "blake3:" + "0" * 64, "bytes": 1}
    raw = {
        "format": "rlfleet.weights/v3",
        "version": 3,
        "published_at": "",
        "publisher": "x",
        "metadata": {},
        "views": {VIEW: {"files": {"config.json": entry, path: entry}, "tensors": {}}},
    }
    with pytest.raises(ChannelError) as refused:
        Manifest.from_bytes(json.dumps(raw).encode())
    assert str(refused.value) == (
        f"manifest of v3: view fp8: {path!r} is not a plain relative path (no absolute path, '..', '.' or empty part)"
    )


async def test_a_planted_path_never_leaves_the_cache(
    engine: RecordingEngine,  # noqa: F811 - the fixture
    tmp_path: Path,
    tiny_qwen3_dir: Path,
) -> None:
    """The same attack through the sidecar: a manifest (and a pointer vouching for it) naming
    `../../escape.safetensors`. The step fails in one line, nothing is written outside the cache."""
    store = FilesystemStore(tmp_path / "store", create=True)
    publisher = DeltaPublisher(store, tmp_path / "published", tiny_qwen3_dir)
    cache = tmp_path / "deep" / "cache"
    async with delta_syncer(store, engine.url, cache) as syncer:
        publisher.publish_chain(range(2), anchors={0})
        raw = json.loads(store.get(manifest_key(1)))
        files = raw["views"][VIEW]["files"]
        files["../../escape.safetensors"] = files["config.json"]
        store.put(f"v1/{VIEW}/escape.safetensors", b"planted")
        vouch_for_manifest(store, 1, raw)
        assert await syncer.reconcile_once() is False
    error = syncer.status()["last_error"]
    assert "'../../escape.safetensors' is not a plain relative path" in error and "\n" not in error
    planted = sorted(
        p for p in tmp_path.rglob("escape.safetensors*") if (tmp_path / "store") not in p.parents
    )
    assert planted == [] and engine.version is None


def test_a_sidecar_killed_halfway_through_a_rebuild_leaves_no_copy_and_restarts_clean(
    s3_endpoint: str, tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    """The real `rlfleet sampler sync --fetch-only` rebuilds v3 from its copy of v1 (deltas v2, v3) through
    an S3 proxy that holds the request for v3's payload: v2 is built in the hidden work directory when the
    process is SIGKILLed there. Its copy of v1 is untouched and still verifies, no `v3` directory exists;
    restarted, it removes the partial directory, rebuilds v3 and names it in the launch file."""
    bucket = make_bucket(s3_endpoint)
    direct = S3Store(bucket, "job", endpoint_url=s3_endpoint)
    proxy = S3FaultProxy(int(s3_endpoint.rsplit(":", 1)[1]))
    uri = f"s3://{bucket}/job?endpoint={proxy.url}"
    cache = tmp_path / "cache"
    try:
        publisher = DeltaPublisher(direct, tmp_path / "published", tiny_qwen3_dir)
        publisher.publish_chain(range(2), anchors={0})
        first = fetch_only(uri, cache, "--backoff-max", "0.5")
        out, _ = first.communicate(timeout=120)
        assert first.returncode == 0, out
        assert read_launch_file(cache) == (1, cache / f"v1-{VIEW}")
        # a new replica seeds from the anchor: its line says so, with the bytes it read per kind
        anchor, delta = publisher.stored_bytes(0), publisher.manifests[1].views[VIEW].delta.bytes  # type: ignore[union-attr]
        assert (
            f"from anchor v0 + delta v1, {anchor + delta} bytes read (anchor {anchor}, delta {delta}, "
            "whole-file 0)"
        ) in out, out
        publisher.publish_chain(range(2, 4), anchors=set())
        proxy.hold = ("GET", re.compile(rf"/job/v3/{VIEW}/model\.safetensors\.delta"))
        killed = fetch_only(uri, cache, "--backoff-max", "0.5")
        try:
            assert proxy.held.wait(120), "the rebuild never asked for v3's payload"
            [partial] = [p for p in cache.iterdir() if p.name.startswith(f".v3-{VIEW}.partial-")]
            assert_bit_exact(partial / "v2", publisher, 2)  # v2 was rebuilt and verified before v3 began
            # meanwhile its report names the version it rebuilds, so retention keeps it (and its chain)
            [report] = WeightChannel(direct).subscribers()
            assert (report.replica, report.applied_version, report.in_use) == ("pod-0", None, [3])
            os.kill(killed.pid, signal.SIGKILL)
            killed.wait(30)
        finally:
            proxy.hold = None
            proxy.release.set()
            if killed.poll() is None:
                killed.kill()
        assert killed.returncode == -signal.SIGKILL
        assert cache_entries(cache) == [partial.name, LAUNCH_FILE, f"v1-{VIEW}"]
        assert_bit_exact(cache / f"v1-{VIEW}", publisher, 1)  # the local copy was never written into
        assert read_launch_file(cache) == (1, cache / f"v1-{VIEW}")
        restarted = fetch_only(uri, cache, "--backoff-max", "0.5")
        out, _ = restarted.communicate(timeout=120)
        assert restarted.returncode == 0, out
        assert "a partial copy left by an earlier run" in out and partial.name in out
        assert read_launch_file(cache) == (3, cache / f"v3-{VIEW}")
        assert_bit_exact(cache / f"v3-{VIEW}", publisher, 3)
        payloads = sum(publisher.manifests[v].views[VIEW].delta.bytes for v in (2, 3))  # type: ignore[union-attr]
        assert (
            f"launch checkpoint: v3 (fp8) at {cache / 'v3-fp8'}, from local v1 + deltas v2, v3, {payloads} "
            f"bytes read (anchor 0, delta {payloads}, whole-file 0)"
        ) in out, out
        assert cache_entries(cache) == [LAUNCH_FILE, f"v1-{VIEW}", f"v3-{VIEW}"]
    finally:
        proxy.close()
        direct.close()


def sharded_view(directory: Path, seed: int, shards: int = 4) -> Path:
    """A view of `shards` safetensors files (a real view's shard layout) plus a config, seeded values."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    for i in range(shards):
        weights = {f"model.layers.{i}.w": rng.integers(0, 2**16, size=4096, dtype=np.uint16).view(np.float16)}
        save_file(weights, str(directory / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))
    (directory / "config.json").write_text("{}")
    return directory


@pytest.mark.parametrize("workers", [1, 4])
def test_the_shards_of_a_view_are_built_at_once_and_the_first_failure_in_file_order_is_raised(
    tmp_path: Path, workers: int
) -> None:
    """obtain_view builds a view's files `download_workers` at a time: v1 (a delta of every shard) is rebuilt
    from the local v0 bit exact with the same bytes read whatever the count; with the payloads of shards 2
    and 4 flipped in the store, the error names shard 2's (the one a build file by file meets first)."""
    store = FilesystemStore(tmp_path / "store", create=True)
    channel = WeightChannel(store, publisher_id="trainer/test")
    v0 = sharded_view(tmp_path / "src" / "v0", seed=0)
    v1 = tmp_path / "src" / "v1"
    shutil.copytree(v0, v1)
    payloads = {}
    for shard in sorted(v1.glob("*.safetensors")):
        data = bytearray(shard.read_bytes())
        data[-2] ^= 0x40  # one element of each shard's only tensor changes
        shard.write_bytes(bytes(data))
        payloads[shard.name] = tmp_path / "payloads" / (shard.name + DELTA_SUFFIX)
        payloads[shard.name].parent.mkdir(exist_ok=True)
        assert encode_delta(v0 / shard.name, shard, payloads[shard.name]) is not None
    channel.publish({"bf16": v0}, version=0)
    channel.publish({"bf16": v1}, version=1, deltas={"bf16": DeltaSource(0, payloads)})
    reader = WeightChannel(store, download_workers=workers)
    local = reader.obtain_view(0, "bf16", tmp_path / "cache" / "v0").directory
    got = reader.obtain_view(1, "bf16", tmp_path / "cache" / "v1", local={0: local})
    for path in sorted(v1.iterdir()):
        assert (got.directory / path.name).read_bytes() == path.read_bytes(), path.name
    assert got.read_bytes == {
        "anchor": 0,
        "delta": sum(p.stat().st_size for p in payloads.values()),
        "whole-file": 0,
    }
    for shard in (2, 4):
        key = f"v1/bf16/model-{shard:05d}-of-00004.safetensors{DELTA_SUFFIX}"
        store.put(key, flip_a_bit(store.get(key)))
    with pytest.raises(ChannelError) as refused:
        reader.obtain_view(1, "bf16", tmp_path / "cache" / "again", local={0: local})
    assert "v1/bf16/model-00002-of-00004.safetensors.delta: blake3:" in str(refused.value)
    assert "model-00004" not in str(refused.value)
    assert not (tmp_path / "cache" / "again").exists()
