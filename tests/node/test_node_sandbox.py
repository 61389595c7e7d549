"""Sandbox pods (rollout.sandbox.backend pods, rlfleet/sandbox/pods.py) on the dev cluster's real node.

The "trainer" here is this test process (and a child process it kills): it talks to the real API server
with the token of the ServiceAccount the operator's builders make, bound by the operator's RoleBinding
to the sandbox role's exact rules (operator/sandboxes.py), so every call below also proves those rights
suffice. Its "trainer pod" is a real pod (the sandboxes' owner). The sandbox image is the CPU base plus
git (tests/cluster/nodeimages.py sandbox_image). No rlfleet image is needed:
`RLFLEET_DEV_CLUSTER_IMAGES= pytest tests/node/test_node_sandbox.py` skips their builds.

Egress: the node enforces NetworkPolicy (kube-router's firewall beside the bridge CNI, realnode.py). What
is shown here: the job's policy is accepted by the API server and selects exactly the sandbox pods; a
sandbox pod cannot open a TCP connection to an IP address (another pod's, the API server's on the node),
while a control pod, the same pod spec less the policy's labels, connects to both; the pods have no
resolver (no name resolves: dnsPolicy None, nameserver 127.0.0.1) and no ServiceAccount token.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nodeimages
import pytest
import yaml
from support.control_plane import applies_children_by_bind_alone, fresh_namespace
from support.manifests import pod_manifest
from support.waits import wait_for

from rlfleet.api import RLJob
from rlfleet.operator import sandboxes
from rlfleet.sandbox import SandboxLimits
from rlfleet.sandbox.pods import PodSandboxes
from rlfleet.sandbox.podspec import CONTAINER, SandboxPodConfig, build_sandbox_pod, owner_selector

pytestmark = [pytest.mark.node, pytest.mark.cluster, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
UID = 10001
ROLE = "rlfleet-sandboxes"


@dataclass
class Trainer:
    """A namespace set up as the operator does for a job with sandbox pods, and the trainer's side."""

    namespace: str
    job: RLJob
    kubeconfig: Path  # the trainer ServiceAccount's token
    image: str
    kube: Any

    def config(self, owner: str, **extra: Any) -> SandboxPodConfig:
        uid = self.kube.get_json("pod", owner, "-n", self.namespace)["metadata"]["uid"]
        return SandboxPodConfig(
            namespace=self.namespace,
            job=self.job.name,
            owner_pod=owner,
            owner_uid=uid,
            image=self.image,
            image_pull_policy="Never",
            cpu="500m",
            memory="256Mi",
            node_selector={"rlfleet.dev/dev-node": "true"},
            max_seconds=600,
            **extra,
        )

    @contextmanager
    def sandboxes(self, owner: str, **extra: Any) -> Iterator[PodSandboxes]:
        """The trainer's sandbox factory for pods owned by `owner` (`extra`: more config fields), shut down
        when the block ends."""
        factory = PodSandboxes(self.config(owner, **extra), kubeconfig=str(self.kubeconfig))
        try:
            yield factory
        finally:
            factory.shutdown()

    def pods(self, selector: str) -> set[str]:
        got = self.kube.get_json("pods", "-n", self.namespace, "-l", selector)["items"]
        return {p["metadata"]["name"] for p in got if not p["metadata"].get("deletionTimestamp")}

    def owner_pod(self, name: str) -> str:
        """A running pod standing for the trainer pod (the sandboxes' owner)."""
        body = pod_manifest(
            name,
            nodeSelector={"rlfleet.dev/dev-node": "true"},
            restartPolicy="Never",
            terminationGracePeriodSeconds=0,
            containers=[
                {
                    "name": "trainer",
                    "image": nodeimages.HELPER_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sleep", "86400"],
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": UID,
                        "allowPrivilegeEscalation": False,
                    },
                }
            ],
        )
        self.kube.kubectl("apply", "-n", self.namespace, "-f", "-", input=json.dumps(body))
        self.kube.kubectl(
            "wait",
            "-n",
            self.namespace,
            "--for=jsonpath={.status.phase}=Running",
            f"pod/{name}",
            "--timeout=180s",
        )
        return name


