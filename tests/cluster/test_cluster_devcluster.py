"""`scripts/dev-cluster up` while another `up` holds the dev cluster's work dir (issue 39 item 9): refused
at once with one line naming the holder, exit 2, nothing of the work dir touched (a traceback from its
cleanup before). The real CLI (tests/cluster/devcluster.py, what scripts/dev-cluster runs after its
bootstrap) in a subprocess; this test process holds the lock, as a first `up` holds it while it
installs, builds and starts. The CLI runs without root (in a user namespace when the test is root): its
refusal must come before anything that needs root, and were it missing, the CLI would stop at its root
check instead of touching the host. No control plane needed."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import devcluster  # noqa: E402 - this folder, put on sys.path just above

CLI = Path(__file__).resolve().parent / "devcluster.py"


def without_root() -> list[str]:
    """The prefix that runs a command without root: as root, a new user namespace (uid 65534 inside)."""
    return ["unshare", "--user"] if os.geteuid() == 0 else []


def test_a_second_up_while_one_holds_the_work_dir_is_refused_at_once_in_one_line(tmp_path: Path) -> None:
    workdir = tmp_path / "dev-cluster"
    workdir.mkdir()
    (workdir / "supervisor.log").write_text("the first up's log\n")
    lock = tmp_path / "dev-cluster.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write(f"{os.getpid()}\n")
        held.flush()
        result = subprocess.run(
            [*without_root(), sys.executable, str(CLI), "--workdir", str(workdir), "up"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr.splitlines() == [
        f"error: another scripts/dev-cluster up (pid {os.getpid()}) is starting the dev cluster in {workdir} "
        f"(it holds {lock}); wait for it, or stop it with scripts/dev-cluster down"
    ]
    assert (workdir / "supervisor.log").read_text() == "the first up's log\n"
    assert sorted(path.name for path in tmp_path.rglob("*")) == [
        "dev-cluster",
        "dev-cluster.lock",
        "supervisor.log",
    ]


def test_the_lock_is_free_once_its_holder_lets_go_and_names_its_new_holder(tmp_path: Path) -> None:
    """The kernel drops a flock with its holder's file: an `up` that died leaves no stale lock, only its
    pid in the file, which the next `up` replaces with its own."""
    workdir = tmp_path / "dev-cluster"
    lock = devcluster.lock_path(workdir)
    assert lock == tmp_path / "dev-cluster.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("999999999\n")
        held.flush()
        with pytest.raises(
            devcluster.Busy, match=r"^another scripts/dev-cluster up \(pid 999999999\) is starting"
        ):
            devcluster.take_up_lock(workdir)
    fd = devcluster.take_up_lock(workdir)
    try:
        assert lock.read_text() == f"{os.getpid()}\n"
        with open(lock) as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    assert not workdir.exists()  # the lock lives beside the work dir, which `up` empties


def test_the_sweep_removes_empty_cgroup_trees_and_never_raises_on_what_is_missing(tmp_path: Path) -> None:
    """realnode's sweep takes back the kubelet's cgroups bottom-up; what vanished (removed by the kubelet
    or another sweep meanwhile) or is still busy (here: holds a file, as a cgroup holds a process) is
    left, without an error."""
    import realnode

    realnode._remove_tree_bottom_up(tmp_path / "kubepods-gone")  # missing: nothing to do, no error
    root = tmp_path / "kubepods"
    (root / "burstable" / "pod-a" / "ctr-1").mkdir(parents=True)
    (root / "besteffort" / "pod-b").mkdir(parents=True)
    (root / "burstable" / "pod-c").mkdir(parents=True)
    (root / "burstable" / "pod-c" / "cgroup.procs").write_text("42\n")
    realnode._remove_tree_bottom_up(root)
    assert sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*")) == [
        "kubepods",
        "kubepods/burstable",
        "kubepods/burstable/pod-c",
        "kubepods/burstable/pod-c/cgroup.procs",
    ]
