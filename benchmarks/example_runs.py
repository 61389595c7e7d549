"""The documented CPU example, again and again, each time on a fresh dev cluster (issue 39 item 8).

    sudo flock /tmp/node-tier.lock .venv/bin/python benchmarks/example_runs.py --runs 3 [--out DIR]

Each run does what docs/dev-cluster.md tells a new user to do, from nothing: `scripts/dev-cluster up`
(a fresh control plane and real node), `scripts/dev-cluster images` (built once before the first run from
the tree as it is then and kept in --out/images, loaded into each fresh node; `--images DIR` loads those
an earlier invocation kept instead), the `helm install` of the operator
in namespace rlfleet-cpu with that page's flags, `kubectl apply -f examples/rljob-cpu.yaml` (unchanged:
50 steps), then waits for the RLJob to read Succeeded and tears the cluster down (`scripts/dev-cluster
down`). Per run it records, from `kubectl apply`:
- the seconds until the RLJob's status first shows a step, a reward and a KL (the operator reading the
  trainer's report), and until it reads Succeeded;
- the prompt groups the trainer dropped (its "prompt N dropped" lines, every container of the trainer
  pod, restarted ones included) and those it held through an outage ("the router is unavailable");
- the trainer container's restarts.
A run holds when it reaches Succeeded with a step, reward and KL shown before, and drops no prompt. The
table goes to stdout (docs/benchmarks.md records it); each run's status timeline and the trainer's,
router's and operator's logs go to --out/run-N/ (they are what explains a run that does not hold).
The script exits 1 when any run did not hold.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "cluster"))

import controlplane  # noqa: E402 - tests/cluster, put on sys.path just above
import nodeimages  # noqa: E402
import realnode  # noqa: E402

DEVCLUSTER = [
    sys.executable,
    str(REPO / "tests" / "cluster" / "devcluster.py"),
]  # scripts/dev-cluster, minus bootstrap
WORKDIR = controlplane.WORK_ROOT / "dev-cluster"
NAMESPACE, JOB = "rlfleet-cpu", "cpu"
EXAMPLE = REPO / "examples" / "rljob-cpu.yaml"
DROPPED = re.compile(r"prompt \d+ dropped: ")
HELD = "the router is unavailable ("


@dataclass
class Run:
    run: int
    held: bool = False
    phase: str = ""
    first_step_s: float | None = None  # apply -> status.step, metrics.reward and metrics.kl all shown
    succeeded_s: float | None = None  # apply -> phase Succeeded
    dropped_prompts: int = 0
    outages: int = 0
    trainer_restarts: int = 0
    why: str = ""
    timeline: list[dict[str, Any]] = field(default_factory=list)


@contextlib.contextmanager
def node_lock(path: str | None) -> Iterator[None]:
    """The node tier's lock, held for one run (other node-tier users get the machine between runs)."""
    if not path:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def devcluster(*args: str, timeout: float = 3600) -> None:
    subprocess.run([*DEVCLUSTER, *args], check=True, timeout=timeout, stdout=subprocess.DEVNULL)


