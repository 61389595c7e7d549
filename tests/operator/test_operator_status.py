"""Pure status computation: phases, conditions with observedGeneration, transition times, change detection."""

from __future__ import annotations

from rlfleet.api.weightchannel import WeightChannelStatus
from rlfleet.catalog import load_catalog
from rlfleet.channel import ChannelStatus, GroupVersionStatus, ViewArtifactStatus
from rlfleet.operator import status as st
from rlfleet.operator.channel_status import weightchannel_status
from rlfleet.operator.group_status import quarantine_reason, samplergroup_status
from rlfleet.operator.job_status import rljob_status

CATALOG = load_catalog(None)
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def sg(
    replicas: int = 2, generation: int = 3, accelerator: str = "h100", fmt: str = "fp8", **spec: object
) -> dict:
    return {
        "apiVersion": "rlfleet.dev/v1alpha1",
        "kind": "SamplerGroup",
        "metadata": {"name": "job-g", "namespace": "ns", "generation": generation},
        "spec": {
            "name": "g",
            "accelerator": accelerator,
            "weightFormat": fmt,
            "replicas": replicas,
            "model": {"name": "m", "path": "p"},
            "weightChannel": "job-weights",
            **spec,
        },
    }


def deployment(ready: int, replicas: int, updated: int | None = None, conditions: list | None = None) -> dict:
    return {
        "metadata": {"generation": 2},
        "status": {
            "observedGeneration": 2,
            "readyReplicas": ready,
            "replicas": replicas,
            "updatedReplicas": replicas if updated is None else updated,
            "conditions": conditions or [],
        },
    }


def conds(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status["conditions"]}


def test_pending_then_running_with_generation_and_selector() -> None:
    s = samplergroup_status(sg(), None, CATALOG, now=T0)
    assert (s["phase"], s["ready"], s["observedGeneration"]) == ("Pending", "0/2", 3)
    assert s["selector"] == "rlfleet.dev/samplergroup=job-g"
    s = samplergroup_status(sg(), deployment(1, 2), CATALOG, now=T0)
    assert s["phase"] == "Pending" and conds(s)["Ready"]["status"] == "False"
    assert conds(s)["Progressing"]["status"] == "True"
    s = samplergroup_status(sg(), deployment(2, 2), CATALOG, now=T0)
    c = conds(s)
    assert s["phase"] == "Running" and s["readyReplicas"] == 2 and s["ready"] == "2/2"
    assert c["Ready"] == {
        "type": "Ready",
        "status": "True",
        "reason": "AllReplicasReady",
        "message": "2/2 replicas ready",
        "observedGeneration": 3,
        "lastTransitionTime": T0,
    }
    assert c["Progressing"]["status"] == "False" and c["Degraded"]["status"] == "False"
    assert s["selectedAccelerator"] == "h100" and "NVIDIA-H100-80GB-HBM3" in s["selectionReason"]
    assert s["degradedPrecision"] is False


def test_degraded_precision_is_flagged_for_fp8_on_a100() -> None:
    s = samplergroup_status(sg(accelerator="a100", fmt="fp8"), deployment(2, 2), CATALOG, now=T0)
    assert s["degradedPrecision"] is True and "W8A16" in s["precisionNote"]
    assert s["phase"] == "Running" and "runs degraded on a100" in s["message"]


def test_suspended_quarantined_and_deadline() -> None:
    s = samplergroup_status(sg(suspend=True), deployment(2, 2), CATALOG, now=T0)
    assert (s["phase"], conds(s)["Ready"]["reason"]) == ("Pending", "Suspending")  # pods still up
    down = deployment(0, 0) | {"spec": {"replicas": 0}}
    s = samplergroup_status(sg(suspend=True), down, CATALOG, now=T0)
    assert s["phase"] == "Suspended" and s["ready"] == "0/0" and conds(s)["Progressing"]["status"] == "False"
    s = samplergroup_status(
        sg(quarantined=True),
        deployment(2, 2),
        CATALOG,
        now=T0,
        quarantine=quarantine_reason(sg(quarantined=True)),
    )
    assert s["phase"] == "Quarantined" and conds(s)["Ready"]["status"] == "True" and s["quarantined"] is True
    assert "quarantined by spec.quarantined" in s["message"]
    s = samplergroup_status(sg(), deployment(2, 2), CATALOG, now=T0, quarantine=None)
    assert s["phase"] == "Running" and s["quarantined"] is False
    stalled = [
        {
            "type": "Progressing",
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "message": "timed out",
        }
    ]
    s = samplergroup_status(sg(), deployment(1, 2, conditions=stalled), CATALOG, now=T0)
    assert s["phase"] == "Degraded" and conds(s)["Degraded"]["reason"] == "ProgressDeadlineExceeded"
    assert "timed out" in s["message"]


