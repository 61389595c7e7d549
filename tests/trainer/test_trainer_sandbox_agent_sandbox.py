"""The agent-sandbox backend (rlfleet/sandbox/agent_sandbox.py) as far as agent-sandbox runs here.

Here: the SDK (`k8s-agent-sandbox`, the `agent-sandbox` extra) against the real test control plane with
agent-sandbox's own CRDs installed (tests/trainer/agent_sandbox/crds, from kubernetes-sigs/agent-sandbox at
2fd412d5, its helm/crds), and its own example runtime server (tests/trainer/agent_sandbox/runtime_main.py,
examples/python-runtime-sandbox/main.py of the same commit) on this machine. NOT here: agent-sandbox's
controller (Go; the module proxy refuses sigs.k8s.io/agent-sandbox), so no SandboxClaim ever becomes ready
by itself: the test that runs commands writes the claim's Ready status itself, as the controller would,
and the runtime runs the commands on this machine, not in a sandbox pod. The control plane runs
kube-controller-manager, so its garbage collector follows the claims' ownerReference to the trainer pod.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from support import waits
from support.control_plane import applies_children_by_bind_alone
from support.manifests import pod_manifest
from support.ports import free_port

from rlfleet.sandbox import SandboxLimits, SandboxUnavailable
from rlfleet.sandbox.agent_sandbox import AgentSandboxes, command_line

HERE = Path(__file__).resolve().parent / "agent_sandbox"
GROUP, VERSION = "extensions.agents.x-k8s.io", "v1beta1"
wait_for = functools.partial(waits.wait_for, timeout=30.0, interval=0.05)


def test_the_command_line_carries_stdin_and_merges_stderr_through_a_real_shell(tmp_path: Path) -> None:
    """What the runtime gets: one line it splits with shlex and runs (its /execute); here a real sh runs it."""
    work = tmp_path / "w o r k"
    line = command_line(
        ["sh", "-c", 'cat > "$1"; echo out; echo err >&2; exit 3', "sh", "f.txt"],
        b"a'b\n\x00c",
        SandboxLimits(),
        str(work),
    )
    done = subprocess.run(shlex.split(line), capture_output=True, timeout=30)
    assert done.returncode == 3 and done.stdout == b"out\nerr\n" and done.stderr == b""
    assert (work / "f.txt").read_bytes() == b"a'b\n\x00c"  # made the work dir, ran in it, stdin byte-exact
    quiet = subprocess.run(
        shlex.split(command_line(["cat"], b"", SandboxLimits(), str(work))), capture_output=True, timeout=30
    )
    assert quiet.returncode == 0 and quiet.stdout == b""  # no stdin: /dev/null, never the runtime's own


def test_from_environment_says_what_is_missing() -> None:
    class Spec:
        template, warm_pool = "t", 0

    with pytest.raises(SandboxUnavailable, match=r"does not know its own pod \(RLFLEET_POD_UID unset"):
        AgentSandboxes.from_environment(
            Spec(), "j", environ={"RLFLEET_POD_NAME": "p", "RLFLEET_POD_NAMESPACE": "n"}
        )


@pytest.fixture(scope="module")
def crds(kube) -> None:
    kube.kubectl("apply", "--server-side", "-f", str(HERE / "crds"))
    for plural in ("sandboxclaims", "sandboxwarmpools"):
        kube.kubectl("wait", "--for=condition=Established", f"crd/{plural}.{GROUP}", "--timeout=60s")


def trainer_pod(kube, namespace: str, name: str) -> str:
    """A pod standing for the trainer pod (the claims' owner; never scheduled: no node matches); its uid."""
    body = pod_manifest(
        name,
        nodeSelector={"rlfleet.dev/no-such-node": "true"},
        containers=[{"name": "trainer", "image": "registry.example/trainer:1"}],
    )
    kube.apply(body, namespace=namespace)
    return str(kube.get_json("pod", name, "-n", namespace)["metadata"]["uid"])


def job_sandboxes(kube, namespace: str, **options: Any) -> AgentSandboxes:
    """Job "j"'s sandboxes on the python-task template, owned by a trainer pod "j-trainer-0" made here."""
    uid = trainer_pod(kube, namespace, "j-trainer-0")
    return AgentSandboxes(
        namespace,
        "j",
        "python-task",
        owner_pod="j-trainer-0",
        owner_uid=uid,
        api_client=kube.api_client(),
        **options,
    )


def owned_claims(api: Any, namespace: str, owner: str) -> set[str]:
    """The claims labelled with `owner` (the trainer pod), not yet being deleted."""
    found = api.list_namespaced_custom_object(
        GROUP,
        VERSION,
        namespace,
        "sandboxclaims",
        label_selector=f"app.kubernetes.io/component=sandbox,rlfleet.dev/sandbox-owner={owner}",
    )
    return {c["metadata"]["name"] for c in found["items"] if not c["metadata"].get("deletionTimestamp")}


def objects(kube) -> Any:
    from kubernetes import client

    return client.CustomObjectsApi(kube.api_client())


def claims(api: Any, namespace: str) -> list[dict[str, Any]]:
    return api.list_namespaced_custom_object(GROUP, VERSION, namespace, "sandboxclaims")["items"]


def replicas(api: Any, namespace: str, pool: str) -> int:
    scale = api.get_namespaced_custom_object_scale(GROUP, VERSION, namespace, "sandboxwarmpools", pool)
    return int(scale["spec"].get("replicas", 0))  # a Scale's spec leaves 0 out


@pytest.mark.cluster
def test_a_claim_that_never_gets_ready_fails_naming_the_controller_and_is_deleted(
    kube, crds, namespace: str
) -> None:
    api = objects(kube)
    boxes = job_sandboxes(kube, namespace, warm_pool=4, ready_timeout_s=4)
    assert boxes.removed_leftovers == []
    pool = api.get_namespaced_custom_object(GROUP, VERSION, namespace, "sandboxwarmpools", "j-sandboxes")
    assert pool["spec"] == {"replicas": 0, "sandboxTemplateRef": {"name": "python-task"}}
    assert pool["metadata"]["labels"] == {"rlfleet.dev/job": "j", "app.kubernetes.io/component": "sandbox"}

    errors: list[BaseException] = []

    def episode() -> None:
        try:
            boxes({"a.py": "x = 1\n"}, SandboxLimits())
        except BaseException as e:  # noqa: BLE001 - the main thread asserts on it
            errors.append(e)

    thread = threading.Thread(target=episode)
    thread.start()
    (claim,) = wait_for("the claim", lambda: claims(api, namespace))
    # the SDK's claim on the job's warm pool, labelled as the SDK labels it and with the job and the owner,
    # owned by the trainer pod
    assert claim["spec"] == {"warmPoolRef": {"name": "j-sandboxes"}}
    assert claim["metadata"]["name"].startswith("j-trainer-0-sbx-")
    assert claim["metadata"]["labels"] == {
        "rlfleet.dev/job": "j",
        "app.kubernetes.io/component": "sandbox",
        "rlfleet.dev/sandbox-owner": "j-trainer-0",
        "agents.x-k8s.io/created-by": "python-client",
    }
    assert claim["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "j-trainer-0", "uid": boxes.owner_uid}
    ]
    assert "agents.x-k8s.io/client-first-requested-at" in claim["metadata"]["annotations"]
    assert replicas(api, namespace, "j-sandboxes") == 1  # one sandbox open: one warm one ahead of it
    thread.join(timeout=60)
    assert not thread.is_alive()
    (error,) = errors
    assert isinstance(error, SandboxUnavailable)
    message = str(error)
    assert (
        "\n" not in message and "not ready within 4s" in message and "agent-sandbox's controller" in message
    )
    assert claims(api, namespace) == []  # the claim deleted
    assert replicas(api, namespace, "j-sandboxes") == 0 and boxes.open == 0


@pytest.mark.cluster
def test_a_pool_of_another_template_is_refused(kube, crds, namespace: str) -> None:
    owner = {"owner_pod": "j-trainer-0", "owner_uid": trainer_pod(kube, namespace, "j-trainer-0")}
    AgentSandboxes(namespace, "j", "python-task", warm_pool=1, api_client=kube.api_client(), **owner)
    with pytest.raises(
        SandboxUnavailable, match="exists for template 'python-task', not rollout.sandbox.template 'go-task'"
    ):
        AgentSandboxes(namespace, "j", "go-task", warm_pool=1, api_client=kube.api_client(), **owner)


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[str]:
    """agent-sandbox's example runtime (its /execute runs shlex.split(command) in SANDBOX_BASE_DIR) on a port here."""
    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("multipart") is None:
        pytest.skip("the example runtime needs fastapi and python-multipart")
    port = free_port()
    base = tmp_path / "runtime"
    base.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "runtime_main:app", "--host", "127.0.0.1", "--port", str(port)],
        cwd=HERE,
        env={"PATH": "/usr/bin:/bin", "SANDBOX_BASE_DIR": str(base), "HOME": str(tmp_path)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:

        def up() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return True
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                return False

        wait_for("the runtime", up)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def play_controller(api: Any, namespace: str, sandbox: str) -> None:
    """What agent-sandbox's controller does once a claim's sandbox is up: status.sandbox.name and Ready."""
    (claim,) = wait_for("the claim", lambda: claims(api, namespace))
    ready(api, namespace, claim, sandbox)


def play_controller_of(api: Any, namespace: str, owner: str, sandbox: str) -> None:
    """play_controller for the one claim of trainer pod `owner`."""
    (name,) = wait_for("the claim", lambda: owned_claims(api, namespace, owner))
    ready(
        api,
        namespace,
        api.get_namespaced_custom_object(GROUP, VERSION, namespace, "sandboxclaims", name),
        sandbox,
    )


def ready(api: Any, namespace: str, claim: dict[str, Any], sandbox: str) -> None:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    claim["status"] = {
        "sandbox": {"name": sandbox},
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "SandboxReady",
                "message": "",
                "lastTransitionTime": now,
            }
        ],
    }
    api.replace_namespaced_custom_object_status(
        GROUP, VERSION, namespace, "sandboxclaims", claim["metadata"]["name"], claim
    )


