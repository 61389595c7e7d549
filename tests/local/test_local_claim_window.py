"""`rlfleet run --local` SIGKILLed inside its claim window, then `--resume`d (issue 32: a publish interrupted
after its claim used to wedge the run for good: VersionConflictError on its own dead claim)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from support.claim_window import kill_inside_the_claim_window
from support.waits import wait_for
from test_local_run import fleet_hosts, local_run_command, small_manifest

from rlfleet.channel import WeightChannel, manifest_key
from rlfleet.store import FilesystemStore
from rlfleet.trainer.publish import checkpoint as ckpt


def test_a_local_run_killed_inside_its_claim_window_resumes_and_publishes_on(tmp_path: Path) -> None:
    """The whole run (trainer; its fleet host notices its stdin close) is SIGKILLed while version 2 is
    claimed, written and its manifest too, the pointer still at 1 (tests/support/claim_window.py). `--resume` loads
    the step-2 checkpoint, publishes version 2 again over its own claim (its id local/<job>, its writer
    lease), trains to step 4 and exits 0; every kept version is the run's and verifies file by file."""
    manifest = small_manifest(tmp_path)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run = local_run_command(manifest, out, steps=4)
    proc = subprocess.Popen(
        run,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        kill_inside_the_claim_window(proc, out / "channel", version=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wait_for(
        "the fleet host to exit after its trainer", lambda: fleet_hosts(out / "fleet.json") == [], timeout=60
    )
    killed = ckpt.load_latest(out / "checkpoints")
    assert killed is not None and killed["step"] == 2

    resumed = subprocess.run(
        [*run, "--resume"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    step_lines = [line for line in resumed.stdout.splitlines() if line.startswith("step ")]
    assert step_lines[0].startswith("step 3/4 ") and step_lines[-1].startswith("step 4/4 ")
    assert (
        "version 2: taking over the claim of this publisher of an interrupted publish"
        in resumed.stderr + resumed.stdout
    )

    channel = WeightChannel(FilesystemStore(out / "channel"), publisher_id="test-observer")
    pointer = channel.latest()
    assert pointer is not None and pointer.version == 4 and pointer.publisher.startswith("local/")
    kept = channel.versions()
    assert kept[-1] == 4 and 2 in kept
    assert channel.store.get("claims/v2") == pointer.publisher.encode()
    for version in kept:
        m = channel.manifest(version)
        assert m.publisher == pointer.publisher
        listed = {f"v{version}/{view}/{rel}" for view, vm in m.views.items() for rel in vm.stored_files()}
        assert set(channel.store.list(f"v{version}/")) == listed | {manifest_key(version)}
        for view in m.views:
            channel.obtain_view(version, view, tmp_path / "dl" / f"{version}-{view}", manifest=m)  # verifies
    final = ckpt.load_latest(out / "checkpoints")
    assert final is not None and final["step"] == 4
    assert [int(h["step"]) for h in final["history"]] == [1, 2, 3, 4]
    assert fleet_hosts(out / "fleet.json") == []