def test_class_the_runtime_catalog_cannot_run_fails_clearly() -> None:
    s = samplergroup_status(sg(accelerator="h100", fmt="nvfp4"), None, CATALOG, now=T0)
    assert s["phase"] == "Failed" and "native NVFP4 needs Blackwell" in s["message"]
    assert conds(s)["Ready"]["reason"] == "InvalidSpec"


def test_transition_time_kept_while_status_unchanged() -> None:
    first = samplergroup_status(sg(), deployment(2, 2), CATALOG, now=T0)
    obj = sg() | {"status": first}
    again = samplergroup_status(obj, deployment(2, 2), CATALOG, now=T1)
    assert conds(again)["Ready"]["lastTransitionTime"] == T0
    assert not st.status_changed(first, again)  # nothing to write
    down = samplergroup_status(obj, deployment(1, 2), CATALOG, now=T1)
    assert conds(down)["Ready"]["lastTransitionTime"] == T1 and st.status_changed(first, down)


def test_status_changed_ignores_fields_and_conditions_owned_by_others() -> None:
    mine = samplergroup_status(sg(), deployment(2, 2), CATALOG, now=T0)
    observed = {
        **mine,
        "share": 0.3,
        "tokensPerSecond": 1234.0,
        "conditions": [*mine["conditions"], {"type": "CollapseRisk", "status": "True"}],
    }
    assert not st.status_changed(observed, mine)
    assert st.status_changed({**observed, "readyReplicas": 1}, mine)


def test_a_status_differing_only_in_one_condition_has_changed() -> None:
    """Kills the mutant of the change gate whose condition branch never returns True (or compares only the
    condition types): each of these differs from `mine` in one field of one condition and nothing else."""
    mine = samplergroup_status(sg(), deployment(2, 2), CATALOG, now=T0)
    for field_, value in (
        ("status", "True"),
        ("reason", "Other"),
        ("message", "other"),
        ("observedGeneration", 2),
    ):
        observed = {
            **mine,
            "conditions": [
                {**c, field_: value} if c["type"] == "Degraded" else c for c in mine["conditions"]
            ],
        }
        assert st.status_changed(observed, mine), field_
    missing = {**mine, "conditions": [c for c in mine["conditions"] if c["type"] != "Degraded"]}
    assert st.status_changed(missing, mine)


def test_applied_version_and_lag_from_the_channel() -> None:
    channel = {
        "latestVersion": 9,
        "groups": [{"group": "job-g", "appliedVersion": 7, "lag": 2}, {"group": "x", "appliedVersion": 1}],
    }
    s = samplergroup_status(sg(), deployment(2, 2), CATALOG, channel_status=channel, now=T0)
    assert (s["appliedWeightVersion"], s["versionLag"]) == (7, 2)
    s = samplergroup_status(sg(), deployment(2, 2), CATALOG, channel_status={"groups": []}, now=T0)
    assert "appliedWeightVersion" not in s


def test_a_foreign_weight_load_shows_as_the_groups_reason_until_a_newer_version() -> None:
    """A sidecar whose engine served weights it had not applied applies the channel's again and says so
    in its report (the message is the sidecar's own, sampler/syncer.py): `kubectl get sg` shows reason
    ForeignWeightVersion, the message says it, WeightsSynced stays True (the channel's version is served)."""
    from rlfleet.sampler.syncer import foreign_version_message

    message = foreign_version_message(1000000, 7, 7, 1, T0)
    report = {"group": "job-g", "appliedVersion": 7, "lag": 0, "lastError": message}
    s = samplergroup_status(sg(), deployment(2, 2), CATALOG, channel_status={"groups": [report]}, now=T0)
    assert (s["phase"], s["reason"]) == ("Running", "ForeignWeightVersion")
    assert (
        "; foreign weight version: the engine served v1000000, not v7 that this sidecar applied"
        in s["message"]
    )
    assert "weight sync failing" not in s["message"]
    [synced] = [c for c in s["conditions"] if c["type"] == "WeightsSynced"]
    assert (synced["status"], synced["reason"]) == ("True", "ForeignWeightVersion")
    newer = {"group": "job-g", "appliedVersion": 8, "lag": 0}  # the next publish applied: the note is gone
    s = samplergroup_status(sg(), deployment(2, 2), CATALOG, channel_status={"groups": [newer]}, now=T0)
    assert s["reason"] == "AllReplicasReady" and "foreign" not in s["message"]


