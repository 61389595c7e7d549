"""A finished multi-rank trainer ends every rank, in the trainer image on the real node (issue 39 item 8).

After "training finished at step 50" of the CPU example one rank of its 2-rank trainer stayed alive, so
the pod stayed Running and the RLJob never read Succeeded. The trainer image's torch (Debian's 2.6, gloo)
loses the end of a 2-rank run in about one run of four when rank 0 broadcasts the stop and ends at once
(the stop lost, or rank 0 stuck in its broadcast as the follower ended). The end is now a handshake through
the rendezvous store (trainer/backends/backend_common.py `RankCommands`). This pod runs the trainer's own finish
(the FINISH script of tests/trainer/test_trainer_launch.py: a step, `close()`, `exit_now(0)`) under the trainer pod's command, `rlfleet trainer launch`, RUNS times in a row: every run
exits 0, every rank confirmed, within the time a finish takes.

Run with RLFLEET_DEV_CLUSTER_IMAGES=trainer (the only image it uses).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))

from test_node_pods import apply, logs, pod, restricted_container, wait_phase  # noqa: E402
from test_trainer_launch import FINISH  # noqa: E402 - tests/trainer, put on sys.path just above

pytestmark = [pytest.mark.node, pytest.mark.cluster, pytest.mark.timeout(1800)]
RUNS = 12
RUN_TIMEOUT_S = 90  # a finish takes seconds; a lost stop waits for good

# In the pod: write FINISH, then run it RUNS times under the trainer's launcher, one JSON line per run.
DRIVER = f"""
import json, os, subprocess, sys, time
open("/tmp/finish.py", "w").write({FINISH!r})
for run in range({RUNS}):
    out = "/tmp/run%d" % run
    os.makedirs(out)
    started = time.time()
    try:
        rc = subprocess.run(["rlfleet", "trainer", "launch", "--standalone", "--nproc-per-node=2",
                             "--monitor-interval=0.1", "/tmp/finish.py", out], capture_output=True,
                            timeout={RUN_TIMEOUT_S}).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    ranks = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out))]
    print(json.dumps({{"run": run, "rc": rc, "seconds": round(time.time() - started, 1), "ranks": ranks}}), flush=True)
"""


def test_every_rank_of_a_finished_trainer_ends_run_after_run_in_the_trainer_image(
    dev_cluster, ns: str
) -> None:
    kube = dev_cluster.kube
    container = restricted_container(
        "finish",
        dev_cluster.images["trainer"].ref,
        ["python3", "-c", DRIVER],
        volumeMounts=[{"name": "tmp", "mountPath": "/tmp"}],
    )
    container["resources"] = {"requests": {"cpu": "500m", "memory": "512Mi"}}
    container["env"] = [{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "HOME", "value": "/tmp"}]
    apply(kube, pod("finish", [container]), namespace=ns)
    wait_phase(kube, ns, "finish", {"Succeeded"}, timeout=RUNS * (RUN_TIMEOUT_S + 30))
    runs = [json.loads(line) for line in logs(kube, ns, "finish").splitlines() if line.startswith("{")]
    assert len(runs) == RUNS
    failed = [r for r in runs if r["rc"] != 0]
    assert not failed, failed
    for r in runs:
        by_rank = {x["rank"]: x for x in r["ranks"]}
        assert sorted(by_rank) == [0, 1] and by_rank[0]["confirmed"] == [1], r
        assert by_rank[0]["sum"] == 2.0
