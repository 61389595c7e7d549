"""agent-sandbox: the `agent-sandbox` backend of `Sandbox` (RLJob rollout.sandbox.backend: agent-sandbox).

Where a cluster runs kubernetes-sigs/agent-sandbox (its controller and CRDs, agents.x-k8s.io and
extensions.agents.x-k8s.io v1beta1), the trainer gets its sandboxes through the project's Python SDK
(`k8s-agent-sandbox`, the `agent-sandbox` extra) instead of making pods itself:
- the RLJob names a SandboxTemplate (rollout.sandbox.template: the task image's pod template, which the
  cluster's owner writes); the trainer makes the SandboxWarmPool `<job>-sandboxes` of it if absent;
- one SandboxClaim per sandbox (an episode's, or its grading's) on that pool, owned by the trainer pod
  (an ownerReference: deleting the trainer pod, its StatefulSet or the RLJob garbage-collects the claims,
  and agent-sandbox's controller their sandboxes) and labelled with its name, so a restarted trainer
  deletes what its killed run left, as the pods backend does with its pods. The claim is made here
  (the SDK's `create_sandbox` takes no ownerReference), in the SDK's own shape; the SDK's K8sHelper
  waits for it (`wait_for_claim_ready`) and its `Sandbox` handle runs the commands; `close()` deletes it
  (the handle's `terminate`);
- every command through the SDK's `commands.run` (the sandbox runtime's HTTP API, reached in-cluster);
- the pool's replicas follow the sandboxes open now, as the pods backend's warm pool does
  (podspec.warm_pool_target, at most rollout.sandbox.warmPool), set through its scale subresource.

The SDK's `commands.run` takes no stdin: a command's stdin travels base64-encoded in its shell line.
"""

from __future__ import annotations

import base64
import math
import os
import secrets
import shlex
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from k8s_agent_sandbox.constants import (
    CLAIM_API_GROUP,
    CLAIM_API_VERSION,
    CLAIM_PLURAL_NAME,
    CLIENT_REQUEST_TIME_ANNOTATION,
    CREATED_BY_LABEL,
)
from k8s_agent_sandbox.k8s_helper import K8sHelper
from k8s_agent_sandbox.models import SandboxConnectionConfig, SandboxInClusterConnectionConfig
from k8s_agent_sandbox.sandbox import Sandbox as SdkSandbox
from kubernetes.client import ApiClient, ApiException

from rlfleet.sandbox import ExecSandbox, SandboxLimits, SandboxUnavailable
from rlfleet.sandbox.local import MAX_OUTPUT_BYTES
from rlfleet.sandbox.pods import _tar
from rlfleet.sandbox.podspec import (
    COMPONENT,
    LABEL_COMPONENT,
    LABEL_JOB,
    LABEL_OWNER,
    own_pod,
    owner_selector,
    sandbox_pod_name,
    warm_pool_target,
)

WARM_POOL_PLURAL = "sandboxwarmpools"
WARM_POOL_KIND = "SandboxWarmPool"
READY_TIMEOUT_S = 300
WORKDIR = "/tmp/rlfleet-work"  # made by each command: a SandboxTemplate's image need not have /work
EXEC_WRAPPER = (
    "mkdir -p {workdir} && cd {workdir} || exit 126; ulimit -t {cpu}; ulimit -n {files}; {stdin}{argv} 2>&1"
)


def warm_pool_name(job: str) -> str:
    return f"{job}-sandboxes"


def command_line(argv: list[str], stdin: bytes, limits: SandboxLimits, workdir: str = WORKDIR) -> str:
    """The one shell line `commands.run` gets: `argv` in the work dir under the limits, `stdin` decoded
    from base64 onto its standard input, stderr merged into stdout."""
    feed = f"printf %s {base64.b64encode(stdin).decode()} | base64 -d | " if stdin else "</dev/null "
    script = EXEC_WRAPPER.format(
        workdir=shlex.quote(workdir),
        cpu=int(limits.cpu_seconds),
        files=int(limits.open_files),
        stdin=feed,
        argv=shlex.join(argv),
    )
    return shlex.join(["sh", "-c", script])


