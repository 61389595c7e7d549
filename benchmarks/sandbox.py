"""Local sandboxes (bubblewrap, rlfleet/sandbox/local.py): acquire latency, tool-call round trip,
sandboxes per core, and one grading run per shipped SWE task.

    nice -n 10 .venv/bin/python benchmarks/sandbox.py [--calls 200] [--acquires 20] [--cold 3]
        [--per-core-seconds 4] [--max-sandboxes 64]

Each case that has process state (cold acquire, each sandboxes-per-core count) runs in a fresh
subprocess of this script. Baselines are measured in the same run:
- acquire: `LocalSandbox(files)` (a temp dir, the files written, chowned to the sandbox's uid when
  root, then one bwrap running `git init; git add -A; git commit`: the snapshot `diff()` compares
  against) against the same steps on the host (the files written, the same git command through
  plain `sh -c`). Cold is the first sandbox of a fresh process; warm the next ones in that process.
  The backend has no warm pool and no long-lived process per sandbox (every command is a fresh
  bwrap), so the acquire is split into what a pool of ready sandboxes would save: the file
  materialisation (host writes + chown), the snapshot command, and of it the bare bwrap start (`true`).
- round trip: a `bash` tool call (`true`; `seq 1 2000`, 8.9 kB of output) through `Sandbox.run`,
  and an `edit` tool call (SweEnv's own `_edit`: read_file + write_file, two commands), against the
  same commands through plain `subprocess` on the host (sandbox and host calls alternate).
- per core: K sandboxes, one thread each, each calling `true` every 100 ms for a few seconds, the
  driver and every bwrap pinned to one CPU (sched_setaffinity, inherited); K grows (1, 2, 4, 8, 12,
  16, ...) until the round-trip p90 is over twice K=1's (or the calls fall behind their schedule).
- grading: per shipped task (trainer/envs/swe_tasks.py SHIPPED), its reference fix made in a working
  sandbox, then SweEnv._grade: the diff, the working sandbox closed, a fresh sandbox, git apply,
  the hidden tests written, the test command. Reward must be 1.

The machine is shared: the load average (`/proc/loadavg`) is printed before and after; read ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PERIOD_S = 0.1  # the per-core loop: one tool call per sandbox every 100 ms
ECHO = "seq 1 2000"  # 8,893 bytes of output


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def shipped_files() -> Mapping[str, str]:
    from rlfleet.trainer.envs.swe_tasks import SHIPPED

    return SHIPPED[0][0].files


def big_files() -> dict[str, str]:
    """A larger repository: 200 files of 4 KiB in 10 packages."""
    return {f"pkg{i % 10}/mod{i}.py": f"# module {i}\n" + "x = 1\n" * 680 for i in range(200)}


# --- host baselines ---------------------------------------------------------------------------------


class HostBox:
    """The same commands as LocalSandbox, through plain subprocess on the host (no bwrap)."""

    def __init__(self, files: Mapping[str, str]) -> None:
        from rlfleet.sandbox import SNAPSHOT_SCRIPT

        self.root = Path(tempfile.mkdtemp(prefix="rlfleet-bench-host-"))
        for path, content in files.items():
            target = self.root / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
        snap = self.run(SNAPSHOT_SCRIPT)
        assert snap.returncode == 0, snap.stdout

    def exec(self, argv: list[str], stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            argv, cwd=self.root, input=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )

    def run(self, command: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
        return self.exec(["sh", "-c", command], stdin)

    def read_file(self, path: str) -> str:
        return self.exec(["cat", "--", path]).stdout.decode()

    def write_file(self, path: str, content: str) -> None:
        self.exec(
            ["sh", "-c", 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"', "sh", path], content.encode()
        )

    def close(self) -> None:
        shutil.rmtree(self.root)


# --- cases (each in its own subprocess) ---------------------------------------------------------------


def case_acquire(files_name: str, acquires: int) -> dict[str, object]:
    """The first acquire of this process (cold), then `acquires` more (warm), with their parts."""
    t0 = time.perf_counter()
    from rlfleet.sandbox.local import LocalSandbox

    import_s = time.perf_counter() - t0
    files = shipped_files() if files_name == "shipped" else big_files()
    rows = []
    for _ in range(acquires + 1):
        t = time.perf_counter()
        box = LocalSandbox(files)
        total = time.perf_counter() - t
        snapshot = box.seconds  # the snapshot command (bwrap + git init/add/commit)
        bare = box.run("true", timeout_s=10).seconds
        t = time.perf_counter()
        box.close()
        close = time.perf_counter() - t
        t = time.perf_counter()
        host = HostBox(files)
        host_total = time.perf_counter() - t
        host.close()
        rows.append(
            {
                "total": total,
                "materialise": total - snapshot,
                "snapshot": snapshot,
                "bare_bwrap": bare,
                "close": close,
                "host": host_total,
            }
        )
    return {"import_s": import_s, "rows": rows}


def case_round_trip(calls: int) -> dict[str, list[float]]:
    from rlfleet.sandbox.local import LocalSandbox
    from rlfleet.trainer.envs.swe_env import SweEnv

    files = shipped_files()
    path = next(p for p in files if p.endswith("__init__.py") and files[p])
    box, host = LocalSandbox(files), HostBox(files)
    times: dict[str, list[float]] = {}
    edits: list[str] = []  # SweEnv._edit's replies

    def timed(name: str, fn: Callable[[], object]) -> None:
        t = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - t)

    try:
        assert box.run(ECHO, timeout_s=10).output == host.run(ECHO).stdout.decode()
        for i in range(calls):
            old, new = ("- 1)", "- 2)") if i % 2 == 0 else ("- 2)", "- 1)")  # edit back and forth
            timed("sandbox true", lambda: box.run("true", timeout_s=10))
            timed("host true", lambda: host.run("true"))
            timed("sandbox echo", lambda: box.run(ECHO, timeout_s=10))
            timed("host echo", lambda: host.run(ECHO))
            timed("sandbox edit", lambda o=old, n=new: edits.append(SweEnv._edit(box, path, o, n)))
            timed("host edit", lambda o=old, n=new: edits.append(SweEnv._edit(host, path, o, n)))  # type: ignore[arg-type]
        assert box.read_file(path) == host.read_file(path) == files[path]
        assert edits == [f"edited {path}"] * len(edits), {*edits}  # each edit made (its `old` found once)
    finally:
        box.close()
        host.close()
    return times


def case_per_core(sandboxes: int, seconds: float, cpu: int) -> dict[str, object]:
    """`sandboxes` threads, each calling `true` in its own sandbox every PERIOD_S, all on one CPU."""
    os.sched_setaffinity(0, {cpu})
    from rlfleet.sandbox.local import LocalSandbox

    boxes = [LocalSandbox(shipped_files()) for _ in range(sandboxes)]
    round_trips: list[list[float]] = [[] for _ in boxes]
    late = [0] * sandboxes
    start = time.monotonic() + 0.2
    end = start + seconds

    def loop(i: int) -> None:
        due = start + i * PERIOD_S / sandboxes  # staggered
        while due < end:
            now = time.monotonic()
            if now < due:
                time.sleep(due - now)
            elif now - due > PERIOD_S:
                late[i] += 1  # behind schedule by a whole period
            t = time.perf_counter()
            result = boxes[i].run("true", timeout_s=10)
            round_trips[i].append(time.perf_counter() - t)
            assert result.exit_code == 0, result.output
            due += PERIOD_S

    before = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(sandboxes)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = sum(a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime for a, b in zip(after, before, strict=True))
    for box in boxes:
        box.close()
    flat = [x for r in round_trips for x in r]
    return {"round_trips": flat, "calls": len(flat), "wall": wall, "cpu_s": cpu_s, "late": sum(late)}


def case_grading() -> list[dict[str, object]]:
    from rlfleet.sandbox import SandboxLimits
    from rlfleet.sandbox.local import LocalSandbox
    from rlfleet.trainer.env_try import byte_chat_tokenizer
    from rlfleet.trainer.envs.swe_env import EpisodeState, SweEnv
    from rlfleet.trainer.envs.swe_tasks import SHIPPED

    acquires: list[float] = []
    fresh: list[LocalSandbox] = []

    def timed_sandbox(files: Mapping[str, str], limits: SandboxLimits) -> LocalSandbox:
        t = time.perf_counter()
        box = LocalSandbox(files, limits)
        acquires.append(time.perf_counter() - t)
        fresh.append(box)
        return box

    env = SweEnv(byte_chat_tokenizer(), sandbox=timed_sandbox)
    rows = []
    for task, (path, old, new) in SHIPPED:
        working = LocalSandbox(task.files, env.limits)
        assert SweEnv._edit(working, path, old, new) == f"edited {path}"
        ep = EpisodeState(task=task, sandbox=working)
        acquires.clear()
        fresh.clear()
        t = time.perf_counter()
        env._grade(ep)
        total = time.perf_counter() - t
        rows.append(
            {
                "task": task.instance_id,
                "reward": ep.reward,
                "reason": ep.reason,
                "total": total,
                "fresh_acquire": acquires[0],
                "fresh_commands": fresh[0].seconds,
            }
        )
    return rows


CASES: dict[str, Callable[[argparse.Namespace], object]] = {
    "acquire-shipped": lambda a: case_acquire("shipped", a.acquires),
    "acquire-big": lambda a: case_acquire("big", a.acquires),
    "round-trip": lambda a: case_round_trip(a.calls),
    "per-core": lambda a: case_per_core(a.sandboxes, a.per_core_seconds, a.cpu),
    "grading": lambda a: case_grading(),
}


def child(case: str, args: argparse.Namespace, **extra: object) -> object:
    argv = [
        sys.executable,
        __file__,
        "--case",
        case,
        "--calls",
        str(args.calls),
        "--acquires",
        str(args.acquires),
        "--per-core-seconds",
        str(args.per_core_seconds),
        "--cpu",
        str(args.cpu),
    ]
    for k, v in extra.items():
        argv += [f"--{k}", str(v)]
    out = subprocess.run(argv, check=True, stdout=subprocess.PIPE, cwd=REPO).stdout
    return json.loads(out.decode().splitlines()[-1])


# --- the report ------------------------------------------------------------------------------------


def report_acquire(args: argparse.Namespace) -> None:
    print(
        "\nAcquire (ms): cold = the first `LocalSandbox(files)` of a fresh process (median of "
        f"{args.cold} processes), warm = median of the next {args.acquires} in one process"
    )
    print(
        "| repository | acquire | total | files written (+chown) | snapshot (bwrap + git) | of it bare bwrap "
        "| close | host: files + same git | total / host |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    imports = []
    for name, label in (("shipped", "stats-mean (4 files, 0.5 kB)"), ("big", "200 files x 4 kB")):
        results = [child(f"acquire-{name}", args) for _ in range(args.cold)]
        cold = [r["rows"][0] for r in results]  # type: ignore[index]
        warm = [row for r in results for row in r["rows"][1:]]  # type: ignore[index]
        for kind, rows in (("cold", cold), ("warm", warm)):
            med = {k: statistics.median(float(r[k]) for r in rows) for k in rows[0]}
            print(
                f"| {label} | {kind} | {ms(med['total'])} | {ms(med['materialise'])} | {ms(med['snapshot'])} "
                f"| {ms(med['bare_bwrap'])} | {ms(med['close'])} | {ms(med['host'])} "
                f"| {med['total'] / med['host']:.2f}x |"
            )
        imports += [float(r["import_s"]) for r in results]  # type: ignore[index]
    print(f"(cold excludes `import rlfleet.sandbox.local`: {ms(statistics.median(imports))} ms)")


def report_round_trip(args: argparse.Namespace) -> None:
    times = child("round-trip", args)
    assert isinstance(times, dict)
    print(f"\nTool-call round trip (ms, {args.calls} calls each, sandbox and host alternating)")
    print("| tool call | sandbox p50 | sandbox p90 | host p50 | host p90 | p50 ratio | added p50 |")
    print("|---|---|---|---|---|---|---|")
    for name, label in (
        ("true", "bash `true`"),
        ("echo", f"bash `{ECHO}` (8.9 kB out)"),
        ("edit", "edit (read_file + write_file)"),
    ):
        s, h = times[f"sandbox {name}"], times[f"host {name}"]
        sp50, hp50 = statistics.median(s), statistics.median(h)
        print(
            f"| {label} | {ms(sp50)} | {ms(pct(s, 0.9))} | {ms(hp50)} | {ms(pct(h, 0.9))} "
            f"| {sp50 / hp50:.1f}x | {ms(sp50 - hp50)} |"
        )


def report_per_core(args: argparse.Namespace) -> None:
    print(
        f"\nSandboxes per core: K sandboxes each calling bash `true` every {PERIOD_S * 1e3:.0f} ms for "
        f"{args.per_core_seconds:g} s, driver + bwrap pinned to CPU {args.cpu}"
    )
    print(
        "| K | calls/s (target K x 10) | p50 ms | p90 ms | p90 / K=1 | late calls | CPU ms per call | CPU share |"
    )
    print("|---|---|---|---|---|---|---|---|")
    base_p90 = None
    for k in (1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 64, 96, 128):
        if k > args.max_sandboxes:
            break
        r = child("per-core", args, sandboxes=k)
        assert isinstance(r, dict)
        rts = r["round_trips"]
        p90 = pct(rts, 0.9)
        base_p90 = base_p90 or p90
        print(
            f"| {k} | {r['calls'] / r['wall']:.0f} ({k * 10}) | {ms(statistics.median(rts))} | {ms(p90)} "
            f"| {p90 / base_p90:.2f}x | {r['late']} | {ms(r['cpu_s'] / r['calls'])} "
            f"| {r['cpu_s'] / r['wall']:.2f} |"
        )
        if p90 > 2 * base_p90 or r["late"]:
            break


def report_grading(args: argparse.Namespace) -> None:
    rows = child("grading", args)
    assert isinstance(rows, list)
    print(
        "\nGrading (SweEnv._grade: diff + close of the working sandbox, fresh sandbox, git apply, hidden "
        "tests, close), one run per shipped task, ms"
    )
    print(
        "| task | reward | grading total | fresh acquire | fresh sandbox's commands (snapshot, apply, writes, tests) |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        assert r["reward"] == 1.0, r
        print(
            f"| {r['task']} | {r['reward']:g} | {ms(r['total'])} | {ms(r['fresh_acquire'])} | {ms(r['fresh_commands'])} |"
        )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--acquires", type=int, default=20)
    p.add_argument("--cold", type=int, default=3)
    p.add_argument("--per-core-seconds", type=float, default=4.0)
    p.add_argument("--max-sandboxes", type=int, default=64)
    p.add_argument("--cpu", type=int, default=max(os.sched_getaffinity(0)))
    p.add_argument("--case", choices=sorted(CASES), help=argparse.SUPPRESS)
    p.add_argument("--sandboxes", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(CASES[args.case](args)))
        return 0
    from rlfleet.sandbox.local import bwrap_problem

    problem = bwrap_problem()
    if problem:
        print(f"local sandboxes cannot run here: {problem}", file=sys.stderr)
        return 2
    bwrap = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
    print(f"{bwrap}, {os.cpu_count()} CPUs, euid {os.geteuid()}, load average before: {loadavg()}")
    report_acquire(args)
    report_round_trip(args)
    report_per_core(args)
    report_grading(args)
    print(f"\nload average after: {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
