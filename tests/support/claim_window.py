"""Killing a real trainer process INSIDE its claim window.

The window: `claims/v{N}` exists, version N's files and manifest may be written, the pointer still names
N-1 (rlfleet/channel.py `publish`). On a filesystem store the pointer's compare-and-swap holds an
`flock(2)` on `<store>/.pointer.json.lock` (rlfleet/store/filesystem.py): holding that lock from the test
stops the trainer's publish of version N exactly before its pointer would move, after the claim, the files
and the manifest, so the SIGKILL lands inside the window every time, not by timing."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
from pathlib import Path

from rlfleet.channel import WeightChannel, manifest_key
from rlfleet.store import FilesystemStore
from support.waits import wait_for


def kill_inside_the_claim_window(
    proc: subprocess.Popen, store_dir: Path, version: int, timeout: float = 300
) -> None:
    """Once the pointer names `version - 1`, hold the pointer's lock; once `proc` wrote version `version`'s
    manifest (its publish now waits for the lock), SIGKILL its process group (`proc` started with
    start_new_session=True: the trainer and what it started, as a node loss would); then let go."""
    store = FilesystemStore(store_dir)
    channel = WeightChannel(store, publisher_id="test-observer")

    def pointer_at(wanted: int) -> bool:
        assert proc.poll() is None, f"the trainer exited ({proc.returncode}) before version {version}"
        pointer = channel.latest()
        return pointer is not None and pointer.version == wanted

    wait_for(
        f"the pointer at version {version - 1}",
        lambda: pointer_at(version - 1),
        timeout=timeout,
        interval=0.005,
    )
    fd = os.open(store_dir / ".pointer.json.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        wait_for(
            f"version {version}'s manifest",
            lambda: manifest_key(version) in store.list(f"v{version}/"),
            timeout=timeout,
            interval=0.05,
        )
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        os.close(fd)  # releases the lock
    pointer = channel.latest()
    assert pointer is not None and pointer.version == version - 1, (
        "the pointer moved: not killed inside the window"
    )
    assert f"claims/v{version}" in store.list("claims/")