@pytest.fixture(scope="module")
def trainer(dev_cluster, tmp_path_factory) -> Iterator[Trainer]:
    kube = dev_cluster.kube
    built = nodeimages.sandbox_image(
        log=lambda msg: print(f"[sandbox-image] {msg}", file=sys.stderr, flush=True)
    )
    dev_cluster.node.load_images([built])
    raw = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())
    raw["metadata"]["name"] = "swe"
    raw["spec"]["rollout"]["sandbox"] = {"backend": "pods", "image": built.ref}
    job = RLJob.model_validate(raw)
    with fresh_namespace(kube, "sbx", ready_s=60) as namespace:
        # what the operator applies for this job (and what the chart installs as the role), as a Role here
        role_ref = sandboxes.parse_role_ref(f"Role/{ROLE}")
        objects = [
            sandboxes.build_sandbox_role(ROLE, namespace),
            *sandboxes.build_sandbox_children(job, namespace, None, role_ref),
        ]
        kube.kubectl(
            "apply", "-n", namespace, "-f", "-", input="\n---\n".join(json.dumps(o) for o in objects)
        )
        token = kube.kubectl(
            "create", "token", sandboxes.trainer_service_account(job), "-n", namespace, "--duration=2h"
        ).stdout.strip()
        kubeconfig = kube.token_kubeconfig(token, tmp_path_factory.mktemp("trainer") / "kubeconfig")
        yield Trainer(namespace, job, kubeconfig, built.ref, kube)


