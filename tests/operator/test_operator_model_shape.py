"""A group whose tensorParallel cannot split the model's heads is refused as soon as the model is known: the
operator reads config.json of the published version 0 from a real filesystem channel, keeps the head counts in
the WeightChannel status, and the group is Failed with the numbers (operator/model_shape.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfleet.api import StoreSpec
from rlfleet.catalog import load_catalog
from rlfleet.channel import WeightChannel
from rlfleet.operator.channel_read import read_channel
from rlfleet.operator.channel_status import weightchannel_status
from rlfleet.operator.group_status import samplergroup_status
from rlfleet.operator.job_status import rljob_status
from rlfleet.operator.model_shape import model_shape, tensor_parallel_problem
from rlfleet.store import store_from_spec

CATALOG = load_catalog(None)
T0 = "2026-01-01T00:00:00Z"
# Qwen/Qwen3-8B's config.json (the fields that matter here)
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_size": 4096, "head_dim": 128}  # fmt: skip


@pytest.mark.parametrize(
    ("heads", "kv", "fits", "refused"),
    [
        (32, 8, [1, 2, 4, 8], [3, 5, 6, 7]),  # Qwen3-8B
        (16, 8, [1, 2, 4, 8], [3, 5, 6, 7]),  # Qwen3-0.6B / 1.7B
        (64, 4, [1, 2, 4, 8], [3, 5, 6, 7]),  # kv heads replicated on 8 ranks (8 % 4 == 0)
        (40, 8, [1, 2, 4, 8], [3, 5, 6, 7]),  # Qwen3-14B
        (
            12,
            2,
            [1, 2, 4, 6],
            [3, 5, 7, 8],
        ),  # 8 does not divide 12; 3 splits the query heads, not the 2 kv heads
    ],
)
def test_sglangs_head_split_rule(heads: int, kv: int, fits: list[int], refused: list[int]) -> None:
    shape = model_shape({"num_attention_heads": heads, "num_key_value_heads": kv}, 0)
    assert [tp for tp in range(1, 9) if tensor_parallel_problem(shape, tp) is None] == fits
    for tp in refused:
        problem = tensor_parallel_problem(shape, tp)
        assert problem is not None and f"{heads} attention heads and {kv} key/value heads" in problem
        assert problem.endswith(f"use tensorParallel {', '.join(map(str, fits))}")
    assert tensor_parallel_problem(None, 3) is None  # the model not known yet: no verdict


def test_a_config_without_kv_heads_uses_the_attention_heads_and_one_without_heads_is_no_shape() -> None:
    assert model_shape({"num_attention_heads": 4}, 2) == {
        "attentionHeads": 4,
        "keyValueHeads": 4,
        "version": 2,
    }
    assert model_shape({"model_type": "x"}, 0) is None


def publish(tmp_path: Path, files: dict[str, bytes]) -> dict:
    spec = {"store": {"type": "filesystem", "path": str(tmp_path / "store")}}
    (tmp_path / "store").mkdir()
    view = tmp_path / "bf16"
    view.mkdir()
    for name, data in files.items():
        (view / name).write_bytes(data)
    store = store_from_spec(StoreSpec.model_validate(spec["store"]))
    try:
        WeightChannel(store, publisher_id="trainer").publish({"bf16": view}, version=0)
    finally:
        store.close()
    return spec


def test_the_operator_reads_the_published_config_once_and_refuses_a_group_it_cannot_split(
    tmp_path: Path,
) -> None:
    spec = publish(tmp_path, {"config.json": json.dumps(QWEN3_8B).encode(), "model.bin": b"\0" * 64})
    read = read_channel(spec, None, want_model=True)
    assert read.error is None and read.model == {
        "attentionHeads": 32,
        "keyValueHeads": 8,
        "version": 0,
        "architecture": "Qwen3ForCausalLM",
    }
    assert read_channel(spec, None).model is None  # not asked (the status has it): not read

    wc = {"metadata": {"name": "j-weights", "generation": 1}, "spec": spec}
    wc_status = weightchannel_status(wc, read.status, None, now=T0, model=read.model)
    assert wc_status["model"]["attentionHeads"] == 32
    kept = weightchannel_status({**wc, "status": wc_status}, read.status, None, now=T0)  # a later read
    assert kept["model"] == wc_status["model"]

    def group(tp: int | None) -> dict:
        spec = {
            "name": "h100-bf16",
            "accelerator": "h100",
            "weightFormat": "bf16",
            "replicas": 2,
            "model": {"name": "m", "path": "Qwen/Qwen3-8B"},
            "weightChannel": "j-weights",
        }
        if tp is not None:
            spec["tensorParallel"] = tp
        return {
            "apiVersion": "rlfleet.dev/v1alpha1",
            "kind": "SamplerGroup",
            "metadata": {"name": "j-h100-bf16", "generation": 1},
            "spec": spec,
        }

    refused = samplergroup_status(group(3), None, CATALOG, wc_status, now=T0)
    assert (refused["phase"], refused["reason"]) == ("Failed", "InvalidSpec")
    assert refused["message"].startswith(
        "tensorParallel 3 does not split Qwen3ForCausalLM's 32 attention heads and 8"
    )
    assert "config.json of weight version 0" in refused["message"]
    for tp in (None, 2):  # the class default (1) and a TP that splits the heads
        assert samplergroup_status(group(tp), None, CATALOG, wc_status, now=T0)["phase"] != "Failed"
    # before version 0 the model is unknown: no verdict yet
    assert samplergroup_status(group(3), None, CATALOG, None, now=T0)["phase"] != "Failed"
    job = {"metadata": {"name": "j", "generation": 1}, "spec": {"samplerGroups": [{"name": "h100-bf16"}]}}
    r = rljob_status(job, [{**group(3), "status": refused}], {"status": {"readyReplicas": 1}}, None, now=T0)
    assert (r["phase"], r["reason"]) == ("Degraded", "GroupsDegraded") and "tensorParallel 3" in r["message"]
