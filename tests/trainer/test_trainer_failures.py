"""Runtime failures an operator can act on (trainer/failures.py, issue 32 item 8): one line naming the
store, the path and the fix, and a distinct exit code per class, with no traceback.

The cluster entrypoint `rlfleet trainer run` runs as a REAL process (the tiny Qwen3 checkpoint, the torch
backend, a filesystem channel) for the failures that come before the first rollout: a store that is not
there, no loadable checkpoint, another trainer holding the channel's writer lease. The full store is
tests/trainer/test_trainer_entrypoint.py's (it needs a step: a fleet). A version conflict and the rollout
stall are described from the real exceptions the channel and the training loop raise."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from support.ports import free_port
from test_trainer_entrypoint import job_manifest  # the trainer tests' one copy

from rlfleet.channel import VersionConflictError, WeightChannel
from rlfleet.store import FilesystemStore
from rlfleet.trainer.failures import FAILURES, FailureContext, describe_failure
from rlfleet.trainer.loop import LoopConfig, TrainingLoop
from rlfleet.trainer.publish import checkpoint
from rlfleet.trainer.rollout.driver import RolloutStallError

PREFIX = "rlfleet trainer run: "


def _trainer(
    tmp_path: Path, base: Path, channel: Path, store: dict | None = None, launched: bool = False
) -> subprocess.Popen:
    """The entrypoint on the job of test_trainer_entrypoint.py, its store `store` when given; `launched`:
    as the trainer pod runs it, one rank under `rlfleet trainer launch` (torchrun, trainer/launch.py)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    manifest = job_manifest(tmp_path, base, channel)
    if store is not None:
        doc = yaml.safe_load(manifest.read_text())
        doc["spec"]["weightChannel"]["store"] = store
        manifest.write_text(yaml.safe_dump(doc))
    rlfleet = str(Path(sys.executable).with_name("rlfleet"))
    command = (
        [
            rlfleet,
            "trainer",
            "launch",
            "--standalone",
            "--nproc-per-node=1",
            "--monitor-interval=0.1",
            "-m",
            "rlfleet.cli",
        ]
        if launched
        else [rlfleet]
    )
    return subprocess.Popen(
        [
            *command,
            "trainer",
            "run",
            "--config",
            str(manifest),
            "--router-url",
            "http://127.0.0.1:9",
            "--metrics-port",
            "0",
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "RLFLEET_LOG_LEVEL": "WARNING",
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
        },
    )


def _said(proc: subprocess.Popen) -> tuple[int, str]:
    """(exit code, the one line the trainer said), with no traceback on stderr."""
    try:
        _, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    lines = [line for line in stderr.splitlines() if line.startswith(PREFIX)]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return proc.returncode, lines[0].removeprefix(PREFIX)


