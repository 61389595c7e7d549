"""Against the real control plane: the operator removes the weight-channel reports of sampler pods that
no longer exist, keeps those of live pods, and a replaced pod no longer freezes its group's VERSION /
LAG. The sampler pod is real (Deployment -> kube-scheduler -> kwok); the reports are written here with
the WeightChannel API, as the pods' sync sidecars write them (kwok runs no containers)."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from support.control_plane import get, operator_in_process
from support.waits import wait_for

REPO = Path(__file__).resolve().parents[2]
GROUP = "small-h100-fp8"

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def removals() -> float:
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value(
        "rlfleet_operator_subscriber_reports_removed_total", {"result": "removed"}
    )
    return value or 0.0


def test_reports_of_gone_pods_are_removed_and_stop_freezing_the_group_version(
    kube, crds, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlfleet.channel import SubscriberReport, WeightChannel
    from rlfleet.store import FilesystemStore

    monkeypatch.setenv("RLFLEET_CHANNEL_STATUS_INTERVAL", "2")  # read if the handlers are not imported yet

    store_dir = tmp_path / "channel"
    store = FilesystemStore(store_dir, create=True)
    channel = WeightChannel(store)
    for version in range(3):
        view = tmp_path / "views" / str(version) / "fp8"
        view.mkdir(parents=True)
        (view / "config.json").write_text(json.dumps({"version": version}))
        channel.publish({"fp8": view}, version=version)
    manifest = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())
    manifest["metadata"]["name"] = "small"
    manifest["spec"]["samplerGroups"] = [
        {"name": "h100-fp8", "accelerator": "h100", "replicas": 1, "weightFormat": "fp8"}
    ]
    manifest["spec"]["weightChannel"]["store"] = {"type": "filesystem", "path": str(store_dir)}

    def running_pod() -> str | None:
        pods = (get(kube, namespace, "pods", "-l", f"rlfleet.dev/samplergroup={GROUP}") or {}).get(
            "items", []
        )
        running = [p["metadata"]["name"] for p in pods if p.get("status", {}).get("phase") == "Running"]
        return running[0] if len(running) == 1 else None

    stop = threading.Event()

    def newborn_sidecar() -> None:
        """A pod the operator's index does not hold (as one created an instant ago): its sidecar keeps
        its report fresh, every second."""
        while not stop.is_set():
            channel.report(
                SubscriberReport(
                    GROUP, f"{GROUP}-newborn", "fp8", 2, [2], updated_at=datetime.now(UTC).isoformat()
                )
            )
            stop.wait(1.0)

    before = removals()
    heartbeat = threading.Thread(target=newborn_sidecar, daemon=True)
    with operator_in_process(kube, namespace, monkeypatch) as runner:
        try:
            kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest))
            pod = wait_for("the sampler pod Running", running_pod, timeout=120)
            hour_ago = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
            # the live pod's sidecar has not written for an hour (it cannot reach the store): its report
            # stays, but counts nowhere; a replaced pod's report (applied v1) goes
            channel.report(SubscriberReport(GROUP, pod, "fp8", 0, [0], updated_at=hour_ago))
            channel.report(SubscriberReport(GROUP, f"{GROUP}-replaced", "fp8", 1, [1], updated_at=hour_ago))
            heartbeat.start()
            wait_for(
                "the replaced pod's report removed",
                lambda: not (store_dir / "subscribers" / GROUP / f"{GROUP}-replaced.json").exists(),
                timeout=120,
            )
            # (a dot-file is the heartbeat's write in flight: the store writes a hidden temporary, then renames)
            reports = (store_dir / "subscribers" / GROUP).iterdir()
            assert sorted(p.name for p in reports if not p.name.startswith(".")) == sorted(
                [f"{GROUP}-newborn.json", f"{pod}.json"]
            )
            status = wait_for(
                "channel status from the fresh report only",
                lambda: (get(kube, namespace, "wc", "small-weights") or {}).get("status", {}).get("groups"),
                timeout=60,
            )
            assert status == [
                {
                    "group": GROUP,
                    "view": "fp8",
                    "appliedVersion": 2,
                    "lag": 0,
                    "replicas": [f"{GROUP}-newborn"],
                }
            ]

            def group_status() -> dict | None:
                sg_status = (get(kube, namespace, "sg", GROUP) or {}).get("status", {})
                return sg_status if sg_status.get("appliedWeightVersion") == 2 else None

            assert wait_for("group VERSION/LAG", group_status, timeout=60)["versionLag"] == 0
            assert removals() - before == 1
        finally:
            stop.set()
            if heartbeat.is_alive():
                heartbeat.join(5)
    assert f"removed the subscriber report of {GROUP}/{GROUP}-replaced" in runner.output