def install(kube: controlplane.KubeCluster) -> None:
    """docs/dev-cluster.md, "The operator and the CPU example on it", word for word."""
    stores = [{"name": "cpu", "claimName": "rlfleet-cpu-weights", "mountPath": "/weights/cpu"}]
    subprocess.run(
        [
            str(kube.bin_dir / "helm"),
            "install",
            "rlfleet",
            str(REPO / "charts" / "rlfleet"),
            "-n",
            NAMESPACE,
            "--create-namespace",
            "--set",
            "image.tag=0.1.0-cpu",
            "--set",
            "image.pullPolicy=Never",
            "--set",
            "operator.replicas=1",
            "--set-json",
            f"weightStores.filesystem={json.dumps(stores)}",
        ],
        env=kube.env(),
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    kube.kubectl("apply", "-n", NAMESPACE, "-f", str(EXAMPLE))


def observe(kube: controlplane.KubeCluster, run: Run, started: float, timeout: float) -> None:
    """Poll the RLJob until Succeeded (or timeout), recording when its status first shows progress."""
    last: tuple[Any, ...] = ()
    while time.monotonic() - started < timeout:
        got = kube.kubectl("get", "rljob", JOB, "-n", NAMESPACE, "-o", "json", check=False)
        status = (json.loads(got.stdout).get("status") or {}) if got.returncode == 0 else {}
        metrics = status.get("metrics") or {}
        now = round(time.monotonic() - started, 1)
        row = (
            status.get("phase"),
            status.get("reason"),
            status.get("step"),
            metrics.get("reward"),
            metrics.get("kl"),
        )
        if row != last:
            run.timeline.append(
                {"t": now, "phase": row[0], "reason": row[1], "step": row[2], "reward": row[3], "kl": row[4]}
            )
            last = row
        if run.first_step_s is None and None not in row[2:]:
            run.first_step_s = now
        run.phase = row[0] or ""
        if run.phase == "Succeeded":
            run.succeeded_s = now
            return
        time.sleep(2)


def trainer_logs(kube: controlplane.KubeCluster) -> str:
    """Every container of trainer pod 0 this run had: the one before the last restart, then the current."""
    pod = f"{JOB}-trainer-0"
    previous = kube.kubectl("logs", "-n", NAMESPACE, pod, "-c", "trainer", "--previous", check=False).stdout
    return previous + kube.kubectl("logs", "-n", NAMESPACE, pod, "-c", "trainer", check=False).stdout


def collect(kube: controlplane.KubeCluster, run: Run, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    logs = trainer_logs(kube)
    (out / "trainer.log").write_text(logs)
    run.dropped_prompts = len(DROPPED.findall(logs))
    run.outages = logs.count(HELD)
    pod = kube.kubectl("get", "pod", f"{JOB}-trainer-0", "-n", NAMESPACE, "-o", "json", check=False)
    if pod.returncode == 0:
        statuses = json.loads(pod.stdout).get("status", {}).get("containerStatuses") or []
        run.trainer_restarts = sum(int(s.get("restartCount", 0)) for s in statuses)
    for what, args in (
        ("router", ["-l", "app.kubernetes.io/component=router"]),
        ("operator", ["-l", "app.kubernetes.io/name=rlfleet"]),
    ):
        (out / f"{what}.log").write_text(
            kube.kubectl("logs", "-n", NAMESPACE, *args, "--all-containers", "--tail=-1", check=False).stdout
        )
    (out / "status.yaml").write_text(
        kube.kubectl("get", "rljob,sg,pods", "-n", NAMESPACE, "-o", "wide", check=False).stdout
    )


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def one_run(index: int, out: Path, timeout: float, images: list[Any]) -> Run:
    run = Run(run=index)
    devcluster("down")  # whatever a previous run or crash left (a no-op when nothing runs)
    devcluster("up", timeout=1200)
    try:
        realnode.RealNode(WORKDIR, log).load_images(images)  # `scripts/dev-cluster images`, built once
        kube = controlplane.KubeCluster.from_state(WORKDIR)
        install(kube)
        started = time.monotonic()
        observe(kube, run, started, timeout)
        collect(kube, run, out / f"run-{index}")
    finally:
        devcluster("down")
    problems = []
    if run.phase != "Succeeded":
        problems.append(f"phase {run.phase or 'none'} after {timeout:.0f} s")
    if run.first_step_s is None:
        problems.append("the status never showed a step, reward and KL")
    if run.dropped_prompts:
        problems.append(f"{run.dropped_prompts} prompts dropped")
    run.held, run.why = not problems, "; ".join(problems)
    (out / f"run-{index}" / "run.json").write_text(json.dumps(asdict(run), indent=2))
    return run


def build_once(lock: str | None, keep: Path) -> list[Any]:
    """Build the images once (every run gets the same ones, whatever changes in the tree meanwhile) and keep
    a copy of each archive in `keep`: the build cache keeps one archive per image, so another build of the
    tree (a node test) removes it between two runs."""
    with node_lock(lock):
        built = nodeimages.build_all(list(nodeimages.CPU_TAGS), log=log)
    keep.mkdir(parents=True, exist_ok=True)
    for image in built:
        shutil.copyfile(image.archive, keep / image.archive.name)
    return saved_images(keep)


def saved_images(folder: Path) -> list[Any]:
    """The operator, sampler and trainer archives kept in `folder` (one `<name>-<digest>.tar` each)."""
    images = []
    for name, ref in nodeimages.CPU_TAGS.items():
        archives = sorted(folder.glob(f"{name}-*.tar"))
        if len(archives) != 1:
            raise SystemExit(f"{folder}: expected one {name}-<digest>.tar, found {len(archives)}")
        images.append(nodeimages.Built(name, ref, archives[0], 0.0))
    return images


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900, help="seconds from apply to Succeeded, per run")
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "cluster" / ".work" / "example-runs")
    parser.add_argument("--lock", default=None, help="a lock file held during each run (/tmp/node-tier.lock)")
    parser.add_argument(
        "--images",
        type=Path,
        default=None,
        help="load the images an earlier invocation saved (its --out/images) instead of building",
    )
    args = parser.parse_args()
    images = saved_images(args.images) if args.images else build_once(args.lock, args.out / "images")
    runs = []
    for index in range(1, args.runs + 1):
        with node_lock(args.lock):
            run = one_run(index, args.out, args.timeout, images)
        runs.append(run)
        print(
            f"run {run.run}: {'holds' if run.held else 'FAILS: ' + run.why}; first step shown "
            f"{run.first_step_s} s, Succeeded {run.succeeded_s} s after apply; {run.dropped_prompts} dropped, "
            f"{run.outages} outages, {run.trainer_restarts} trainer restarts",
            flush=True,
        )
    print(
        "| run | holds | status shows step/reward/KL (s) | Succeeded (s) | prompts dropped | outages | trainer restarts |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        print(
            f"| {r.run} | {'yes' if r.held else 'no: ' + r.why} | {r.first_step_s} | {r.succeeded_s} | "
            f"{r.dropped_prompts} | {r.outages} | {r.trainer_restarts} |"
        )
    return 0 if all(r.held for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
