"""PURE: the sandbox pod of the `pods` backend (rlfleet/sandbox/pods.py), its labels and the exec wrapper.

One pod per sandbox, in the trainer's namespace (docs/environments.md 'Sandboxes in a cluster'):
- owned by the trainer pod (an ownerReference the trainer learns from the downward API), so deleting
  the trainer pod, its StatefulSet or the RLJob garbage-collects it; labelled with the trainer pod's
  name, so a restarted trainer finds and deletes what its previous run left (`owner_selector`);
- no ServiceAccount token, no Service links, no DNS (nameserver 127.0.0.1), uid 10001 like every rlfleet
  pod, a read-only root with writable emptyDirs for the work dir and /tmp (size-limited), no privilege,
  CPU and memory limits equal to their requests, and activeDeadlineSeconds (the kubelet kills a pod the
  trainer lost track of). The job's NetworkPolicy `<job>-sandboxes` (operator/network_policies.py) denies
  its ingress and egress;
- pid 1 is a Python reaper (orphans of killed commands are reaped, not left as zombies).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlfleet.sandbox import SandboxLimits, SandboxUnavailable

GROUP = "rlfleet.dev"
LABEL_JOB = f"{GROUP}/job"  # = operator/naming.py LABEL_JOB (the NetworkPolicy selects on it)
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_OWNER = f"{GROUP}/sandbox-owner"  # the trainer pod's name: what a restarted trainer cleans up
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
COMPONENT = "sandbox"
MANAGED_BY = "rlfleet-trainer"  # not the operator's: its pod index watches only its own pods
UID = 10001  # operator/podspec.py NON_ROOT_UID: the one uid of every rlfleet image and pod
WORKDIR = "/work"
CONTAINER = "sandbox"
MAX_NAME = 63
# the trainer pod's identity, from the downward API (operator/sandboxes.py sets them)
POD_NAME_ENV, POD_UID_ENV, NAMESPACE_ENV = "RLFLEET_POD_NAME", "RLFLEET_POD_UID", "RLFLEET_POD_NAMESPACE"


@dataclass(frozen=True)
class OwnPod:
    """The trainer pod a sandbox backend runs in: what its sandboxes are owned by and live beside."""

    namespace: str
    name: str
    uid: str


def own_pod(backend: str, environ: Mapping[str, str]) -> OwnPod:
    """The trainer pod's identity from the downward API in `environ`; SandboxUnavailable naming the
    `backend` (rollout.sandbox.backend) and each variable unset."""
    missing = [k for k in (POD_NAME_ENV, POD_UID_ENV, NAMESPACE_ENV) if not environ.get(k)]
    if missing:
        raise SandboxUnavailable(
            f"rollout.sandbox.backend {backend}: the trainer does not know its own pod ({', '.join(missing)} unset; "
            "the operator sets them from the downward API)"
        )
    return OwnPod(environ[NAMESPACE_ENV], environ[POD_NAME_ENV], environ[POD_UID_ENV])


# pid 1: reaps every orphan (a killed command's children are re-parented to it), exits on SIGTERM
REAPER = """import os, signal, time
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(1)
"""


@dataclass(frozen=True)
class SandboxPodConfig:
    """What every sandbox pod of one trainer shares (the RLJob's rollout.sandbox and the trainer's
    identity from the downward API)."""

    namespace: str
    job: str
    owner_pod: str  # the trainer pod's name and uid: the ownerReference, and the cleanup label
    owner_uid: str
    image: str
    runtime_class_name: str | None = None
    cpu: str = "1"
    memory: str = "2Gi"
    work_dir_size: str = "1Gi"
    max_seconds: int = 3600
    node_selector: Mapping[str, str] = field(default_factory=dict)
    image_pull_policy: str = "IfNotPresent"
    warm_pool: int = 0  # most idle pods kept started ahead of demand (warm_pool_target); 0: none

    def __post_init__(self) -> None:
        for what, value in (
            ("namespace", self.namespace),
            ("job", self.job),
            ("owner_pod", self.owner_pod),
            ("owner_uid", self.owner_uid),
            ("image", self.image),
        ):
            if not value:
                raise ValueError(f"a sandbox pod needs its {what} (the trainer pod's downward API sets it)")


def warm_pool_target(open_sandboxes: int, maximum: int) -> int:
    """Idle pods to keep started: one per open sandbox, at most `maximum`. An open sandbox is an
    in-flight episode's, and each such episode soon asks for one more pod: its grading's at submit,
    or its successor's when it ends; so the pool follows the in-flight episodes up and down."""
    return max(0, min(maximum, open_sandboxes))


