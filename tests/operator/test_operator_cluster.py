"""The operator against the real control plane (etcd + kube-apiserver + controllers + scheduler + kwok).

The operator runs under kopf's KopfRunner (in-process), or as `rlfleet operator run` subprocesses for
the kill -9 test. Sampler pods are scheduled by the real kube-scheduler onto kwok's fake GPU nodes
(GFD labels, 8 x nvidia.com/gpu, tainted) and kwok marks them Running and Ready.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from support.control_plane import bind_claim, get, operator_in_process
from support.processes import start_operator
from support.stub_views import stub_views
from support.waits import wait_for
from test_operator_builders import LAUNCH_KEY, launched_argv

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "rljob.yaml"
JOB = "reference-fleet"
# `kubectl get samplergroups`: the CRD's printer columns, in order
SAMPLERGROUP_COLUMNS = (
    "NAME ACCELERATOR WEIGHTS PHASE READY TOK/S SHARE% VERSION LAG KL OOR USABLE REASON AGE".split()
)
GROUPS = [g["name"] for g in yaml.safe_load(EXAMPLE.read_text())["spec"]["samplerGroups"]]
FLAGS = {
    "b200-nvfp4": ["--quantization", "modelopt_fp4", "--fp4-gemm-backend", "flashinfer_cutlass"],
    "b300-nvfp4": ["--quantization", "modelopt_fp4", "--fp4-gemm-backend", "flashinfer_cutlass"],
    "h100-fp8": ["--quantization", "fp8", "--fp8-gemm-backend", "deep_gemm"],
    "h100-bf16": [],
    "h200-fp8": ["--quantization", "fp8", "--fp8-gemm-backend", "deep_gemm"],
    "h200-bf16": [],
    "a100-bf16": [],
    "rtx-pro-6000-bf16": ["--kv-cache-dtype", "fp8_e4m3"],
}

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(autouse=True)
def fast_timers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLFLEET_CHANNEL_STATUS_INTERVAL", "2")


def store_dir(namespace: str) -> Path:
    """The hostPath of `shared_volume`, on this machine: the operator (run here) reads the channel's store
    there, as the chart's operator mounts the weight store (docs/install.md "Weight stores"). An RLJob whose
    channel the operator cannot read is Degraded (StoreUnreachable), never Ready."""
    path = Path(f"/tmp/rlfleet-weights-{namespace}")
    path.mkdir(exist_ok=True)
    return path


def example(namespace: str) -> dict:
    """examples/rljob.yaml with its store path on `store_dir` (the example's /weights/reference-fleet is the
    path inside the pods of a real cluster)."""
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["weightChannel"]["store"]["path"] = str(store_dir(namespace))
    return manifest


def apply_example(kube, namespace: str) -> None:
    kube.apply(example(namespace), namespace=namespace)


def shared_volume(kube, namespace: str) -> None:
    """The example's weights PVC (`rlfleet-weights`), statically bound to a hostPath PV: on a real cluster
    this is a ReadWriteMany volume the user provides; kwok never mounts it."""
    pv = bind_claim(kube, namespace, "rlfleet-weights", store_dir(namespace), "ReadWriteMany", "1Gi")
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "rlfleet-weights", "namespace": namespace},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "",
            "volumeName": pv,
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    kube.apply(pvc)


def column(table: list[str], name: str, row: int = 1) -> str:
    """The cell of a `kubectl get` table under the header `name` (cells may be empty)."""
    header = table[0]
    start = header.index(f"{name} ") if f"{name} " in header else header.index(name)
    rest = header[start + len(name) :]
    end = start + len(name) + (len(rest) - len(rest.lstrip())) if rest.strip() else None
    return table[row][start:end].strip()


def job_phase(kube, namespace: str) -> str | None:
    job = get(kube, namespace, "rljob", JOB)
    return (job or {}).get("status", {}).get("phase")


def wait_running(kube, namespace: str, timeout: float = 90.0) -> dict:
    def running() -> dict | None:
        job = get(kube, namespace, "rljob", JOB)
        status = (job or {}).get("status", {})
        if (
            status.get("phase") == "Running"
            and status.get("observedGeneration") == job["metadata"]["generation"]
        ):
            return job
        return None

    return wait_for("RLJob Running", running, timeout)


@contextmanager
def example_running(kube, namespace: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    """The operator in process, the example's shared volume and the example RLJob applied: the job once
    Running, the operator still running inside the block."""
    with operator_in_process(kube, namespace, monkeypatch):
        shared_volume(kube, namespace)
        apply_example(kube, namespace)
        yield wait_running(kube, namespace)


def items(kube, namespace: str, kind: str, selector: str = f"rlfleet.dev/job={JOB}") -> list[dict]:
    return get(kube, namespace, kind, "-l", selector)["items"]


def test_example_job_creates_a_placed_ready_fleet(
    kube, crds, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with example_running(kube, namespace, monkeypatch) as job:
        status = job["status"]
        assert status["readyGroups"] == "8/8"
        assert status["trainer"] == {"replicas": 1, "readyReplicas": 1, "ready": "1/1"}
        ready = {c["type"]: c for c in status["conditions"]}["Ready"]
        assert ready["status"] == "True" and ready["observedGeneration"] == job["metadata"]["generation"]
        # every child
        for kind, name in [
            ("configmap", f"{JOB}-config"),
            ("weightchannel", f"{JOB}-weights"),
            ("service", f"{JOB}-trainer"),
            ("statefulset", f"{JOB}-trainer"),
            ("service", f"{JOB}-router"),
            ("deployment", f"{JOB}-router"),
            ("secret", f"{JOB}-router-admin"),
        ]:
            assert get(kube, namespace, kind, name) is not None, (kind, name)
        sgs = {sg["spec"]["name"]: sg for sg in items(kube, namespace, "samplergroups")}
        assert sorted(sgs) == sorted(GROUPS)
        # sampler pods: only on nodes of their class, Running, with the right precision flags
        for group in GROUPS:
            sg = sgs[group]
            accelerator = sg["spec"]["accelerator"]
            pods = items(kube, namespace, "pods", f"rlfleet.dev/samplergroup={JOB}-{group}")
            assert len(pods) == 2, group
            for pod in pods:
                assert pod["spec"]["nodeName"] in kube.gpu_nodes[accelerator], (
                    group,
                    pod["spec"]["nodeName"],
                )
                assert pod["status"]["phase"] == "Running"
                engine = pod["spec"]["containers"][0]
                # the engine execs SGLang from the launch file the weight fetch writes: run the wrapper
                argv = launched_argv(engine, version=0, directory="/var/lib/rlfleet/weights/v0")
                assert argv[argv.index("--weight-version") + 2 :] == [
                    *FLAGS[group],
                    "--api-key",
                    LAUNCH_KEY,
                ], group
                assert [c["name"] for c in pod["spec"]["containers"]] == ["sglang", "weight-sync"]
            assert sg["status"]["phase"] == "Running" and sg["status"]["ready"] == "2/2"
            assert sg["status"]["selectedAccelerator"] == accelerator
            assert sg["status"]["degradedPrecision"] is False
        trainer_pod = get(kube, namespace, "pod", f"{JOB}-trainer-0")
        assert trainer_pod["spec"]["nodeName"] in kube.gpu_nodes["b200"]
        # kubectl get samplergroups: the columns, with values
        table = kube.kubectl("get", "samplergroups", "-n", namespace).stdout.splitlines()
        assert table[0].split() == SAMPLERGROUP_COLUMNS
        row = next(line.split() for line in table if line.startswith(f"{JOB}-rtx-pro-6000-bf16"))
        assert row[1:5] == ["rtx-pro-6000", "bf16", "Running", "2/2"]
        # the channel: its store readable and empty -> nothing published yet, said clearly (an unreadable
        # one would make the job Degraded: tests/operator/test_operator_pipeline.py)
        wc = wait_for(
            "WeightChannel status",
            lambda: (get(kube, namespace, "weightchannel", f"{JOB}-weights") or {}).get("status"),
        )
        assert wc["phase"] == "Pending" and wc["message"] == "no version published yet"
        # kubectl scale through the scale subresource
        kube.kubectl("scale", "-n", namespace, f"sg/{JOB}-h100-fp8", "--replicas=1")
        wait_for(
            "h100-fp8 scaled to 1",
            lambda: (
                (get(kube, namespace, "sg", f"{JOB}-h100-fp8")["status"].get("ready") == "1/1")
                and get(kube, namespace, "deployment", f"{JOB}-h100-fp8")["spec"]["replicas"] == 1
            ),
        )
        scale = json.loads(
            kube.kubectl(
                "get",
                "--raw",
                f"/apis/rlfleet.dev/v1alpha1/namespaces/{namespace}/samplergroups/{JOB}-h100-fp8/scale",
            ).stdout
        )
        assert (
            scale["spec"]["replicas"] == 1
            and scale["status"]["selector"] == f"rlfleet.dev/samplergroup={JOB}-h100-fp8"
        )
        # self-healing: children deleted behind the operator's back come back
        old_uid = get(kube, namespace, "sg", f"{JOB}-h200-fp8")["metadata"]["uid"]
        kube.kubectl(
            "delete", "-n", namespace, f"deployment/{JOB}-a100-bf16", f"sg/{JOB}-h200-fp8", "--wait=false"
        )
        wait_for("a100 Deployment re-created", lambda: get(kube, namespace, "deployment", f"{JOB}-a100-bf16"))
        wait_for(
            "h200-fp8 SamplerGroup re-created",
            lambda: (
                (get(kube, namespace, "sg", f"{JOB}-h200-fp8") or {"metadata": {"uid": old_uid}})["metadata"][
                    "uid"
                ]
                != old_uid
            ),
        )
        wait_for("h200-fp8 Deployment back", lambda: get(kube, namespace, "deployment", f"{JOB}-h200-fp8"))
        wait_running(kube, namespace)
        # events on transitions
        events = get(kube, namespace, "events")["items"]
        assert any(e["reason"] == "PhaseRunning" and e["involvedObject"]["kind"] == "RLJob" for e in events)


def test_spec_update_group_removal_suspend_resume_and_deletion(
    kube, crds, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with example_running(kube, namespace, monkeypatch):
        # update: one group scaled in the RLJob, one group removed
        manifest = example(namespace)
        manifest["spec"]["samplerGroups"] = [
            g for g in manifest["spec"]["samplerGroups"] if g["name"] != "a100-bf16"
        ]
        next(g for g in manifest["spec"]["samplerGroups"] if g["name"] == "h200-bf16")["replicas"] = 1
        kube.apply(manifest, namespace=namespace)
        wait_for("a100 group deleted", lambda: get(kube, namespace, "sg", f"{JOB}-a100-bf16") is None)
        wait_for(
            "a100 deployment collected",
            lambda: get(kube, namespace, "deployment", f"{JOB}-a100-bf16") is None,
        )
        wait_for(
            "h200-bf16 at 1",
            lambda: get(kube, namespace, "deployment", f"{JOB}-h200-bf16")["spec"]["replicas"] == 1,
        )
        job = wait_running(kube, namespace)
        assert job["status"]["readyGroups"] == "7/7"
        router = yaml.safe_load(get(kube, namespace, "configmap", f"{JOB}-config")["data"]["router.yaml"])
        assert "a100-bf16" not in [g["name"] for g in router["groups"]]
        # suspend -> samplers and trainer at zero, spec.replicas kept; resume -> restored
        kube.kubectl(
            "patch", "rljob", JOB, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}'
        )
        wait_for("Suspended", lambda: job_phase(kube, namespace) == "Suspended")
        for dep in items(
            kube, namespace, "deployments", f"rlfleet.dev/job={JOB},app.kubernetes.io/component=sampler"
        ):
            assert dep["spec"]["replicas"] == 0
        assert get(kube, namespace, "statefulset", f"{JOB}-trainer")["spec"]["replicas"] == 0
        assert get(kube, namespace, "sg", f"{JOB}-h100-fp8")["spec"]["replicas"] == 2
        wait_for(
            "sampler pods gone",
            lambda: not items(kube, namespace, "pods", "app.kubernetes.io/component=sampler"),
        )
        kube.kubectl(
            "patch", "rljob", JOB, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":false}}'
        )
        job = wait_running(kube, namespace)
        assert get(kube, namespace, "deployment", f"{JOB}-h100-fp8")["spec"]["replicas"] == 2
        # the operator never wrote the spec: only the user's field managers own it
        job = json.loads(
            kube.kubectl("get", "rljob", JOB, "-n", namespace, "-o", "json", "--show-managed-fields").stdout
        )
        managers = {
            m["manager"]
            for m in job["metadata"]["managedFields"]
            if "f:spec" in json.dumps(m.get("fieldsV1", {}))
        }
        assert not any("rlfleet" in m or "kopf" in m for m in managers), managers
        # deletion cascades through owner references (garbage collector)
        kube.kubectl("delete", "rljob", JOB, "-n", namespace, "--wait=false")
        wait_for(
            "children collected",
            lambda: (
                not items(kube, namespace, "samplergroups")
                and not items(kube, namespace, "deployments")
                and not items(kube, namespace, "statefulsets")
                and not items(kube, namespace, "configmaps")
                and not items(kube, namespace, "weightchannels")
            ),
        )


def test_cockpit_columns_and_deletion_without_the_operator(
    kube, crds, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kubectl get rlj` / `kubectl get sg` say what runs and why without -o wide (share in percent); the
    RLJob carries no finalizer, so it deletes while the operator is stopped (docs/operations.md)."""
    manifest = yaml.safe_load((REPO / "examples" / "rljob-small.yaml").read_text())
    manifest["spec"]["weightChannel"]["store"]["path"] = str(store_dir(namespace))  # readable by the operator
    with operator_in_process(kube, namespace, monkeypatch):
        shared_volume(kube, namespace)
        kube.apply(manifest, namespace=namespace)
        wait_for(
            "small Running",
            lambda: (get(kube, namespace, "rlj", "small") or {}).get("status", {}).get("phase") == "Running",
            timeout=120,
        )
        table = kube.kubectl("get", "rlj", "small", "-n", namespace).stdout.splitlines()
        assert table[0].split() == [
            "NAME",
            "PHASE",
            "GROUPS",
            "TRAINER",
            "STEP",
            "VERSION",
            "REWARD",
            "KL",
            "REASON",
            "AGE",
        ]
        assert [column(table, c) for c in ("PHASE", "GROUPS", "TRAINER", "REASON")] == [
            "Running",
            "2/2",
            "1/1",
            "AllReady",
        ]

        # the rebalance tick's share (0..1) is in the group's one status; the column shows percent
        def balanced() -> dict | None:
            status = (get(kube, namespace, "sg", "small-h200-fp8") or {}).get("status", {})
            return status if status.get("share") is not None else None

        share = wait_for("a share from the rebalance tick", balanced, timeout=120)["share"]

        def sg_table() -> list[str] | None:
            table = kube.kubectl("get", "sg", "small-h200-fp8", "-n", namespace).stdout.splitlines()
            return (
                table
                if column(table, "SHARE%") and float(column(table, "SHARE%")) == round(100 * share, 1)
                else None
            )

        table = wait_for("share in percent", sg_table)
        assert table[0].split() == SAMPLERGROUP_COLUMNS
        assert [column(table, c) for c in ("PHASE", "READY", "REASON")] == [
            "Running",
            "1/1",
            "AllReplicasReady",
        ]
        assert not get(kube, namespace, "rlj", "small")["metadata"].get("finalizers")
    # the operator is stopped: the job still deletes (the garbage collector takes its children)
    kube.kubectl("delete", "rlj", "small", "-n", namespace, "--wait=false")
    wait_for(
        "RLJob gone without the operator", lambda: get(kube, namespace, "rlj", "small") is None, timeout=30
    )
    wait_for("groups collected", lambda: not items(kube, namespace, "samplergroups", "rlfleet.dev/job=small"))