@pytest.mark.cluster
def test_an_episode_runs_through_the_sdk_and_close_deletes_its_claim(
    kube, crds, namespace: str, runtime: str, tmp_path: Path
) -> None:
    from k8s_agent_sandbox.models import SandboxDirectConnectionConfig

    api = objects(kube)
    work = tmp_path / "runtime" / "repo"
    boxes = job_sandboxes(
        kube,
        namespace,
        warm_pool=4,
        connection=SandboxDirectConnectionConfig(api_url=runtime),
        ready_timeout_s=30,
        workdir=str(work),
    )
    controller = threading.Thread(target=play_controller, args=(api, namespace, "sbx-1"))
    controller.start()
    box = boxes({"pkg/a.py": "x = 1\n", "README": "hi\n"}, SandboxLimits())
    controller.join(timeout=30)
    (claim,) = claims(api, namespace)
    assert claim["metadata"]["name"] == box.claim_name and replicas(api, namespace, "j-sandboxes") == 1
    assert box.read_file("pkg/a.py") == "x = 1\n"
    box.write_file("pkg/b.py", "y = 'two'\n")
    result = box.run(
        "python3 -c 'import sys; print(sys.stdin.read().upper())'; echo e >&2; exit 5",
        timeout_s=30,
        stdin=b"in",
    )
    assert (result.exit_code, result.output, result.timed_out) == (5, "IN\ne\n", False)
    diff = box.diff()
    assert "+++ b/pkg/b.py" in diff and "+y = 'two'" in diff and "a.py" not in diff
    with pytest.raises(FileNotFoundError):
        box.read_file("nope.txt")
    box.close()
    assert claims(api, namespace) == [] and boxes.open == 0
    assert replicas(api, namespace, "j-sandboxes") == 0
    box.close()  # idempotent