def test_commands_files_limits_and_the_diff_in_a_real_sandbox_pod(trainer: Trainer) -> None:
    owner = trainer.owner_pod("swe-trainer-0")
    files = {"calc/ops.py": "def add(a, b):\n    return a - b\n", "README.md": "calc\n"}
    with trainer.sandboxes(owner) as factory:
        box = factory(files, SandboxLimits(max_timeout_s=30))
        pod = trainer.kube.get_json("pod", box.name, "-n", trainer.namespace)
        assert pod["metadata"]["ownerReferences"][0]["name"] == owner
        assert pod["status"]["phase"] == "Running"
        # exit codes and output (stdout and stderr), in the snapshot's root, as uid 10001
        result = box.run("cat calc/ops.py; echo oops >&2; exit 3", timeout_s=30)
        assert (result.exit_code, result.timed_out) == (3, False)
        assert "return a - b" in result.output and "oops" in result.output
        assert box.run("id -u; pwd", timeout_s=30).output.split() == [str(UID), "/work"]
        # stdin of any size on the exec stream
        assert box.run("wc -c", timeout_s=30, stdin=b"x" * 300_000).output.strip() == "300000"
        # a read-only root, no ServiceAccount token, no resolver
        assert "Read-only file system" in box.run("touch /usr/x", timeout_s=30).output
        assert box.run("ls /var/run/secrets/kubernetes.io", timeout_s=30).exit_code != 0
        resolve = box.run(
            "python3 -c \"import socket; socket.getaddrinfo('kubernetes.default.svc.cluster.local', 443)\"",
            timeout_s=30,
        )
        assert resolve.exit_code != 0 and "gaierror" in resolve.output, resolve.output
        # the pod's limits are its cgroup's (v2 or v1)
        limits = box.run(
            textwrap.dedent("""\
            python3 - <<'EOF'
            from pathlib import Path
            v2 = Path('/sys/fs/cgroup/memory.max')
            if v2.exists():
                quota, period = Path('/sys/fs/cgroup/cpu.max').read_text().split()
                print(v2.read_text().strip(), quota, period)
            else:
                cg = Path('/sys/fs/cgroup')
                print((cg / 'memory/memory.limit_in_bytes').read_text().strip(),
                      (cg / 'cpu/cpu.cfs_quota_us').read_text().strip(), (cg / 'cpu/cpu.cfs_period_us').read_text().strip())
            EOF"""),
            timeout_s=30,
        )
        assert limits.output.split() == [str(256 << 20), "50000", "100000"], limits.output
        # memory beyond the limit: the kernel kills the command, the sandbox lives on
        oom = box.run("python3 -c 'b = bytearray(512 << 20); print(len(b))'", timeout_s=30)
        assert oom.exit_code == 137 and not oom.timed_out, oom
        # a command past its timeout is killed with everything it started; background processes of a
        # command that returned are killed too
        slow = box.run("sleep 100 & sleep 100", timeout_s=2)
        assert (slow.exit_code, slow.timed_out) == (-9, True)
        assert box.run("sleep 200 &", timeout_s=30).exit_code == 0
        left = box.run(
            "python3 -c \"import os; print([open(f'/proc/{p}/cmdline').read() for p in os.listdir('/proc')"
            " if p.isdigit() and open(f'/proc/{p}/cmdline').read().startswith('sleep')])\"",
            timeout_s=30,
        )
        assert left.output.strip() == "[]", left.output
        # files through exec, and the diff applies in a fresh sandbox pod from the snapshot
        box.write_file("calc/ops.py", box.read_file("calc/ops.py").replace("a - b", "a + b"))
        box.write_file("calc/new.py", "X = 1\n")
        diff = box.diff()
        assert "-    return a - b" in diff and "+    return a + b" in diff and "b/calc/new.py" in diff
        with factory(files, SandboxLimits()) as fresh:
            assert fresh.run("git apply --binary -", timeout_s=30, stdin=diff.encode()).exit_code == 0
            assert fresh.read_file("calc/ops.py") == "def add(a, b):\n    return a + b\n"
            assert (
                fresh.run("python3 -c 'import calc.new as n; print(n.X)'", timeout_s=30).output.strip() == "1"
            )
        # close() deletes the pod
        name = box.name
        box.close()
        box.close()  # idempotent
        wait_for(
            f"sandbox pod {name} deleted",
            lambda: name not in trainer.pods(owner_selector(owner)) or None,
            timeout=60,
        )
        assert trainer.pods(owner_selector(owner)) == set()  # the fresh one too


TRAINER_SCRIPT = """
import json, sys, time
from rlfleet.sandbox import SandboxLimits
from rlfleet.sandbox.podspec import SandboxPodConfig
from rlfleet.sandbox.pods import PodSandboxes

config = SandboxPodConfig(**json.loads(sys.argv[1]))
factory = PodSandboxes(config, kubeconfig=sys.argv[2])
boxes = [factory({"a.py": "A = 1\\n"}, SandboxLimits()) for _ in range(2)]
print(json.dumps([b.name for b in boxes]), flush=True)
time.sleep(3600)
"""


