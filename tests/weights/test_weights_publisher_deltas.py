"""The trainer's publisher stores each view as an anchor or a delta (trainer/publish/publisher.py; docs/weights.md,
"Deltas between versions"), and retention keeps every version a kept one is rebuilt from.

Real publishers (the tiny Qwen3 of `tiny_qwen3_dir`, or tensor-only views) on a real directory and a real
S3-compatible server (moto_server). Every version is rebuilt here independently of the sampler's code: an
anchor's files as stored, a delta's with `apply_delta` on the same file of its base (rebuilt the same way),
each file then hashed (`rlfleet.store.hash_file`) against the manifest's digest of the COMPLETE file."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from test_weights_channel import make_view

from rlfleet.channel import DeltaSource, SubscriberReport, WeightChannel, manifest_key
from rlfleet.deltas import DELTA_SUFFIX, apply_delta, encode_delta
from rlfleet.numerics.views import save_view
from rlfleet.store import FilesystemStore, Store, StoreError, hash_file
from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model
from rlfleet.trainer.publish.publisher import SNAPSHOT_PREFIX, WeightPublisher

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rebuild(store: Store, version: int, view: str, dest: Path) -> Path:
    """The complete files of `view` at `version` in `dest/v{version}`, every one verified against the
    manifest (an assertion): an anchor's as stored, a delta's rebuilt from its base (itself rebuilt)."""
    vm = WeightChannel(store).manifest(version).views[view]
    out = dest / f"v{version}"
    base = None if vm.delta is None else rebuild(store, vm.delta.base, view, dest)
    rebuilt = set() if vm.delta is None else set(vm.delta.rebuilt())
    for rel, entry in sorted(vm.files.items()):
        if rel in rebuilt:
            assert base is not None
            payload = dest / "payloads" / f"v{version}" / f"{rel}{DELTA_SUFFIX}"
            store.get_file(f"v{version}/{view}/{rel}{DELTA_SUFFIX}", payload)
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            apply_delta(base / rel, payload, out / rel)
        else:
            store.get_file(f"v{version}/{view}/{rel}", out / rel)
        assert hash_file(out / rel) == entry, f"v{version}/{view}/{rel}"
    return out


def kinds(store: Store, versions: range, view: str = "bf16") -> list[int | None]:
    """Per version: its view's delta base (None: an anchor)."""
    channel = WeightChannel(store)
    bases = []
    for v in versions:
        delta = channel.manifest(v).views[view].delta
        bases.append(None if delta is None else delta.base)
    return bases


def nudge(state: dict[str, torch.Tensor], step: int, count: int = 8) -> None:
    """Change `count` elements of every matrix by far more than a bf16 ulp (an RL step's few changed values)."""
    for tensor in state.values():
        if tensor.ndim == 2:
            flat = tensor.view(-1)
            flat[step * count : (step + 1) * count] += 1.0


def tiny_state() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tiny_model(TinyQwen3(seed=0)).state_dict().items()}


