"""PURE: what a job whose sandboxes are in the cluster (RLJob rollout.sandbox.backend: pods or
agent-sandbox) adds to its children.

The trainer makes and deletes its sandboxes itself (rlfleet/sandbox/pods.py: pods it execs into;
rlfleet/sandbox/agent_sandbox.py: SandboxClaims of kubernetes-sigs/agent-sandbox), so only then does it get
API rights, and only its backend's, in its own namespace:
- a ServiceAccount `<job>-trainer` (unless the user names one in trainer.serviceAccountName), its token
  mounted in the trainer pods, and the trainer pod's name, uid and namespace from the downward API (its
  sandboxes' ownerReference and cleanup label);
- a RoleBinding `<job>-sandboxes` of that account to the backend's role, which the chart installs: for
  pods SANDBOX_RULES (pods create, delete, get, list; pods/exec create, get), a ClusterRole
  `<release>-<namespace>-sandboxes` (or in namespace mode a Role `<release>-sandboxes` in each watched
  namespace) named to the operator by RLFLEET_SANDBOX_ROLE (`ClusterRole/<name>` / `Role/<name>`); for
  agent-sandbox AGENT_SANDBOX_RULES (what the backend and the SDK call: sandboxclaims create, delete,
  list, watch; sandboxwarmpools create, get; sandboxwarmpools/scale patch; sandboxes get), the role
  `...-agent-sandboxes` named by RLFLEET_AGENT_SANDBOX_ROLE. A RoleBinding confines a ClusterRole to its
  own namespace, and the operator needs only `bind` on those roles to grant them, never the rights
  themselves (it holds no pods/exec, no agent-sandbox API);
- with pods, a NetworkPolicy `<job>-sandboxes`: the sandbox pods get no ingress and no egress at all (the
  API server's exec reaches them through the kubelet, not the pod network). Made whenever the backend is
  pods, whether or not the operator's other policies are on (networkPolicy.enabled). agent-sandbox's
  sandbox pods are its SandboxTemplate's, and so is their network policy.
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
AGENT_ROLE_ENV = "RLFLEET_AGENT_SANDBOX_ROLE"
DEFAULT_AGENT_ROLE = "ClusterRole/rlfleet-agent-sandboxes"
SANDBOX_RULES: list[Manifest] = [
    # create a sandbox pod, wait for it (get), delete it; list: a restarted trainer finds its old ones
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "delete", "get", "list"]},
    # exec is a websocket GET upgraded to a stream: authorized as `get` (websocket) or `create` (SPDY/POST)
    {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create", "get"]},
]
# Every call of rlfleet/sandbox/agent_sandbox.py and of the SDK paths it takes (k8s-agent-sandbox 1.0.8):
AGENT_SANDBOX_RULES: list[Manifest] = [
    # a claim made (create), awaited (the SDK's watch: list + watch, by field selector), deleted at close;
    # list: a restarted trainer finds its old ones (by label) and deletes them
    {"apiGroups": ["extensions.agents.x-k8s.io"], "resources": ["sandboxclaims"],
     "verbs": ["create", "delete", "list", "watch"]},
    # the job's warm pool made at the trainer's start, or read (get) if there to check its template
    {"apiGroups": ["extensions.agents.x-k8s.io"], "resources": ["sandboxwarmpools"], "verbs": ["create", "get"]},
    # its replicas set through the scale subresource (a merge patch)
    {"apiGroups": ["extensions.agents.x-k8s.io"], "resources": ["sandboxwarmpools/scale"], "verbs": ["patch"]},
    # the SDK's in-cluster connection reads the claim's Sandbox for the pod's IP
    {"apiGroups": ["agents.x-k8s.io"], "resources": ["sandboxes"], "verbs": ["get"]},
]  # fmt: skip
# backend -> (the operator's setting naming its role, the default, the role's rules)
BACKEND_ROLES: dict[str, tuple[str, str, list[Manifest]]] = {
    "pods": (ROLE_ENV, DEFAULT_ROLE, SANDBOX_RULES),
    "agent-sandbox": (AGENT_ROLE_ENV, DEFAULT_AGENT_ROLE, AGENT_SANDBOX_RULES),
}


def pods_backend(job: RLJob) -> bool:
    return job.spec.rollout.sandbox.backend == "pods"


def cluster_backend(job: RLJob) -> bool:
    """The trainer makes its sandboxes through the API (pods or agent-sandbox): it gets an account and a role."""
    return job.spec.rollout.sandbox.backend in BACKEND_ROLES


def role_ref_from_env(environ: Mapping[str, str] | None = None, backend: str = "pods") -> Manifest:
    """The roleRef of `backend`'s sandbox RoleBinding: `Kind/name` from its setting (RLFLEET_SANDBOX_ROLE,
    RLFLEET_AGENT_SANDBOX_ROLE: the chart sets them)."""
    env = os.environ if environ is None else environ
    variable, default, _ = BACKEND_ROLES[backend]
    return parse_role_ref(env.get(variable, "").strip() or default, variable)


def role_refs_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Manifest]:
    """Every cluster backend's roleRef (backend -> roleRef), read once at the operator's start."""
    return {backend: role_ref_from_env(environ, backend) for backend in BACKEND_ROLES}


def parse_role_ref(value: str, variable: str = ROLE_ENV) -> Manifest:
    kind, sep, name = value.partition("/")
    if not sep or kind not in ("ClusterRole", "Role") or not name:
        raise ValueError(f"{variable}: expected ClusterRole/<name> or Role/<name>, got {value!r}")
    return {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name}


def trainer_service_account(job: RLJob) -> str:
    return job.spec.trainer.service_account_name or n.trainer_service_account_name(job.name)


def build_sandbox_role(name: str, namespace: str | None = None, backend: str = "pods") -> Manifest:
    """`backend`'s sandbox role itself (a ClusterRole, or a Role in `namespace`): what the chart installs."""
    meta: Manifest = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role" if namespace else "ClusterRole",
        "metadata": meta,
        "rules": [dict(r) for r in BACKEND_ROLES[backend][2]],
    }


