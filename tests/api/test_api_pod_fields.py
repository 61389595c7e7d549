"""Pod template fields at the API (rlfleet/api/podfields.py): what is accepted as written, and the refusals
that need the whole job (the cases kube-apiserver refuses too are in tests/api/invalid_rljobs.yaml)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from support.manifests import samplergroup

from rlfleet.api import RLJob, SamplerGroup
from rlfleet.api.podfields import looks_like_secret

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rljob.yaml"


def example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("HF_TOKEN", True),
        ("hf_token", True),
        ("WANDB_API_KEY", True),
        ("DB_PASSWORD", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("GOOGLE_APPLICATION_CREDENTIALS", True),
        ("TOKEN", True),
        ("TOKENIZERS_PARALLELISM", False),
        ("HF_HUB_ENABLE_HF_TRANSFER", False),
        ("NCCL_DEBUG", False),
        ("KEYRING", False),
    ],
)
def test_which_env_names_look_like_secrets(name: str, secret: bool) -> None:
    assert looks_like_secret(name) is secret


def test_literal_values_of_ordinary_names_are_kept_as_written() -> None:
    m = example()
    m["spec"]["trainer"]["env"] = [
        {"name": "TOKENIZERS_PARALLELISM", "value": "false"},
        {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    job = RLJob.from_manifest(m)
    assert job.to_wire()["spec"]["trainer"]["env"] == m["spec"]["trainer"]["env"]


def test_a_trainer_mount_at_the_weight_store_path_is_refused() -> None:
    m = example()
    path = m["spec"]["weightChannel"]["store"]["path"]
    m["spec"]["trainer"]["volumes"] = [{"name": "mine", "emptyDir": {}}]
    m["spec"]["trainer"]["volumeMounts"] = [{"name": "mine", "mountPath": path + "/"}]
    with pytest.raises(ValidationError, match="is where the trainer mounts the weight store"):
        RLJob.from_manifest(m)


def test_a_mount_path_with_a_trailing_slash_is_still_the_operators() -> None:
    sg = samplergroup(
        model={"name": "m", "path": "org/gated"},
        volumes=[{"name": "t", "emptyDir": {}}],
        volumeMounts=[{"name": "t", "mountPath": "/tmp/"}],
    )
    with pytest.raises(ValidationError, match="volumeMounts must not mount at the operator's paths"):
        SamplerGroup.from_manifest(sg)
    sg["spec"]["volumeMounts"][0]["mountPath"] = "/tmp/huggingface"
    sg["spec"]["env"] = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]
    parsed = SamplerGroup.from_manifest(sg)
    assert parsed.spec.placement_wire() == {k: sg["spec"][k] for k in ("env", "volumes", "volumeMounts")}
