"""Local-mode training loop throughput: steps/s and where the wall time goes (sampling vs training).

    .venv/bin/python benchmarks/loop.py [--steps 8] [--groups 2|8] [--environment tool_add|copy_digit]
    .venv/bin/python benchmarks/loop.py --baseline-rev a0a2ece [--steps 8] [--groups 2|8]

With `--baseline-rev REV` the same benchmark (same fleet, steps and environment) runs twice, one after
the other, each in its own process: the code of git revision REV (a detached worktree, imported through
a PYTHONPATH shim in front of the editable install) and the working tree; it prints both and the ratio
after/before, with each process's peak RSS (`os.wait4`: the largest of the trainer process and the
fleet-host subprocess it waited for).

Runs `rlfleet run examples/rljob.yaml --local` in this process (real fleet-host subprocess with the
reference sampler servers, router and weight sync; trainer here), then prints per-step means of the
loop's own timers: `time/wait_rollouts` (the trainer waiting for complete prompt groups, i.e. sampling
that did not overlap training), `time/train` (forward + backward + optimizer), `time/publish`
(checkpoint + weight views + channel). Ratios, not absolute times, are the result: the shares of a
step, and a step relative to the train-only time measured on the same batches in the same process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--groups", type=int, default=2, choices=(2, 8))
    p.add_argument("--environment", default="tool_add")
    p.add_argument("--baseline-rev", help="also run the code of this git revision and print after/before")
    args = p.parse_args(argv)
    if args.baseline_rev:
        return compare(args)

    from rlfleet.api import load_rljob
    from rlfleet.local.main import run_local
    from rlfleet.trainer.config import resolve_run

    doc = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())
    if args.groups == 2:
        doc["spec"]["samplerGroups"] = [
            {"name": "h100-bf16", "accelerator": "h100", "replicas": 1, "weightFormat": "bf16"},
            {"name": "b200-nvfp4", "accelerator": "b200", "replicas": 1, "weightFormat": "nvfp4"},
        ]
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / "rljob.yaml"
        manifest.write_text(yaml.safe_dump(doc))
        rc = resolve_run(load_rljob(manifest), local=True)
        rc.steps, rc.environment = args.steps, args.environment
        summary = run_local(rc, Path(tmp) / "run", live=False)
        import json

        rows = json.loads((Path(tmp) / "run" / "report" / "metrics.json").read_text())["steps"]
    rows = rows[1:]  # step 1 includes the fleet's first weight load and warm-up
    wait = statistics.mean(r["time/wait_rollouts"] for r in rows)
    train = statistics.mean(r["time/train"] for r in rows)
    publish = statistics.mean(r["time/publish"] for r in rows)
    step = wait + train + publish
    tokens = statistics.mean(r["trained_tokens"] for r in rows)
    print(
        f"groups={args.groups} environment={args.environment} steps={summary['steps']} (first step excluded)"
    )
    print(f"steps/s                    {1 / step:.3f}")
    print(f"trained tokens/s           {tokens / step:.0f}")
    print(f"share waiting for rollouts {wait / step:.1%}")
    print(f"share training             {train / step:.1%}")
    print(f"share publishing           {publish / step:.1%}")
    print(f"step / train-only          {step / train:.1f}x")
    print(f"reward first -> last       {summary['reward_first']:.3f} -> {summary['reward_last']:.3f}")
    return 0


ROWS = (
    "steps/s",
    "trained tokens/s",
    "share waiting for rollouts",
    "share training",
    "share publishing",
    "step / train-only",
    "reward first -> last",
)  # the lines main() prints, parsed by compare()


def _checkout(rev: str) -> tuple[Path, Path]:
    """A detached worktree of `rev` whose `rlfleet` folder also holds the mapped product folders, and a
    shim directory holding only that `rlfleet` (the worktree root itself must never be on sys.path: its
    operator/ would shadow the standard library): PYTHONPATH=<shim> imports that revision's code
    instead of the editable install. Returns (worktree, shim)."""
    tree = Path(tempfile.gettempdir()) / f"rlfleet-bench-{rev}"
    if not tree.exists():
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev],
            check=True,
            capture_output=True,
        )
    for folder in ("operator", "sampler", "trainer", "router"):
        link = tree / "rlfleet" / folder
        if not link.exists():
            link.symlink_to(tree / folder, target_is_directory=True)
    shim = tree.with_name(tree.name + "-shim")
    shim.mkdir(exist_ok=True)
    if not (shim / "rlfleet").exists():
        (shim / "rlfleet").symlink_to(tree / "rlfleet", target_is_directory=True)
    return tree, shim


def _measure(script: Path, args: argparse.Namespace, pythonpath: Path | None) -> tuple[dict[str, str], float]:
    """Run one benchmark process; its printed `name value` lines and its peak RSS (MiB)."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-P",
            str(script),
            "--steps",
            str(args.steps),
            "--groups",
            str(args.groups),
            "--environment",
            args.environment,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=tempfile.gettempdir(),
        text=True,
    )
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"{script} failed (status {status}):\n{out}")
    rows = {}
    for line in out.splitlines():
        for name in ROWS:
            if line.startswith(name + " "):
                rows[name] = line[len(name) :].strip()
    return rows, usage.ru_maxrss / 1024  # Linux: KiB


def compare(args: argparse.Namespace) -> int:
    tree, shim = _checkout(args.baseline_rev)
    before, rss_before = _measure(tree / "benchmarks" / "loop.py", args, shim)
    after, rss_after = _measure(Path(__file__).resolve(), args, None)
    print(
        f"groups={args.groups} environment={args.environment} steps={args.steps} (first step excluded); "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'':27}{args.baseline_rev:>14}{'working tree':>16}{'after/before':>14}")
    for name in ("steps/s", "trained tokens/s"):
        b, a = float(before[name]), float(after[name])
        print(f"{name:27}{b:>14.3f}{a:>16.3f}{a / b:>13.2f}x")
    print(f"{'peak RSS (MiB)':27}{rss_before:>14.0f}{rss_after:>16.0f}{rss_after / rss_before:>13.2f}x")
    for name in ("share waiting for rollouts", "share training", "share publishing", "reward first -> last"):
        print(f"{name:27}{before.get(name, '-'):>14}{after.get(name, '-'):>16}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
