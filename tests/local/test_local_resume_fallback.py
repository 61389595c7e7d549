"""`rlfleet run --local --resume` when the newest checkpoint is damaged (issue 39 item 3): the run resumes
from the previous kept checkpoint although the channel is ahead of it, and publishes above the pointer.

Before: the damaged newest checkpoint was skipped, and the run then refused to start ("the weight channel
is at version 3, ahead of the trainer (checkpoint step 2)", exit 2): the fallback that docs/operations.md
promised never resumed. Through the real entry (`python -m rlfleet.cli run ... --local`), the real fleet
host, the filesystem channel and the checkpoints on disk."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from test_local_run import fleet_hosts, local_run_command, small_manifest

from rlfleet.channel import WeightChannel
from rlfleet.store import FilesystemStore
from rlfleet.trainer.publish import checkpoint as ckpt


def test_a_damaged_newest_checkpoint_resumes_from_the_previous_one_above_the_pointer(tmp_path: Path) -> None:
    """A 3-step run (pointer at 3, checkpoints of steps 2 and 3); the step-3 checkpoint's bytes are flipped.
    `--resume --steps 5` warns, loads step 2, publishes its weights as version 4 (manifest step 2), trains
    steps 3-5 as versions 5-7 and exits 0; the final checkpoint records the offset (version = step + 2) and
    every step in its history once."""
    manifest = small_manifest(tmp_path)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run = local_run_command(manifest, out)
    first = subprocess.run(
        [*run, "--steps", "3"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    channel = WeightChannel(FilesystemStore(out / "channel"), publisher_id="test-observer")
    assert channel.latest().version == 3  # type: ignore[union-attr]
    checkpoints = out / "checkpoints"
    newest = ckpt.load_latest(checkpoints)
    assert newest is not None and (newest["step"], newest.get("version_offset")) == (3, 0)
    names = sorted(p.name for p in checkpoints.glob("ckpt-*.pt"))
    assert len(names) == 2 and ckpt.parse_checkpoint_name(names[-1])[0] == 3
    data = bytearray((checkpoints / names[-1]).read_bytes())
    data[len(data) // 2] ^= 0xFF  # one bit flipped in the middle of the step-3 checkpoint
    (checkpoints / names[-1]).write_bytes(bytes(data))

    resumed = subprocess.run(
        [*run, "--resume", "--steps", "5"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    said = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, said[-4000:]
    assert "ahead of the trainer" not in said
    assert f"checkpoint {names[-1]} in {checkpoints} not loaded" in said
    assert (
        "the weight channel is at version 3, ahead of the checkpoint of step 2 (version 2; the newer "
        "checkpoints were refused): resuming from step 2 and publishing its weights as version 4"
    ) in said
    step_lines = [line for line in resumed.stdout.splitlines() if line.startswith("step ")]
    assert step_lines[0].startswith("step 3/5 ") and step_lines[-1].startswith("step 5/5 "), step_lines

    pointer = channel.latest()
    assert pointer is not None and pointer.version == 7
    kept = [v for v in channel.versions() if v >= 4]  # local mode's retention keeps the newest few
    assert kept[-3:] == [5, 6, 7] and all(channel.manifest(v).metadata.get("step") == v - 2 for v in kept)
    final = ckpt.load_latest(checkpoints)
    assert final is not None and (final["step"], final["version_offset"]) == (5, 2)
    assert [int(h["step"]) for h in final["history"]] == [1, 2, 3, 4, 5]
    assert [int(h["weight_version"]) for h in final["history"][2:]] == [5, 6, 7]
    assert fleet_hosts(out / "fleet.json") == []
