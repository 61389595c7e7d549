"""The WeightChannel pipeline's subscriber-report clean-up at the handler level, on a real filesystem
store: the operator reads the channel with the age-out bound (a dead replica no longer freezes its
group's version), removes the reports of replicas that are no live pod of their group once they aged
out, keeps a live pod's report and a fresh report of a pod its index has not seen yet, counts and logs
what it removed, and says once when the store refuses the delete. The pure rule is tested exactly in
tests/weights/test_weights_channel.py; the same path against the real control plane in
test_operator_cluster_subscribers.py."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kopf
import pytest
from support.fake_kube import FakeKube

from rlfleet.channel import SubscriberReport, WeightChannel
from rlfleet.operator import kube
from rlfleet.operator.channel_read import read_channel
from rlfleet.operator.pods import pod_view
from rlfleet.store import FilesystemStore

NS = "ns"
API = "rlfleet.dev/v1alpha1"
GROUP = "job-h100-fp8"


def publish(store: FilesystemStore, tmp_path: Path, versions: int) -> None:
    channel = WeightChannel(store)
    for version in range(versions):
        view = tmp_path / "views" / str(version) / "fp8"
        view.mkdir(parents=True)
        (view / "config.json").write_text(f'{{"version": {version}}}')
        channel.publish({"fp8": view}, version=version)


def report(replica: str, age: float, applied: int, now: datetime, group: str = GROUP) -> SubscriberReport:
    return SubscriberReport(
        group, replica, "fp8", applied, [applied], updated_at=(now - timedelta(seconds=age)).isoformat()
    )


def sampler_pod(name: str, group: str = GROUP) -> dict[str, Any]:
    return pod_view(
        {
            "metadata": {
                "name": name,
                "labels": {"rlfleet.dev/samplergroup": group, "app.kubernetes.io/component": "sampler"},
            },
            "status": {"phase": "Running"},
        }
    )


@pytest.fixture
def pipeline() -> Any:
    """The WeightChannel pipeline's module, imported when a test runs, not at collection: its store-read
    interval is read from the environment at import, which the cluster tests of this folder set first."""
    from rlfleet.operator import weightchannel_pipeline

    return weightchannel_pipeline


def view_with_pods(pods: dict[tuple[str, str, str], list[dict[str, Any]]]) -> Any:
    from rlfleet.operator.indexes import View

    return View(
        rljobs={},
        samplergroups={},
        samplergroups_by_job={},
        weightchannels={},
        sampler_deployments={},
        trainers={},
        pods=pods,
        mount_failures={},
        create_failures={},
        kueue_pending={},
    )


@pytest.fixture
def channel_store(tmp_path: Path) -> tuple[FilesystemStore, dict[str, Any], datetime]:
    """Versions 0-2 and five reports: a live pod's fresh one (v2), a live pod's aged one (v0: its
    sidecar cannot write), a replaced pod's (v1, 10 min old), a fresh one of a pod the index has not
    seen yet (v2), and one of a group that has no pods any more (v0, 1 h old)."""
    store = FilesystemStore(tmp_path / "store", create=True)
    publish(store, tmp_path, 3)
    now = datetime.now(UTC)
    channel = WeightChannel(store)
    channel.report(report("live-fresh", 5, 2, now))
    channel.report(report("live-stuck", 900, 0, now))
    channel.report(report("replaced", 600, 1, now))
    channel.report(report("newborn", 3, 2, now))
    channel.report(report("pod-x", 3600, 0, now, group="job-removed"))
    return store, {"store": {"type": "filesystem", "path": str(store.root)}}, now


def removals(result: str) -> float:
    """rlfleet_operator_subscriber_reports_removed_total{result} as the operator's /metrics exports it."""
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value("rlfleet_operator_subscriber_reports_removed_total", {"result": result})
    return value or 0.0


def reports_in(store: FilesystemStore) -> list[str]:
    return sorted(store.list("subscribers/"))


def test_view_lists_the_live_pods_of_each_sampler_group() -> None:
    view = view_with_pods(
        {
            (NS, "sampler", GROUP): [sampler_pod("a"), sampler_pod("b")],
            (NS, "sampler", "job-b200"): [sampler_pod("c", "job-b200")],
            (NS, "trainer", "job"): [{"name": "job-trainer-0"}],
            ("other", "sampler", GROUP): [sampler_pod("d")],
        }
    )
    assert view.sampler_replicas(NS) == {GROUP: frozenset({"a", "b"}), "job-b200": frozenset({"c"})}
    assert view.sampler_replicas("empty") == {}


def test_read_channel_removes_aged_reports_of_gone_replicas_only(channel_store: tuple) -> None:
    store, spec, now = channel_store
    live = {GROUP: frozenset({"live-fresh", "live-stuck"})}
    read = read_channel(spec, live, now)
    assert read.error is None and (read.removal_failures, read.removal_error) == (0, None)
    assert [(r.group, r.replica) for r in read.removed] == [(GROUP, "replaced"), ("job-removed", "pod-x")]
    assert reports_in(store) == [
        f"subscribers/{GROUP}/live-fresh.json",
        f"subscribers/{GROUP}/live-stuck.json",
        f"subscribers/{GROUP}/newborn.json",
    ]
    # the group's version counts fresh reports only: neither the dead replica's v1 nor the stuck one's v0
    [group] = read.status.groups
    assert (group.group, group.applied_version, group.lag) == (GROUP, 2, 0)
    assert group.replicas == {"live-fresh": 2, "newborn": 2}
    # a second read removes nothing more
    again = read_channel(spec, live, now)
    assert again.removed == () and len(reports_in(store)) == 3