@pytest.mark.slow
def test_entrypoint_store_failures_are_one_line_with_their_own_exit_code(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    # 1. the store does not answer: an S3 endpoint on a port nothing listens on
    endpoint = f"http://127.0.0.1:{free_port()}"
    s3 = {"type": "s3", "bucket": "rl-weights", "prefix": "job", "endpoint": endpoint, "region": "us-east-1"}
    # 2. every kept checkpoint damaged (the only one truncated)
    damaged = tmp_path / "damaged" / "channel"
    checkpoint.save_checkpoint(damaged / "checkpoints", {"step": 1})
    newest = damaged / "checkpoints" / "ckpt-00000001.pt"
    newest.write_bytes(newest.read_bytes()[:-1])
    # 3. another trainer holds the channel's writer lease (renewed just now)
    taken = tmp_path / "taken" / "channel"
    taken.mkdir(parents=True)
    WeightChannel(FilesystemStore(taken), publisher_id="trainer/team-b/other-job").acquire_lease()

    runs = {
        "unreachable": _trainer(tmp_path / "unreachable", tiny_qwen3_dir, tmp_path, store=s3),
        "damaged": _trainer(tmp_path / "damaged", tiny_qwen3_dir, damaged),
        "taken": _trainer(tmp_path / "taken", tiny_qwen3_dir, taken),
        # the pod's command: the rank's code is the container's (torchrun alone would exit 1)
        "taken, launched": _trainer(tmp_path / "launched", tiny_qwen3_dir, taken, launched=True),
    }
    said = {name: _said(proc) for name, proc in runs.items()}

    code, line = said["unreachable"]
    assert code == 5, line
    assert line.startswith("the weight store s3://rl-weights/job is unreachable: ") and endpoint in line, line
    assert "Fix: mount its volume, or check the S3 endpoint, bucket and credentials" in line
    assert "the trainer resumes from its last checkpoint when its pod restarts" in line

    code, line = said["damaged"]
    assert code == 6, line
    assert line.startswith(
        f"cannot resume from the checkpoints in {damaged / 'checkpoints'}: no checkpoint in "
    )
    assert "ckpt-00000001.pt: blake3:" in line and "Fix: put back a good checkpoint there" in line

    code, line = said["taken"]
    assert code == 9, line
    assert (
        line.startswith(f"the weight channel {taken} has another writer: ")
        and "trainer/team-b/other-job" in line
    )
    assert "Fix: one trainer writes a channel: stop the other one" in line
    assert "its own spec.weightChannel.store path" in line
    code, launched_line = said["taken, launched"]  # the same line (but for the lease's age) and code
    assert code == 9 and launched_line.split(" ago;")[1] == line.split(" ago;")[1], launched_line


def _context(**fields: str) -> FailureContext:
    return FailureContext(
        **{
            "store": "/data/ch",
            "checkpoints": "/data/ch/checkpoints",
            "router": "http://r:30000",
            "rollout_logs": "the pods' logs",
            "own_store": "its own store",
            "continue_with": "restart it",
            **fields,
        }
    )


def test_a_version_conflict_and_a_rollout_stall_are_described(tmp_path: Path) -> None:
    """The real exceptions: the channel refusing a version at or below its pointer, and the training loop
    finding no complete group within its stall limit (a source that never has one)."""
    store = FilesystemStore(tmp_path / "ch", create=True)
    channel = WeightChannel(store, publisher_id="a")
    view = tmp_path / "view"
    view.mkdir()
    (view / "w.bin").write_bytes(b"x")
    channel.publish({"bf16": view}, version=3)
    with pytest.raises(VersionConflictError) as conflict:
        channel.publish({"bf16": view}, version=2)
    code, line = describe_failure(conflict.value, _context(store=store.uri)) or (0, "")
    assert code == 4
    assert line == (
        f"the weight channel {store.uri} refused this trainer's publish: version 2 is not above the "
        "published version 3. Fix: another trainer publishes to this channel: stop it, or give this "
        "run its own store; then restart it"
    )

    class NeverAGroup:
        next_position = 0

        def check(self) -> None: ...

        def take(self, n: int, timeout: float, stop: threading.Event) -> list:
            return []

    loop = TrainingLoop(
        LoopConfig(total_steps=1, prompts_per_step=1, take_timeout=0.05),
        None,
        NeverAGroup(),  # type: ignore[arg-type]
        lambda v, w: None,
        None,
        [],
        {},
    )  # type: ignore[arg-type]
    with pytest.raises(RolloutStallError) as stall:
        loop.run()
    code, line = describe_failure(
        stall.value, _context(detail="the router has been unavailable for 900s")
    ) or (0, "")
    assert code == 7
    assert line == (
        "no complete rollout group for 0s from the router http://r:30000 (the router has been unavailable "
        "for 900s). Fix: check the router and the sampler groups (the pods' logs); then restart it"
    )


def test_every_failure_class_has_its_own_exit_code() -> None:
    codes = [row.code for row in FAILURES]
    assert len(set(codes)) == len(codes) and not {0, 1, 2, 8, 130} & set(codes)  # 8: local mode's fleet death
    assert describe_failure(ValueError("a bug"), _context()) is None  # anything else keeps its traceback