def test_a_failing_weight_sync_is_said_while_the_group_keeps_running() -> None:
    """A replica that refused a version (checksum) keeps serving the one it has: the group stays Running,
    its message and WeightsSynced condition say what was refused; the count stays after recovery."""
    failing = {
        "group": "job-g",
        "appliedVersion": 7,
        "lag": 1,
        "syncFailures": 1,
        "lastError": "checksum: v8: v8/nvfp4/model.safetensors: blake3:aa != manifest blake3:bb",
    }
    s = samplergroup_status(sg(), deployment(2, 2), CATALOG, channel_status={"groups": [failing]}, now=T0)
    assert s["phase"] == "Running" and s["weightSyncFailures"] == 1
    assert "weight sync failing (serving v7): checksum: v8: v8/nvfp4" in s["message"]
    [synced] = [c for c in s["conditions"] if c["type"] == "WeightsSynced"]
    assert (synced["status"], synced["reason"]) == ("False", "SyncFailing") and "checksum" in synced[
        "message"
    ]
    recovered = {"group": "job-g", "appliedVersion": 9, "lag": 0, "syncFailures": 1}
    s = samplergroup_status(sg(), deployment(2, 2), CATALOG, channel_status={"groups": [recovered]}, now=T0)
    [synced] = [c for c in s["conditions"] if c["type"] == "WeightsSynced"]
    assert synced["status"] == "True" and "failing" not in s["message"] and s["weightSyncFailures"] == 1


def sampler_pod(name: str, sync_started: str, deleting: bool = False) -> dict:
    """The pod index's view (operator/pods.py pod_view) of a ready sampler pod whose sidecar started then."""
    from rlfleet.operator.pods import pod_view

    ready = {"ready": True, "restartCount": 0, "state": {"running": {"startedAt": sync_started}}}
    return pod_view(
        {
            "metadata": {
                "name": name,
                "labels": {"rlfleet.dev/samplergroup": "job-g"},
                **({"deletionTimestamp": T1} if deleting else {}),
            },
            "status": {
                "phase": "Running",
                "containerStatuses": [{"name": "sglang", **ready}, {"name": "weight-sync", **ready}],
            },
        }
    )


def test_a_ready_replica_without_a_fresh_report_is_named_with_where_to_look() -> None:
    """Report writes that fail (a store the sidecar cannot write, S3 credentials without PutObject on
    subscribers/) were seen only as an empty VERSION column: a pod whose sidecar has run for the report's
    age-out bound (150 s) with no fresh report in the channel's status is named, WeightsSynced=False."""
    channel = {
        "phase": "Ready",
        "latestVersion": 7,
        "groups": [{"group": "job-g", "appliedVersion": 7, "lag": 0, "replicas": ["job-g-a"]}],
    }
    started_long_ago, started_now = (
        "2025-12-31T23:57:29Z",
        "2025-12-31T23:57:31Z",
    )  # 151 s and 149 s before T0
    pods = [sampler_pod("job-g-a", started_long_ago), sampler_pod("job-g-b", started_long_ago)]
    s = samplergroup_status(sg(), deployment(2, 2), CATALOG, channel_status=channel, now=T0, pods=pods)
    assert (s["phase"], s["reason"]) == ("Running", "NoSubscriberReport")
    assert "no subscriber report from pod job-g-b for 150s" in s["message"]
    assert "cannot write subscribers/job-g/ in the store" in s["message"]
    assert "kubectl logs job-g-b -c weight-sync" in s["message"]
    [synced] = [c for c in s["conditions"] if c["type"] == "WeightsSynced"]
    assert (synced["status"], synced["reason"]) == ("False", "NoSubscriberReport")
    # two silent pods: the first named, the others counted
    s = samplergroup_status(
        sg(), deployment(2, 2), CATALOG, channel_status={**channel, "groups": []}, now=T0, pods=pods
    )
    assert "no subscriber report from pod job-g-a (and 1 more) for 150s" in s["message"]
    # a sidecar younger than the bound, a pod being deleted, or a channel the operator could not read: no claim
    for judged_pods, judged_channel in (
        ([sampler_pod("job-g-a", started_long_ago), sampler_pod("job-g-b", started_now)], channel),
        (
            [
                sampler_pod("job-g-a", started_long_ago),
                sampler_pod("job-g-b", started_long_ago, deleting=True),
            ],
            channel,
        ),
        (pods, {"phase": "Degraded", "groups": []}),
    ):
        s = samplergroup_status(
            sg(), deployment(2, 2), CATALOG, channel_status=judged_channel, now=T0, pods=judged_pods
        )
        assert s["reason"] == "AllReplicasReady" and "subscriber report" not in s["message"], s["message"]
        [synced] = [c for c in s["conditions"] if c["type"] == "WeightsSynced"]
        assert synced["status"] == "True"


