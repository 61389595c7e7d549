"""A local run directory (`rlfleet run --local --out DIR`): its marker, its lock, and what a run may delete.

A run never deletes what it did not make (issue 39):
- the marker `DIR/.rlfleet-run` (a small JSON: job, created, pid) is written when a run starts; a
  non-empty directory without it is not a run directory and is refused (one line naming what is
  there) unless `--force` is given;
- a fresh run (and `--force`) removes only rlfleet's own files: the names a run writes
  (`checkpoints/`, `channel/`, `cache/`, `report/`, `fleet.log`, `fleet.json`, `run.json`) and, within
  them, only files of the shapes the run writes there (OWN_FILES); anything else in those folders is
  kept where it is and named on stderr. It never deletes through a symlink or below a mount point: one
  line, before anything is removed;
- `DIR/.rlfleet-lock` is held with `fcntl.flock` for the whole run (fresh or `--resume`): a second run on
  the directory is refused at once naming the holder's pid. The kernel drops the lock when the holding
  process dies, so a killed run leaves no stale lock; the file itself stays (deleting a lock file
  another process may be opening is a race).
docs/local.md, "The run directory".
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from rlfleet.local.report import PLOTS

MARKER = ".rlfleet-run"
LOCK = ".rlfleet-lock"
# the top-level names a run writes (models/ is a cache of built models, reused and never removed)
OWN_NAMES = (
    "checkpoints",
    "channel",
    "cache",
    "report",
    "fleet.log",
    "fleet.json",
    "run.json",
    "endpoint.json",
)
_PLOTS = "|".join(re.escape(plot.file) for plot in PLOTS)
_STORE_DIRS = (
    r"channel/(?:v\d+|claims|subscribers|\.staging)"  # the filesystem store's folders (rlfleet/channel.py)
)
# per group, a version of its view rebuilt from deltas (rlfleet.sampler.syncer: `v<N>-<view>`) and the hidden
# partial directory it is rebuilt in (WeightChannel.obtain_view: `.v<N>-<view>.partial-<hex>`)
_REBUILT_DIRS = r"cache/[^/]+/(?:v\d+-[a-z0-9]+|\.v\d+-[a-z0-9]+\.partial-[0-9a-f]+)"
# relative paths (with '/') of the files a run writes, after the temporary or lock suffix is taken off
OWN_FILES = re.compile(
    r"fleet\.log|fleet\.json|run\.json|endpoint\.json"  # endpoint.json: an external trainer's run (external.py)
    r"|checkpoints/latest"  # and the checkpoints trainer/publish/checkpoint.py names (is_own_file)
    r"|channel/(?:pointer|lease)\.json"
    rf"|{_STORE_DIRS}/.+"
    r"|cache/[^/]+/launch"  # per group, the version its engine starts from (rlfleet.sampler.syncer)
    rf"|{_REBUILT_DIRS}/.+"
    rf"|report/(?:metrics\.json|metrics\.csv|weights\.csv|{_PLOTS})"  # rlfleet/local/report.py
)
# the folders that hold such files: the only ones a clean walks into or removes once empty
OWN_DIRS = re.compile(
    rf"checkpoints|channel|cache|report|cache/[^/]+|{_STORE_DIRS}(?:/.+)?|{_REBUILT_DIRS}(?:/.+)?"
)
# a writer's temporary file (`.<name>.tmp-<hex>` of the store, `<name>.tmp` of checkpoints and reports) or
# the store's lock file of a name (`.<name>.lock`): rlfleet's when the name is
_COMPANION = re.compile(r"\.(?P<a>.+)\.(?:tmp-[0-9a-f]+|lock)|(?P<b>.+)\.tmp")


class RunDirError(ValueError):
    """The run directory cannot be used as asked: one line for the user."""


def is_own_file(rel: str) -> bool:
    """Whether `rel` (a path relative to the run directory, with '/') is a file a run writes."""
    head, _, name = rel.rpartition("/")
    if m := _COMPANION.fullmatch(name):
        name = m["a"] or m["b"]
        rel = f"{head}/{name}" if head else name
    return OWN_FILES.fullmatch(rel) is not None or (head == "checkpoints" and _is_checkpoint_name(name))


def _is_checkpoint_name(name: str) -> bool:
    """A name exactly as the trainer writes a checkpoint (`ckpt-<step:08d>[-g<G>].pt`)."""
    # imported here: trainer/publish/checkpoint.py imports torch, which a refusal before the lock needs not
    from rlfleet.trainer.publish.checkpoint import CheckpointError, parse_checkpoint_name

    try:
        parse_checkpoint_name(name)
    except CheckpointError:
        return False
    return True


def _listing(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_replaceable(out: Path, *, force: bool) -> None:
    """Refuse a fresh run in `out` that would replace what it should not: a run's checkpoints without
    `--force`, or a non-empty directory that is not a run directory (no marker) without `--force`."""
    if not out.is_dir():
        return
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir() if p.name != LOCK)
    if force or not entries:
        return
    checkpoints = out / "checkpoints"
    if (checkpoints / "latest").is_file():
        raise RunDirError(
            f"{out} holds a run (its checkpoints in {checkpoints}): --resume continues it, --force replaces it, "
            "or choose another --out"
        )
    if not (out / MARKER).is_file():
        raise RunDirError(
            f"--out {out} is not an rlfleet run directory (no {MARKER}) and holds {_listing(entries)}: choose a new "
            f"or empty --out, or add --force to remove only rlfleet's own files there ({', '.join(OWN_NAMES)}) "
            "and keep everything else"
        )


def read_holder(path: Path) -> str:
    """Who holds the lock, as its file says ("pid 123 since ..."); "pid unknown" when unreadable."""
    try:
        holder = json.loads(path.read_text())
        return f"pid {int(holder['pid'])} since {holder['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "pid unknown"


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold `out`'s run lock (creating `out`) until the block ends; RunDirError at once if another
    process holds it, naming its pid."""
    path = out / LOCK
    try:
        out.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: the lock file is never a symlink planted to make this run write elsewhere
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise RunDirError(f"--out {out}: cannot write the run directory ({exc.strerror or exc})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirError(
                f"--out {out} is in use by another rlfleet run ({read_holder(path)}; its lock {path}): wait for it "
                "to end or stop it, or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            json.dumps(
                {"pid": os.getpid(), "since": datetime.now(UTC).isoformat(timespec="seconds")}
            ).encode(),
            0,
        )
        yield
    finally:
        os.close(fd)  # releases the lock


