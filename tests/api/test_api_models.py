"""The API models: the example parses to the reference fleet, defaults, and every invalid case is
rejected by pydantic with the same words the CRD's CEL uses."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from support.invalid_rljobs import CASES, apply_case
from support.manifests import samplergroup

from rlfleet.api import (
    RLJob,
    RLJobLoadError,
    RLJobSpec,
    SamplerGroup,
    SamplerGroupStatus,
    WeightChannel,
    load_rljob,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "rljob.yaml"


def example_manifest() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def test_example_is_the_reference_fleet() -> None:
    job = load_rljob(EXAMPLE)
    spec = job.spec
    assert job.name == "reference-fleet"
    assert (spec.trainer.accelerator, spec.trainer.precision) == ("b200", "bf16")
    # each group is named <class>-<format>
    assert all(g.name == f"{g.accelerator}-{g.weight_format}" for g in spec.sampler_groups)
    assert [g.name for g in spec.sampler_groups] == [
        "b200-nvfp4",
        "b300-nvfp4",
        "h100-fp8",
        "h100-bf16",
        "h200-fp8",
        "h200-bf16",
        "a100-bf16",
        "rtx-pro-6000-bf16",
    ]
    assert spec.sampler_groups[-1].kv_cache_dtype == "fp8_e4m3"
    assert all(g.kv_cache_dtype == "auto" for g in spec.sampler_groups[:-1])
    assert (spec.rollout.prompts_per_step, spec.rollout.samples_per_prompt) == (128, 8)
    assert (spec.rollout.top_p, spec.rollout.top_k) == (0.97, 64)
    assert (spec.correction.mode, spec.correction.mis_low, spec.correction.mis_high) == (
        "sc-mis-topp",
        0.2,
        5.0,
    )
    assert spec.staleness.max_steps is None
    # local mode must be small: a tiny model, few steps, fewer prompts than the cluster run
    assert spec.local.prompts_per_step < spec.rollout.prompts_per_step
    assert spec.local.steps <= 50 and spec.local.model.hidden_size <= 128


def test_defaults_of_a_minimal_job() -> None:
    job = RLJob.from_manifest(
        {
            "apiVersion": "rlfleet.dev/v1alpha1",
            "kind": "RLJob",
            "metadata": {"name": "tiny"},
            "spec": {
                "model": {"name": "m", "path": "/models/m"},
                "samplerGroups": [{"name": "g", "accelerator": "h100"}],
                "weightChannel": {"store": {"path": "/weights"}},
            },
        }
    )
    s = job.spec
    assert (s.rollout.prompts_per_step, s.rollout.samples_per_prompt, s.rollout.top_p, s.rollout.top_k) == (
        128,
        8,
        1.0,
        -1,
    )
    assert (s.correction.mode, s.correction.mis_low, s.correction.mis_high, s.correction.sc_head_size) == (
        "sc-mis-topp",
        0.2,
        5.0,
        128,
    )
    assert s.staleness.max_steps is None
    assert (s.router.policy, s.router.rebalance_interval_seconds) == ("throughput", 30)
    assert s.weight_channel.store.type == "filesystem"
    g = s.sampler_groups[0]
    assert (g.replicas, g.weight_format, g.kv_cache_dtype, g.tensor_parallel) == (1, "bf16", "auto", None)
    assert s.suspend is False and s.safety.action == "alert"


def test_wire_form_is_camel_case_and_round_trips() -> None:
    job = load_rljob(EXAMPLE)
    wire = job.to_wire()
    assert "samplerGroups" in wire["spec"] and "promptsPerStep" in wire["spec"]["rollout"]
    assert wire["spec"]["samplerGroups"][0]["weightFormat"] == "nvfp4"
    assert RLJob.from_manifest(wire) == job


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_invalid_manifest_rejected_with_clear_message(case: dict) -> None:
    manifest = apply_case(example_manifest(), case)
    with pytest.raises((ValidationError, ValueError)) as info:
        RLJob.from_manifest(manifest)
    assert case.get("expect_local", case["expect"]) in str(info.value)


def test_at_least_twelve_invalid_cases() -> None:
    assert len(CASES) >= 12 and len({c["name"] for c in CASES}) == len(CASES)


def test_load_rljob_errors_are_one_readable_message(tmp_path: Path) -> None:
    bad = apply_case(example_manifest(), next(c for c in CASES if c["name"] == "top-p-without-top-k"))
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(RLJobLoadError) as info:
        load_rljob(path)
    text = str(info.value)
    assert "spec.rollout" in text and "topP < 1 requires a finite topK" in text and "Traceback" not in text
    with pytest.raises(RLJobLoadError, match="cannot read"):
        load_rljob(tmp_path / "missing.yaml")
    (tmp_path / "two.yaml").write_text("kind: Service\n---\nkind: ConfigMap\n")
    with pytest.raises(RLJobLoadError, match="exactly one RLJob"):
        load_rljob(tmp_path / "two.yaml")
    (tmp_path / "broken.yaml").write_text("spec: [unclosed\n")
    with pytest.raises(RLJobLoadError, match="not valid YAML"):
        load_rljob(tmp_path / "broken.yaml")


def test_wrong_api_version_is_rejected() -> None:
    manifest = example_manifest()
    manifest["apiVersion"] = "rlfleet.dev/v1"
    with pytest.raises(ValueError, match="apiVersion must be 'rlfleet.dev/v1alpha1'"):
        RLJob.from_manifest(manifest)


def test_degraded_formats_are_accepted() -> None:
    """FP8 on A100 runs weight-only: accepted (flagged in status by the operator), not rejected."""
    manifest = apply_case(example_manifest(), {"set": {"spec.samplerGroups.6.weightFormat": "fp8"}})
    assert RLJob.from_manifest(manifest).spec.sampler_groups[6].weight_format == "fp8"


def test_samplergroup_and_weightchannel_parse_api_objects() -> None:
    sg = SamplerGroup.from_manifest(
        {
            "apiVersion": "rlfleet.dev/v1alpha1",
            "kind": "SamplerGroup",
            "metadata": {"name": "j-g", "managedFields": [{"manager": "x"}], "generation": 3},
            "spec": {
                "name": "g",
                "accelerator": "b200",
                "weightFormat": "nvfp4",
                "model": {"name": "m", "path": "p"},
            },
            "status": {
                "readyReplicas": 2,
                "costPer1MTokens": 0.5,
                "shareHistory": [
                    {"time": "2026-01-01T00:00:00Z", "from": 0.1, "to": 0.2, "reason": "throughput"}
                ],
            },
        }
    )
    assert sg.metadata.generation == 3 and sg.status.cost_per_1m_tokens == 0.5
    assert sg.status.share_history[0].to_share == 0.2
    assert sg.status.to_wire()["shareHistory"][0]["from"] == 0.1
    with pytest.raises(ValidationError, match="at most 5 items"):
        SamplerGroupStatus.model_validate(
            {"shareHistory": [{"time": "2026-01-01T00:00:00Z", "from": 0, "to": 1}] * 6}
        )
    wc = WeightChannel.from_manifest(
        {
            "apiVersion": "rlfleet.dev/v1alpha1",
            "kind": "WeightChannel",
            "metadata": {"name": "w"},
            "spec": {
                "store": {
                    "type": "s3",
                    "bucket": "weights",
                    "secretRef": {"name": "s3"},
                    "sharedCredentials": True,
                },
            },
        }
    )
    assert wc.spec.store.secret_ref.name == "s3" and wc.spec.retention.keep_versions == 3
    with pytest.raises(ValidationError, match="type s3 needs bucket"):
        WeightChannel.from_manifest(
            {"apiVersion": "rlfleet.dev/v1alpha1", "kind": "WeightChannel", "spec": {"store": {"type": "s3"}}}
        )


def test_every_spec_field_is_documented() -> None:
    """Descriptions come from field docstrings; a field without one would ship an undocumented CRD field."""
    missing = []

    def visit(model: type) -> None:
        for name, field in model.model_fields.items():
            if not field.description:
                missing.append(f"{model.__name__}.{name}")
            ann = field.annotation
            for sub in getattr(ann, "__args__", ()) + (ann,):
                if (
                    isinstance(sub, type)
                    and hasattr(sub, "model_fields")
                    and sub.__module__.startswith("rlfleet.api")
                ):
                    if sub.__name__ != "ObjectMeta":
                        visit(sub)

    visit(RLJobSpec)
    assert missing == []


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("rljob*.yaml")), ids=lambda p: p.name)
def test_every_example_rljob_is_valid(path: Path) -> None:
    job = load_rljob(path)
    assert job.name and len(job.spec.sampler_groups) >= 1
    assert job.spec.local.steps <= 50  # examples double as quick local runs


def test_samplergroup_refuses_what_cannot_run() -> None:
    from rlfleet.api.samplergroup import (
        EXTRA_ARGS_MESSAGE,
        PORT_MESSAGE,
        RESERVED_NAME_MESSAGE,
        SG_NAME_MESSAGE,
    )

    assert SamplerGroup.from_manifest(samplergroup()).spec.port == 30000
    with pytest.raises(ValueError, match="must be a DNS-1035 label") as info:
        SamplerGroup.from_manifest(samplergroup("solo.h100"))
    assert SG_NAME_MESSAGE in str(info.value)
    with pytest.raises(ValueError, match="must be a DNS-1035 label"):
        SamplerGroup.from_manifest(samplergroup("x" * 64))
    for spec, message in [
        ({"port": 9400}, PORT_MESSAGE),
        ({"name": "router"}, RESERVED_NAME_MESSAGE),
        ({"extraArgs": ["--dp-size", "2"]}, EXTRA_ARGS_MESSAGE),
        ({"extraArgs": ["--model-path=/other"]}, EXTRA_ARGS_MESSAGE),
    ]:
        with pytest.raises(ValidationError) as err:
            SamplerGroup.from_manifest(samplergroup(**spec))
        assert message in str(err.value), spec
    # flags the operator does not set pass through (a prefix of an owned flag is not the flag)
    ok = SamplerGroup.from_manifest(samplergroup(extraArgs=["--mem-fraction-static", "0.8", "--tp-size-x"]))
    assert ok.spec.extra_args[-1] == "--tp-size-x"


def test_reserved_group_names_are_the_suffixes_of_every_child_name() -> None:
    """A group named like a child suffix would give <job>-<group> == that child's name (operator/naming.py)."""
    from rlfleet.api.common import RESERVED_GROUP_NAMES
    from rlfleet.operator import naming

    children = [
        naming.trainer_name,
        naming.router_name,
        naming.config_name,
        naming.weightchannel_name,
        naming.router_secret_name,
    ]
    suffixes = {f("job").removeprefix("job-") for f in children}
    assert suffixes == set(RESERVED_GROUP_NAMES)
    for suffix in suffixes:
        assert naming.samplergroup_name("job", suffix) in {f("job") for f in children}