def test_a_restarted_trainer_deletes_what_its_killed_run_left(trainer: Trainer) -> None:
    owner = trainer.owner_pod("swe-trainer-1")
    config = trainer.config(owner)
    payload = {k: v for k, v in config.__dict__.items()} | {"node_selector": dict(config.node_selector)}
    proc = subprocess.Popen(
        [sys.executable, "-I", "-c", TRAINER_SCRIPT, json.dumps(payload), str(trainer.kubeconfig)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line, f"the trainer process exited ({proc.wait()}) before it made its sandboxes"
        names = set(json.loads(line))
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # no close(), no finalizer: as a killed trainer
        proc.wait()
    assert len(names) == 2 and trainer.pods(owner_selector(owner)) == names  # left behind
    with trainer.sandboxes(owner) as factory:  # the restarted trainer
        assert set(factory.removed_leftovers) == names
        wait_for(
            "the killed run's sandbox pods gone",
            lambda: not trainer.pods(owner_selector(owner)) or None,
            timeout=60,
        )


def test_deleting_the_trainer_pod_deletes_its_sandbox_pods(trainer: Trainer) -> None:
    owner = trainer.owner_pod("swe-trainer-2")
    with trainer.sandboxes(owner) as factory:
        box = factory({"a.py": "A = 1\n"}, SandboxLimits())
        assert trainer.pods(owner_selector(owner)) == {box.name}
        trainer.kube.kubectl("delete", "pod", owner, "-n", trainer.namespace, "--wait=false")
        # the garbage collector follows the ownerReference (the RLJob -> StatefulSet -> trainer pod chain
        # ends here)
        wait_for(
            "the sandbox pod garbage-collected",
            lambda: not trainer.pods(owner_selector(owner)) or None,
            timeout=120,
        )
        box.close()  # already gone: still fine


def test_the_network_policy_selects_exactly_the_sandbox_pods(trainer: Trainer) -> None:
    owner = trainer.owner_pod("swe-trainer-3")
    with trainer.sandboxes(owner) as factory:
        with factory({"a.py": "A = 1\n"}, SandboxLimits()) as box:
            policy = trainer.kube.get_json(
                "networkpolicy", f"{trainer.job.name}-sandboxes", "-n", trainer.namespace
            )
            assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
            assert not policy["spec"].get("egress") and not policy["spec"].get("ingress")
            selector = ",".join(f"{k}={v}" for k, v in policy["spec"]["podSelector"]["matchLabels"].items())
            assert trainer.pods(selector) == {box.name}  # not the trainer (owner) pod, nothing else


# One TCP connection attempt to argv[1]:argv[2]: "connected", or "failed: <errno name or error type> <message>".
CONNECT = """
import errno, socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()
    print("connected")
except OSError as err:
    print("failed:", errno.errorcode.get(err.errno or 0, type(err).__name__), err)
"""
SERVER_PORT = 8080


def _node_filter_table() -> str:
    """The node's iptables filter table, where kube-router names each pod it firewalls
    (`name:<pod> namespace: <namespace>`)."""
    return subprocess.run(
        ["iptables-save", "-t", "filter"], capture_output=True, text=True, check=True
    ).stdout


def test_a_sandbox_pod_cannot_connect_to_an_ip_address_a_control_pod_reaches(trainer: Trainer) -> None:
    """The policy enforced: TCP to a pod's IP and to the API server's (a host process on the node's
    bridge address) fails from the sandbox pod, and succeeds from a control pod in the same namespace built
    by the same builder, less the labels the policy selects on (before and after the sandbox's attempts)."""
    kube, namespace = trainer.kube, trainer.namespace
    owner = trainer.owner_pod("swe-trainer-6")
    server = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "tcp-server"},
        "spec": {
            "nodeSelector": {"rlfleet.dev/dev-node": "true"},
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "server",
                    "image": trainer.image,
                    "imagePullPolicy": "Never",
                    "command": ["python3", "-m", "http.server", str(SERVER_PORT), "--directory", "/tmp"],
                    "readinessProbe": {"tcpSocket": {"port": SERVER_PORT}, "periodSeconds": 1},
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": UID,
                        "allowPrivilegeEscalation": False,
                    },
                }
            ],
        },
    }
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(server))
    kube.kubectl("wait", "-n", namespace, "--for=condition=Ready", "pod/tcp-server", "--timeout=180s")
    api_server = urllib.parse.urlsplit(kube.server)
    targets = [
        (kube.get_json("pod", "tcp-server", "-n", namespace)["status"]["podIP"], SERVER_PORT),
        (api_server.hostname, api_server.port),
    ]
    config = trainer.config(owner)
    factory = PodSandboxes(config, kubeconfig=str(trainer.kubeconfig))
    try:
        created = time.monotonic()
        with factory({"a.py": "A = 1\n"}, SandboxLimits()) as box:
            policy = kube.get_json("networkpolicy", f"{trainer.job.name}-sandboxes", "-n", namespace)
            selected = policy["spec"]["podSelector"]["matchLabels"]
            control = build_sandbox_pod(config, f"{owner}-control")
            control["metadata"]["labels"] = {
                k: v for k, v in control["metadata"]["labels"].items() if k not in selected
            }
            kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(control))
            kube.kubectl(
                "wait",
                "-n",
                namespace,
                "--for=jsonpath={.status.phase}=Running",
                f"pod/{owner}-control",
                "--timeout=180s",
            )
            selector = ",".join(f"{k}={v}" for k, v in selected.items())
            assert trainer.pods(selector) == {box.name}  # the control pod is not the policy's
            wait_for(
                f"the node's firewall for {box.name}",
                lambda: f"name:{box.name} namespace: {namespace}" in _node_filter_table(),
                timeout=60,
            )
            print(
                f"the sandbox pod firewalled {time.monotonic() - created:.1f}s after its creation began",
                file=sys.stderr,
            )

            def from_control(ip: str, port: int) -> str:
                return kube.kubectl(
                    "exec",
                    "-n",
                    namespace,
                    f"{owner}-control",
                    "-c",
                    CONTAINER,
                    "--",
                    "python3",
                    "-c",
                    CONNECT,
                    ip,
                    str(port),
                ).stdout.strip()

            assert [from_control(*t) for t in targets] == ["connected"] * len(targets), targets
            from_sandbox = [
                box.run(f"python3 -c {shlex.quote(CONNECT)} {ip} {port}", timeout_s=30).output.strip()
                for ip, port in targets
            ]
            print(f"the sandbox pod's connections to {targets}: {from_sandbox}", file=sys.stderr)
            # kube-router REJECTs what no policy allows (ICMP port unreachable: connection refused at once)
            assert [r.split()[:2] for r in from_sandbox] == [["failed:", "ECONNREFUSED"]] * len(targets), (
                from_sandbox
            )
            assert [from_control(*t) for t in targets] == ["connected"] * len(targets), targets  # still up
    finally:
        factory.shutdown()
        kube.kubectl(
            "delete", "pod", "tcp-server", f"{owner}-control", "-n", namespace, "--wait=false", check=False
        )