def job(groups: list[str], suspend: bool = False, generation: int = 4) -> dict:
    return {
        "apiVersion": "rlfleet.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "job", "namespace": "ns", "generation": generation},
        "spec": {
            "suspend": suspend,
            "trainer": {"replicas": 1},
            "samplerGroups": [{"name": g} for g in groups],
        },
    }


def group_obj(
    name: str, phase: str, ready: str = "2/2", stale: bool = False, risk: str | None = None
) -> dict:
    conditions = [{"type": "CollapseRisk", "status": "True", "message": risk}] if risk else []
    return {
        "metadata": {"generation": 2},
        "spec": {"name": name},
        "status": {
            "phase": phase,
            "ready": ready,
            "observedGeneration": 1 if stale else 2,
            "share": 0.5,
            "conditions": conditions,
        },
    }


def trainer(ready: int) -> dict:
    return {"status": {"readyReplicas": ready}}


def test_job_rollup_running_pending_degraded_suspended() -> None:
    groups = [group_obj("a", "Running"), group_obj("b", "Running")]
    s = rljob_status(job(["a", "b"]), groups, trainer(1), {"status": {"latestVersion": 5}}, now=T0)
    assert (s["phase"], s["readyGroups"], s["weightVersion"], s["observedGeneration"]) == (
        "Running",
        "2/2",
        5,
        4,
    )
    assert conds(s)["Ready"]["status"] == "True" and "CollapseRisk" not in conds(s)  # the rebalancer's
    assert s["groups"] == [
        {"name": "a", "phase": "Running", "ready": "2/2", "share": 0.5},
        {"name": "b", "phase": "Running", "ready": "2/2", "share": 0.5},
    ]
    # a stale group status (older generation) does not count as ready; nor does a missing group
    s = rljob_status(
        job(["a", "b", "c"]), [groups[0], group_obj("b", "Running", stale=True)], trainer(1), None, now=T0
    )
    assert (s["phase"], s["readyGroups"]) == ("Pending", "1/3") and "weightVersion" not in s
    assert s["groups"][2] == {"name": "c", "phase": "Pending"}
    s = rljob_status(job(["a", "b"]), groups, trainer(0), None, now=T0)
    assert s["phase"] == "Pending" and "trainer 0/1" in s["message"]
    s = rljob_status(
        job(["a", "b"]), [groups[0], group_obj("b", "Degraded", "1/2")], trainer(1), None, now=T0
    )
    assert s["phase"] == "Degraded" and conds(s)["Degraded"]["status"] == "True" and "b" in s["message"]
    s = rljob_status(job(["a", "b"], suspend=True), groups, trainer(0), None, now=T0)
    assert (s["phase"], s["reason"]) == ("Pending", "Suspending")  # groups still running
    down = [group_obj("a", "Suspended", "0/0"), group_obj("b", "Suspended", "0/0")]
    s = rljob_status(job(["a", "b"], suspend=True), down, trainer(0), None, now=T0)
    assert s["phase"] == "Suspended" and s["trainer"] == {"replicas": 0, "readyReplicas": 0, "ready": "0/0"}