def build_sandbox_children(
    job: RLJob, namespace: str, owner: Manifest | None, role_ref: Manifest | None = None
) -> list[Manifest]:
    """The ServiceAccount (when the user names none), the RoleBinding to `role_ref` (the job's backend's
    role; None: that backend's default) and, for pods, the NetworkPolicy; none unless the job's sandboxes
    are in the cluster."""
    if not cluster_backend(job):
        return []
    role_ref = role_ref or parse_role_ref(BACKEND_ROLES[job.spec.rollout.sandbox.backend][1])
    labels = n.job_labels(job.name, "sandbox")
    account = trainer_service_account(job)
    children: list[Manifest] = []
    if job.spec.trainer.service_account_name is None:
        children.append(
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": n.object_meta(account, namespace, n.job_labels(job.name, "trainer"), owner),
                "automountServiceAccountToken": False,  # mounted by the trainer pods alone (pod_identity)
            }
        )
    children.append(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": n.object_meta(n.sandboxes_name(job.name), namespace, labels, owner),
            "roleRef": dict(role_ref),
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
        }
    )
    if not pods_backend(job):
        return children
    children.append(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": n.object_meta(n.sandboxes_name(job.name), namespace, labels, owner),
            "spec": {
                "podSelector": {"matchLabels": {LABEL_JOB: job.name, LABEL_COMPONENT: COMPONENT}},
                "policyTypes": ["Ingress", "Egress"],  # and no rule: nothing in, nothing out
            },
        }
    )
    return children


def trainer_pod_identity(job: RLJob) -> tuple[Manifest, list[Manifest]]:
    """The trainer pod spec's identity fields and the env of its own identity (downward API), when its
    sandboxes are in the cluster: the account's token mounted, the pod's name, uid and namespace (the
    sandboxes' owner reference and cleanup label). Empty otherwise."""
    if not cluster_backend(job):
        return {}, []
    identity = {"serviceAccountName": trainer_service_account(job), "automountServiceAccountToken": True}
    env = [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
        for name, path in (
            (POD_NAME_ENV, "metadata.name"),
            (POD_UID_ENV, "metadata.uid"),
            (NAMESPACE_ENV, "metadata.namespace"),
        )
    ]
    return identity, env
