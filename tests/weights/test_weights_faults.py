"""Faults with real processes: a publisher SIGKILLed mid-write or while holding the pointer lock,
and publishers racing from separate processes on a shared directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from rlfleet.channel import WeightChannel
from rlfleet.store import FilesystemStore
from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model
from rlfleet.trainer.publish.publisher import WeightPublisher

# A publisher in its own process. Its store sleeps after each durable file (a slow shared volume),
# so the test can SIGKILL it with some bytes written and the manifest / pointer not yet.
SLOW_PUBLISHER = textwrap.dedent(
    """
    import sys, time
    import torch
    from rlfleet.numerics.views import calibrate_activation_amax
    from rlfleet.store import FilesystemStore
    from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model
    from rlfleet.trainer.publish.publisher import WeightPublisher

    class SlowStore(FilesystemStore):
        def put_file(self, key, path, **kwargs):
            digest = super().put_file(key, path, **kwargs)
            time.sleep(float(sys.argv[2]))
            return digest

    model = tiny_model(TinyQwen3(seed=int(sys.argv[3])))  # the shape of the base checkpoint sys.argv[7]
    amax = calibrate_activation_amax(model, [torch.arange(32).reshape(2, 16)])  # nvfp4's input_scale
    publisher = WeightPublisher(SlowStore(sys.argv[1]), views=sys.argv[6].split(","), publisher_id=sys.argv[4], keep_versions=None,
                                base_checkpoint=sys.argv[7])
    for _ in range(int(sys.argv[5])):
        print(publisher.publish(model.state_dict(), activation_amax=amax).version, flush=True)
    """
)


def tiny_state(seed: int) -> dict[str, torch.Tensor]:
    """The tiny Qwen3's tensors from `seed` (the shape of the `tiny_qwen3_dir` base checkpoint)."""
    return dict(tiny_model(TinyQwen3(seed=seed)).state_dict())