class AgentSandboxes:
    """The factory of claimed sandboxes for one trainer pod: `(files, limits) -> AgentSandbox` (SweEnv's `sandbox`).
    Made at the trainer's start, before its first episode, it deletes every claim its trainer pod's previous
    run left (`removed_leftovers`)."""

    def __init__(
        self,
        namespace: str,
        job: str,
        template: str,
        warm_pool: int,
        owner_pod: str,
        owner_uid: str,
        api_client: ApiClient | None = None,
        connection: SandboxConnectionConfig | None = None,
        ready_timeout_s: int = READY_TIMEOUT_S,
        workdir: str = WORKDIR,
    ) -> None:
        """`owner_pod`, `owner_uid`: the trainer pod (every claim's owner and cleanup label).
        `api_client`: None in a pod (its ServiceAccount token), else one from a kubeconfig (tests).
        `connection`: how the SDK reaches a sandbox's runtime; default: in-cluster (the pod's IP).
        `workdir`: the repository's root inside each sandbox (made by every command)."""
        for what, value in (("namespace", namespace), ("owner_pod", owner_pod), ("owner_uid", owner_uid)):
            if not value:
                raise SandboxUnavailable(
                    f"rollout.sandbox.backend agent-sandbox: no {what} (the trainer pod's downward "
                    "API sets it)"
                )
        self.workdir = workdir
        self.namespace, self.job, self.template = namespace, job, template
        self.owner_pod, self.owner_uid = owner_pod, owner_uid
        self.max_warm = warm_pool
        self.ready_timeout_s = ready_timeout_s
        self.pool = warm_pool_name(job)
        self.connection = connection or SandboxInClusterConnectionConfig()
        self.k8s = K8sHelper(api_client=api_client)
        self.objects = self.k8s.custom_objects_api
        self._lock = threading.Lock()  # the open count and the pool's last scale
        self._open = 0
        self._replicas: int | None = None
        self._ensure_pool()
        self.removed_leftovers = self._delete_owned()

    @classmethod
    def from_environment(
        cls, spec: Any, job: str, environ: Mapping[str, str] | None = None
    ) -> AgentSandboxes:
        """In the trainer pod: the RLJob's rollout.sandbox (`spec`, rlfleet.api.SandboxSpec) and the pod's own
        identity from the downward API (the operator sets it for this backend as for the pods backend); the
        SDK authenticates with the pod's ServiceAccount token."""
        pod = own_pod("agent-sandbox", os.environ if environ is None else environ)
        return cls(pod.namespace, job, spec.template, spec.warm_pool, owner_pod=pod.name, owner_uid=pod.uid)

    def _claim_call(self, method: str, **kwargs: Any) -> Any:
        return self._custom_call(CLAIM_PLURAL_NAME, method, **kwargs)

    def _custom_call(self, plural: str, method: str, **kwargs: Any) -> Any:
        """`method` of the custom objects API on the job's namespace's `plural` (SandboxClaims, warm
        pools: both of the agent-sandbox extensions API group and version)."""
        return getattr(self.objects, method)(
            group=CLAIM_API_GROUP,
            version=CLAIM_API_VERSION,
            namespace=self.namespace,
            plural=plural,
            **kwargs,
        )

    def _delete_owned(self) -> list[str]:
        """Every claim of this trainer pod (a previous run's, after a restart): deleted now."""
        found = self._claim_call(
            "list_namespaced_custom_object", label_selector=owner_selector(self.owner_pod)
        )
        names = [c["metadata"]["name"] for c in found.get("items", [])]
        for name in names:
            self.k8s.delete_sandbox_claim(name, self.namespace)  # a 404 (gone meanwhile) is success
        return names

    def claim_manifest(self, name: str) -> dict[str, Any]:
        """One SandboxClaim on the job's pool: the SDK's own claim (`K8sHelper.create_sandbox_claim`: its label
        and request-time annotation, spec.warmPoolRef) plus the job's labels, the owner label and the
        ownerReference to the trainer pod."""
        return {
            "apiVersion": f"{CLAIM_API_GROUP}/{CLAIM_API_VERSION}",
            "kind": "SandboxClaim",
            "metadata": {
                "name": name,
                "annotations": {CLIENT_REQUEST_TIME_ANNOTATION: datetime.now(UTC).isoformat()},
                "labels": {
                    LABEL_JOB: self.job,
                    LABEL_COMPONENT: COMPONENT,
                    LABEL_OWNER: self.owner_pod,
                    CREATED_BY_LABEL: "python-client",
                },
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Pod", "name": self.owner_pod, "uid": self.owner_uid}
                ],
            },
            "spec": {"warmPoolRef": {"name": self.pool}},
        }

    def _pool_call(self, method: str, **kwargs: Any) -> Any:
        return self._custom_call(WARM_POOL_PLURAL, method, **kwargs)

    def _ensure_pool(self) -> None:
        """Make the SandboxWarmPool of the template (replicas 0), or check the one there names it."""
        body = {
            "apiVersion": f"{CLAIM_API_GROUP}/{CLAIM_API_VERSION}",
            "kind": WARM_POOL_KIND,
            "metadata": {"name": self.pool, "labels": {LABEL_JOB: self.job, LABEL_COMPONENT: COMPONENT}},
            "spec": {"replicas": 0, "sandboxTemplateRef": {"name": self.template}},
        }
        try:
            self._pool_call("create_namespaced_custom_object", body=body)
            self._replicas = 0
        except ApiException as e:
            if e.status == 404:
                raise SandboxUnavailable(
                    f"rollout.sandbox.backend agent-sandbox: the cluster has no {WARM_POOL_KIND} API "
                    f"({CLAIM_API_GROUP}/{CLAIM_API_VERSION}): install agent-sandbox's CRDs and controller"
                ) from None
            if e.status != 409:
                raise
            existing = self._pool_call("get_namespaced_custom_object", name=self.pool)
            named = existing.get("spec", {}).get("sandboxTemplateRef", {}).get("name")
            if named != self.template:
                raise SandboxUnavailable(
                    f"{WARM_POOL_KIND} {self.namespace}/{self.pool} exists for template {named!r}, "
                    f"not rollout.sandbox.template {self.template!r}: delete it or rename the job"
                ) from None

    def _scale(self) -> None:
        """Set the pool's replicas to the warm target of the sandboxes open now (under the lock)."""
        target = warm_pool_target(self._open, self.max_warm)
        if target != self._replicas:
            self._pool_call(
                "patch_namespaced_custom_object_scale", name=self.pool, body={"spec": {"replicas": target}}
            )
            self._replicas = target

    def claim(self) -> SdkSandbox:
        """One SandboxClaim on the pool, ready (the SDK's watch on the claim's Ready condition)."""
        with self._lock:
            self._open += 1
            self._scale()
        name = sandbox_pod_name(self.owner_pod, secrets.token_hex(4))
        uid: str | None = None
        try:
            created = self._claim_call("create_namespaced_custom_object", body=self.claim_manifest(name))
            uid = created["metadata"]["uid"]
            sandbox_id = self.k8s.wait_for_claim_ready(
                name,
                self.namespace,
                self.ready_timeout_s,
                resource_version=created["metadata"]["resourceVersion"],
                expected_uid=uid,
                initial_claim=created,
            )
            return SdkSandbox(
                claim_name=name,
                sandbox_id=sandbox_id,
                namespace=self.namespace,
                connection_config=self.connection,
                k8s_helper=self.k8s,
            )
        except BaseException as error:
            try:
                if uid is not None:  # only this claim (a precondition on its uid), never a namesake
                    self.k8s.delete_sandbox_claim(name, self.namespace, expected_uid=uid)
            finally:
                self.released()
            if isinstance(error, TimeoutError):
                raise SandboxUnavailable(
                    f"SandboxClaim on {WARM_POOL_KIND} {self.namespace}/{self.pool} (template {self.template}) was not "
                    f"ready within {self.ready_timeout_s}s: is agent-sandbox's controller running in the cluster?"
                ) from None
            raise

    def released(self) -> None:
        with self._lock:
            self._open -= 1
            self._scale()

    @property
    def open(self) -> int:
        return self._open

    def __call__(self, files: Mapping[str, str], limits: SandboxLimits) -> AgentSandbox:
        return AgentSandbox(self, files, limits)