def test_the_warm_pool_follows_the_open_sandboxes(trainer: Trainer) -> None:
    owner = trainer.owner_pod("swe-trainer-4")
    files = {"a.py": "A = 1\n"}
    with trainer.sandboxes(owner, warm_pool=2) as factory:

        def idle_when(count: int, open_now: int) -> list[str] | None:
            idle, warming, opened = factory.pool()
            return idle if (len(idle), warming, opened) == (count, 0, open_now) else None

        assert factory.pool() == ([], 0, 0)  # nothing open: nothing started ahead
        first = factory(files, SandboxLimits())
        assert not first.warm  # a cold start
        (idle,) = wait_for("one idle pod for one open sandbox", lambda: idle_when(1, 1), timeout=180)
        assert trainer.pods(owner_selector(owner)) == {first.name, idle}
        second = factory(files, SandboxLimits())
        assert second.warm and second.name == idle  # the pool's pod, with this sandbox's snapshot
        assert second.read_file("a.py") == "A = 1\n" and second.diff() == ""
        # two open: two idle (the pool's maximum)
        two = wait_for("two idle pods for two open sandboxes", lambda: idle_when(2, 2), timeout=180)
        assert trainer.pods(owner_selector(owner)) == {first.name, second.name, *two}
        first.close()
        (kept,) = wait_for("one idle pod for one open sandbox", lambda: idle_when(1, 1), timeout=60)
        second.close()
        wait_for("no idle pod for no open sandbox", lambda: idle_when(0, 0) is not None, timeout=60)
        wait_for(
            "every pod of the pool deleted",
            lambda: not trainer.pods(owner_selector(owner)) or None,
            timeout=60,
        )
        assert kept in two


