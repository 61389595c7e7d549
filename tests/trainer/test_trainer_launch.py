"""`rlfleet trainer launch` (trainer/launch.py), the trainer pod's command: PyTorch's real torchrun, run
on CPU with real rank processes, exiting with the failed rank's own code where torchrun exits 1.
The whole chain (launch -> `rlfleet trainer run` -> a failure class's code) is
tests/trainer/test_trainer_failures.py's; on the real node, tests/node/test_node_fleet.py's full store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet.trainer.launch import exit_code_of

RLFLEET = str(Path(sys.executable).with_name("rlfleet"))

# rank 1 ends as told by argv[1] (an exit code, or "kill" for SIGKILL); rank 0 waits to be stopped
RANKS = """
import os, signal, sys, time
if os.environ["RANK"] == "1":
    time.sleep(0.5)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(sys.argv[1]))
time.sleep(120)
"""


def test_a_failed_ranks_code_is_the_containers_code() -> None:
    assert [exit_code_of(c) for c in (3, 9, 1, 255)] == [3, 9, 1, 255]
    assert [exit_code_of(c) for c in (-9, -15, -6)] == [137, 143, 134]  # killed by signal N: 128 + N
    assert [exit_code_of(c) for c in (0, 256, -200)] == [1, 1, 1]  # no usable code: torchrun's 1


def _launch(command: list[str], script: Path, rank1: str) -> subprocess.CompletedProcess:
    argv = [*command, "--standalone", "--nproc-per-node=2", "--monitor-interval=0.1", str(script), rank1]
    return subprocess.run(argv, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip


@pytest.mark.slow
def test_launch_exits_with_the_failed_ranks_code_where_torchrun_exits_1(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    torchrun = _launch([sys.executable, "-m", "torch.distributed.run"], script, "4")
    assert torchrun.returncode == 1, torchrun.stderr[-3000:]  # why the launcher exists

    launched = _launch([RLFLEET, "trainer", "launch"], script, "4")
    assert launched.returncode == 4, launched.stderr[-3000:]
    # torchrun's own summary names the root cause, and no traceback of the launcher follows it
    assert "exitcode  : 4" in launched.stderr and "Traceback" not in launched.stderr, launched.stderr[-3000:]

    killed = _launch([RLFLEET, "trainer", "launch"], script, "kill")
    assert killed.returncode == 128 + 9, killed.stderr[-3000:]


@pytest.mark.slow
def test_launch_exits_0_when_every_rank_does(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text("import sys; sys.exit(0)\n")
    done = _launch([RLFLEET, "trainer", "launch"], script, "0")
    assert done.returncode == 0, done.stderr[-3000:]
