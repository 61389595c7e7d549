"""PURE: what a job whose sandboxes are pods (RLJob rollout.sandbox.backend: pods) adds to its children.

The trainer creates, execs into and deletes its sandbox pods itself (rlfleet/sandbox/pods.py), so only
then does it get API rights, and only these, in its own namespace:
- a ServiceAccount `<job>-trainer` (unless the user names one in trainer.serviceAccountName), its token
  mounted in the trainer pods;
- a RoleBinding `<job>-sandboxes` of that account to the sandbox role: SANDBOX_RULES (pods create,
  delete, get, list; pods/exec create, get), which the chart installs: a ClusterRole
  `<release>-<namespace>-sandboxes`, or in namespace mode a Role `<release>-sandboxes` in each watched
  namespace, named to the operator by RLFLEET_SANDBOX_ROLE (`ClusterRole/<name>` / `Role/<name>`). A
  RoleBinding confines a ClusterRole to its own namespace, and the operator needs only `bind` on that one
  role to grant it, never the rights themselves (it holds no pods/exec);
- a NetworkPolicy `<job>-sandboxes`: the sandbox pods get no ingress and no egress at all (the API
  server's exec reaches them through the kubelet, not the pod network). Made whenever the backend is
  pods, whether or not the operator's other policies are on (networkPolicy.enabled).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from rlfleet.api import RLJob
from rlfleet.operator import naming as n
from rlfleet.sandbox.podspec import (
    COMPONENT,
    LABEL_COMPONENT,
    LABEL_JOB,
    NAMESPACE_ENV,
    POD_NAME_ENV,
    POD_UID_ENV,
)

Manifest = dict[str, Any]

ROLE_ENV = "RLFLEET_SANDBOX_ROLE"
DEFAULT_ROLE = "ClusterRole/rlfleet-sandboxes"
SANDBOX_RULES: list[Manifest] = [
    # create a sandbox pod, wait for it (get), delete it; list: a restarted trainer finds its old ones
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "delete", "get", "list"]},
    # exec is a websocket GET upgraded to a stream: authorized as `get` (websocket) or `create` (SPDY/POST)
    {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create", "get"]},
]


def pods_backend(job: RLJob) -> bool:
    return job.spec.rollout.sandbox.backend == "pods"


def role_ref_from_env(environ: Mapping[str, str] | None = None) -> Manifest:
    """The roleRef of the sandbox RoleBinding: `Kind/name` from RLFLEET_SANDBOX_ROLE (the chart sets it)."""
    env = os.environ if environ is None else environ
    return parse_role_ref(env.get(ROLE_ENV, "").strip() or DEFAULT_ROLE)


def parse_role_ref(value: str) -> Manifest:
    kind, sep, name = value.partition("/")
    if not sep or kind not in ("ClusterRole", "Role") or not name:
        raise ValueError(f"{ROLE_ENV}: expected ClusterRole/<name> or Role/<name>, got {value!r}")
    return {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name}


def trainer_service_account(job: RLJob) -> str:
    return job.spec.trainer.service_account_name or n.trainer_service_account_name(job.name)


def build_sandbox_role(name: str, namespace: str | None = None) -> Manifest:
    """The sandbox role itself (a ClusterRole, or a Role in `namespace`): what the chart installs."""
    meta: Manifest = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role" if namespace else "ClusterRole",
            "metadata": meta, "rules": [dict(r) for r in SANDBOX_RULES]}  # fmt: skip


def build_sandbox_children(job: RLJob, namespace: str, owner: Manifest | None, role_ref: Manifest) -> list[Manifest]:
    """The ServiceAccount (when the user names none), the RoleBinding and the NetworkPolicy; none
    unless the job's sandboxes are pods."""
    if not pods_backend(job):
        return []
    labels = n.job_labels(job.name, "sandbox")
    account = trainer_service_account(job)
    children: list[Manifest] = []
    if job.spec.trainer.service_account_name is None:
        children.append({
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": n.object_meta(account, namespace, n.job_labels(job.name, "trainer"), owner),
            "automountServiceAccountToken": False,  # mounted by the trainer pods alone (pod_identity)
        })  # fmt: skip
    children.append({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": n.object_meta(n.sandboxes_name(job.name), namespace, labels, owner),
        "roleRef": dict(role_ref),
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
    })  # fmt: skip
    children.append({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": n.object_meta(n.sandboxes_name(job.name), namespace, labels, owner),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_JOB: job.name, LABEL_COMPONENT: COMPONENT}},
            "policyTypes": ["Ingress", "Egress"],  # and no rule: nothing in, nothing out
        },
    })  # fmt: skip
    return children


def trainer_pod_identity(job: RLJob) -> tuple[Manifest, list[Manifest]]:
    """The trainer pod spec's identity fields and the env of its own identity (downward API), when its
    sandboxes are pods: the account's token mounted, the pod's name, uid and namespace (the sandbox
    pods' owner reference and cleanup label). Empty otherwise."""
    if not pods_backend(job):
        return {}, []
    identity = {"serviceAccountName": trainer_service_account(job), "automountServiceAccountToken": True}
    env = [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
        for name, path in ((POD_NAME_ENV, "metadata.name"), (POD_UID_ENV, "metadata.uid"),
                           (NAMESPACE_ENV, "metadata.namespace"))  # fmt: skip
    ]
    return identity, env