def test_operator_killed_mid_reconcile_converges_without_duplicates(
    kube, crds, namespace: str, tmp_path: Path
) -> None:
    proc = start_operator(kube, namespace, tmp_path / "operator-1.log", "--standalone", "--verbose")
    try:
        shared_volume(kube, namespace)
        apply_example(kube, namespace)
        # kill -9 as soon as the first children appear, before the job is reconciled
        wait_for(
            "first child",
            lambda: get(kube, namespace, "configmap", f"{JOB}-config"),
            timeout=60,
            interval=0.05,
        )
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        partial = len(items(kube, namespace, "samplergroups"))
        proc = start_operator(kube, namespace, tmp_path / "operator-2.log", "--standalone", "--verbose")
        job = wait_running(kube, namespace, timeout=120)
        assert job["status"]["readyGroups"] == "8/8"
        assert len(items(kube, namespace, "samplergroups")) == 8
        assert len(items(kube, namespace, "deployments")) == 9  # 8 sampler groups + router
        assert (
            len(items(kube, namespace, "statefulsets")) == 1 and len(items(kube, namespace, "services")) == 10
        )
        assert len(items(kube, namespace, "pods", "app.kubernetes.io/component=sampler")) == 16

        # and once more: a restart of a converged operator changes nothing and loses no status
        def snapshot() -> dict:
            return {
                sg["metadata"]["name"]: (sg["spec"], sg["status"])
                for sg in items(kube, namespace, "samplergroups")
            }

        # converged includes the rebalance tick, which writes each group's share one group at a time after
        # the job is Running: a snapshot between two of those writes is not converged (it failed so in CI)
        def balanced() -> dict | None:
            groups = snapshot()
            return groups if all(status.get("share") is not None for _, status in groups.values()) else None

        before = wait_for("every group's share from the rebalance tick", balanced, timeout=120)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        third = tmp_path / "operator-3.log"
        proc = start_operator(kube, namespace, third, "--standalone", "--verbose")

        def resumed() -> bool:  # the restarted operator has handled the job and every group (resume)
            text = third.read_text()
            return (
                text.count("Handler 'reconcile_rljob' succeeded") >= 1
                and text.count("Handler 'reconcile_samplergroup' succeeded") >= 8
            )

        wait_for("restarted operator resumed every object", resumed, timeout=120)
        after = snapshot()
        changed = [
            (name, part, key, was.get(key), now.get(key))
            for name in sorted(set(before) | set(after))
            for part, was, now in zip(
                ("spec", "status"), before.get(name, ({}, {})), after.get(name, ({}, {})), strict=True
            )
            for key in sorted(set(was) | set(now))
            if was.get(key) != now.get(key)
        ]
        assert not changed, f"a restart changed converged SamplerGroups (spec or status): {changed}"
        assert job_phase(kube, namespace) == "Running"
        print(f"killed with {partial}/8 SamplerGroups applied")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def test_weightchannel_and_group_versions_from_a_real_store(
    kube, crds, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem channel the operator can read: published versions and the sidecars' reports (written
    here with the weights engineer's WeightChannel API, as the trainer and sync sidecars do) show up as
    WeightChannel latestVersion/artifacts, SamplerGroup VERSION/LAG columns and the RLJob's weightVersion."""
    from rlfleet.channel import SubscriberReport
    from rlfleet.channel import WeightChannel as Channel
    from rlfleet.store import FilesystemStore

    store_dir = tmp_path / "channel"
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["metadata"]["name"] = "small"
    manifest["spec"]["samplerGroups"] = [
        {"name": "h100-fp8", "accelerator": "h100", "replicas": 1, "weightFormat": "fp8"},
        {"name": "h200-bf16", "accelerator": "h200", "replicas": 1, "weightFormat": "bf16"},
    ]
    manifest["spec"]["weightChannel"]["store"] = {"type": "filesystem", "path": str(store_dir)}
    channel = Channel(FilesystemStore(store_dir, create=True))
    views = stub_views(tmp_path / "views")
    channel.publish(views, version=1)
    with operator_in_process(kube, namespace, monkeypatch):
        kube.apply(manifest, namespace=namespace)

        def wc_status() -> dict | None:
            status = (get(kube, namespace, "wc", "small-weights") or {}).get("status", {})
            return status if status.get("latestVersion") == 2 and status.get("groups") else None

        channel.publish(views, version=2)
        channel.report(
            SubscriberReport(
                group="small-h100-fp8", replica="pod-a", view="fp8", applied_version=1, in_use=[1]
            )
        )
        status = wait_for("channel status", wc_status)
        assert status["phase"] == "Ready" and {a["view"] for a in status["artifacts"]} == {"bf16", "fp8"}
        assert all(a["version"] == 2 and len(a["sha256"]) == 64 for a in status["artifacts"])
        # both views stored whole (anchors): the stored bytes are the complete view's, Stored% 100
        assert all(a["kind"] == "anchor" and a["storedBytes"] == a["bytes"] > 0 for a in status["artifacts"])
        assert status["storedPercent"] == 100.0
        assert (
            column(kube.kubectl("get", "wc", "small-weights", "-n", namespace).stdout.splitlines(), "STORED%")
            == "100"
        )
        assert {
            "group": "small-h100-fp8",
            "view": "fp8",
            "appliedVersion": 1,
            "lag": 1,
            "replicas": ["pod-a"],
        } in status["groups"]
        sg = wait_for(
            "group version",
            lambda: (
                (get(kube, namespace, "sg", "small-h100-fp8") or {}).get("status", {}).get("versionLag") == 1
                and get(kube, namespace, "sg", "small-h100-fp8")["status"]
            ),
        )
        assert sg["appliedWeightVersion"] == 1
        table = kube.kubectl("get", "sg", "small-h100-fp8", "-n", namespace).stdout.splitlines()
        assert (
            column(table, "VERSION") == "1"
            and column(table, "LAG") == "1"
            and column(table, "WEIGHTS") == "fp8"
        )
        wait_for(
            "job weight version",
            lambda: get(kube, namespace, "rlj", "small")["status"].get("weightVersion") == 2,
        )


def test_ha_peering_standby_takes_over(kube, crds, namespace: str, tmp_path: Path) -> None:
    """Two operators in one kopf peering (distinct priorities): the standby stays passive while the leader
    lives and takes over after the leader is killed."""
    kube.kubectl(
        "apply",
        "--server-side",
        "--force-conflicts",
        "-f",
        str(REPO / "charts" / "rlfleet" / "crds" / "kopf.dev_peerings.yaml"),
    )
    kube.kubectl("wait", "--for=condition=Established", "crd/kopfpeerings.kopf.dev", "--timeout=60s")
    kube.apply(
        {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "rlfleet"}},
        namespace=namespace,
    )
    shared_volume(kube, namespace)
    manifest = yaml.safe_load((REPO / "examples" / "rljob-small.yaml").read_text())
    manifest["spec"]["weightChannel"]["store"]["path"] = str(store_dir(namespace))  # readable by the operator

    def start(priority: int) -> subprocess.Popen:
        return start_operator(
            kube,
            namespace,
            tmp_path / f"operator-{priority}.log",
            "--peering",
            "rlfleet",
            "--priority",
            str(priority),
            "--verbose",
            env={"RLFLEET_PEERING_LIFETIME": "6"},
        )

    def peers() -> int:
        return len((get(kube, namespace, "kopfpeering", "rlfleet") or {}).get("status", {}) or {})

    leader_log, standby_log = tmp_path / "operator-200.log", tmp_path / "operator-100.log"
    # Bounded waits on what each peer says, never on timing. kopf starts every peer paused and resumes
    # it once it sees no live peer of higher priority; so the leader goes first, and the standby starts
    # only when the leader's record is in the peering object: the standby's first look sees the leader
    # and it never resumes, however slowly either process starts on a loaded machine.
    leader = start(200)
    standby = None
    try:
        wait_for(
            "leader active",
            lambda: peers() >= 1 and "Resuming operations" in leader_log.read_text(),
            timeout=120,
        )
        standby = start(100)
        wait_for("standby announced", lambda: peers() >= 2, timeout=120)
        kube.apply(manifest, namespace=namespace)
        wait_for(
            "small job Running",
            lambda: (get(kube, namespace, "rlj", "small") or {}).get("status", {}).get("phase") == "Running",
            timeout=180,
        )
        passive = standby_log.read_text()
        assert "Resuming operations" not in passive  # the standby stayed paused
        assert "Handler 'reconcile_rljob' is invoked" not in passive  # the leader did the work
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait(10)
        manifest["spec"]["samplerGroups"][0]["replicas"] = 2
        kube.apply(manifest, namespace=namespace)
        # the standby notices the leader is gone (lifetime 6 s) and reconciles the change
        wait_for(
            "standby reconciled the update",
            lambda: (
                (get(kube, namespace, "deployment", "small-h200-fp8") or {}).get("spec", {}).get("replicas")
                == 2
            ),
            timeout=180,
        )
        assert "Handler 'reconcile_rljob' is invoked" in standby_log.read_text()
    finally:
        for proc in (leader, standby):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
