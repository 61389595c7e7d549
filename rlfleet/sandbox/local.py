"""Local sandboxes: each command a bubblewrap (`bwrap`, Debian package `bubblewrap`) process tree.

What a command sees and may do (docs/environments.md 'Sandboxes'):
- the host's /usr, /etc and the /bin, /lib* links, read-only; a fresh /tmp (tmpfs), /proc of its own
  pid namespace, a minimal /dev; the repository read-write at /work, and nothing else of the host;
- new user, pid, network, IPC, UTS and cgroup namespaces (`--unshare-all`): no network at all (only
  a loopback that is down), no view of the host's processes; `--die-with-parent`: when bwrap dies,
  so does the tree; the command's shell is pid 1 of its namespace (`--as-pid-1`), so when it ends
  the namespace is torn down, killing anything it left in the background (no process survives its
  command), and bwrap waits for it (no zombie is left behind);
- rlimits set before exec (`SandboxLimits`): CPU seconds, address space, file size, open files and
  processes. Run as root (the trainer pod, CI), each sandbox gets a uid of its own (no account: a
  number in [UID_BASE, UID_BASE + UID_SPAN)), so RLIMIT_NPROC bounds that sandbox's processes (a
  fork bomb stops there) and `close()` can kill every process of the uid. Run as another user,
  the commands keep that user's uid: the process limit then counts all of that user's processes;
- a wall-clock timeout per command kills the command (SIGKILL to its pid 1, which ends its whole
  namespace), then bwrap if it has not exited: no zombie is left behind either way (`_kill_command`).
Not isolated: the disk (the work dir is on the host's temp dir; only each file is bounded by
RLIMIT_FSIZE), CPU share (no cgroup: a sandbox may use every core for its CPU seconds), and the
kernel (one shared kernel: a kernel exploit escapes, which gVisor or a VM would stop).
"""

from __future__ import annotations

import os
import random
import resource
import shutil
import signal
import subprocess
import tempfile
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath

from rlfleet.sandbox import SNAPSHOT_SCRIPT, ExecSandbox, SandboxLimits, SandboxUnavailable

UID_BASE = 200_000
UID_SPAN = 1 << 20
WORKDIR = "/work"
MAX_OUTPUT_BYTES = 1 << 20  # a command's output kept: the first and last half MiB
KILL_GRACE_S = 5.0  # how long bwrap may take to reap a killed command before it is killed too


