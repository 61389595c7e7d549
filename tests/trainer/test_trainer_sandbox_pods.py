"""The sandbox pod (rlfleet/sandbox/podspec.py) and the pods backend's pure parts; the backend itself
runs against a real node in tests/node/test_node_sandbox.py."""

from __future__ import annotations

import io
import tarfile
from dataclasses import replace

import pytest

from rlfleet.sandbox import SandboxLimits
from rlfleet.sandbox.local import MAX_OUTPUT_BYTES
from rlfleet.sandbox.pods import SandboxPodError, _BoundedOutput, _tar, exit_code
from rlfleet.sandbox.podspec import (
    SandboxPodConfig,
    build_sandbox_pod,
    exec_argv,
    owner_selector,
    sandbox_pod_name,
    warm_pool_target,
)

CONFIG = SandboxPodConfig(
    namespace="team-a",
    job="j",
    owner_pod="j-trainer-0",
    owner_uid="uid-1",
    image="registry.example/sandbox:1",
    cpu="500m",
    memory="1Gi",
    work_dir_size="2Gi",
    max_seconds=900,
)


def test_the_pod_runs_without_token_or_privilege_on_a_read_only_root() -> None:
    pod = build_sandbox_pod(CONFIG, "j-trainer-0-sbx-ab12")
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "j-trainer-0-sbx-ab12" and meta["namespace"] == "team-a"
    assert meta["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "j-trainer-0", "uid": "uid-1"}
    ]
    assert meta["labels"] == {
        "app.kubernetes.io/component": "sandbox",
        "rlfleet.dev/job": "j",
        "rlfleet.dev/sandbox-owner": "j-trainer-0",
        "app.kubernetes.io/managed-by": "rlfleet-trainer",
    }
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    assert spec["activeDeadlineSeconds"] == 900 and spec["restartPolicy"] == "Never"
    assert spec["dnsPolicy"] == "None" and spec["dnsConfig"] == {"nameservers": ["127.0.0.1"]}
    assert spec["securityContext"]["runAsUser"] == 10001 and spec["securityContext"]["runAsNonRoot"] is True
    assert "runtimeClassName" not in spec and "serviceAccountName" not in spec
    (container,) = spec["containers"]
    assert container["image"] == "registry.example/sandbox:1"
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
    }
    assert container["resources"] == {
        "requests": {"cpu": "500m", "memory": "1Gi"},
        "limits": {"cpu": "500m", "memory": "1Gi"},
    }
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts == {"/work": "work", "/tmp": "tmp"}  # the only writable paths
    assert spec["volumes"] == [
        {"name": "work", "emptyDir": {"sizeLimit": "2Gi"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "2Gi"}},
    ]


def test_the_runtime_class_and_node_selector_are_the_jobs() -> None:
    config = replace(CONFIG, runtime_class_name="gvisor", node_selector={"pool": "cpu"})
    spec = build_sandbox_pod(config, "j-trainer-0-sbx-1")["spec"]
    assert spec["runtimeClassName"] == "gvisor" and spec["nodeSelector"] == {"pool": "cpu"}


def test_names_stay_dns_labels_and_the_selector_names_the_owner() -> None:
    long = "a" * 60 + "-trainer-0"
    name = sandbox_pod_name(long, "0f0f0f0f")
    assert len(name) <= 63 and name.endswith("-sbx-0f0f0f0f") and name.startswith("a" * 40)
    assert (
        owner_selector("j-trainer-0")
        == "app.kubernetes.io/component=sandbox,rlfleet.dev/sandbox-owner=j-trainer-0"
    )
    with pytest.raises(ValueError, match="owner_uid"):
        SandboxPodConfig(namespace="n", job="j", owner_pod="p", owner_uid="", image="i")


def test_exec_argv_passes_the_command_and_the_stdin_size_as_arguments() -> None:
    argv = exec_argv(["sh", "-c", "echo 'a b'"], 12, SandboxLimits(cpu_seconds=7, open_files=99))
    assert argv[:2] == ["sh", "-c"] and argv[3:] == ["sandbox", "12", "sh", "-c", "echo 'a b'"]
    assert "ulimit -t 7; ulimit -n 99" in argv[2] and "kill -9 -1" in argv[2]


def test_the_snapshot_tar_holds_the_files_and_refuses_escapes() -> None:
    data = _tar({"pkg/a.py": "print(1)\n", "README": "é\n"})
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    assert got == {"pkg/a.py": b"print(1)\n", "README": "é\n".encode()}
    with pytest.raises(ValueError, match="inside the repository"):
        _tar({"../x": ""})


def test_exit_codes_from_the_exec_status_channel() -> None:
    assert exit_code({"metadata": {}, "status": "Success"}) == 0
    failure = {
        "status": "Failure",
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": "3"}]},
    }
    assert exit_code(failure) == 3
    with pytest.raises(SandboxPodError, match="container not found"):
        exit_code({"status": "Failure", "message": 'container not found ("sandbox")'})


def test_output_beyond_the_bound_keeps_its_first_and_last_half() -> None:
    out = _BoundedOutput()
    half = MAX_OUTPUT_BYTES // 2
    for chunk in (b"h" * half, b"m" * 1000, b"x" * (half - 10), b"t" * 10):
        out.add(chunk)
    text = out.text()
    assert text.startswith("h" * half + "\n[... 1000 bytes omitted ...]\n")
    assert text.endswith("x" * (half - 10) + "t" * 10)
    small = _BoundedOutput()
    small.add(b"ok\n")
    assert small.text() == "ok\n"


@pytest.mark.parametrize(
    ("open_now", "maximum", "expected"), [(0, 4, 0), (1, 4, 1), (3, 4, 3), (4, 4, 4), (9, 4, 4), (5, 0, 0)]
)
def test_the_warm_pool_is_one_idle_pod_per_open_sandbox_up_to_its_maximum(
    open_now: int, maximum: int, expected: int
) -> None:
    assert warm_pool_target(open_now, maximum) == expected