def test_anchors_every_k_versions_and_deltas_against_the_previous_one_rebuild_exactly(
    store: Store, tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    publisher = WeightPublisher(
        store,
        views=["bf16"],
        keep_versions=None,
        base_checkpoint=tiny_qwen3_dir,
        anchor_every=3,
        staging_dir=tmp_path / "staging",
    )
    state = tiny_state()
    published = []
    for step in range(7):
        result = publisher.publish(state)
        assert result.version == step and result.advanced
        published.append(publisher.last_published["bf16"])
        nudge(state, step)
    assert kinds(store, range(7)) == [None, 0, 1, None, 3, 4, None]
    assert [(p.kind, p.base) for p in published] == [
        ("anchor", None),
        ("delta", 0),
        ("delta", 1),
        ("anchor", None),
        ("delta", 3),
        ("delta", 4),
        ("anchor", None),
    ]
    assert published[0].reason == "no earlier version of the view kept"
    assert published[3].reason == published[6].reason == "every 3 versions"
    manifests = [WeightChannel(store).manifest(v).views["bf16"] for v in range(7)]
    for p, vm in zip(published, manifests, strict=True):
        assert (p.stored_bytes, p.full_bytes) == (vm.stored_bytes, vm.bytes)
        if p.kind == "anchor":
            assert p.stored_bytes == p.full_bytes
        else:  # 8 changed elements per matrix, 6 bytes each, of a 0.7 MB view (+ the small files whole)
            assert vm.delta is not None and vm.delta.rebuilt() == ["model.safetensors"]
            assert vm.delta.bytes < 0.01 * p.full_bytes
    for v in range(7):
        rebuild(store, v, "bf16", tmp_path / "rebuilt")
    # the manifest holds the digest of the COMPLETE file: the same weights written whole hash the same
    written = save_view(state, "bf16", tmp_path / "whole", base_checkpoint=tiny_qwen3_dir)
    last = publisher.publish(state)
    assert last.manifest.views["bf16"].delta is not None and last.manifest.views["bf16"].delta.base == 6
    assert (
        last.manifest.views["bf16"].files["model.safetensors"]
        == written[tmp_path / "whole" / "model.safetensors"]
    )
    root = publisher.snapshot_dir("bf16")
    assert root is not None and root.parent.name.startswith(SNAPSHOT_PREFIX)
    assert [p.name for p in root.parent.iterdir()] == ["bf16"]  # no pending copy of a publish left
    publisher.close()
    assert not root.parent.exists()
    restarted = WeightPublisher(store, views=["bf16"], keep_versions=None, base_checkpoint=tiny_qwen3_dir)
    restarted.publish(state)  # a restarted trainer holds no copy of what its predecessor published
    assert (restarted.last_published["bf16"].kind, restarted.last_published["bf16"].reason) == (
        "anchor",
        "no earlier version of the view kept",
    )


def test_a_view_a_subscriber_adds_starts_with_an_anchor_and_one_it_leaves_out_loses_its_base(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    store = FilesystemStore(tmp_path / "store", create=True)
    channel = WeightChannel(store)
    publisher = WeightPublisher(store, views=["bf16"], keep_versions=None, base_checkpoint=tiny_qwen3_dir)
    state = tiny_state()
    bases: list[dict[str, int | None]] = []

    def publish(step: int) -> None:
        manifest = publisher.publish(state).manifest
        bases.append(
            {view: None if vm.delta is None else vm.delta.base for view, vm in manifest.views.items()}
        )
        nudge(state, step)

    publish(0)
    channel.report(SubscriberReport("h100-fp8", "pod-a", "fp8", applied_version=None, in_use=[]))
    publish(1)  # fp8 newly needed: an anchor
    publish(2)
    channel.remove_subscriber("h100-fp8", "pod-a")
    publish(3)  # no fp8
    channel.report(SubscriberReport("h100-fp8", "pod-a", "fp8", applied_version=None, in_use=[]))
    publish(4)  # fp8 again: v2 is not the version before, so an anchor
    assert bases == [
        {"bf16": None},
        {"bf16": 0, "fp8": None},
        {"bf16": 1, "fp8": 1},
        {"bf16": 2},
        {"bf16": 3, "fp8": None},
    ]
    for version in (2, 4):
        rebuild(store, version, "fp8", tmp_path / "rebuilt")


def test_a_restarted_trainer_replaces_its_predecessors_copy(tmp_path: Path) -> None:
    """The copies live in the staging directory (a trainer pod's /tmp emptyDir outlives its container):
    a publisher with the same id removes its predecessor's copy instead of leaving a second one."""
    store = FilesystemStore(tmp_path / "store", create=True)
    staging = tmp_path / "staging"
    first = WeightPublisher(
        store, views=["bf16"], keep_versions=None, publisher_id="trainer/ns/job", staging_dir=staging
    )
    first.publish({"w": torch.zeros(4, 128)})
    killed = first.snapshot_dir("bf16")  # never closed: the process was killed
    assert killed is not None and killed.is_dir()
    second = WeightPublisher(
        store, views=["bf16"], keep_versions=None, publisher_id="trainer/ns/job", staging_dir=staging
    )
    second.publish({"w": torch.ones(4, 128)})
    assert second.last_published["bf16"].kind == "anchor"
    assert [p.name for p in staging.iterdir() if p.name.startswith(SNAPSHOT_PREFIX)] == [killed.parent.name]
    assert second.snapshot_dir("bf16") == killed
    assert (
        hash_file(killed / "model.safetensors")
        == WeightChannel(store).manifest(1).views["bf16"].files["model.safetensors"]
    )


def test_anchor_every_1_stores_every_version_whole(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    store = FilesystemStore(tmp_path / "store", create=True)
    publisher = WeightPublisher(
        store, views=["bf16"], keep_versions=None, base_checkpoint=tiny_qwen3_dir, anchor_every=1
    )
    state = tiny_state()
    for step in range(3):
        publisher.publish(state)
        nudge(state, step)
    assert kinds(store, range(3)) == [None, None, None]
    assert publisher.last_published["bf16"].reason == "anchorEvery 1: deltas off"
    assert not any(key.endswith(DELTA_SUFFIX) for key in store.list("v"))
    assert publisher.snapshot_dir("bf16") is None  # nothing kept: no copy of the view on disk


def test_quantized_views_keep_their_scales_so_unchanged_blocks_stay_out_of_the_delta(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    """fp8 and nvfp4 written with the previous version's scales (save_view(previous_scales=)): the
    largest value of every matrix 0.2% smaller gives its block a new fresh scale, and so new codes wherever
    a value sits near a rounding boundary (fp8: 5268 elements, a delta of 9% of the file); under the kept
    scales (within the rule and the 1.01x error bound) no other code changes."""
    store = FilesystemStore(tmp_path / "store", create=True)
    publisher = WeightPublisher(
        store, views=["fp8", "nvfp4"], keep_versions=None, base_checkpoint=tiny_qwen3_dir
    )
    state = tiny_state()
    publisher.publish(state)
    for tensor in state.values():
        if tensor.ndim == 2:
            flat = tensor.view(-1)
            flat[flat.abs().argmax()] *= 0.998
    publisher.publish(state)
    for view in ("fp8", "nvfp4"):
        stats = publisher.last_published[view]
        assert (stats.kind, stats.base) == ("delta", 0), (view, stats.reason)
        delta = WeightChannel(store).manifest(1).views[view].delta
        assert delta is not None and delta.bytes < 0.01 * stats.full_bytes, view
        rebuild(store, 1, view, tmp_path / "rebuilt" / view)


def test_a_view_whose_layout_changes_is_stored_whole(tmp_path: Path) -> None:
    store = FilesystemStore(tmp_path / "store", create=True)
    publisher = WeightPublisher(store, views=["bf16"], keep_versions=None)  # tensor-only views
    one = torch.zeros(4, 128)
    publisher.publish({"w": one, "b": torch.zeros(128)})
    one[0, 0] = 1.0
    publisher.publish({"w": one, "b": torch.zeros(128)})
    publisher.publish({"w": torch.zeros(8, 128), "b": torch.zeros(128)})  # a new shape: another header
    publisher.publish({"w": torch.zeros(8, 128), "b": torch.ones(1) * torch.arange(128) / 1000})
    assert kinds(store, range(4)) == [None, 0, None, 2]
    assert WeightChannel(store).manifest(2).views["bf16"].files["model.safetensors"].bytes > (
        WeightChannel(store).manifest(1).views["bf16"].files["model.safetensors"].bytes
    )
    for v in range(4):
        rebuild(store, v, "bf16", tmp_path / "rebuilt")


def test_the_share_bound_is_exact(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A delta's payload of k changed bf16 elements, each at most 255 after the previous, is 3k bytes (a gap
    byte + a U16 value): with max_delta_share * file size = 3k exactly, k changed elements are a delta and
    k + 1 an anchor."""
    store = FilesystemStore(tmp_path / "store", create=True)
    k = 10
    weights = torch.zeros(64, 128)
    first = WeightPublisher(store, views=["bf16"], keep_versions=None).publish({"w": weights})
    file_bytes = first.manifest.views["bf16"].files["model.safetensors"].bytes
    share = (3 * k + 0.5) / file_bytes
    publisher = WeightPublisher(store, views=["bf16"], keep_versions=None, max_delta_share=share)
    publisher.publish({"w": weights})  # v1: an anchor (this publisher has no earlier version)
    weights.view(-1)[:k] = 100.0
    publisher.publish({"w": weights})  # v2: k elements changed
    assert publisher.last_published["bf16"].kind == "delta"
    weights.view(-1)[k : 2 * k + 1] = 100.0  # first gap k + 1 (from -1): one byte, as the others
    caplog.set_level(logging.INFO, logger="rlfleet.trainer.publish.publisher")
    publisher.publish({"w": weights})  # v3: k + 1
    assert kinds(store, range(4)) == [None, None, 1, None]
    stats = publisher.last_published["bf16"]
    assert (stats.kind, stats.reason) == (
        "anchor",
        f"the delta of model.safetensors exceeds {share:g} of the file",
    )
    assert (
        f"weights v3 bf16: anchor (the delta of model.safetensors exceeds {share:g} of the file): "
        in caplog.text
    )
    assert "encode " in caplog.text.splitlines()[-1]  # the publish line states the encode seconds
    for v in range(4):
        rebuild(store, v, "bf16", tmp_path / "rebuilt")


def test_after_a_failed_publish_the_next_delta_is_against_the_version_the_channel_serves(
    store: Store, tmp_path: Path, tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    publisher = WeightPublisher(
        store,
        views=["bf16"],
        keep_versions=2,
        base_checkpoint=tiny_qwen3_dir,
        staging_dir=tmp_path / "staging",
    )
    state = tiny_state()
    for step in range(2):
        publisher.publish(state)
        nudge(state, step)
    real_put = store.put

    def refuse_manifests(key: str, data: bytes, **kwargs: object) -> None:
        if key.endswith("manifest.json"):
            raise StoreError(f"{key}: injected: the store refused the write")
        real_put(key, data, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "put", refuse_manifests)
    with pytest.raises(StoreError, match="injected"):
        publisher.publish(state)  # v2: its payload is stored, its manifest is not, the pointer stays at v1
    monkeypatch.setattr(store, "put", real_put)
    channel = WeightChannel(store)
    assert channel.latest().version == 1  # type: ignore[union-attr]
    assert any(key.startswith("v2/bf16/") for key in store.list("v2/"))
    nudge(state, 2)
    result = publisher.publish(state)
    assert result.version == 3
    delta = result.manifest.views["bf16"].delta
    assert delta is not None and delta.base == 1  # what the channel holds, not the failed v2
    assert channel.versions() == [0, 1, 3]  # retention: v2's partial bytes go, v3's chain (1, 0) stays
    assert store.list("v2/") == []
    rebuild(store, 3, "bf16", tmp_path / "rebuilt")
    kept = publisher.snapshot_dir("bf16")
    assert kept is not None and [p.name for p in kept.parent.iterdir()] == ["bf16"]


def test_a_version_another_publisher_outran_is_no_base(
    tmp_path: Path, tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Publishers without the writer lease may race: a publish the pointer does not name (not advanced)
    may go at the other publisher's next retention, so the next delta is never made against it."""
    store = FilesystemStore(tmp_path / "store", create=True)
    state = tiny_state()
    slow = WeightPublisher(store, views=["bf16"], keep_versions=None, base_checkpoint=tiny_qwen3_dir)
    other = WeightPublisher(
        FilesystemStore(tmp_path / "store"),
        views=["bf16"],
        keep_versions=None,
        base_checkpoint=tiny_qwen3_dir,
    )
    slow.publish(state, version=0)
    real_put = store.put

    def overtaken(key: str, data: bytes, **kwargs: object) -> None:
        if key == manifest_key(3):  # the other publisher moves the pointer past v3 before v3's manifest
            monkeypatch.setattr(store, "put", real_put)
            other.publish(state, version=5)
        real_put(key, data, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "put", overtaken)
    nudge(state, 0)
    assert slow.publish(state, version=3).advanced is False
    assert (slow.last_published["bf16"].kind, slow.last_published["bf16"].base) == ("delta", 0)
    nudge(state, 1)
    assert slow.publish(state).version == 6
    assert (slow.last_published["bf16"].kind, slow.last_published["bf16"].reason) == (
        "anchor",
        "no earlier version of the view kept",
    )


def publish_hand_built(
    channel: WeightChannel, tmp_path: Path, plan: Mapping[int, Mapping[str, int | None]]
) -> None:
    """Versions 0.. of views whose delta bases are `plan[version][view]` (None: an anchor), each file a
    real delta (`encode_delta`) against the same view's file at its base."""
    for version, views in sorted(plan.items()):
        dirs = {view: make_view(tmp_path / f"v{version}" / view, view, f"{view}-{version}") for view in views}
        deltas = {}
        for view, base in views.items():
            if base is not None:
                payload = tmp_path / f"v{version}" / f"{view}.delta"
                stats = encode_delta(
                    tmp_path / f"v{base}" / view / "model.safetensors",
                    dirs[view] / "model.safetensors",
                    payload,
                )
                assert stats is not None
                deltas[view] = DeltaSource(base, {"model.safetensors": payload})
        assert channel.publish(dirs, version=version, deltas=deltas).version == version


CHAINS: dict[int, dict[str, int | None]] = {
    0: {"bf16": None, "fp8": None},
    1: {"bf16": 0, "fp8": 0},
    2: {"bf16": 1, "fp8": None},
    3: {"bf16": None, "fp8": 2},
    4: {"bf16": 3, "fp8": 3},
    5: {"bf16": 4, "fp8": None},
}
"""bf16: anchors 0 and 3; fp8: anchors 0, 2 and 5. Version 5's bf16 needs 4 and 3; version 4's fp8 needs
3 and 2."""


def test_retention_keeps_the_chain_of_every_kept_version_per_view(any_store: Store, tmp_path: Path) -> None:
    channel = WeightChannel(any_store)
    publish_hand_built(channel, tmp_path / "views", CHAINS)
    # keep=2 keeps 4 and 5; 5's bf16 is rebuilt from 4 and 3 (an anchor), 4's fp8 from 3 and 2 (an anchor)
    assert channel.retain(keep=2) == [0, 1]
    assert channel.versions() == [2, 3, 4, 5]
    for version in (4, 5):  # what retention keeps for: every view of each kept version rebuilds
        for view in ("bf16", "fp8"):
            rebuild(any_store, version, view, tmp_path / "rebuilt" / f"{version}-{view}")
    # keep=1 keeps 5: bf16 needs 4 and 3, fp8 (an anchor at 5) nothing: 2 goes
    assert channel.retain(keep=1) == [2]
    assert channel.versions() == [3, 4, 5]


def test_retention_keeps_the_chain_of_a_version_a_subscriber_uses(any_store: Store, tmp_path: Path) -> None:
    channel = WeightChannel(any_store)
    publish_hand_built(channel, tmp_path / "views", CHAINS)
    channel.report(SubscriberReport("g", "pod-a", "bf16", applied_version=2, in_use=[2]))
    # 2 pins its chain 1, 0 (both views are followed: retention keeps whole versions)
    assert channel.retain(keep=1) == []
    channel.report(SubscriberReport("g", "pod-a", "bf16", applied_version=5, in_use=[5]))
    assert channel.retain(keep=1) == [0, 1, 2]


def test_a_chain_whose_base_is_gone_ends_there(
    any_store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    channel = WeightChannel(any_store)
    publish_hand_built(channel, tmp_path / "views", CHAINS)
    any_store.delete("v3/manifest.json")  # damaged by hand: 4 and 5 cannot be rebuilt any more
    caplog.set_level(logging.WARNING, logger="rlfleet.channel")
    assert channel.retain(keep=1) == [0, 1, 2]
    assert "view bf16 of v4 is a delta against v3, which the channel no longer holds" in caplog.text
    assert sorted({int(k.split("/")[0][1:]) for k in any_store.list("v")}) == [3, 4, 5]


def test_the_trainer_exports_each_views_stored_bytes_by_kind(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    import httpx

    from rlfleet.trainer.metrics import PrometheusExporter

    store = FilesystemStore(tmp_path / "store", create=True)
    publisher = WeightPublisher(store, views=["bf16"], keep_versions=None, base_checkpoint=tiny_qwen3_dir)
    state = tiny_state()
    exporter = PrometheusExporter(port=0)
    try:
        publisher.publish(state)
        exporter.update_published(publisher.last_published.values())
        full = publisher.last_published["bf16"].full_bytes
        text = httpx.get(f"http://127.0.0.1:{exporter.port}/metrics").text
        assert f'rlfleet_trainer_weights_published_bytes{{kind="anchor",view="bf16"}} {float(full)}' in text
        assert 'rlfleet_trainer_weights_published_bytes{kind="delta",view="bf16"} 0.0' in text
        nudge(state, 0)
        result = publisher.publish(state)
        exporter.update_published(publisher.last_published.values())
        stored = result.manifest.views["bf16"].stored_bytes
        assert stored < full
        text = httpx.get(f"http://127.0.0.1:{exporter.port}/metrics").text
        assert 'rlfleet_trainer_weights_published_bytes{kind="anchor",view="bf16"} 0.0' in text
        assert f'rlfleet_trainer_weights_published_bytes{{kind="delta",view="bf16"}} {float(stored)}' in text
        assert f'rlfleet_trainer_weights_view_bytes{{view="bf16"}} {float(full)}' in text
        assert 'rlfleet_trainer_weights_encode_seconds{view="bf16"}' in text
    finally:
        exporter.close()


def test_the_trainer_counts_each_views_stored_bytes_over_its_versions(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    """`rlfleet_trainer_weights_stored_bytes_total{view}`: the anchor's bytes plus each delta's payloads, as
    the manifests say the channel stores them; a call without a new version adds nothing."""
    import httpx

    from rlfleet.trainer.metrics import PrometheusExporter

    store = FilesystemStore(tmp_path / "store", create=True)
    publisher = WeightPublisher(store, views=["bf16"], keep_versions=None, base_checkpoint=tiny_qwen3_dir)
    state = tiny_state()
    exporter = PrometheusExporter(port=0)

    def counter() -> str:
        text = httpx.get(f"http://127.0.0.1:{exporter.port}/metrics").text
        return next(
            line
            for line in text.splitlines()
            if line.startswith("rlfleet_trainer_weights_stored_bytes_total{")
        )

    try:
        exporter.update_published(
            publisher.last_published.values(), publisher.stored_bytes_total
        )  # nothing yet
        assert (
            "rlfleet_trainer_weights_stored_bytes_total{"
            not in httpx.get(f"http://127.0.0.1:{exporter.port}/metrics").text
        )
        anchor = publisher.publish(state).manifest.views["bf16"].stored_bytes
        nudge(state, 0)
        delta = publisher.publish(state).manifest.views["bf16"].stored_bytes
        assert 0 < delta < anchor
        assert publisher.stored_bytes_total == {"bf16": anchor + delta}
        exporter.update_published(publisher.last_published.values(), publisher.stored_bytes_total)
        assert (
            counter() == f'rlfleet_trainer_weights_stored_bytes_total{{view="bf16"}} {float(anchor + delta)}'
        )
        exporter.update_published(
            publisher.last_published.values(), publisher.stored_bytes_total
        )  # same version
        assert (
            counter() == f'rlfleet_trainer_weights_stored_bytes_total{{view="bf16"}} {float(anchor + delta)}'
        )
        nudge(state, 1)
        third = publisher.publish(state).manifest.views["bf16"].stored_bytes
        exporter.update_published(publisher.last_published.values(), publisher.stored_bytes_total)
        assert (
            counter()
            == f'rlfleet_trainer_weights_stored_bytes_total{{view="bf16"}} {float(anchor + delta + third)}'
        )
    finally:
        exporter.close()


def test_the_rljobs_deltas_reach_the_cluster_and_the_local_publisher(tmp_path: Path) -> None:
    """weightChannel.deltas -> the cluster trainer's publisher (trainer/entrypoint.py) and local mode's
    RunConfig (trainer/config.py `resolve_run`, which rlfleet/local/main.py passes on)."""
    import yaml

    from rlfleet.api import RLJob
    from rlfleet.trainer.config import resolve_run
    from rlfleet.trainer.entrypoint import _channel_writer

    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "rljob.yaml").read_text())
    doc["spec"]["weightChannel"]["deltas"] = {"anchorEvery": 4, "maxDeltaShare": 0.25}
    job = RLJob.from_manifest(doc)
    assert (resolve_run(job, local=True).deltas.anchor_every, resolve_run(job).deltas.max_delta_share) == (
        4,
        0.25,
    )
    rc = resolve_run(job, local=False)
    rc.views = ["bf16"]
    publisher = _channel_writer(job, rc, None, FilesystemStore(tmp_path / "store", create=True))
    try:
        assert (publisher.anchor_every, publisher.max_delta_share) == (4, 0.25)
    finally:
        publisher.close()
    del doc["spec"]["weightChannel"]["deltas"]
    default = RLJob.from_manifest(doc).spec.weight_channel.deltas
    assert (default.anchor_every, default.max_delta_share) == (16, 0.5)
    with pytest.raises(ValueError, match="anchor_every must be >= 1"):
        WeightPublisher(FilesystemStore(tmp_path / "other", create=True), anchor_every=0)
