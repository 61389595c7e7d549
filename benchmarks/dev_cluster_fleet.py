"""The CPU example fleet on the dev cluster's real node (docs/dev-cluster.md): start-up, weight sync and
training speed of real pods, against local mode on the same groups.

    sudo scripts/dev-cluster up && sudo scripts/dev-cluster images
    sudo .venv/bin/python benchmarks/dev_cluster_fleet.py [--steps 40] [--workdir tests/cluster/.work/dev-cluster]

1. `helm install` (the operator, the store's claim mounted) and `kubectl apply` of examples/rljob-cpu.yaml
   with `--steps` steps, in a fresh namespace. Pod start to first generated token, per sampler pod: from
   the pod's creationTimestamp to the first 200 of its engine's GET /health_generate (a one-token
   generation), polled from the host (pod IPs are on the node's bridge). The fleet's first pods wait for
   the trainer's version 0; a replacement pod (one deleted mid-run) starts from the newest version.
2. Weight-sync latency: for each version every group applied, from the manifest's `published_at` to
   the LAST group's `applied weights vN` line (each sidecar's log, its own timestamps).
3. Steps/s: the trainer loop's own per-step time (time/wait_rollouts + time/train + time/publish,
   from the checkpoint's history, after the first 5 steps), against `rlfleet run --local` of the same
   job (same groups, prompts per step, samples, tokens, steps) on this machine, after the cluster job
   is deleted (the two never share the CPU).
Prints the figures and the ratio; record them in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "cluster"))
sys.path.insert(0, str(REPO / "tests"))

import controlplane  # noqa: E402 - tests/cluster, put on sys.path just above
from support.waits import wait_for  # noqa: E402

EXAMPLE = REPO / "examples" / "rljob-cpu.yaml"
JOB, CLAIM, STORE_PATH = "cpu", "rlfleet-cpu-weights", "/weights/cpu"
WARMUP_STEPS = 5


def parse_time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def log_time(line: str) -> float:
    """A sidecar log line's own timestamp (`%(asctime)s`, UTC in the pod: `2026-12-02 16:03:36,280`)."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=UTC).timestamp()


class Fleet:
    def __init__(self, kube: Any, ns: str) -> None:
        self.kube, self.ns = kube, ns

    def sampler_pods(self) -> list[dict[str, Any]]:
        items = self.kube.get_json("pods", "-n", self.ns, "-l", "app.kubernetes.io/component=sampler")[
            "items"
        ]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def store_dir(self) -> Path:
        volume = self.kube.get_json("pvc", CLAIM, "-n", self.ns)["spec"]["volumeName"]
        pv = self.kube.get_json("pv", volume)["spec"]
        return Path((pv.get("hostPath") or pv.get("local"))["path"])

    def first_tokens(self, names: set[str], timeout: float = 900) -> dict[str, float]:
        """Seconds from each named pod's creation to its engine's first one-token generation."""
        done: dict[str, float] = {}
        deadline = time.monotonic() + timeout
        while set(done) != names:
            assert time.monotonic() < deadline, f"no first token from {sorted(names - set(done))}"
            for pod in self.sampler_pods():
                name = pod["metadata"]["name"]
                ip = pod["status"].get("podIP")
                if name not in names or name in done or not ip:
                    continue
                engine = next(c for c in pod["spec"]["containers"] if c["name"] != "weight-sync")
                port = engine["ports"][0]["containerPort"]
                try:
                    with urllib.request.urlopen(f"http://{ip}:{port}/health_generate", timeout=5) as r:
                        if r.status == 200:
                            done[name] = time.time() - parse_time(pod["metadata"]["creationTimestamp"])
                except OSError:
                    pass
            time.sleep(0.2)
        return done