@pytest.mark.cluster
def test_the_trainer_builds_the_backend_from_the_rljob(kube, crds, namespace: str, monkeypatch) -> None:
    """rollout.sandbox.backend agent-sandbox -> trainer/config.py build_environment -> the job's warm pool."""
    import yaml
    from chat_tokenizer import build_chat_tokenizer

    from rlfleet.api import RLJob
    from rlfleet.trainer.config import build_environment, resolve_run

    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "rljob.yaml").read_text())
    raw["spec"]["rollout"]["environment"] = "rlfleet.trainer.envs.swe_env:SweEnv"
    raw["spec"]["rollout"]["sandbox"] = {"backend": "agent-sandbox", "template": "python-task", "warmPool": 3}
    rc = resolve_run(RLJob.model_validate(raw), local=False)
    # the SDK's own client: in a pod, its ServiceAccount token; here the test cluster's kubeconfig, which
    # `kubernetes` reads from KUBECONFIG once, at its import (before this test)
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(kube.kubeconfig))
    monkeypatch.setenv("RLFLEET_POD_NAMESPACE", namespace)
    monkeypatch.setenv("RLFLEET_POD_NAME", "t-trainer-0")  # the operator's downward API
    monkeypatch.setenv("RLFLEET_POD_UID", trainer_pod(kube, namespace, "t-trainer-0"))
    env = build_environment(rc, tokenizer=build_chat_tokenizer())
    assert isinstance(env.sandbox, AgentSandboxes) and env.sandbox.max_warm == 3
    assert (env.sandbox.owner_pod, env.sandbox.namespace) == ("t-trainer-0", namespace)
    pool = objects(kube).get_namespaced_custom_object(
        GROUP, VERSION, namespace, "sandboxwarmpools", f"{rc.job_name}-sandboxes"
    )
    assert pool["spec"]["sandboxTemplateRef"] == {"name": "python-task"}