def test_the_shipped_tasks_earn_their_reward_in_sandbox_pods(trainer: Trainer) -> None:
    """SweEnv with sandbox pods, through the rollout driver's episode loop (as `rlfleet env try`): the
    scripted correct policy earns 1 on every shipped task, graded in a fresh pod; an endless loop is
    killed at its timeout and the episode goes on to its end (0: nothing changed)."""
    from rlfleet.trainer.env_try import ScriptedSampler, byte_chat_tokenizer, load_policy, try_episodes
    from rlfleet.trainer.envs.swe_env import SweEnv, load_tasks
    from rlfleet.trainer.envs.swe_tasks import tool_call

    owner = trainer.owner_pod("swe-trainer-5")
    with trainer.sandboxes(owner, warm_pool=1) as factory:
        tokenizer = byte_chat_tokenizer()
        env = SweEnv(tokenizer, sandbox=factory, grade_timeout_s=60)
        tasks = load_tasks(REPO / "examples" / "swe" / "tasks.jsonl")
        policy = load_policy(REPO / "examples" / "swe" / "solutions.jsonl")
        prompts = [env.prompt(task, index=i) for i, task in enumerate(tasks)]
        replies = {i: policy[t.instance_id] for i, t in enumerate(tasks)}
        loop = [tool_call("bash", command="while :; do :; done", timeout=3), tool_call("submit")]
        replies[len(tasks)] = loop
        prompts.append(env.prompt(tasks[0], index=len(tasks)))
        lines = try_episodes(env, prompts, ScriptedSampler(tokenizer, replies))
        assert [(line["task"], line["reward"]) for line in lines[:-1]] == [
            (t.instance_id, 1.0) for t in tasks
        ], lines
        assert (lines[-1]["reward"], lines[-1]["reason"], lines[-1]["turns"]) == (
            0.0,
            "submitted an empty diff",
            2,
        )
        wait_for("no sandbox pod open after the episodes", lambda: factory.pool()[2] == 0 or None, timeout=30)
    wait_for("every sandbox pod deleted", lambda: not trainer.pods(owner_selector(owner)) or None, timeout=60)


def test_the_operator_grants_the_sandbox_role_by_bind_alone(trainer: Trainer, tmp_path: Path) -> None:
    """The chart's grants for sandbox pods (tests/ship/test_ship_chart.py pins them), as a Role here:
    serviceaccounts and rolebindings create/patch and `bind` on the sandbox role. With them an account
    holding none of the role's rights (no pods/exec) applies the operator's ServiceAccount and RoleBinding
    by server-side apply; without `bind` the API server refuses the RoleBinding (it would grant rights the
    account does not hold)."""
    kube, namespace = trainer.kube, trainer.namespace
    raw = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())
    raw["metadata"]["name"] = "swe-granted"
    raw["spec"]["rollout"]["sandbox"] = {"backend": "pods", "image": trainer.image}
    job = RLJob.model_validate(raw)
    children = [
        c
        for c in sandboxes.build_sandbox_children(
            job, namespace, None, sandboxes.parse_role_ref(f"Role/{ROLE}")
        )
        if c["kind"] in ("ServiceAccount", "RoleBinding")
    ]  # the policy: networkpolicies, granted apart
    assert [c["kind"] for c in children] == ["ServiceAccount", "RoleBinding"]
    operator_env = applies_children_by_bind_alone(kube, namespace, children, ROLE, tmp_path)
    binding = kube.get_json("rolebinding", "swe-granted-sandboxes", "-n", namespace)
    assert binding["roleRef"]["name"] == ROLE and binding["subjects"][0]["name"] == "swe-granted-trainer"
    can_exec = subprocess.run(
        [str(kube.kubectl_bin), "auth", "can-i", "create", "pods", "--subresource=exec", "-n", namespace],
        env=operator_env,
        text=True,
        capture_output=True,
        timeout=60,
    )
    assert can_exec.stdout.strip() == "no"  # it granted what it does not hold