def test_job_collapse_risk_rolls_up_from_groups_and_invalid_spec_fails() -> None:
    from rlfleet.operator.trainer_report import trainer_job_status

    groups = [group_obj("a", "Running"), group_obj("b", "Running", risk="kl surge 4.1x")]
    s = trainer_job_status(job(["a", "b"]), groups, None, now=T0).status  # written by the rebalance timer
    risk = conds(s)["CollapseRisk"]
    assert (
        risk["status"] == "True" and "b: kl surge 4.1x" in risk["message"] and risk["observedGeneration"] == 4
    )
    s = rljob_status(job(["a"]), [], None, None, now=T0, invalid="invalid RLJob: bad")
    assert (s["phase"], s["reason"]) == ("Failed", "InvalidSpec") and conds(s)["Degraded"]["status"] == "True"


def channel_status(
    latest: int | None, artifacts: list[ViewArtifactStatus], groups: list[GroupVersionStatus]
) -> ChannelStatus:
    return ChannelStatus(latest, None, artifacts, groups, [], [])


def artifact(view: str, version: int, **kw: object) -> ViewArtifactStatus:
    return ViewArtifactStatus(
        **{"view": view, "version": version, "uri": "u", "sha256": "ab", "bytes": 10, "time": None, **kw}
    )  # type: ignore[arg-type]


def test_weightchannel_status_known_unknown_and_empty() -> None:
    wc = {"metadata": {"generation": 1}}
    s = weightchannel_status(wc, None, "store /w not mounted", now=T0)
    assert s["phase"] == "Pending" and s["message"] == "latest version unknown: store /w not mounted"
    assert "latestVersion" not in s and conds(s)["Ready"]["reason"] == "StoreUnreadable"
    s = weightchannel_status(wc, channel_status(None, [], []), None, now=T0)
    assert s["phase"] == "Pending" and conds(s)["Ready"]["reason"] == "NothingPublished"
    assert "storedPercent" not in s
    ch = channel_status(
        4,
        [
            artifact("bf16", 4, kind="delta", stored_bytes=1, base=3),
            artifact("fp8", 4, kind="anchor", stored_bytes=10),
        ],
        [
            GroupVersionStatus(
                "job-g", "fp8", 3, 1, {"p": 3}, sync_failures=2, last_error="checksum: v4/fp8: x"
            ),
            GroupVersionStatus("job-h", "bf16", None, None, {}),
        ],
    )
    s = weightchannel_status(wc, ch, None, now=T0)
    assert (s["phase"], s["latestVersion"]) == ("Ready", 4)
    assert s["artifacts"] == [
        {
            "view": "bf16",
            "version": 4,
            "uri": "u",
            "sha256": "ab",
            "bytes": 10,
            "kind": "delta",
            "storedBytes": 1,
            "base": 3,
        },
        {
            "view": "fp8",
            "version": 4,
            "uri": "u",
            "sha256": "ab",
            "bytes": 10,
            "kind": "anchor",
            "storedBytes": 10,
        },
    ]
    assert s["storedPercent"] == 55.0  # (1 + 10) stored of (10 + 10)
    WeightChannelStatus.model_validate(s)  # what the CRD's schema holds
    assert s["groups"] == [
        {
            "group": "job-g",
            "view": "fp8",
            "appliedVersion": 3,
            "lag": 1,
            "syncFailures": 2,
            "lastError": "checksum: v4/fp8: x",
            "replicas": ["p"],
        },  # the replicas with a fresh report
        {"group": "job-h", "view": "bf16"},
    ]


def test_one_quarantine_path_for_spec_annotation_and_collapse_detector() -> None:
    annotated = sg() | {"metadata": {"name": "job-g", "annotations": {"rlfleet.dev/quarantined": "true"}}}
    assert quarantine_reason(sg(quarantined=True)) == "spec.quarantined"
    assert quarantine_reason(annotated) == "annotation rlfleet.dev/quarantined"
    assert quarantine_reason(sg(), frozenset({"g"})) == "the trainer's collapse detector"
    assert quarantine_reason(sg(), frozenset({"other"})) is None
    not_true = sg() | {"metadata": {"name": "job-g", "annotations": {"rlfleet.dev/quarantined": "false"}}}
    assert quarantine_reason(not_true) is None


