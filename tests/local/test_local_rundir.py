"""A local run directory never loses a user's files (issue 39 item 1) and holds one run at a time (item 9).

`rlfleet run --local --out DIR`: a non-empty DIR without the run marker is refused in one line and left
as it was; `--force` removes only the files a run writes, keeping anything else under rlfleet's names;
nothing is removed through a symlink or below a mount point; a second run on a DIR a run holds is refused
at once naming the holder's pid, and the kernel drops the lock of a killed run. The end-to-end test runs
two real processes on one directory and then holds rlfleet's file patterns to everything the real run
wrote. Local mode keeps the versions the RLJob's weightChannel.retention says (item 9)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_local_run import EXAMPLE, local_run_command, small_manifest  # the local tests' one copy

from rlfleet.api import load_rljob
from rlfleet.local import main as local
from rlfleet.local import rundir
from rlfleet.trainer.config import resolve_run

# a user's file under each of rlfleet's names, and one beside them
USER_FILES = ("report/notes.tex", "cache/notes.txt", "channel/notes.txt", "checkpoints/notes.txt", "fleet.log",
              "thesis.tex")  # fmt: skip


def tree(root: Path) -> dict[str, str]:
    """Every file under `root` (not following symlinks) with its content, and every folder ('/')."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_dir():
            out[rel + "/"] = ""
        else:
            out[rel] = p.read_bytes().decode(errors="replace")
    return out


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def one_line(capsys: pytest.CaptureFixture[str], argv: list[str], code: int = 2) -> str:
    assert local.cli(argv) == code
    err = capsys.readouterr().err
    assert err.startswith("rlfleet run: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("name", USER_FILES)
def test_a_directory_that_is_not_a_run_is_refused_and_left_as_it_was(tmp_path, capsys, name):
    """Before issue 39 a fresh run removed cache/, report/, channel/, checkpoints/ and fleet.log of any
    directory without checkpoints/latest: a user's report/notes.tex disappeared and the run exited 0."""
    out = tmp_path / "mine"
    write(out, {name: "the user's words\n"})
    before = tree(out)
    err = one_line(capsys, [str(EXAMPLE), "--local", "--out", str(out), "--steps", "2"])
    listed = name.split("/")[0] + ("/" if "/" in name else "")
    assert err == (
        f"rlfleet run: --out {out} is not an rlfleet run directory (no .rlfleet-run) and holds {listed}: choose a "
        "new or empty --out, or add --force to remove only rlfleet's own files there (checkpoints, channel, cache, "
        "report, fleet.log, fleet.json, run.json, endpoint.json) and keep everything else\n"
    )
    assert tree(out) == before  # not even the lock file was made


def test_what_a_run_may_remove_is_only_the_shape_it_writes(tmp_path):
    """rundir.clean, as a fresh run and --force call it: every file shape a run writes (the store's
    temporary and lock files, a checkpoint's .tmp) goes; a user's file at any depth of rlfleet's folders,
    a folder of its own, models/ and anything beside rlfleet's names stay, byte for byte."""
    out = tmp_path / "run"
    own = [
        "fleet.log",
        "fleet.json",
        "run.json",
        "checkpoints/ckpt-00000003.pt",
        "checkpoints/ckpt-00000005-g2.pt",
        "checkpoints/latest",
        "checkpoints/ckpt-00000004.pt.tmp",
        "checkpoints/latest.tmp",
        "channel/pointer.json",
        "channel/lease.json",
        "channel/.pointer.json.lock",
        "channel/.lease.json.tmp-0123abcd",
        "channel/v0/manifest.json",
        "channel/v12/bf16/model.safetensors",
        "channel/v12/bf16/.config.json.tmp-99ff",
        "channel/claims/v12",
        "channel/subscribers/g/replica-0.json",
        "channel/.staging/abc/part",
        "cache/h100-bf16/launch",
        "cache/h100-bf16/.launch.tmp-0a",
        "cache/h100-bf16/v12-bf16/model.safetensors",
        "cache/h100-bf16/.v13-bf16.partial-0a1b2c3d/v13/model.safetensors.delta",
        "report/metrics.json",
        "report/metrics.csv",
        "report/weights.csv",
        "report/reward.png",
        "report/routing.png",
    ]
    user = [
        "report/notes.tex",
        "report/figures/plot.png",
        "cache/notes.txt",
        "cache/h100-bf16/mine.txt",
        "channel/notes.txt",
        "checkpoints/ckpt-best.pt",
        "checkpoints/latest.bak",
        "models/tiny/config.json",
        "thesis.tex",
        "fleet.log.1",
    ]
    write(out, {rel: f"own {rel}" for rel in own} | {rel: f"user {rel}" for rel in user})
    kept = rundir.clean(out)
    assert kept == [
        "checkpoints/ckpt-best.pt",
        "checkpoints/latest.bak",
        "channel/notes.txt",
        "cache/h100-bf16/mine.txt",
        "cache/notes.txt",
        "report/figures/",
        "report/notes.tex",
    ]
    left = {rel: text for rel, text in tree(out).items() if not rel.endswith("/")}
    assert left == {rel: f"user {rel}" for rel in user}
    assert not (out / "channel" / "v12").exists() and not (out / "channel" / ".staging").exists()


def test_a_symlinked_channel_is_refused_with_nothing_removed(tmp_path, capsys):
    """A run directory (its marker) whose channel/ is a symlink to the user's own store: --force refuses in
    one line before removing anything, here or through the link."""
    out, elsewhere = tmp_path / "run", tmp_path / "precious"
    write(elsewhere, {"v0/manifest.json": "{}", "pointer.json": "{}", "data.bin": "user data"})
    write(out, {".rlfleet-run": "{}", "report/metrics.json": "{}", "fleet.log": "log"})
    (out / "channel").symlink_to(elsewhere)
    before, before_elsewhere = tree(out), tree(elsewhere)
    err = one_line(capsys, [str(EXAMPLE), "--local", "--out", str(out), "--force", "--steps", "2"])
    assert err == (
        f"rlfleet run: {out / 'channel'} is a symlink (to {elsewhere}): rlfleet never deletes through a symlink or a "
        f"mount point, and nothing was removed; move it out of {out} or choose another --out\n"
    )
    assert {k: v for k, v in tree(out).items() if k != ".rlfleet-lock"} == before
    assert tree(elsewhere) == before_elsewhere


def test_a_mount_point_is_never_emptied(tmp_path, capsys):
    """channel/ is a bind mount (the same filesystem: st_dev alone would miss it; /proc/self/mountinfo
    names it) holding a store's files: refused in one line, nothing removed. Needs CAP_SYS_ADMIN."""
    out, volume = tmp_path / "run", tmp_path / "volume"
    write(volume, {"v3/manifest.json": "{}", "pointer.json": "{}"})
    write(out, {".rlfleet-run": "{}", "fleet.log": "log"})
    (out / "channel").mkdir()
    mounted = subprocess.run(
        ["mount", "--bind", str(volume), str(out / "channel")], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"cannot make a bind mount here (needs root with CAP_SYS_ADMIN): {mounted.stderr.strip()}"
        )
    try:
        before = tree(volume)
        err = one_line(capsys, [str(EXAMPLE), "--local", "--out", str(out), "--force", "--steps", "2"])
        assert err == (
            f"rlfleet run: {out / 'channel'} is a mount point: rlfleet never deletes through a symlink or a mount "
            f"point, and nothing was removed; move it out of {out} or choose another --out\n"
        )
        assert tree(volume) == before and (out / "fleet.log").read_text() == "log"
        # the user empties the volume (a filesystem's lost+found stays): nothing to remove below the mount
        # point, so a run uses it, and leaves it mounted
        for rel in ("v3/manifest.json", "pointer.json"):
            (volume / rel).unlink()
        (volume / "v3").rmdir()
        (volume / "lost+found").mkdir()
        assert rundir.clean(out) == ["channel/lost+found/"]
        assert str(out / "channel") in rundir.mount_points() and not (out / "fleet.log").exists()
    finally:
        subprocess.run(["umount", str(out / "channel")], check=True)


def test_an_empty_or_new_directory_becomes_a_run_directory(tmp_path):
    """What a fresh run does first, under its lock: an empty directory and one that does not exist yet are
    accepted and marked; the marker names the job and survives a later resume's preparation."""
    rc = resolve_run(load_rljob(str(EXAMPLE)), local=True)
    for out in (tmp_path / "empty", tmp_path / "new" / "run"):
        if out.name == "empty":
            out.mkdir()
        with rundir.locked(out):
            assert local.prepare_out(out, rc, resume=False, force=False) is None
        marker = json.loads((out / ".rlfleet-run").read_text())
        assert marker["job"] == rc.job_name and marker["pid"] == os.getpid()
        assert sorted(p.name for p in out.iterdir()) == [".rlfleet-lock", ".rlfleet-run"]


def test_a_run_from_before_markers_resumes_and_is_marked(tmp_path, capsys):
    """A run directory made before issue 39 (its checkpoints, no marker): --resume continues it and marks it;
    a fresh run without --force is refused as holding a run, and nothing in it is touched."""
    from rlfleet.trainer.publish import checkpoint as ckpt

    rc = resolve_run(load_rljob(str(EXAMPLE)), local=True)
    out = tmp_path / "old"
    ckpt.save_checkpoint(out / "checkpoints", {"step": 1})
    write(out, {"report/notes.tex": "mine"})
    before = tree(out)
    err = one_line(capsys, [str(EXAMPLE), "--local", "--out", str(out)])
    assert err.startswith(
        f"rlfleet run: {out} holds a run (its checkpoints in {out / 'checkpoints'}): --resume continues it"
    )
    assert tree(out) == before
    with rundir.locked(out):
        state = local.prepare_out(out, rc, resume=True, force=False)
    assert state is not None and state["step"] == 1
    assert json.loads((out / ".rlfleet-run").read_text())["job"] == rc.job_name
    assert {k: v for k, v in tree(out).items() if k not in (".rlfleet-run", ".rlfleet-lock")} == before


HOLDER = """
import sys, time
from pathlib import Path
from rlfleet.local import rundir
with rundir.locked(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(600)
"""


def test_a_killed_holder_leaves_no_stale_lock(tmp_path, capsys):
    """Another process holds the lock: refused at once naming its pid; SIGKILLed, the kernel drops its
    lock, and the next command takes it (here a --resume of a directory without a checkpoint, which then
    says there is nothing to resume)."""
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"  # type: ignore[union-attr]
        t0 = time.monotonic()
        err = one_line(capsys, [str(EXAMPLE), "--local", "--out", str(out), "--resume", "--steps", "2"])
        assert time.monotonic() - t0 < 10
        assert err.startswith(
            f"rlfleet run: --out {out} is in use by another rlfleet run (pid {holder.pid} since "
        )
        assert err.endswith(
            f"; its lock {out / '.rlfleet-lock'}): wait for it to end or stop it, or choose another --out\n"
        )
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    err = one_line(capsys, [str(EXAMPLE), "--local", "--out", str(out), "--resume", "--steps", "2"])
    assert "nothing to resume" in err


@pytest.mark.slow
def test_a_second_run_is_refused_at_once_and_the_first_keeps_the_users_files(tmp_path):
    """Two real processes on one directory. The first (--force on a directory that is not a run's, holding a
    user's file under each of rlfleet's names and a stale log and checkpoint) runs 4 steps; while it runs, a
    second `--resume` and a second `--force` are each refused in seconds naming its pid (before issue 39
    two resumes took the writer lease from each other and both stopped). The first finishes untouched;
    the user's files are as they were; the channel keeps the versions weightChannel.retention.keepVersions
    (5) says: all of v0..v4 (before: always the newest 4). Then rundir.clean on the finished run removes
    everything the run wrote: rlfleet's file patterns cover a real run's files."""
    doc = yaml.safe_load(small_manifest(tmp_path).read_text())
    doc["spec"]["weightChannel"]["retention"] = {"keepVersions": 5}
    manifest = tmp_path / "rljob.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    out = tmp_path / "run"
    users = {
        rel: f"the user's {rel}\n"
        for rel in (
            "report/notes.tex",
            "cache/notes.txt",
            "channel/notes.txt",
            "checkpoints/notes.txt",
            "thesis.tex",
        )
    }
    write(out, users | {"fleet.log": "a stale log\n", "checkpoints/ckpt-00000099.pt": "stale"})

    def command(*flags: str) -> list[str]:
        return local_run_command(manifest, out, *flags, steps=4)

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(
        command("--force"), cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        lines = []
        for line in first.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("step 1/4"):
                break
        # the first holds still (SIGSTOP) while the others try: alive and holding its lock however loaded
        # this machine is, so neither can start after it ended
        first.send_signal(signal.SIGSTOP)
        try:
            for flags in (["--resume"], ["--force"]):
                t0 = time.monotonic()
                second = subprocess.run(
                    command(*flags), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
                )
                took = time.monotonic() - t0
                assert second.returncode == 2 and first.poll() is None, second.stderr
                assert second.stderr.startswith(
                    f"rlfleet run: --out {out} is in use by another rlfleet run (pid {first.pid} "
                )
                assert second.stderr.count("\n") == 1 and "Traceback" not in second.stderr
                assert took < 60, (
                    took
                )  # at once: before any model is built (measured: 8 s at a load of 14 on 2 cores, imports)
        finally:
            first.send_signal(signal.SIGCONT)
        rest, err = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == 0, "".join(lines) + rest + err[-3000:]
    assert [
        line.split()[1] for line in [*lines, *rest.splitlines(keepends=True)] if line.startswith("step ")
    ] == ["1/4", "2/4", "3/4", "4/4"]
    assert (
        f"rlfleet run: kept what rlfleet did not write in {out}: checkpoints/notes.txt, channel/notes.txt, "
        "cache/notes.txt, report/notes.tex\n"
    ) in err
    for rel, text in users.items():
        assert (out / rel).read_text() == text
    assert (
        "a stale log" not in (out / "fleet.log").read_text()
        and not (out / "checkpoints/ckpt-00000099.pt").exists()
    )
    assert json.loads((out / ".rlfleet-run").read_text())["job"] == doc["metadata"]["name"]
    versions = sorted(
        int(p.name[1:]) for p in (out / "channel").glob("v*") if (p / "manifest.json").is_file()
    )
    assert versions == [0, 1, 2, 3, 4]

    kept = rundir.clean(out)
    assert kept == ["checkpoints/notes.txt", "channel/notes.txt", "cache/notes.txt", "report/notes.tex"]
    assert sorted(
        str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.parts[len(out.parts)] != "models"
    ) == sorted([".rlfleet-lock", ".rlfleet-run", *users])
