"""Sandboxes: where an agent's commands run (the SWE environment, trainer/envs/swe_env.py).

One small interface, `Sandbox`, and its backends. A sandbox starts from a repository snapshot
(files), runs commands with a timeout, reads and writes files, reports the diff against the
snapshot, and is closed at the end of its episode (nothing of it may outlive the episode).
File reads and writes go through the sandbox itself, never through the host's view of its work
dir: a path the agent made a symlink must resolve inside the sandbox, not on the host.

Backends: `LocalSandbox` (rlfleet/sandbox/local.py: bubblewrap process trees on this machine) and
`PodSandbox` (rlfleet/sandbox/pods.py: one Kubernetes pod per sandbox, commands through the API's exec)
and `AgentSandbox` (rlfleet/sandbox/agent_sandbox.py: one kubernetes-sigs/agent-sandbox SandboxClaim per
sandbox, through its Python SDK).
docs/environments.md 'Sandboxes' says what each isolates.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

GIT = [
    "git",
    "-c",
    "user.name=rlfleet",
    "-c",
    "user.email=rlfleet@localhost",
    "-c",
    "core.hooksPath=/dev/null",
]
_GIT = " ".join(GIT)
# The grader's git: the agent can write the working sandbox's .git/config and a .gitattributes, so every
# setting that changes what a diff looks like or runs a program is overridden here (`-c` wins over the
# repository's config), and the environment drops the system and global config.
SAFE_GIT = [*GIT, *(arg for setting in (
    "core.fsmonitor=false", "core.attributesFile=/dev/null", "core.quotePath=true", "core.pager=cat",
    "core.autocrlf=false", "core.safecrlf=false", "core.symlinks=true", "core.ignoreCase=false",
    "diff.external=", "diff.noprefix=false", "diff.mnemonicPrefix=false", "diff.relative=false",
    "diff.renames=false", "color.ui=false", "apply.whitespace=nowarn",
) for arg in ("-c", setting))]  # fmt: skip
GIT_SAFE_ENV = "GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null GIT_ATTR_NOSYSTEM=1 HOME=/nonexistent XDG_CONFIG_HOME=/nonexistent"
_SAFE_GIT = f"{GIT_SAFE_ENV} {' '.join(SAFE_GIT)}"
SAFE_DIFF = "diff --cached --binary --no-ext-diff --no-textconv --no-color --no-renames --src-prefix=a/ --dst-prefix=b/"
# Run in the repository's root once its files are there: the snapshot every diff is taken against.
SNAPSHOT_SCRIPT = (
    f"{_GIT} init -q && printf '__pycache__/\\n*.pyc\\n' >> .git/info/exclude"
    f" && {_GIT} add -A && {_GIT} commit -q --allow-empty -m snapshot"
)


class SandboxUnavailable(RuntimeError):
    """The backend cannot run here (a missing tool, a kernel without namespaces): one line, the fix."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per command. cpu_seconds / memory_bytes / file_bytes / processes are each process's rlimits
    (RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NPROC: the last counts the sandbox's own uid);
    a command longer than its timeout (at most max_timeout_s) is killed with its whole tree."""

    cpu_seconds: int = 60
    memory_bytes: int = 1 << 30
    file_bytes: int = 64 << 20
    processes: int = 64
    open_files: int = 256
    max_timeout_s: float = 120.0


@dataclass(frozen=True)
class CommandResult:
    exit_code: int  # the command's status; -9 when the timeout killed it
    output: str  # stdout and stderr, interleaved as written (decoded as UTF-8, errors replaced)
    timed_out: bool
    seconds: float


class Sandbox(Protocol):
    """One isolated work dir and the commands run in it."""

    def run(self, command: str, timeout_s: float, stdin: bytes = b"") -> CommandResult:
        """`command` through `sh -c` in the repository's root."""
        ...

    def read_file(self, path: str) -> str: ...

    def write_file(self, path: str, content: str) -> None: ...

    def diff(self) -> str:
        """A `git apply`-able diff of the work dir against the snapshot (new files included)."""
        ...

    def close(self) -> None:
        """Kill everything the sandbox started and remove its work dir (idempotent)."""
        ...

    @property
    def seconds(self) -> float:
        """Wall time spent in the sandbox's commands so far."""
        ...


class ExecSandbox(ABC):
    """A `Sandbox` whose every operation is a command run in it by `exec`: reads, writes and the diff go
    through the sandbox (a path the agent made a symlink resolves inside it, never on the host). A
    backend runs one command (`_run_command`) and frees what the sandbox holds (`_release`, once)."""

    limits: SandboxLimits
    seconds: float
    closed: bool

    def exec(self, argv: list[str], timeout_s: float, stdin: bytes = b"") -> CommandResult:
        """`argv` in the repository's root, `stdin` on its standard input, killed with everything it
        started after `timeout_s` (at most the limits' max_timeout_s, at least 0.1 s); its wall time
        counts in `seconds`. A closed sandbox runs nothing (RuntimeError)."""
        if self.closed:
            raise RuntimeError("the sandbox is closed")
        timeout = max(0.1, min(float(timeout_s), self.limits.max_timeout_s))
        t0 = time.monotonic()
        code, output, timed_out = self._run_command(argv, timeout, stdin)
        seconds = time.monotonic() - t0
        self.seconds += seconds
        return CommandResult(code, output, timed_out, seconds)

    @abstractmethod
    def _run_command(self, argv: list[str], timeout: float, stdin: bytes) -> tuple[int, str, bool]:
        """The backend's run of one command: (its exit code, -9 when the timeout killed it; its output;
        whether the timeout killed it)."""

    def close(self) -> None:
        """Kill everything the sandbox started and free what it holds (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self._release()

    @abstractmethod
    def _release(self) -> None:
        """Free what the sandbox holds (its work dir, pod or claim); called once, by `close`."""

    def run(self, command: str, timeout_s: float, stdin: bytes = b"") -> CommandResult:
        return self.exec(["sh", "-c", command], timeout_s, stdin)

    def unpack_snapshot(self, tar: bytes, directory: str, owner: str) -> None:
        """A remote backend's start: the repository's files (a tar on the command's stdin) unpacked into
        `directory` and committed as the snapshot; SandboxUnavailable naming `owner` if that fails. On any
        failure the sandbox is closed before the error is raised: nothing of it is left behind."""
        try:
            snap = self.exec(
                ["sh", "-c", f"tar -x -f - -C {directory} && {SNAPSHOT_SCRIPT}"], timeout_s=120, stdin=tar
            )
            if snap.exit_code != 0:
                raise SandboxUnavailable(f"{owner}: the snapshot failed: {snap.output.strip()[-500:]}")
        except BaseException:
            self.close()
            raise

    def read_file(self, path: str) -> str:
        result = self.exec(["cat", "--", path], timeout_s=30)
        if result.exit_code != 0:
            raise FileNotFoundError(result.output.strip() or path)
        return result.output

    def write_file(self, path: str, content: str) -> None:
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
        result = self.exec(["sh", "-c", script, "sh", path], timeout_s=30, stdin=content.encode())
        if result.exit_code != 0:
            raise OSError(result.output.strip() or f"cannot write {path}")

    def diff(self) -> str:
        result = self.run(
            f"{_SAFE_GIT} add -A >/dev/null 2>&1 && {_SAFE_GIT} {SAFE_DIFF} 2>/dev/null", timeout_s=60
        )
        return result.output if result.exit_code == 0 else ""

    def __enter__(self) -> ExecSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