def sandbox_labels(config: SandboxPodConfig) -> dict[str, str]:
    return {
        LABEL_COMPONENT: COMPONENT,
        LABEL_JOB: config.job,
        LABEL_OWNER: config.owner_pod,
        LABEL_MANAGED_BY: MANAGED_BY,
    }


def owner_selector(owner_pod: str) -> str:
    """The label selector of every sandbox pod one trainer pod made (its runs, the current one included)."""
    return f"{LABEL_COMPONENT}={COMPONENT},{LABEL_OWNER}={owner_pod}"


def sandbox_pod_name(owner_pod: str, suffix: str) -> str:
    """<trainer pod>-sbx-<suffix>, the trainer's name cut so the whole stays a DNS label."""
    tail = f"-sbx-{suffix}"
    return f"{owner_pod[: MAX_NAME - len(tail)].rstrip('-')}{tail}"


def build_sandbox_pod(config: SandboxPodConfig, name: str) -> dict[str, Any]:
    """The pod manifest of one sandbox."""
    resources = {"cpu": config.cpu, "memory": config.memory}
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "activeDeadlineSeconds": config.max_seconds,
        "terminationGracePeriodSeconds": 0,
        "hostname": "sandbox",
        # no cluster DNS: a name never resolves (the NetworkPolicy is what denies egress; this is the
        # second line where the CNI does not enforce policies)
        "dnsPolicy": "None",
        "dnsConfig": {"nameservers": ["127.0.0.1"]},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": UID,
            "runAsGroup": UID,
            "fsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": CONTAINER,
                "image": config.image,
                "imagePullPolicy": config.image_pull_policy,
                "command": ["python3", "-c", REAPER],
                "workingDir": WORKDIR,
                "env": [
                    {"name": "HOME", "value": "/tmp"},
                    {"name": "LANG", "value": "C.UTF-8"},
                    {"name": "GIT_CONFIG_NOSYSTEM", "value": "1"},
                    # the emptyDir at /work is root's (group 10001): git refuses a repository its user
                    # does not own unless safe.directory says so, which only protected configuration
                    # may (GIT_CONFIG_* is the command-line scope)
                    {"name": "GIT_CONFIG_COUNT", "value": "1"},
                    {"name": "GIT_CONFIG_KEY_0", "value": "safe.directory"},
                    {"name": "GIT_CONFIG_VALUE_0", "value": WORKDIR},
                    {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
                ],
                "resources": {"requests": dict(resources), "limits": dict(resources)},
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                    "readOnlyRootFilesystem": True,
                    "runAsNonRoot": True,
                },
                "volumeMounts": [
                    {"name": "work", "mountPath": WORKDIR},
                    {"name": "tmp", "mountPath": "/tmp"},
                ],
            }
        ],
        "volumes": [
            {"name": "work", "emptyDir": {"sizeLimit": config.work_dir_size}},
            {"name": "tmp", "emptyDir": {"sizeLimit": config.work_dir_size}},
        ],
    }
    if config.runtime_class_name:
        spec["runtimeClassName"] = config.runtime_class_name
    if config.node_selector:
        spec["nodeSelector"] = dict(config.node_selector)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": config.namespace,
            "labels": sandbox_labels(config),
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Pod", "name": config.owner_pod, "uid": config.owner_uid}
            ],
        },
        "spec": spec,
    }


# Every exec runs through this wrapper: per-process rlimits (CPU seconds, open files), stdin as exactly
# $1 bytes (`head -c`: the exec stream's stdin cannot be half-closed on every API server version), the
# command through `sh -c` in the work dir, then every other process of the container killed (pid 1, the
# reaper, is spared by kill -1): nothing a command starts outlives it, as in the local sandbox.
EXEC_WRAPPER = (
    "n=$1; shift; cd {workdir} || exit 126; ulimit -t {cpu}; ulimit -n {files}; "
    'if [ "$n" -gt 0 ]; then head -c "$n" | "$@"; else "$@" </dev/null; fi; '
    "rc=$?; kill -9 -1 2>/dev/null; exit $rc"
)


def exec_argv(argv: list[str], stdin_bytes: int, limits: SandboxLimits) -> list[str]:
    """The exec command of `argv` with `stdin_bytes` of stdin to follow on the stream."""
    script = EXEC_WRAPPER.format(
        workdir=shlex.quote(WORKDIR), cpu=int(limits.cpu_seconds), files=int(limits.open_files)
    )
    return ["sh", "-c", script, "sandbox", str(int(stdin_bytes)), *argv]


KILL_ARGV = ["sh", "-c", "kill -9 -1 2>/dev/null; exit 0"]
"""What a timed-out command gets: every process of the container but pid 1 (and this shell) killed."""