def spawn_publisher(
    store_dir: Path, delay: float, seed: int, name: str, count: int, base: Path, views: str = "bf16,fp8,nvfp4"
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            SLOW_PUBLISHER,
            str(store_dir),
            str(delay),
            str(seed),
            name,
            str(count),
            views,
            str(base),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_publisher_sigkilled_mid_write_leaves_pointer_unchanged(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    store_dir = tmp_path / "store"
    store = FilesystemStore(store_dir, create=True)
    channel = WeightChannel(store)
    WeightPublisher(store, views=["bf16"], keep_versions=None, base_checkpoint=tiny_qwen3_dir).publish(
        tiny_state(0)
    )
    proc = spawn_publisher(store_dir, 1.0, 1, "doomed", 1, tiny_qwen3_dir)
    try:
        deadline = time.monotonic() + 60
        while not store.list("v1/") and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.02)
        assert store.list("v1/"), "the publisher never wrote a byte"
        os.kill(proc.pid, signal.SIGKILL)  # some files durable, manifest and pointer not written
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    partial = store.list("v1/")
    assert partial and "v1/manifest.json" not in partial
    pointer = channel.latest()
    assert pointer is not None and pointer.version == 0  # readers still see v0 ...
    assert channel.versions() == [0]
    channel.obtain_view(0, "bf16", tmp_path / "dl")  # ... and it is intact
    # the next publish succeeds (v1 is the dead publisher's number) and retention removes the debris
    result = WeightPublisher(store, views=["bf16"], keep_versions=3, base_checkpoint=tiny_qwen3_dir).publish(
        tiny_state(2)
    )
    assert (result.version, result.advanced) == (2, True)
    assert channel.latest().version == 2  # type: ignore[union-attr]
    assert store.list("v1/") == [] and channel.versions() == [0, 2]


def test_publisher_sigkilled_holding_the_pointer_lock_does_not_wedge_it(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    store = FilesystemStore(store_dir, create=True)
    store.compare_and_swap("pointer.json", None, b"0")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
            import time
            from rlfleet.store import FilesystemStore
            store = FilesystemStore({str(store_dir)!r})
            with store._locked(store._path("pointer.json")):
                print("locked", flush=True)
                time.sleep(60)
            """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(30)
    finally:
        holder.kill()
        holder.wait(30)
    current = store.read_pointer("pointer.json")
    assert current is not None
    assert store.compare_and_swap("pointer.json", current.token, b"1")  # the kernel released the lock
    assert store.get("pointer.json") == b"1"


@pytest.mark.slow
def test_publishers_racing_from_two_processes(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    store_dir = tmp_path / "store"
    store = FilesystemStore(store_dir, create=True)
    procs = {
        name: spawn_publisher(store_dir, 0.0, seed, name, 2, tiny_qwen3_dir, "bf16,fp8")
        for name, seed in (("A", 1), ("B", 2))
    }
    channel = WeightChannel(store)
    seen: list[int] = []
    while any(p.poll() is None for p in procs.values()):
        pointer = channel.latest()
        if pointer is not None:
            seen.append(pointer.version)
        time.sleep(0.02)
    published = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        published[name] = [int(line) for line in out.split()]
    versions = published["A"] + published["B"]
    assert len(versions) == len(set(versions)) == 4
    assert seen == sorted(seen)
    assert channel.latest().version == max(versions)  # type: ignore[union-attr]
    expected = {name: {v: WeightChannel(store).manifest(v) for v in vs} for name, vs in published.items()}
    for name, manifests in expected.items():
        for version, manifest in manifests.items():
            assert manifest.publisher == name
            # the bytes under v{N}/ are exactly the manifest's (one publisher), for every view
            for view in ("bf16", "fp8"):
                channel.obtain_view(version, view, tmp_path / "dl" / f"{version}-{view}", manifest=manifest)
    # A and B publish different weights: a version's bf16 view (downloaded, or rebuilt where its publisher
    # stored it as a delta) matches its publisher's seed
    a_file = {v: (tmp_path / "dl" / f"{v}-bf16" / "model.safetensors").read_bytes() for v in published["A"]}
    b_file = {v: (tmp_path / "dl" / f"{v}-bf16" / "model.safetensors").read_bytes() for v in published["B"]}
    assert len(set(a_file.values())) == 1 and len(set(b_file.values())) == 1
    assert set(a_file.values()) != set(b_file.values())


def test_a_restarted_trainer_takes_over_its_own_claim_of_an_interrupted_publish(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    """The trainer publishes version N (its step) after checkpointing step N; killed between the claim and
    the pointer, the restarted trainer (the same job: the same publisher id) publishes version N again. It
    takes over its own claim and clears the partial bytes; another publisher's claim still refuses it."""
    from rlfleet.channel import VersionConflictError

    store_dir = tmp_path / "store"
    store = FilesystemStore(store_dir, create=True)
    channel = WeightChannel(store)
    trainer_id = "trainer/ns/job"  # trainer/entrypoint.py: one id per job, the same across restarts
    WeightPublisher(
        store, views=["bf16"], keep_versions=None, base_checkpoint=tiny_qwen3_dir, publisher_id=trainer_id
    ).publish(tiny_state(0), version=0)
    proc = spawn_publisher(store_dir, 1.0, 1, trainer_id, 1, tiny_qwen3_dir, views="bf16")  # claims v1
    try:
        deadline = time.monotonic() + 60
        while not store.list("v1/") and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    assert store.get("claims/v1") == trainer_id.encode() and "v1/manifest.json" not in store.list("v1/")
    # a partial file the new publish will not write: it must not survive into the published version
    store.put("v1/bf16/stale.bin", b"left by the killed publisher")
    # another trainer on the same channel is refused, naming the holder
    with pytest.raises(VersionConflictError, match="claimed by publisher 'trainer/ns/job'"):
        WeightPublisher(
            store,
            views=["bf16"],
            keep_versions=None,
            base_checkpoint=tiny_qwen3_dir,
            publisher_id="trainer/ns/other",
        ).publish(tiny_state(2), version=1)
    restarted = WeightPublisher(
        store, views=["bf16"], keep_versions=None, base_checkpoint=tiny_qwen3_dir, publisher_id=trainer_id
    )
    result = restarted.publish(tiny_state(2), version=1)
    assert (result.version, result.advanced) == (1, True)
    manifest = channel.manifest(1)
    listed = {f"v1/bf16/{rel}" for rel in manifest.views["bf16"].files}
    assert set(store.list("v1/")) == listed | {"v1/manifest.json"}  # nothing of the killed publish left
    channel.obtain_view(1, "bf16", tmp_path / "dl")  # every file verifies


@pytest.mark.parametrize("conditional", [True, False], ids=["s3-conditional", "s3-lock-free"])
def test_s3_failing_mid_publish_then_the_restarted_trainer_publishes_on(
    s3_endpoint: str, s3_bucket: str, tmp_path: Path, tiny_qwen3_dir: Path, conditional: bool
) -> None:
    """S3 answers 503 SlowDown to every upload of version 2's fp8 view (an outage that outlasts boto's
    retries, after the claim and after the bf16 view landed): the trainer's publish fails with
    StoreUnavailableError, the pointer stays at 1 and claims/v2 holds the trainer's id. The restarted
    trainer (the same id: a new generation of its writer lease) publishes version 2 over its own claim,
    then version 3: each version complete, nothing of the failed publish left, every file verifies."""
    from s3_fault_proxy import S3FaultProxy

    from rlfleet.channel import manifest_key
    from rlfleet.store import S3Store, StoreUnavailableError

    proxy = S3FaultProxy(int(s3_endpoint.rsplit(":", 1)[1]))
    trainer_id = "trainer/ns/job"

    def trainer() -> WeightPublisher:
        store = S3Store(s3_bucket, "channel", endpoint_url=proxy.url, conditional_writes=conditional)
        return WeightPublisher(
            store,
            views=["bf16", "fp8"],
            keep_versions=None,
            base_checkpoint=tiny_qwen3_dir,
            publisher_id=trainer_id,
            writer_lease_ttl_seconds=300.0,
        )

    observer = WeightChannel(
        S3Store(s3_bucket, "channel", endpoint_url=s3_endpoint, conditional_writes=conditional)
    )
    try:
        first = trainer()
        for version in (0, 1):
            first.publish(tiny_state(version), version=version)
        with (
            proxy.failing("PUT", r"/channel/v2/fp8/"),
            pytest.raises(StoreUnavailableError, match="SlowDown"),
        ):
            first.publish(tiny_state(2), version=2)
        first.close()
        assert len(proxy.failed) >= 3, (
            proxy.failed
        )  # boto retried (standard mode, 3 attempts) before giving up
        assert observer.latest().version == 1  # type: ignore[union-attr]
        assert observer.store.get("claims/v2") == trainer_id.encode()
        assert any(key.startswith("v2/bf16/") for key in observer.store.list("v2/"))  # a partial version
        restarted = trainer()
        try:
            assert restarted.publish(tiny_state(2), version=2).advanced
            assert restarted.publish(tiny_state(3), version=3).advanced
        finally:
            restarted.close()
    finally:
        proxy.close()
    assert observer.versions() == [0, 1, 2, 3] and observer.latest().version == 3  # type: ignore[union-attr]
    for version in range(4):
        manifest = observer.manifest(version)
        assert manifest.publisher == trainer_id and sorted(manifest.views) == ["bf16", "fp8"]
        listed = {
            f"v{version}/{view}/{rel}" for view, vm in manifest.views.items() for rel in vm.stored_files()
        }
        assert set(observer.store.list(f"v{version}/")) == listed | {manifest_key(version)}
        for view in manifest.views:
            observer.obtain_view(version, view, tmp_path / "dl" / f"{version}-{view}", manifest=manifest)
