"""What the operator watches, as kopf indexes (in memory: no list or get per event), and the `View` of them
that a handler is given.

kopf passes every index to every handler as a keyword argument named after its function (`rljobs_idx`,
...), which `View.of(kwargs)` names. One small view per object: the whole body of an rlfleet kind, the
replicas and status of a workload, `pods.pod_view` of a pod, `pods.event_view` of an Event (only a pod's
FailedMount, a StatefulSet's FailedCreate and Kueue's Pending on a Workload: what shows nowhere else).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import kopf

from rlfleet.api.common import GROUP, VERSION
from rlfleet.operator import naming as n
from rlfleet.operator.pods import event_view, latest_event_message, pod_view

SAMPLER_LABELS = {n.LABEL_MANAGED_BY: n.MANAGED_BY, n.LABEL_COMPONENT: "sampler"}
TRAINER_LABELS = {n.LABEL_MANAGED_BY: n.MANAGED_BY, n.LABEL_COMPONENT: "trainer"}
POD_LABELS = {n.LABEL_MANAGED_BY: n.MANAGED_BY}


def plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """A kopf Body as a plain, deep-copied dict."""
    return copy.deepcopy({k: body[k] for k in body})


def namespaced(namespace: str | None) -> str:
    """The namespace kopf passes to a handler. kopf types it optional (a cluster-scoped kind has none);
    every kind the operator handles is namespaced (its CRDs, pods, Events, Deployments, StatefulSets),
    so None would mean a handler registered on a kind it was not written for."""
    if namespace is None:
        raise kopf.PermanentError("the operator handles namespaced objects only; kopf passed none")
    return namespace


@kopf.index(GROUP, VERSION, "rljobs")
def rljobs_idx(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespaced(namespace), name): plain(body)}


@kopf.index(GROUP, VERSION, "samplergroups")
def samplergroups_idx(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespaced(namespace), name): plain(body)}


@kopf.index(GROUP, VERSION, "samplergroups")
def samplergroups_by_job_idx(namespace: str | None, body: kopf.Body, **_: Any) -> dict | None:
    namespace = namespaced(namespace)
    job = body.get("spec", {}).get("jobName")
    return {(namespace, job): plain(body)} if job else None


@kopf.index(GROUP, VERSION, "weightchannels")
def weightchannels_idx(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespaced(namespace), name): plain(body)}


def _workload(body: kopf.Body) -> dict[str, Any]:
    return {
        "metadata": {"name": body["metadata"]["name"], "generation": body["metadata"].get("generation")},
        "spec": {"replicas": body.get("spec", {}).get("replicas")},
        "status": copy.deepcopy(dict(body.get("status") or {})),
    }


@kopf.index("apps", "v1", "deployments", labels=SAMPLER_LABELS)
def sampler_deployments_idx(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespaced(namespace), name): _workload(body)}


@kopf.index("apps", "v1", "statefulsets", labels=TRAINER_LABELS)
def trainers_idx(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespaced(namespace), name): _workload(body)}


def pod_owner(labels: Mapping[str, str]) -> tuple[str, str] | None:
    """(component, owner): ("sampler", SamplerGroup name) or ("trainer" | "router", job name)."""
    component = labels.get(n.LABEL_COMPONENT)
    if component == "sampler" and labels.get(n.LABEL_SAMPLERGROUP):
        return component, labels[n.LABEL_SAMPLERGROUP]
    if component in ("trainer", "router") and labels.get(n.LABEL_JOB):
        return component, labels[n.LABEL_JOB]
    return None


@kopf.index("", "v1", "pods", labels=POD_LABELS)
def pods_idx(namespace: str | None, body: kopf.Body, **_: Any) -> dict | None:
    namespace = namespaced(namespace)
    owner = pod_owner(body.get("metadata", {}).get("labels") or {})
    return {(namespace, *owner): pod_view(body)} if owner else None


def is_failed_mount(body: Mapping[str, Any], **_: Any) -> bool:
    involved = body.get("involvedObject") or {}
    return (
        body.get("reason") == "FailedMount" and involved.get("kind") == "Pod" and bool(involved.get("name"))
    )


# Events carry no labels: keyed by the involved pod; only FailedMount (a Secret or ConfigMap missing from a
# volume shows nowhere else). One small view per Event object: the index is bounded by the Events' own TTL.
@kopf.index("", "v1", "events", when=is_failed_mount)
def mount_failures_idx(namespace: str | None, body: kopf.Body, **_: Any) -> dict:
    return {(namespaced(namespace), body["involvedObject"]["name"]): event_view(body)}


def is_failed_create(body: Mapping[str, Any], **_: Any) -> bool:
    involved = body.get("involvedObject") or {}
    return (
        body.get("reason") == "FailedCreate"
        and involved.get("kind") == "StatefulSet"
        and bool(involved.get("name"))
    )


# The StatefulSet controller's refusals to create a pod (a ResourceQuota, a missing PriorityClass, a
# webhook) show only as FailedCreate Events on the StatefulSet (it has no ReplicaFailure condition, unlike a
# Deployment): keyed by the StatefulSet's name, bounded by the Events' TTL like the FailedMount index.
@kopf.index("", "v1", "events", when=is_failed_create)
def create_failures_idx(namespace: str | None, body: kopf.Body, **_: Any) -> dict:
    return {(namespaced(namespace), body["involvedObject"]["name"]): event_view(body)}


def is_kueue_pending(body: Mapping[str, Any], **_: Any) -> bool:
    involved = body.get("involvedObject") or {}
    return (
        body.get("reason") == "Pending"
        and involved.get("kind") == "Workload"
        and str(involved.get("apiVersion", "")).startswith("kueue.x-k8s.io/")
        and bool(involved.get("name"))
    )


# Kueue says why it does not admit a Workload (a queue's quota) on the Workload's status and in a `Pending`
# Event on it; the trainer's pod group is the Workload named after the StatefulSet (its pod-group-name).
# Watching Events needs no Kueue CRD in the cluster; bounded by the Events' TTL like the indexes above.
@kopf.index("", "v1", "events", when=is_kueue_pending)
def kueue_pending_idx(namespace: str | None, body: kopf.Body, **_: Any) -> dict:
    return {(namespaced(namespace), body["involvedObject"]["name"]): event_view(body)}


@dataclass(frozen=True)
class View:
    """The indexes, as handed to handlers by kopf (keyword arguments named after the index functions)."""

    rljobs: Any
    samplergroups: Any
    samplergroups_by_job: Any
    weightchannels: Any
    sampler_deployments: Any
    trainers: Any
    pods: Any
    mount_failures: Any
    create_failures: Any
    kueue_pending: Any

    @classmethod
    def of(cls, kwargs: Mapping[str, Any]) -> View:
        return cls(
            rljobs=kwargs["rljobs_idx"],
            samplergroups=kwargs["samplergroups_idx"],
            samplergroups_by_job=kwargs["samplergroups_by_job_idx"],
            weightchannels=kwargs["weightchannels_idx"],
            sampler_deployments=kwargs["sampler_deployments_idx"],
            trainers=kwargs["trainers_idx"],
            pods=kwargs["pods_idx"],
            mount_failures=kwargs["mount_failures_idx"],
            create_failures=kwargs["create_failures_idx"],
            kueue_pending=kwargs["kueue_pending_idx"],
        )

    def pods_of(self, namespace: str) -> Callable[[str, str], list[dict[str, Any]]]:
        """(component, owner) -> the pod views of that workload in `namespace`, each with its latest
        FailedMount message (`mountFailure`, None without one)."""

        def of(component: str, owner: str) -> list[dict[str, Any]]:
            return [
                {
                    **pod,
                    "mountFailure": latest_event_message(
                        self.all(self.mount_failures, (namespace, pod["name"]))
                    ),
                }
                for pod in self.all(self.pods, (namespace, component, owner))
            ]

        return of

    def sampler_replicas(self, namespace: str) -> dict[str, frozenset[str]]:
        """SamplerGroup name -> the names of its pods in the index (terminating ones included: their
        sidecars may still run). A sidecar's report is keyed by exactly these (group, pod name)."""
        return {
            key[2]: frozenset(p["name"] for p in store if p.get("name"))
            for key, store in list(self.pods.items())
            if key[0] == namespace and key[1] == "sampler"
        }

    def owner_of_pod(self, namespace: str, pod_name: str) -> tuple[str, str] | None:
        """(component, owner) of one of the operator's pods, by name (None: not one of ours)."""
        for key, store in self.pods.items():
            if key[0] == namespace and any(p.get("name") == pod_name for p in store):
                return key[1], key[2]
        return None

    @staticmethod
    def one(index: Any, key: tuple[str, ...]) -> dict[str, Any] | None:
        store = index.get(key)
        return next(iter(store), None) if store else None

    @staticmethod
    def all(index: Any, key: tuple[str, ...]) -> list[dict[str, Any]]:
        store = index.get(key)
        return list(store) if store else []


def owned_by(child: Mapping[str, Any], owner: Mapping[str, Any]) -> bool:
    uid = owner["metadata"].get("uid")
    return any(ref.get("uid") == uid for ref in child.get("metadata", {}).get("ownerReferences", []) or [])


def alive(obj: Mapping[str, Any] | None) -> TypeGuard[Mapping[str, Any]]:
    return obj is not None and not obj["metadata"].get("deletionTimestamp")