def apply_fleet(kube: Any, ns: str, operator_ref: str, steps: int) -> None:
    repository, tag = operator_ref.rsplit(":", 1)
    stores = [{"name": "cpu", "claimName": CLAIM, "mountPath": STORE_PATH}]
    subprocess.run(
        [
            str(kube.bin_dir / "helm"),
            "install",
            "rlfleet",
            str(REPO / "charts" / "rlfleet"),
            "-n",
            ns,
            "--create-namespace",
            "--set",
            f"image.repository={repository}",
            "--set",
            f"image.tag={tag}",
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
    docs = list(yaml.safe_load_all(EXAMPLE.read_text()))
    [job] = [d for d in docs if d["kind"] == "RLJob"]
    job["spec"]["trainer"]["totalSteps"] = steps
    kube.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(docs))


def watch_published(fleet: Fleet, published: dict[int, float], stop: threading.Event) -> None:
    """Each version's `published_at`, read from its manifest while it exists (retention deletes old ones)."""
    store: Path | None = None
    while not stop.wait(0.2):
        try:
            store = store or fleet.store_dir()
            version = int(json.loads((store / "pointer.json").read_text())["version"])
            if version not in published:
                manifest = json.loads((store / f"v{version}" / "manifest.json").read_text())
                published[version] = parse_time(manifest["published_at"])
        except (OSError, ValueError, KeyError, TypeError, AssertionError, subprocess.CalledProcessError):
            continue  # the claim not bound yet, or a version just retired


def sync_latencies(fleet: Fleet, published: dict[int, float]) -> list[float]:
    applied: dict[str, dict[int, float]] = {}
    for pod in fleet.sampler_pods():
        group = pod["metadata"]["labels"]["rlfleet.dev/group"]
        out = fleet.kube.kubectl("logs", "-n", fleet.ns, pod["metadata"]["name"], "-c", "weight-sync").stdout
        for line in out.splitlines():
            if m := re.search(r"applied weights v(\d+) ", line):
                applied.setdefault(group, {})[int(m.group(1))] = log_time(line)
    common = set.intersection(*(set(v) for v in applied.values())) if applied else set()
    return [max(applied[g][v] for g in applied) - published[v] for v in sorted(common & set(published))]


def steps_per_second(rows: list[dict[str, Any]]) -> float:
    rows = [r for r in rows if int(r["step"]) > WARMUP_STEPS]
    seconds = sum(
        float(r.get(k, 0.0)) for r in rows for k in ("time/wait_rollouts", "time/train", "time/publish")
    )
    return len(rows) / seconds


def local_rows(steps: int) -> list[dict[str, Any]]:
    """`rlfleet run --local` of the same job: its `local:` section set to the cluster run's sizes."""
    docs = list(yaml.safe_load_all(EXAMPLE.read_text()))
    [job] = [d for d in docs if d["kind"] == "RLJob"]
    rollout = job["spec"]["rollout"]
    job["spec"]["local"] = {
        "steps": steps,
        "promptsPerStep": rollout["promptsPerStep"],
        "samplesPerPrompt": rollout["samplesPerPrompt"],
        "maxNewTokens": rollout["maxNewTokens"],
    }
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-local-") as tmp:
        manifest = Path(tmp) / "rljob.yaml"
        manifest.write_text(yaml.safe_dump(job))
        subprocess.run(
            [
                str(REPO / "scripts" / "rlfleet"),
                "run",
                str(manifest),
                "--local",
                "--no-live",
                "--out",
                str(Path(tmp) / "run"),
            ],
            check=True,
            timeout=3600,
        )
        return json.loads((Path(tmp) / "run" / "report" / "metrics.json").read_text())["steps"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--workdir", default=str(REPO / "tests" / "cluster" / ".work" / "dev-cluster"))
    args = parser.parse_args()
    from rlfleet.trainer.publish import checkpoint

    kube = controlplane.KubeCluster.from_state(Path(args.workdir))
    operator_ref = "ghcr.io/rlfleet/operator:0.1.0-cpu"
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    fleet = Fleet(kube, ns)
    t0 = time.monotonic()
    apply_fleet(kube, ns, operator_ref, args.steps)
    published: dict[int, float] = {}
    stop = threading.Event()
    threading.Thread(target=watch_published, args=(fleet, published, stop), daemon=True).start()
    try:
        names = wait_for(
            "three sampler pods",
            lambda: (p := fleet.sampler_pods()) and len(p) == 3 and {x["metadata"]["name"] for x in p},
            timeout=300,
        )
        first = fleet.first_tokens(names)
        step = lambda: int(kube.get_json("rljob", JOB, "-n", ns).get("status", {}).get("step") or 0)  # noqa: E731
        wait_for("step 10", lambda: step() >= 10, timeout=1800)
        [old] = [p for p in fleet.sampler_pods() if p["metadata"]["labels"]["rlfleet.dev/group"] == "bf16"]
        kube.kubectl("delete", "pod", "-n", ns, old["metadata"]["name"], "--wait=false")
        new = wait_for(
            "the replacement pod",
            lambda: {p["metadata"]["name"] for p in fleet.sampler_pods()} - names,
            timeout=300,
        )
        replacement = fleet.first_tokens(new)
        store = fleet.store_dir()
        wait_for(
            "the trainer's last step",
            lambda: (
                (s := checkpoint.load_latest(store / "checkpoints")) is not None
                and int(s["step"]) >= args.steps
            ),
            timeout=3600,
        )
        print(f"fleet: {args.steps} steps, {time.monotonic() - t0:.0f}s from helm install")
        phase = lambda: kube.get_json("rljob", JOB, "-n", ns).get("status", {}).get("phase")  # noqa: E731
        wait_for("the RLJob Succeeded", lambda: phase() == "Succeeded", timeout=600)
        print(f"RLJob Succeeded {time.monotonic() - t0:.0f}s from helm install")
        latencies = sync_latencies(fleet, published)
        cluster_rows = checkpoint.load_latest(store / "checkpoints")["history"]
    finally:  # the job first, while the operator runs (it releases the WeightChannel's finalizer)
        stop.set()
        kube.kubectl("delete", "rljob", "--all", "-n", ns, "--wait=true", "--timeout=100s", check=False)
        subprocess.run(
            [str(kube.bin_dir / "helm"), "uninstall", "rlfleet", "-n", ns, "--wait"],
            env=kube.env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    cluster_rate = steps_per_second(cluster_rows)
    print("pod start -> first generated token (s):")
    for name, seconds in sorted(first.items()):
        print(f"  {name:40s} {seconds:6.1f}  (first pods: wait for the trainer's version 0)")
    for name, seconds in sorted(replacement.items()):
        print(f"  {name:40s} {seconds:6.1f}  (replacement, from the newest version)")
    if latencies:
        ordered = sorted(latencies)
        p90 = ordered[max(0, -(-9 * len(ordered) // 10) - 1)]  # nearest rank
        print(
            f"weight sync, publish -> every group applied (s), {len(latencies)} versions: "
            f"p50 {statistics.median(latencies):.2f}  p90 {p90:.2f}  max {ordered[-1]:.2f}"
        )
    print(f"steps/s after step {WARMUP_STEPS}: cluster {cluster_rate:.3f}", flush=True)
    local_rate = steps_per_second(local_rows(args.steps))
    print(
        f"steps/s after step {WARMUP_STEPS}: local {local_rate:.3f}  cluster/local {cluster_rate / local_rate:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