@pytest.mark.cluster
def test_deleting_the_trainer_pod_garbage_collects_its_claims(kube, crds, namespace: str) -> None:
    """The claim's ownerReference: kube-controller-manager's garbage collector deletes a claim whose trainer
    pod is gone (the RLJob -> StatefulSet -> trainer pod chain ends here; agent-sandbox's controller then
    deletes the claim's sandbox)."""
    api = objects(kube)
    boxes = job_sandboxes(kube, namespace, warm_pool=1, ready_timeout_s=60)
    controller = threading.Thread(target=play_controller, args=(api, namespace, "sbx-1"))
    controller.start()
    handle = boxes.claim()  # ready: the SDK's handle (no command runs here)
    controller.join(timeout=30)
    assert owned_claims(api, namespace, "j-trainer-0") == {handle.claim_name}
    kube.kubectl("delete", "pod", "j-trainer-0", "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for("the claim garbage-collected", lambda: not claims(api, namespace), timeout=120)


TRAINER = """
import json, sys, threading
from kubernetes import config
from rlfleet.sandbox.agent_sandbox import AgentSandboxes

args = json.loads(sys.argv[1])
boxes = AgentSandboxes(args["namespace"], "swe-claims", "python-task", warm_pool=2, owner_pod=args["owner"],
                       owner_uid=args["uid"], api_client=config.new_client_from_config(config_file=args["kubeconfig"]),
                       ready_timeout_s=3600)
for _ in range(2):  # two episodes waiting for their sandboxes (no controller here: they wait until killed)
    threading.Thread(target=boxes.claim, daemon=True).start()
threading.Event().wait()
"""


@pytest.mark.cluster
def test_a_restarted_trainer_deletes_the_claims_its_killed_run_left_with_the_operators_grant(
    kube, crds, namespace: str, tmp_path: Path
) -> None:
    """The trainer authenticates as the ServiceAccount the operator makes, bound by the operator's RoleBinding
    to the agent-sandbox role's exact rules (operator/sandboxes.py AGENT_SANDBOX_RULES, here as a Role), so
    every call below (the pool made and read, its scale patched, claims made, watched, listed and deleted)
    also proves those rights suffice."""
    import yaml
    from kubernetes import config

    from rlfleet.api import RLJob
    from rlfleet.operator import sandboxes

    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "rljob.yaml").read_text())
    raw["metadata"]["name"] = "swe-claims"
    raw["spec"]["rollout"]["sandbox"] = {"backend": "agent-sandbox", "template": "python-task"}
    job = RLJob.model_validate(raw)
    role = sandboxes.build_sandbox_role("agent-sandboxes", namespace, backend="agent-sandbox")
    granted = [
        role,
        *sandboxes.build_sandbox_children(
            job, namespace, None, sandboxes.parse_role_ref("Role/agent-sandboxes")
        ),
    ]
    assert [o["kind"] for o in granted] == ["Role", "ServiceAccount", "RoleBinding"]
    kube.kubectl("apply", "-n", namespace, "-f", "-", input="\n---\n".join(json.dumps(o) for o in granted))
    token = kube.kubectl(
        "create", "token", sandboxes.trainer_service_account(job), "-n", namespace, "--duration=1h"
    ).stdout.strip()
    kubeconfig = kube.token_kubeconfig(token, tmp_path / "trainer.kubeconfig")
    api = objects(kube)
    uid = trainer_pod(kube, namespace, "swe-claims-trainer-0")
    # another trainer pod's claim: not this trainer's to delete
    other = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "SandboxClaim",
        "metadata": {
            "name": "other",
            "labels": {
                "app.kubernetes.io/component": "sandbox",
                "rlfleet.dev/sandbox-owner": "swe-claims-trainer-1",
            },
        },
        "spec": {"warmPoolRef": {"name": "swe-claims-sandboxes"}},
    }
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "sandboxclaims", other)
    args = {
        "namespace": namespace,
        "owner": "swe-claims-trainer-0",
        "uid": uid,
        "kubeconfig": str(kubeconfig),
    }
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, json.dumps(args)], stderr=subprocess.PIPE)

    def two_claims() -> set[str] | None:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else proc.returncode
        ids = owned_claims(api, namespace, "swe-claims-trainer-0")
        return ids if len(ids) == 2 else None

    try:
        left = wait_for("the killed run's two claims", two_claims, timeout=60)
        assert replicas(api, namespace, "swe-claims-sandboxes") == 2  # scaled by the trainer, as its account
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # no close(), no finalizer: as a killed trainer
        proc.wait()
    assert owned_claims(api, namespace, "swe-claims-trainer-0") == left  # left behind
    restarted = AgentSandboxes(
        namespace,
        "swe-claims",
        "python-task",
        warm_pool=2,
        owner_pod="swe-claims-trainer-0",
        owner_uid=uid,
        api_client=config.new_client_from_config(config_file=str(kubeconfig)),
        ready_timeout_s=60,
    )
    assert set(restarted.removed_leftovers) == left
    wait_for("the killed run's claims gone", lambda: not owned_claims(api, namespace, "swe-claims-trainer-0"))
    assert {c["metadata"]["name"] for c in claims(api, namespace)} == {"other"}
    # the restarted trainer's own episode, as the same account: claimed, awaited, closed
    controller = threading.Thread(
        target=play_controller_of, args=(api, namespace, "swe-claims-trainer-0", "sbx-2")
    )
    controller.start()
    handle = restarted.claim()
    controller.join(timeout=30)
    assert replicas(api, namespace, "swe-claims-sandboxes") == 1
    handle.terminate()
    restarted.released()
    assert owned_claims(api, namespace, "swe-claims-trainer-0") == set()
    assert replicas(api, namespace, "swe-claims-sandboxes") == 0


