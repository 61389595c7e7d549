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
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )


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


# A trainer's finish as the entrypoint does it (trainer/entrypoint.py): rank 0 commands a step (a real gloo
# all-reduce on every rank) and closes the backend; the followers' `follow()` returns on the stop; every
# rank ends at once (`exit_now`), without destroying the process group. Rank 0 records which followers had
# confirmed the stop in the rendezvous store when `close()` returned.
FINISH = """
import json, os, sys, time
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store
from rlfleet.trainer.backends.backend_common import RankCommands
from rlfleet.trainer.entrypoint import exit_now

class Ranks(RankCommands):
    device = torch.device("cpu")
    def _train_step(self, flat, group_index):
        total = torch.ones(1)
        dist.all_reduce(total)
        return float(total)
    def train_step(self):
        self._send(("step", None, {}))
        return self._train_step(None, {})

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
ranks, result = Ranks(), {"rank": rank}
if rank == 0:
    result["sum"] = ranks.train_step()
    ranks.close()
    store = _get_default_store()
    result["confirmed"] = [r for r in range(1, world) if store.check([f"rlfleet/stopped/{r}"])]
else:
    ranks.follow()
result["ended_at"] = time.time()
with open(os.path.join(sys.argv[1], "rank%d.json" % rank), "w") as fh:
    json.dump(result, fh)
exit_now(0)
"""


@pytest.mark.slow
def test_a_finished_multi_rank_trainer_ends_every_rank_in_bounded_time(tmp_path: Path) -> None:
    """Issue 39: after "training finished" one rank of the 2-rank CPU trainer stayed alive (the stop lost
    as rank 0 ended at once), so the pod stayed Running and its RLJob never read Succeeded. Now rank 0
    returns from `close()` only once every follower confirmed the stop, and every rank exits 0 at once."""
    import json
    import time

    script = tmp_path / "finish.py"
    script.write_text(FINISH)
    for attempt in range(2):
        out = tmp_path / f"run{attempt}"
        out.mkdir()
        started = time.time()
        done = subprocess.run(
            [
                RLFLEET,
                "trainer",
                "launch",
                "--standalone",
                "--nproc-per-node=3",
                "--monitor-interval=0.1",
                str(script),
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
        assert ranks[0]["sum"] == 3.0 and ranks[0]["confirmed"] == [1, 2]
        # every rank ended within seconds of the others (none waited for a stop or a peer's teardown)
        ended = [r["ended_at"] for r in ranks]
        assert max(ended) - min(ended) < 10 and max(ended) - started < 100
