"""Two REAL trainer processes on one channel (issue 39 item 4): the first is paused (SIGSTOP: a GC pause, a
frozen VM, a partitioned node) after it published version 2; the second (its restart: the same job, the same
publisher id, a new lease generation) resumes from the step-2 checkpoint and finishes the run; then the
first is continued (SIGCONT). Fenced like its publishes, its checkpoints change nothing: it exits 9 (another
writer) with one line, and every file of the channel (checkpoints, `latest`, pointer, versions, lease) is
byte for byte what the second left. Before: the first wrote its step-3 checkpoint over the second's file of
that step, rewrote `latest` naming step 3 newest and deleted the second's step-4 checkpoint, then failed at
its publish.

Real parts as in test_trainer_entrypoint.py: the local fleet host (reference samplers, router, weight-sync
loops), a filesystem channel, `rlfleet trainer run` processes with the resolved RLJob YAML."""

from __future__ import annotations

import fcntl
import hashlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support.processes import start_trainer
from support.waits import wait_for
from test_trainer_entrypoint import job_manifest, local_fleet

from rlfleet.channel import WeightChannel
from rlfleet.local.fleet import GroupSpec
from rlfleet.store import FilesystemStore
from rlfleet.trainer.publish import checkpoint


def channel_files(channel_dir: Path) -> dict[str, str]:
    """sha256 of every file of the channel but the live samplers' reports and lock/temporary files."""
    found = {}
    for path in sorted(channel_dir.rglob("*")):
        rel = path.relative_to(channel_dir).as_posix()
        if (
            path.is_file()
            and not rel.startswith("subscribers/")
            and not any(p.startswith(".") for p in rel.split("/"))
        ):
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def store_locks_free(channel_dir: Path) -> bool:
    """No process holds the filesystem store's compare-and-swap locks (pointer, lease, checkpoints' `latest`)."""
    for lock in (
        channel_dir / ".pointer.json.lock",
        channel_dir / ".lease.json.lock",
        channel_dir / "checkpoints" / ".latest.lock",
    ):
        if not lock.exists():
            continue
        with open(lock, "a") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(fh, fcntl.LOCK_UN)
    return True


def pause_outside_the_store_locks(proc: subprocess.Popen, channel_dir: Path) -> None:
    """SIGSTOP `proc` at a moment it holds none of the store's flocks. A writer frozen INSIDE a compare-and-swap
    (the few milliseconds of read-compare-write under the flock) blocks the next writer's swap until it is
    continued or dies (docs/operations.md, the faults table); that is the filesystem store's limit, not what this
    test is about. One run in several paused there before this loop (the second trainer then waited forever)."""
    for _ in range(200):
        os.killpg(proc.pid, signal.SIGSTOP)
        if store_locks_free(channel_dir):
            return
        os.killpg(proc.pid, signal.SIGCONT)
        time.sleep(0.005)  # let it leave the critical section
    raise AssertionError("the first trainer held a store lock at every one of 200 pauses")


@pytest.mark.slow
def test_a_paused_then_continued_fenced_trainer_changes_nothing(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    steps = 4
    channel_dir = tmp_path / "channel"
    channel_dir.mkdir()
    manifest = job_manifest(tmp_path, tiny_qwen3_dir, channel_dir, steps=steps)
    channel = WeightChannel(FilesystemStore(channel_dir), publisher_id="test-observer")

    def trainer() -> subprocess.Popen:
        return start_trainer(manifest, router_url, tmp_path)

    def pointer_at_least(version: int, proc: subprocess.Popen) -> bool:
        assert proc.poll() is None, f"the trainer exited ({proc.returncode}) before version {version}"
        pointer = channel.latest()
        return pointer is not None and pointer.version >= version

    router_url, fleet = local_fleet(
        tmp_path, channel_dir, tiny_qwen3_dir, (GroupSpec("h100-bf16", "h100", "bf16"),)
    )
    first = second = None
    try:
        first = trainer()
        fleet.wait_ready()
        wait_for(
            "the first trainer's version 2", lambda: pointer_at_least(2, first), timeout=300, interval=0.01
        )
        pause_outside_the_store_locks(first, channel_dir)
        paused_at = channel.latest().version  # type: ignore[union-attr]
        assert paused_at in (2, 3)

        second = trainer()  # the same job: the same id takes the lease at once, as a new generation
        _, second_err = second.communicate(timeout=600)
        assert second.returncode == 0, second_err[-3000:]
        assert f"resuming from the checkpoint at step {paused_at} " in second_err
        left = channel_files(channel_dir)
        latest_doc = checkpoint._read_latest(FilesystemStore(channel_dir / "checkpoints"), "latest")[0]
        assert latest_doc is not None and latest_doc.generation == 2
        assert [checkpoint.parse_checkpoint_name(e["name"]) for e in latest_doc.entries] == [(4, 2), (3, 2)]

        os.killpg(first.pid, signal.SIGCONT)
        _, first_err = first.communicate(timeout=600)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        fleet.stop()
    assert first.returncode == 9, first_err[-3000:]  # another writer (trainer/failures.py)
    said = [line for line in first_err.splitlines() if line.startswith("rlfleet trainer run: ")]
    assert len(said) == 1 and "taken over" in said[0], first_err[-3000:]
    assert "Traceback" not in first_err
    assert channel_files(channel_dir) == left  # nothing of the second's changed: checkpoints, latest, pointer
    pointer = channel.latest()
    assert pointer is not None and pointer.version == steps and pointer.lease_generation == 2
    final = checkpoint.load_latest(channel_dir / "checkpoints")
    assert final is not None and final["step"] == steps