def write_marker(out: Path, job: str) -> None:
    """Mark `out` as a run directory (kept as it is when present: the first run's identity)."""
    marker = out / MARKER
    if marker.is_file():
        return
    identity = {"job": job, "created": datetime.now(UTC).isoformat(timespec="seconds"), "pid": os.getpid()}
    marker.write_text(json.dumps(identity) + "\n")


class _Clean:
    """What a clean of `out` removes and keeps, found before anything is removed."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.device = out.stat().st_dev
        self.mounts = mount_points()
        self.files: list[Path] = []
        self.dirs: list[Path] = []
        self.kept: list[str] = []

    def refuse(self, path: Path, what: str) -> RunDirError:
        return RunDirError(
            f"{path} is {what}: rlfleet never deletes through a symlink or a mount point, and nothing was removed; "
            f"move it out of {self.out} or choose another --out"
        )

    def walk(self, path: Path, rel: str, mount: Path | None) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        own_dir = OWN_DIRS.fullmatch(rel) is not None
        if stat.S_ISLNK(st.st_mode):
            if own_dir or is_own_file(rel):
                raise self.refuse(path, f"a symlink (to {os.readlink(path)})")
            self.kept.append(rel)
        elif stat.S_ISDIR(st.st_mode) and own_dir:
            if st.st_dev != self.device or str(path) in self.mounts:
                mount = path
            self.dirs.append(path)
            for child in sorted(os.listdir(path)):
                self.walk(path / child, f"{rel}/{child}", mount)
        elif not stat.S_ISDIR(st.st_mode) and is_own_file(rel):
            if mount is not None:
                raise self.refuse(mount, "a mount point")
            self.files.append(path)
        else:
            self.kept.append(rel + ("/" if stat.S_ISDIR(st.st_mode) else ""))


def mount_points() -> set[str]:
    """The mount points of this process's mount namespace (/proc/self/mountinfo, field 5, octal escapes
    undone): a bind mount of the same filesystem has the same st_dev, so st_dev alone misses it."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return set()
    unescape = re.compile(r"\\([0-7]{3})")
    return {
        unescape.sub(lambda m: chr(int(m[1], 8)), line.split()[4]) for line in lines if len(line.split()) > 4
    }


def clean(out: Path) -> list[str]:
    """Remove rlfleet's own files from `out` (module docstring), then the folders of OWN_DIRS left empty;
    returns what was kept (relative paths, folders with a trailing '/'). RunDirError, with nothing
    removed, when a file to remove lies below a mount point or a name of the run is a symlink."""
    found = _Clean(out.resolve())
    for name in OWN_NAMES:
        found.walk(found.out / name, name, None)
    for path in found.files:
        path.unlink(missing_ok=True)
    for path in sorted(found.dirs, key=lambda p: len(p.parts), reverse=True):
        if str(path) not in found.mounts:
            with contextlib.suppress(OSError):  # not empty: it holds what was kept
                path.rmdir()
    return found.kept
