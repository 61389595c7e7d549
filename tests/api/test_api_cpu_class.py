"""The `cpu` class: the catalog's CPU engine (the reference engine, no GPU), its launch line, and what the
API refuses for it (sampler groups and the trainer), with the messages a user reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from support.reference_serve import SERVE_REFERENCE

from rlfleet.api import RLJob, SamplerGroupSpec, load_rljob
from rlfleet.api.crdgen import cpu_classes, generate
from rlfleet.api.rljob import BUILTIN_CPU_CLASSES
from rlfleet.catalog import (
    CatalogError,
    catalog_from_mapping,
    check_group,
    engine_launch,
    engine_launch_for_group,
    load_catalog,
    reference_launch,
    sglang_launch,
)

REPO = Path(__file__).resolve().parents[2]
CATALOG = load_catalog(None)
CPU = CATALOG.get("cpu")


def test_the_cpu_class_runs_the_reference_engine_without_a_gpu() -> None:
    assert (CPU.device, CPU.engine, CPU.gpu, CPU.sm) == ("cpu", "reference", False, "cpu")
    assert CPU.product_labels == [] and CPU.gke_accelerators == [] and CPU.node_selector_terms() == []
    assert list(CPU.weight_formats) == ["bf16", "fp8", "nvfp4"]
    assert CPU.kv_cache_dtypes == ["auto", "bf16", "fp8_e4m3"]  # what the reference engine emulates
    assert "nvidia.com/gpu" not in str(CPU.sampler_resources) + str(CPU.trainer_resources) + str(
        CPU.sync_resources
    )
    # every GPU class keeps its GPU product affinity and its engine
    for name in CATALOG.names():
        cls = CATALOG.get(name)
        if name != "cpu":
            assert cls.gpu and cls.engine == "sglang" and cls.node_selector_terms()
    assert cpu_classes(CATALOG) == list(BUILTIN_CPU_CLASSES)  # the API's built-in rule text agrees


def test_the_cpu_class_refuses_what_the_reference_engine_cannot_emulate() -> None:
    with pytest.raises(CatalogError) as info:
        check_group("cpu", "mxfp4")
    assert "accelerator cpu (cpu) cannot run weightFormat mxfp4" in str(info.value)
    assert "MoE experts" in str(info.value) and "supported: bf16, fp8, nvfp4" in str(info.value)
    for kv in ("fp8_e5m2", "mxfp8", "nvfp4"):
        with pytest.raises(CatalogError) as info:
            check_group("cpu", "bf16", kv)
        assert f"cannot use kvCacheDtype {kv}" in str(info.value)
        assert "the reference engine emulates a bf16 or fp8_e4m3 KV cache" in str(info.value)
    assert check_group("cpu", "fp8", "fp8_e4m3").mode == "native"


def test_reference_launch_is_rlfleet_sampler_serve_with_the_sglang_launch_inputs() -> None:
    launch = reference_launch(
        accelerator=CPU,
        weight_format="fp8",
        kv_cache_dtype="fp8_e4m3",
        model_path="/cache/v3-fp8",
        served_model_name="tiny",
        weight_version=3,
        port=31000,
        sampling_mask_max_tokens=512,
        extra_args=["--threads", "2"],
    )
    assert launch.argv == [
        "rlfleet",
        *SERVE_REFERENCE,
        "--model-path",
        "/cache/v3-fp8",
        "--served-model-name",
        "tiny",
        "--host",
        "0.0.0.0",
        "--port",
        "31000",
        "--sampling-mask-max-tokens",
        "512",
        "--weight-version",
        "3",
        "--weight-format",
        "fp8",
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--threads",
        "2",
    ]
    assert launch.flags == ["--weight-format", "fp8", "--kv-cache-dtype", "fp8_e4m3"]
    assert launch.tensor_parallel == 1 and launch.accelerator == "cpu" and not launch.degraded
    assert "no GPU" in launch.selection_reason and "nvidia.com/gpu.product" not in launch.selection_reason
    # engine_launch dispatches on the class's engine; each engine refuses the other's classes
    kwargs = dict(weight_format="bf16", model_path="/m", served_model_name="m", weight_version=0)
    assert engine_launch(accelerator=CPU, **kwargs).argv[:5] == ["rlfleet", *SERVE_REFERENCE]
    assert engine_launch(accelerator=CATALOG.get("h100"), **kwargs).argv[:3] == [
        "python3",
        "-m",
        "sglang.launch_server",
    ]
    with pytest.raises(CatalogError, match="accelerator cpu runs the reference engine, not SGLang"):
        sglang_launch(accelerator=CPU, **kwargs)
    with pytest.raises(
        CatalogError, match="accelerator h100 runs the sglang engine, not the reference engine"
    ):
        reference_launch(accelerator=CATALOG.get("h100"), **kwargs)
    with pytest.raises(CatalogError, match="tensorParallel must be 1"):
        reference_launch(accelerator=CPU, tensor_parallel=2, **kwargs)


def _group(**spec: object) -> dict:
    return {"name": "g", "accelerator": "cpu", "model": {"name": "m", "path": "p"}, **spec}


def test_a_cpu_group_refuses_tensor_parallelism_and_owned_reference_flags() -> None:
    with pytest.raises(ValidationError) as info:
        SamplerGroupSpec.model_validate(_group(tensorParallel=2))
    assert (
        "accelerator cpu runs the reference engine, one CPU process per replica: tensorParallel must be 1"
        in str(info.value)
    )
    for flag in ("--weight-format", "--engine=sglang", "--kv-cache-dtype"):
        with pytest.raises(ValidationError) as info:
            SamplerGroupSpec.model_validate(_group(extraArgs=[flag, "x"]))
        assert "extraArgs" in str(info.value) and flag.split("=")[0] in str(info.value)
    spec = SamplerGroupSpec.model_validate(_group(tensorParallel=1, extraArgs=["--threads", "2"]))
    launch = engine_launch_for_group(spec, CATALOG, model_path="/d", weight_version=1)
    assert launch.argv[-2:] == ["--threads", "2"] and launch.argv[:5] == ["rlfleet", *SERVE_REFERENCE]
    # --weight-format is a reference flag, not an SGLang one: a GPU group's extraArgs may carry it
    SamplerGroupSpec.model_validate(_group(accelerator="h100", extraArgs=["--weight-format", "x"]))


def _job(trainer: dict) -> dict:
    manifest = yaml.safe_load((REPO / "examples" / "rljob-cpu.yaml").read_text().split("---\n")[1])
    manifest["spec"]["trainer"] = trainer
    return manifest


def test_the_trainer_counts_processes_on_a_cpu_class_and_gpus_on_a_gpu_class() -> None:
    with pytest.raises(ValidationError) as info:
        RLJob.from_manifest(_job({"accelerator": "cpu", "gpusPerReplica": 2}))
    assert "gpusPerReplica is for GPU classes; a CPU class (cpu) has no GPUs: set processesPerReplica" in str(
        info.value
    )
    with pytest.raises(ValidationError) as info:
        RLJob.from_manifest(_job({"accelerator": "h100", "processesPerReplica": 2}))
    assert (
        "processesPerReplica is for CPU classes (cpu); on a GPU class torchrun runs one rank per GPU"
        in str(info.value)
    )
    with pytest.raises(ValidationError) as info:  # processesPerReplica unset on cpu: 1 rank, TP 2 cannot fit
        RLJob.from_manifest(_job({"accelerator": "cpu", "parallelism": {"tensor": 2}}))
    assert "must divide gpusPerReplica (processesPerReplica on a CPU class)" in str(info.value)
    assert "2 does not divide 1" in str(info.value)
    with pytest.raises(ValidationError, match="unknown accelerator 'tpu'"):
        RLJob.from_manifest(_job({"accelerator": "tpu"}))
    cpu = RLJob.from_manifest(
        _job({"accelerator": "cpu", "processesPerReplica": 4, "parallelism": {"tensor": 2}})
    )
    assert (cpu.spec.trainer.ranks_per_replica, cpu.spec.trainer.gpus) == (4, 0)
    assert RLJob.from_manifest(_job({"accelerator": "cpu"})).spec.trainer.ranks_per_replica == 1
    gpu = RLJob.from_manifest(
        _job({"accelerator": "b200"})
    ).spec.trainer  # unset on a GPU class: 8, as before
    assert (gpu.gpus_per_replica, gpu.ranks_per_replica, gpu.gpus) == (None, 8, 8)
    assert "gpusPerReplica" not in gpu.to_wire()


def test_the_crd_carries_the_cpu_rules_generated_from_the_catalog() -> None:
    crds = generate(CATALOG)
    rljob = crds["rlfleet.dev_rljobs.yaml"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "spec"
    ]
    trainer = rljob["properties"]["trainer"]
    assert "default" not in trainer["properties"]["gpusPerReplica"]  # unset means 8 on GPU, refused on cpu
    rules = {r["rule"] for r in trainer["x-kubernetes-validations"]}
    assert "!has(self.gpusPerReplica) || !(self.accelerator in ['cpu'])" in rules
    assert "!has(self.processesPerReplica) || self.accelerator in ['cpu']" in rules
    assert any("(self.accelerator in ['cpu'] ? 1 : 8)" in r for r in rules)
    group_rules = {
        r["rule"] for r in rljob["properties"]["samplerGroups"]["items"]["x-kubernetes-validations"]
    }
    assert "self.accelerator != 'cpu' || !has(self.tensorParallel) || self.tensorParallel == 1" in group_rules
    assert "self.accelerator != 'cpu' || self.weightFormat in ['bf16', 'fp8', 'nvfp4']" in group_rules
    # an override that adds a second CPU class gets the same rules for it
    override = catalog_from_mapping(
        {
            "classes": {
                "cpu-big": {
                    "displayName": "big CPU",
                    "device": "cpu",
                    "engine": "reference",
                    "weightFormats": {"bf16": {}},
                    "kvCacheDtypes": ["auto"],
                    "costPerGpuHour": 0,
                }
            }
        }
    )
    trainer = generate(override)["rlfleet.dev_rljobs.yaml"]["spec"]["versions"][0]["schema"][
        "openAPIV3Schema"
    ]["properties"]["spec"]["properties"]["trainer"]
    assert "!has(self.processesPerReplica) || self.accelerator in ['cpu', 'cpu-big']" in {
        r["rule"] for r in trainer["x-kubernetes-validations"]
    }


def test_a_catalog_class_must_be_coherent() -> None:
    with pytest.raises(CatalogError, match="a gpu class needs productLabels"):
        catalog_from_mapping(
            {
                "classes": {
                    "l4": {
                        "displayName": "L4",
                        "computeCapability": "8.9",
                        "memoryGib": 24,
                        "weightFormats": {"bf16": {}},
                        "kvCacheDtypes": ["auto"],
                        "costPerGpuHour": 1,
                    }
                }
            }
        )
    with pytest.raises(CatalogError, match="a cpu class runs engine reference"):
        catalog_from_mapping({"classes": {"cpu": {"engine": "sglang"}}})
    with pytest.raises(CatalogError, match="a cpu class has no GPU product labels"):
        catalog_from_mapping({"classes": {"cpu": {"productLabels": ["NVIDIA-H100-PCIe"]}}})


@pytest.mark.parametrize("name", ["rljob-cpu.yaml", "rljob-cpu-torch.yaml"])
def test_the_cpu_examples_are_what_they_say(name: str) -> None:
    job = load_rljob(REPO / "examples" / name)
    groups = {g.name: g for g in job.spec.sampler_groups}
    assert {g.accelerator for g in groups.values()} == {"cpu"}
    assert {g.weight_format for g in groups.values()} == {"bf16", "fp8", "nvfp4"}
    assert any(g.kv_cache_dtype == "fp8_e4m3" for g in groups.values())
    t = job.spec.trainer
    assert t.accelerator == "cpu" and t.gpus == 0 and t.ranks_per_replica == 2
    if name == "rljob-cpu.yaml":
        assert t.backend == "megatron" and t.parallelism.tensor == 2
    else:
        assert t.backend == "torch" and t.parallelism.size == 1
    assert job.spec.model.path == "builtin:tiny-qwen3"
    store = job.spec.weight_channel.store
    assert store.type == "filesystem" and store.volume_claim_name
    docs = list(yaml.safe_load_all((REPO / "examples" / name).read_text()))
    pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    assert pvc["metadata"]["name"] == store.volume_claim_name and pvc["spec"]["accessModes"] == [
        "ReadWriteOnce"
    ]
    assert job.spec.sampler_images.sampler.endswith("-cpu") and t.image.endswith("-cpu")