class AgentSandbox(ExecSandbox):
    """One claimed sandbox: the snapshot in WORKDIR (a git commit), every call a `commands.run`."""

    def __init__(
        self, sandboxes: AgentSandboxes, files: Mapping[str, str], limits: SandboxLimits | None = None
    ) -> None:
        self.sandboxes = sandboxes
        self.limits = limits or SandboxLimits()
        self.seconds = 0.0
        t0 = time.monotonic()
        self.handle = sandboxes.claim()
        self.start_seconds = time.monotonic() - t0
        self.claim_name: str = self.handle.claim_name or ""  # the SDK clears it once deleted
        self.closed = False
        self.unpack_snapshot(
            _tar(files), ".", f"SandboxClaim {self.claim_name}"
        )  # commands run in the work dir

    def _run_command(self, argv: list[str], timeout: float, stdin: bytes) -> tuple[int, str, bool]:
        commands = self.handle.commands
        if commands is None:
            raise RuntimeError(f"SandboxClaim {self.claim_name}: the SDK's connection is closed")
        result = commands.run(
            command_line(argv, stdin, self.limits, self.sandboxes.workdir),
            timeout=math.ceil(timeout) + 30,
            command_timeout=timeout,
        )
        output = (result.stdout + result.stderr).encode()
        if len(output) > MAX_OUTPUT_BYTES:  # as the local sandbox keeps it: the first and last half
            half = MAX_OUTPUT_BYTES // 2
            output = (
                output[:half]
                + f"\n[... {len(output) - MAX_OUTPUT_BYTES} bytes omitted ...]\n".encode()
                + output[-half:]
            )
        code = -9 if result.timed_out else result.exit_code
        return code, output.decode("utf-8", errors="replace"), result.timed_out

    def _release(self) -> None:
        """Delete the SandboxClaim; agent-sandbox's controller deletes its sandbox with it."""
        try:
            self.handle.terminate()  # raises if the DELETE fails (a 404 is success)
        finally:
            self.sandboxes.released()