def test_webhook_admission_message_uses_the_runtime_catalog(monkeypatch, tmp_path) -> None:
    """The webhook's decision function: valid -> None; what the catalog in effect cannot run -> the message."""
    import copy
    from pathlib import Path

    import yaml

    from rlfleet.operator.admission import admission_message

    example = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "rljob.yaml").read_text())
    assert admission_message("RLJob", example) is None
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text("classes:\n  h100:\n    weightFormats: {fp8: null}\n")
    monkeypatch.setenv("RLFLEET_CATALOG", str(catalog))
    message = admission_message("RLJob", copy.deepcopy(example))
    assert message is not None and "accelerator h100 (sm90) cannot run weightFormat fp8" in message
    group = sg(fmt="bf16")
    assert admission_message("SamplerGroup", group) is None
    group["spec"]["weightFormat"] = "fp8"
    assert "cannot run weightFormat fp8" in admission_message("SamplerGroup", group)


def test_group_waiting_for_its_views_first_version_says_so() -> None:
    """The pods' init container waits for the newest version of the group's view: until the channel
    has one, the group's status names the view, the channel and why (from the WeightChannel status)."""
    pending_channel = {"phase": "Pending", "message": "no version published yet"}
    s = samplergroup_status(sg(), deployment(0, 2), CATALOG, pending_channel, now=T0)
    assert s["phase"] == "Pending" and conds(s)["Ready"]["reason"] == "WaitingForWeights"
    assert s["message"] == (
        "0/2 replicas ready: waiting for version 0 of view fp8 in channel job-weights: no version published "
        "yet (the trainer publishes version 0 of every view before step 1)"
    )
    # an mxfp4 group waits on a view the trainer may refuse outright: the group points at the job's reason
    s = samplergroup_status(sg(fmt="mxfp4"), deployment(0, 2), CATALOG, pending_channel, now=T0)
    assert (
        "the trainer refuses an mxfp4 view of a dense or Qwen3-family model before publishing anything"
        in s["message"]
    )
    unreadable = {"phase": "Pending", "message": "latest version unknown: store directory /w does not exist"}
    s = samplergroup_status(sg(), deployment(0, 2), CATALOG, unreadable, now=T0)
    assert "store directory /w does not exist" in s["message"]
    s = samplergroup_status(sg(), deployment(0, 2), CATALOG, None, now=T0)
    assert (
        "channel status not read yet" in s["message"] and conds(s)["Ready"]["reason"] == "WaitingForWeights"
    )
    # a version without this group's view
    bf16_only = {"latestVersion": 4, "artifacts": [{"view": "bf16", "version": 4}]}
    s = samplergroup_status(sg(), deployment(0, 2), CATALOG, bf16_only, now=T0)
    assert s["message"].endswith("waiting for view fp8 in channel job-weights: version 4 has views bf16")
    # the view is published: the pods are merely starting (SGLang loading)
    published = {
        "latestVersion": 0,
        "artifacts": [{"view": "bf16", "version": 0}, {"view": "fp8", "version": 0}],
    }
    s = samplergroup_status(sg(), deployment(1, 2), CATALOG, published, now=T0)
    assert conds(s)["Ready"]["reason"] == "ReplicasNotReady" and s["message"] == "1/2 replicas ready"
    # a LoRA job: the latest version is only the adapter, the group's base view was stored at version 0
    lora = {"latestVersion": 7, "artifacts": [{"view": "lora", "version": 7}], "loraBase": {"fp8": 0}}
    s = samplergroup_status(sg(), deployment(1, 2), CATALOG, lora, now=T0)
    assert conds(s)["Ready"]["reason"] == "ReplicasNotReady" and s["message"] == "1/2 replicas ready"
    lora_other = {**lora, "loraBase": {"bf16": 0}}
    s = samplergroup_status(sg(), deployment(0, 2), CATALOG, lora_other, now=T0)
    assert s["message"].endswith("waiting for view fp8 in channel job-weights: version 7 has views lora")
    # a group without a channel never waits for one
    s = samplergroup_status(sg(weightChannel=None), deployment(0, 2), CATALOG, None, now=T0)
    assert conds(s)["Ready"]["reason"] == "ReplicasNotReady"