def test_owned_sglang_flags_are_every_spelling_sglang_parses_for_what_the_operator_sets() -> None:
    """The real SGLang 0.5.23 parser: every option string of every destination the launch line sets (plus
    the GPU-count flags) is refused in extraArgs, and nothing else."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from rlfleet.api.samplergroup import OWNED_SGLANG_FLAGS
    from rlfleet.catalog import load_catalog, sglang_launch

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    by_flag = {opt: action.dest for action in parser._actions for opt in action.option_strings}
    catalog = load_catalog(None)
    set_by_launch: set[str] = set()
    for cls in (n for n in catalog.names() if catalog.get(n).engine == "sglang"):  # every SGLang class and
        for fmt in catalog.get(cls).weight_formats:  # format: the precision flags differ (GEMM backends)
            launch = sglang_launch(
                accelerator=catalog.get(cls),
                weight_format=fmt,
                kv_cache_dtype="fp8_e4m3",
                model_path="/m",
                served_model_name="m",
                weight_version=0,
            )
            set_by_launch |= {by_flag[a] for a in launch.argv if a.startswith("--")} - {"enable_metrics"}
    owned_dests = set_by_launch | {"dp_size", "pp_size", "nnodes"}
    expected = {opt for opt, dest in by_flag.items() if dest in owned_dests}
    assert set(OWNED_SGLANG_FLAGS) == expected


def test_parallelism_and_budgets_name_the_numbers() -> None:
    manifest = apply_case(example_manifest(), {"set": {"spec.trainer.parallelism.tensor": 3}})
    with pytest.raises(ValidationError, match="3 does not divide 8"):
        RLJob.from_manifest(manifest)
    manifest = apply_case(example_manifest(), {"set": {"spec.model.maxSeqLen": 8192}})
    with pytest.raises(ValidationError, match="8192 >= 8192"):
        RLJob.from_manifest(manifest)
    manifest = apply_case(example_manifest(), {"set": {"spec.model.maxSeqLen": 8193}})
    assert RLJob.from_manifest(manifest).spec.model.max_seq_len == 8193
    # context parallelism that fits is accepted; torch on one node of 8 GPUs (FSDP2 data parallel) too
    manifest = apply_case(
        example_manifest(), {"set": {"spec.trainer.parallelism": {"tensor": 4, "context": 2}}}
    )
    assert RLJob.from_manifest(manifest).spec.trainer.parallelism.size == 8
    manifest = apply_case(
        example_manifest(), {"set": {"spec.trainer": {"backend": "torch", "gpusPerReplica": 8}}}
    )
    assert RLJob.from_manifest(manifest).spec.trainer.gpus_per_replica == 8
    manifest = apply_case(
        example_manifest(),
        {
            "set": {
                "spec.router.policy": "static",
                "spec.router.staticShares": {"h200-fp8": 0.0, "a100-bf16": 1.0},
            }
        },
    )
    assert RLJob.from_manifest(manifest).spec.router.static_shares["a100-bf16"] == 1.0


def test_builtin_environments_are_the_trainers() -> None:
    from rlfleet.api.rljob import BUILTIN_ENVIRONMENTS
    from rlfleet.trainer.envs.environments import BUILTIN

    assert set(BUILTIN_ENVIRONMENTS) == set(BUILTIN)
    manifest = apply_case(example_manifest(), {"set": {"spec.rollout.environment": "my_pkg.envs:Maze"}})
    assert RLJob.from_manifest(manifest).spec.rollout.environment == "my_pkg.envs:Maze"


def test_what_the_builtin_model_cannot_run_is_refused_and_what_it_can_is_accepted() -> None:
    """The API's heads of builtin:tiny-qwen3 are the ones rlfleet/tiny_qwen3.py builds it with (the API
    cannot import that module: it reaches torch), and every TP that divides them is accepted."""
    from rlfleet.api import rljob
    from rlfleet.tiny_qwen3 import SIZES

    assert (rljob._TINY_HEADS, rljob._TINY_KV_HEADS) == (
        SIZES["num_attention_heads"],
        SIZES["num_key_value_heads"],
    )
    manifest = example_manifest()
    manifest["spec"]["model"]["path"] = "builtin:tiny-qwen3?seed=3"
    manifest["spec"]["trainer"]["parallelism"]["tensor"] = 1
    for tp in range(1, 9):
        manifest["spec"]["samplerGroups"][3]["tensorParallel"] = tp
        divides = SIZES["num_attention_heads"] % tp == 0 and SIZES["num_key_value_heads"] % tp == 0
        if divides:
            RLJob.model_validate(manifest)
        else:
            with pytest.raises(ValidationError, match=f"got group h100-bf16: {tp}"):
                RLJob.model_validate(manifest)
    manifest["spec"]["model"]["path"] = "Qwen/Qwen3-8B"  # a model the API does not know: left to the trainer
    manifest["spec"]["samplerGroups"][3].update(tensorParallel=3, weightFormat="mxfp4")
    RLJob.model_validate(manifest)


def test_routing_replay_is_off_by_default_and_refused_where_no_routing_exists() -> None:
    """correction.routingReplay: false by default (RunConfig too); on, refused for the megatron backend
    (no mixture of experts) and the built-in dense tiny Qwen3; locally, for a dense local.model; a torch job on
    a model the API does not know is accepted and carried into the run config."""
    from rlfleet.api import rljob
    from rlfleet.trainer.config import resolve_run

    def job(
        correction: dict, backend: str = "torch", path: str = "/models/m", local: dict | None = None
    ) -> RLJob:
        return RLJob.from_manifest(
            {
                "apiVersion": "rlfleet.dev/v1alpha1",
                "kind": "RLJob",
                "metadata": {"name": "tiny"},
                "spec": {
                    "model": {"name": "m", "path": path},
                    "trainer": {"backend": backend},
                    "correction": correction,
                    "samplerGroups": [{"name": "g", "accelerator": "h100"}],
                    "weightChannel": {"store": {"path": "/weights"}},
                    "local": local or {},
                },
            }
        )

    plain = job({}, backend="megatron")
    assert (
        plain.spec.correction.routing_replay is False
        and resolve_run(plain, local=False).routing_replay is False
    )
    with pytest.raises(ValidationError, match="correction.routingReplay needs trainer.backend: torch"):
        job({"routingReplay": True}, backend="megatron")
    with pytest.raises(ValidationError, match="model builtin:tiny-qwen3 is a dense Qwen3"):
        job({"routingReplay": True}, path="builtin:tiny-qwen3?seed=1")
    on = job({"routingReplay": True})
    assert on.spec.correction.routing_replay and on.to_wire()["spec"]["correction"]["routingReplay"] is True
    assert resolve_run(on, local=False).routing_replay is True
    with pytest.raises(ValueError, match=r"local.model.architecture qwen3 is dense .* qwen3_moe"):
        resolve_run(on, local=True)  # the local block's default model is the dense tiny Qwen3
    moe = job({"routingReplay": True}, local={"model": {"architecture": "qwen3_moe"}})
    assert resolve_run(moe, local=True).routing_replay is True
    # the CEL rules say the same to kubectl apply (the real kube-apiserver runs them in tests/operator)
    rules = {r["message"]: r["rule"] for r in RLJobSpec.model_json_schema()["x-kubernetes-validations"]}
    assert "self.trainer.backend == 'torch'" in rules[rljob.ROUTING_REPLAY_MEGATRON_MESSAGE]
    assert "builtin:tiny-qwen3" in rules[rljob.ROUTING_REPLAY_DENSE_MESSAGE]