def test_read_channel_without_live_pods_removes_nothing(channel_store: tuple) -> None:
    store, spec, now = channel_store
    read = read_channel(spec, None, now)
    assert read.removed == () and len(reports_in(store)) == 5
    assert [(g.group, g.applied_version) for g in read.status.groups] == [(GROUP, 2)]


def test_a_store_that_refuses_the_delete_leaves_the_status_right(
    channel_store: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, spec, now = channel_store

    def read_only(self: FilesystemStore, key: str) -> None:
        raise OSError(30, "Read-only file system", key)

    monkeypatch.setattr(FilesystemStore, "delete", read_only)
    read = read_channel(spec, {GROUP: frozenset({"live-fresh"})}, now)
    assert read.removed == () and read.removal_failures == 3  # live-stuck, replaced, pod-x
    assert read.removal_error is not None and "Read-only file system" in read.removal_error
    assert len(reports_in(store)) == 5
    assert [(g.group, g.applied_version, g.lag) for g in read.status.groups] == [(GROUP, 2, 0)]


async def test_the_weightchannel_pipeline_removes_logs_counts_and_writes_status(
    channel_store: tuple, pipeline: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store, spec, _ = channel_store
    api = FakeKube()
    monkeypatch.setattr(kube, "api", lambda: api)
    monkeypatch.setattr(kopf, "event", lambda *a, **k: None)
    caplog.set_level(logging.INFO, logger="rlfleet.operator")
    view = view_with_pods({(NS, "sampler", GROUP): [sampler_pod("live-fresh"), sampler_pod("live-stuck")]})
    wc = {
        "apiVersion": API,
        "kind": "WeightChannel",
        "metadata": {"name": "job-weights", "namespace": NS, "generation": 1},
        "spec": {**spec, "jobName": "job"},
    }
    before = removals("removed")

    await pipeline.refresh_weightchannel_status(NS, "job-weights", view, wc)

    assert removals("removed") - before == 2
    assert reports_in(store) == [
        f"subscribers/{GROUP}/live-fresh.json",
        f"subscribers/{GROUP}/live-stuck.json",
        f"subscribers/{GROUP}/newborn.json",
    ]
    logged = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.INFO and "removed the subscriber" in r.getMessage()
    ]
    assert len(logged) == 2 and any(f"{GROUP}/replaced" in m and "applied v1" in m for m in logged), logged
    [(kind, name, status)] = api.statuses
    assert (kind, name) == ("WeightChannel", "job-weights")
    assert status["latestVersion"] == 2 and status["phase"] == "Ready"
    assert status["groups"] == [
        {"group": GROUP, "view": "fp8", "appliedVersion": 2, "lag": 0, "replicas": ["live-fresh", "newborn"]}
    ]  # (live-stuck's report is stale)


async def test_a_refused_delete_warns_once_per_streak(
    channel_store: tuple, pipeline: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store, spec, _ = channel_store
    monkeypatch.setattr(kube, "api", lambda: FakeKube())
    monkeypatch.setattr(kopf, "event", lambda *a, **k: None)
    monkeypatch.setattr(pipeline, "_removal_failing", set())
    caplog.set_level(logging.INFO, logger="rlfleet.operator")
    real_delete = FilesystemStore.delete

    def read_only(self: FilesystemStore, key: str) -> None:
        raise OSError(30, "Read-only file system", key)

    monkeypatch.setattr(FilesystemStore, "delete", read_only)
    view = view_with_pods({(NS, "sampler", GROUP): [sampler_pod("live-fresh")]})
    wc = {
        "apiVersion": API,
        "kind": "WeightChannel",
        "metadata": {"name": "w", "namespace": NS, "generation": 1},
        "spec": spec,
    }
    before = removals("error")

    def warnings() -> int:
        return sum(
            r.levelno == logging.WARNING and "cannot remove subscriber reports" in r.getMessage()
            for r in caplog.records
        )

    for _ in range(3):
        await pipeline.refresh_weightchannel_status(NS, "w", view, dict(wc))
    # three reads, each refused three deletes (live-stuck, replaced, pod-x): one warning
    assert warnings() == 1 and removals("error") - before == 9 and len(reports_in(store)) == 5
    monkeypatch.setattr(FilesystemStore, "delete", real_delete)
    await pipeline.refresh_weightchannel_status(NS, "w", view, dict(wc))
    assert any("removing subscriber reports works again" in r.getMessage() for r in caplog.records)
    assert reports_in(store) == [f"subscribers/{GROUP}/live-fresh.json", f"subscribers/{GROUP}/newborn.json"]
