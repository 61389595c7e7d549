"""Sandboxes in the cluster (rollout.sandbox.backend pods, agent-sandbox): the trainer's account, its
RoleBinding to the backend's role, the sandbox pods' NetworkPolicy (pods only) and the trainer pod's
identity; nothing of it otherwise."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from support.control_plane import role_grants
from test_operator_builders import CATALOG, NS, OWNER, REPO  # the builder tests' one copy

from rlfleet.api import RLJob
from rlfleet.operator import builders, sandboxes
from rlfleet.sandbox.podspec import SandboxPodConfig, build_sandbox_pod

ROLE_REF = {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "ops-sandboxes"}
AGENT_ROLE_REF = {
    "apiGroup": "rbac.authorization.k8s.io",
    "kind": "ClusterRole",
    "name": "ops-agent-sandboxes",
}


def job_with(sandbox: dict[str, Any] | None = None, **trainer: Any) -> RLJob:
    raw = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())
    if sandbox is not None:
        raw["spec"]["rollout"]["sandbox"] = sandbox
    raw["spec"]["trainer"].update(trainer)
    return RLJob.model_validate(raw)


def children(job: RLJob) -> dict[tuple[str, str], dict[str, Any]]:
    out = builders.build_job_children(
        job, NS, OWNER, CATALOG, sandbox_roles={"pods": ROLE_REF, "agent-sandbox": AGENT_ROLE_REF}
    )
    return {(c["kind"], c["metadata"]["name"]): c for c in out}


def trainer_pod(kids: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    return kids[("StatefulSet", "reference-fleet-trainer")]["spec"]["template"]["spec"]


PODS = {"backend": "pods", "image": "registry.example/sandbox:1"}
AGENT = {"backend": "agent-sandbox", "template": "swe-python"}


def test_local_sandboxes_give_the_trainer_no_api_rights() -> None:
    kids = children(job_with())
    assert not [k for k in kids if k[0] in ("ServiceAccount", "RoleBinding", "Role")]
    assert ("NetworkPolicy", "reference-fleet-sandboxes") not in kids
    pod = trainer_pod(kids)
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    env = {e["name"] for e in pod["containers"][0]["env"]}
    assert not env & {"RLFLEET_POD_NAME", "RLFLEET_POD_UID", "RLFLEET_POD_NAMESPACE"}


def test_sandbox_pods_bind_the_trainers_own_account_to_the_sandbox_role() -> None:
    kids = children(job_with(PODS))
    account = kids[("ServiceAccount", "reference-fleet-trainer")]
    assert account["metadata"]["namespace"] == NS
    assert account["metadata"]["ownerReferences"][0]["uid"] == "u-1"  # goes with the RLJob
    binding = kids[("RoleBinding", "reference-fleet-sandboxes")]
    assert binding["apiVersion"] == "rbac.authorization.k8s.io/v1"
    assert binding["metadata"]["namespace"] == NS  # a RoleBinding: the role's rights in this namespace only
    assert binding["roleRef"] == ROLE_REF
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "reference-fleet-trainer", "namespace": NS}
    ]
    pod = trainer_pod(kids)
    assert pod["serviceAccountName"] == "reference-fleet-trainer"
    assert pod["automountServiceAccountToken"] is True
    env = {e["name"]: e.get("valueFrom") for e in pod["containers"][0]["env"]}
    assert env["RLFLEET_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["RLFLEET_POD_UID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert env["RLFLEET_POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


def test_agent_sandbox_binds_the_trainers_own_account_to_the_agent_sandbox_role() -> None:
    kids = children(job_with(AGENT))
    assert kids[("ServiceAccount", "reference-fleet-trainer")]["metadata"]["namespace"] == NS
    binding = kids[("RoleBinding", "reference-fleet-sandboxes")]
    assert binding["metadata"]["namespace"] == NS and binding["roleRef"] == AGENT_ROLE_REF
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "reference-fleet-trainer", "namespace": NS}
    ]
    # agent-sandbox's sandbox pods are its SandboxTemplate's: their network policy is the template's
    assert ("NetworkPolicy", "reference-fleet-sandboxes") not in kids
    pod = trainer_pod(kids)
    assert (pod["serviceAccountName"], pod["automountServiceAccountToken"]) == (
        "reference-fleet-trainer",
        True,
    )
    env = {e["name"]: e.get("valueFrom") for e in pod["containers"][0]["env"]}
    assert env["RLFLEET_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}  # the claims' owner
    assert env["RLFLEET_POD_UID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert env["RLFLEET_POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    named = children(job_with(AGENT, serviceAccountName="team-trainer"))
    assert not [k for k in named if k[0] == "ServiceAccount"]
    assert named[("RoleBinding", "reference-fleet-sandboxes")]["subjects"][0]["name"] == "team-trainer"


def test_without_settings_each_backend_binds_its_default_role() -> None:
    for sandbox, name in ((PODS, "rlfleet-sandboxes"), (AGENT, "rlfleet-agent-sandboxes")):
        kids = builders.build_job_children(job_with(sandbox), NS, OWNER, CATALOG)
        assert [c["roleRef"]["name"] for c in kids if c["kind"] == "RoleBinding"] == [name]


def test_a_user_named_account_is_bound_and_not_created() -> None:
    kids = children(job_with(PODS, serviceAccountName="team-trainer"))
    assert not [k for k in kids if k[0] == "ServiceAccount"]
    binding = kids[("RoleBinding", "reference-fleet-sandboxes")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "team-trainer", "namespace": NS}]
    assert trainer_pod(kids)["serviceAccountName"] == "team-trainer"


def test_the_sandbox_role_is_exactly_pods_and_their_exec() -> None:
    role = sandboxes.build_sandbox_role("rlfleet-sandboxes")
    assert role["kind"] == "ClusterRole"
    assert role_grants(role) == {
        ("", "pods", "create"),
        ("", "pods", "delete"),
        ("", "pods", "get"),
        ("", "pods", "list"),
        ("", "pods/exec", "create"),
        ("", "pods/exec", "get"),
    }
    assert sandboxes.build_sandbox_role("s", namespace="team-a")["kind"] == "Role"


def test_the_agent_sandbox_role_is_exactly_what_the_backend_and_the_sdk_call() -> None:
    role = sandboxes.build_sandbox_role("rlfleet-agent-sandboxes", backend="agent-sandbox")
    granted = role_grants(role)
    ext = "extensions.agents.x-k8s.io"
    assert granted == {
        (ext, "sandboxclaims", "create"),
        (ext, "sandboxclaims", "delete"),
        (ext, "sandboxclaims", "list"),
        (ext, "sandboxclaims", "watch"),
        (ext, "sandboxwarmpools", "create"),
        (ext, "sandboxwarmpools", "get"),
        (ext, "sandboxwarmpools/scale", "patch"),
        ("agents.x-k8s.io", "sandboxes", "get"),
    }


def test_the_policy_denies_every_sandbox_pod_all_traffic() -> None:
    job = job_with(PODS)
    policy = children(job)[("NetworkPolicy", "reference-fleet-sandboxes")]
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert "ingress" not in policy["spec"] and "egress" not in policy["spec"]  # no rule: nothing allowed
    # it selects the pods the trainer makes (rlfleet/sandbox/podspec.py), and only this job's
    pod = build_sandbox_pod(
        SandboxPodConfig(
            namespace=NS, job=job.name, owner_pod="reference-fleet-trainer-0", owner_uid="p-1", image="x"
        ),
        "s-1",
    )
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    other = build_sandbox_pod(
        SandboxPodConfig(namespace=NS, job="other", owner_pod="other-trainer-0", owner_uid="p-2", image="x"),
        "s-2",
    )
    assert not selector.items() <= other["metadata"]["labels"].items()


def test_the_policy_does_not_wait_for_the_operators_other_policies() -> None:
    kids = builders.build_job_children(job_with(PODS), NS, OWNER, CATALOG, network=None)
    assert [c["kind"] for c in kids].count("NetworkPolicy") == 1


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "rlfleet-sandboxes"}),
        (
            "Role/my-sandboxes",
            {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "my-sandboxes"},
        ),
    ],
)
def test_the_role_comes_from_the_operators_settings(value: str | None, expected: dict[str, str]) -> None:
    env = {} if value is None else {"RLFLEET_SANDBOX_ROLE": value}
    assert sandboxes.role_ref_from_env(env) == expected


def test_the_agent_sandbox_role_comes_from_its_own_setting() -> None:
    refs = sandboxes.role_refs_from_env(
        {"RLFLEET_AGENT_SANDBOX_ROLE": "Role/agents", "RLFLEET_SANDBOX_ROLE": "Role/pods"}
    )
    assert refs == {
        "pods": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pods"},
        "agent-sandbox": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "agents"},
    }
    assert sandboxes.role_refs_from_env({})["agent-sandbox"]["name"] == "rlfleet-agent-sandboxes"
    with pytest.raises(ValueError, match="RLFLEET_AGENT_SANDBOX_ROLE"):
        sandboxes.role_refs_from_env({"RLFLEET_AGENT_SANDBOX_ROLE": "agents"})


@pytest.mark.parametrize("value", ["rlfleet-sandboxes", "Deployment/x", "Role/"])
def test_a_bad_role_setting_names_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match="RLFLEET_SANDBOX_ROLE"):
        sandboxes.role_ref_from_env({"RLFLEET_SANDBOX_ROLE": value})


def test_the_api_refuses_sandbox_pods_without_an_image() -> None:
    with pytest.raises(ValueError, match="rollout.sandbox.image"):
        job_with({"backend": "pods"})


def test_the_documented_role_is_the_one_the_operator_binds() -> None:
    text = (REPO / "docs" / "environments.md").read_text()
    block = text.split("`build_sandbox_role`):\n\n```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(block) == sandboxes.build_sandbox_role("rlfleet-sandboxes")


def test_the_documented_agent_sandbox_role_is_the_one_the_operator_binds() -> None:
    text = (REPO / "docs" / "environments.md").read_text()
    block = text.split('backend="agent-sandbox")`):\n\n  ```yaml\n', 1)[1].split("```", 1)[0]
    assert yaml.safe_load(block) == sandboxes.build_sandbox_role(
        "rlfleet-agent-sandboxes", backend="agent-sandbox"
    )
