"""Local mode supervises its fleet host (issue 32 item 7): the one process that holds every sampler server,
the router and the weight-sync loops is SIGKILLed during a real `rlfleet run --local`; the run ends in
seconds (before: no progress for 900 s, then a TimeoutError that did not name the fleet) with the host's
signal, the tail of fleet.log and the exact resume command, exit 8, no traceback, and the report and the
checkpoint of the steps done. No prompt group was dropped: the rollout driver held the groups that
failed on the dead router instead of burning prompts. Then the printed command resumes the run onto a
full volume (the next checkpoint's temporary file is /dev/full): exit 3 and the store-full line of
trainer/failures.py, ending with the same resume command."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_local_run import fleet_hosts, small_manifest, started_until_step  # the local tests' one copy

from rlfleet.trainer.publish import checkpoint as ckpt


@pytest.mark.slow
def test_a_killed_fleet_host_ends_the_run_in_seconds_with_its_signal_and_the_resume_command(
    tmp_path: Path,
) -> None:
    manifest = small_manifest(tmp_path)
    out = tmp_path / "run"
    with started_until_step(tmp_path, manifest, out, 6) as run:
        hosts = fleet_hosts(out / "fleet.json")
        assert len(hosts) == 1, "".join(run.lines)
        os.kill(hosts[0], signal.SIGKILL)
        killed_at = time.monotonic()
        output = run.finish(timeout=180)
        ended_in = time.monotonic() - killed_at
    assert run.proc.returncode == 8, output[-3000:]
    assert ended_in < 60, output[-3000:]  # the loop stops at the next step boundary; measured: a few seconds
    assert "Traceback" not in output

    report = json.loads((out / "report" / "metrics.json").read_text())
    summary = report["summary"]
    done = summary["steps"]
    assert (
        1 <= done < 6
        and summary["interrupted"]
        and [int(r["step"]) for r in report["steps"]] == list(range(1, done + 1))
    )
    state = ckpt.load_latest(out / "checkpoints")
    assert state is not None and state["step"] == done
    assert summary["driver"]["failed_groups"] == 0  # the dead router's groups were held, not dropped

    said = output[output.index("rlfleet run: ") :].splitlines()
    assert re.fullmatch(
        rf"rlfleet run: the fleet host \(pid {hosts[0]}: the sampler servers, the router and the weight sync\) "
        rf"killed by SIGKILL at step {done} of 6; the checkpoint and the report \({re.escape(str(out / 'report'))}\) "
        rf"hold the steps done\. The end of its log {re.escape(str(out / 'fleet.log'))}:",
        said[0],
    ), said[0]
    log_tail = (out / "fleet.log").read_text().splitlines()[-12:]
    assert said[1 : 1 + len(log_tail)] == [f"    {line}" for line in log_tail]
    # the exact command that continues the run (rlfleet/local/main.py resume_command), as printed on a stop
    hint = f"{sys.executable} -m rlfleet.cli run {manifest} --local --resume --out {out} --steps 6 --no-live"
    assert said[1 + len(log_tail)] == f"resume with: {hint}"
    assert fleet_hosts(out / "fleet.json") == []

    # the resumed trainer takes the writer lease's next generation (docs/weights.md), which names its files
    generation = json.loads((out / "channel" / "lease.json").read_text())["generation"] + 1
    next_checkpoint = out / "checkpoints" / f"{ckpt.checkpoint_name(done + 1, generation)}.tmp"
    next_checkpoint.symlink_to("/dev/full")  # every write of the next checkpoint fails with ENOSPC
    resumed = subprocess.run(shlex.split(hint), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 3, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr
    assert [line for line in resumed.stderr.splitlines() if line.startswith("rlfleet run: ")] == [
        f"rlfleet run: the weight store {out / 'channel'} is full (No space left on device). Fix: free space on "
        "its volume or grow it; nothing partial is named (bytes are written before the pointer moves), so resume "
        f"with: {hint}"
    ]
    assert not next_checkpoint.is_symlink()  # the failed write removed its temporary file: room again
    state = ckpt.load_latest(out / "checkpoints")
    assert state is not None and state["step"] == done
    assert fleet_hosts(out / "fleet.json") == []