@pytest.mark.cluster
def test_the_operator_grants_the_agent_sandbox_role_by_bind_alone(
    kube, crds, namespace: str, tmp_path: Path
) -> None:
    """The chart's grants (serviceaccounts and rolebindings create/patch, `bind` on the agent-sandbox role;
    as a Role here) let an account holding none of the role's rights apply the operator's ServiceAccount and
    RoleBinding for a job with backend agent-sandbox by server-side apply; without `bind` the API server
    refuses the RoleBinding (it would grant rights the account does not hold)."""
    import yaml

    from rlfleet.api import RLJob
    from rlfleet.operator import sandboxes

    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "rljob.yaml").read_text())
    raw["metadata"]["name"] = "swe-granted"
    raw["spec"]["rollout"]["sandbox"] = {"backend": "agent-sandbox", "template": "python-task"}
    job = RLJob.model_validate(raw)
    kube.apply(
        sandboxes.build_sandbox_role("agent-sandboxes", namespace, backend="agent-sandbox"),
        namespace=namespace,
    )
    children = sandboxes.build_sandbox_children(
        job, namespace, None, sandboxes.parse_role_ref("Role/agent-sandboxes")
    )
    assert [c["kind"] for c in children] == [
        "ServiceAccount",
        "RoleBinding",
    ]  # no NetworkPolicy for this backend
    applies_children_by_bind_alone(kube, namespace, children, "agent-sandboxes", tmp_path)
    binding = kube.get_json("rolebinding", "swe-granted-sandboxes", "-n", namespace)
    assert (
        binding["roleRef"]["name"] == "agent-sandboxes"
        and binding["subjects"][0]["name"] == "swe-granted-trainer"
    )
