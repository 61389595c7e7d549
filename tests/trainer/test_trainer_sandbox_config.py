"""RLJob rollout.sandbox -> the trainer: the cluster run takes the job's backend, local mode stays
local, and the pods backend needs an environment with sandboxes and the trainer pod's identity."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlfleet.api import RLJob
from rlfleet.sandbox import SandboxUnavailable
from rlfleet.sandbox.pods import PodSandboxes
from rlfleet.trainer.config import build_environment, resolve_run

REPO = Path(__file__).resolve().parents[2]


def job(sandbox: dict | None) -> RLJob:
    raw = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())
    raw["spec"]["rollout"]["environment"] = "rlfleet.trainer.envs.swe_env:SweEnv"
    if sandbox is not None:
        raw["spec"]["rollout"]["sandbox"] = sandbox
    return RLJob.model_validate(raw)


def test_the_cluster_run_takes_the_jobs_sandbox_and_local_mode_stays_local() -> None:
    pods = {"backend": "pods", "image": "registry.example/sandbox:1", "runtimeClassName": "gvisor"}
    assert resolve_run(job(pods), local=False).sandbox.runtime_class_name == "gvisor"
    assert resolve_run(job(pods), local=True).sandbox.backend == "local"
    assert resolve_run(job(None), local=False).sandbox.backend == "local"
    assert resolve_run(job(pods), local=False).as_json()["sandbox"]["backend"] == "pods"


def test_pods_need_an_environment_with_sandboxes_and_the_trainers_identity(monkeypatch) -> None:
    rc = resolve_run(job({"backend": "pods", "image": "i"}), local=False)
    rc.environment = "tool_add"
    with pytest.raises(ValueError, match="runs no sandboxes"):
        build_environment(rc)
    for name in ("RLFLEET_POD_NAME", "RLFLEET_POD_UID", "RLFLEET_POD_NAMESPACE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SandboxUnavailable, match="RLFLEET_POD_NAME, RLFLEET_POD_UID, RLFLEET_POD_NAMESPACE"):
        PodSandboxes.from_environment(rc.sandbox, "j", environ={})