def bwrap_problem() -> str | None:
    """Why local sandboxes cannot run here (None: they can)."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed: `apt-get install bubblewrap` (Debian package bubblewrap)"
    if shutil.which("git") is None:
        return "git is not installed (the sandbox's diff): `apt-get install git`"
    return None


def checked_relative(path: str) -> str:
    """A snapshot path must stay inside the repository: relative, without '..'."""
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise ValueError(f"repository path {path!r} must be relative and stay inside the repository")
    return str(p)


def _root_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64"):
        host = Path("/") / name
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            args += ["--ro-bind", str(host), str(host)]
    return args


def _limits_preexec(limits: SandboxLimits, uid: int | None) -> Callable[[], None]:
    def apply() -> None:  # runs in the child between fork and exec
        for which, value in (
            (resource.RLIMIT_CPU, limits.cpu_seconds),
            (resource.RLIMIT_AS, limits.memory_bytes),
            (resource.RLIMIT_FSIZE, limits.file_bytes),
            (resource.RLIMIT_NOFILE, limits.open_files),
            (resource.RLIMIT_NPROC, limits.processes),
            (resource.RLIMIT_CORE, 0),
        ):
            resource.setrlimit(which, (value, value))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    return apply


class LocalSandbox(ExecSandbox):
    """A repository snapshot in a temporary work dir; every command a fresh bwrap process tree."""

    def __init__(self, files: Mapping[str, str], limits: SandboxLimits | None = None) -> None:
        problem = bwrap_problem()
        if problem is not None:
            raise SandboxUnavailable(problem)
        self.limits = limits or SandboxLimits()
        self.uid: int | None = UID_BASE + random.randrange(UID_SPAN) if os.geteuid() == 0 else None
        self.root = Path(tempfile.mkdtemp(prefix="rlfleet-sandbox-"))
        self.repo = self.root / "repo"
        self.seconds = 0.0
        self.closed = False
        # an episode dropped without close() (a failed turn, the trainer exiting) still cleans up
        self._cleanup = weakref.finalize(self, _remove_sandbox, self.root, self.uid)
        try:
            for path, content in files.items():  # a fresh dir the agent has not touched: no symlinks yet
                target = self.repo / checked_relative(path)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(content)
            self.repo.mkdir(exist_ok=True)
            if self.uid is not None:
                for p in [self.root, *self.root.rglob("*")]:
                    os.chown(p, self.uid, self.uid)
            snap = self.run(SNAPSHOT_SCRIPT, timeout_s=60)
            if snap.exit_code != 0:
                raise SandboxUnavailable(
                    f"the sandbox cannot start here (bwrap: {snap.output.strip()[-500:]})"
                )
        except BaseException:
            self.close()
            raise

    def _argv(self, argv: list[str]) -> list[str]:
        return [
            "bwrap",
            *_root_binds(),
            "--bind",
            str(self.repo),
            WORKDIR,
            "--chdir",
            WORKDIR,
            "--tmpfs",
            "/tmp",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            # --as-pid-1: the command is its pid namespace's init, no bwrap reaper process. bwrap's
            # reaper outlives the outer bwrap, which exits without waiting for it: it became a zombie
            # of the sandbox's uid under the host's init, counted by RLIMIT_NPROC until reaped (a
            # trainer that is pid 1 never reaps it), so a sandbox failed "Can't fork" after about
            # `processes` commands (benchmarks/sandbox.py found it).
            "--unshare-all",
            "--as-pid-1",
            "--die-with-parent",
            "--new-session",
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/local/bin:/usr/bin:/bin",
            "--setenv",
            "HOME",
            "/tmp",
            "--setenv",
            "LANG",
            "C.UTF-8",
            "--setenv",
            "GIT_CONFIG_NOSYSTEM",
            "1",
            "--setenv",
            "PYTHONDONTWRITEBYTECODE",
            "1",
            "--",
            *argv,
        ]

    def _run_command(self, argv: list[str], timeout: float, stdin: bytes) -> tuple[int, str, bool]:
        """`argv` inside the sandbox, its output in a host file outside the work dir (bounded by
        RLIMIT_FSIZE, so a flood of output cannot fill the trainer's memory)."""
        out_path, in_path = self.root / "output", self.root / "input"
        in_path.write_bytes(stdin)
        timed_out = False
        with open(in_path, "rb") as fin, open(out_path, "wb") as fout:
            proc = subprocess.Popen(
                self._argv(argv),
                stdin=fin,
                stdout=fout,
                stderr=subprocess.STDOUT,
                preexec_fn=_limits_preexec(self.limits, self.uid),
                start_new_session=True,
            )
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                code = _kill_command(proc)
        return -9 if timed_out else code, _read_bounded(out_path), timed_out

    def _release(self) -> None:
        self._cleanup()


def _kill_command(bwrap: subprocess.Popen) -> int:
    """Kill a command at its timeout with its whole tree, leaving no zombie: first the command, pid 1 of
    its own namespace (the kernel then kills everything else in the namespace), so that bwrap reaps it
    and exits; bwrap itself and its session only if it has not exited by then. Killing bwrap first
    made `--die-with-parent` kill the command after bwrap was gone: the command was reparented to the
    host's init and stayed a zombie of the sandbox's uid (counted by RLIMIT_NPROC) until that init
    reaped it, which a trainer running as a pod's pid 1 never does."""
    for pid in _children(bwrap.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        return bwrap.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(bwrap.pid, signal.SIGKILL)
        return bwrap.wait()


def _children(pid: int) -> list[int]:
    """The direct children of `pid` (Linux /proc: every thread's list)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the thread or the process ended meanwhile
            pass
    return children


def _remove_sandbox(root: Path, uid: int | None) -> None:
    if uid is not None:  # every process of the sandbox's own uid, wherever it is
        subprocess.run(
            ["kill", "-9", "-1"],
            preexec_fn=_limits_preexec(SandboxLimits(), uid),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )
    shutil.rmtree(root, onerror=_force_remove)


def _read_bounded(path: Path) -> str:
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= MAX_OUTPUT_BYTES:
            data = f.read()
        else:
            head = f.read(MAX_OUTPUT_BYTES // 2)
            f.seek(size - MAX_OUTPUT_BYTES // 2)
            data = head + f"\n[... {size - MAX_OUTPUT_BYTES} bytes omitted ...]\n".encode() + f.read()
    return data.decode("utf-8", errors="replace")


def _force_remove(func: Callable[..., object], path: str, _exc: object) -> None:
    """rmtree's retry for a dir the agent made unwritable (chmod 000) when not run as root."""
    os.chmod(os.path.dirname(path), 0o700)
    if os.path.isdir(path) and not os.path.islink(path):
        os.chmod(path, 0o700)
    func(path)
