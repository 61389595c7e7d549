"""The accelerator catalog: the classes a sampler group may name, how to find their nodes, what each
can run, and the checks a group must pass.

A class says how to find its nodes (GPU Feature Discovery `nvidia.com/gpu.product` values, several per
class because SKUs differ, plus GKE `cloud.google.com/gke-accelerator` values), what it can run
(weight formats, each `native` or `degraded`, and KV-cache dtypes), which SGLang flags select the
right kernels, its default tensor parallelism, its price per GPU-hour and its relative decode
throughput per weight format (`decodeThroughput`: H100 at bf16 = 1, `DECODE_BANDWIDTH_TB_S` and
`WEIGHT_BYTES_PER_PARAMETER` below say where the figures come from).

What each class really runs (SGLang 0.5.23's code; docs/sampler.md has the table):
- A100 (sm80) has no FP8 tensor cores: a block-128 FP8 checkpoint runs as Marlin W8A16 (FP8 weights,
  BF16 activations; layers/quantization/fp8.py `can_auto_enable_marlin_fp8` is true on sm80-sm88).
- Hopper (sm90) runs block-128 FP8 natively (W8A8, DeepGEMM) but has no FP4 tensor cores: NVFP4 there
  would be weight-only W4A16 through `--fp4-gemm-backend marlin` (modelopt_quant.py refuses the native
  dense GEMMs below SM100), so the built-in catalog rejects nvfp4 on sm80/sm90.
- B200/B300 (sm100/sm103) and RTX PRO 6000 (sm120) run NVFP4 W4A4 natively (`--quantization
  modelopt_fp4`, GEMM backend flashinfer_cutlass on sm100, flashinfer_cudnn on sm120); mxfp8 / nvfp4 KV
  caches need sm100+ / sm100 or sm120.
- MXFP4 is MoE-experts-only: SGLang's Mxfp4Config quantizes FusedMoE layers and leaves every dense
  linear layer unquantized, so a dense model in the mxfp4 view serves its linear layers in BF16.

A class says which engine its sampler groups run and on what device (`engine: sglang | reference`,
`device: gpu | cpu`). The built-in `cpu` class runs the project's reference engine (`rlfleet sampler
serve --engine reference`: a Qwen3 on CPU that emulates the bf16 / fp8 / nvfp4 weight views and an fp8
KV cache) with the SAME launch contract as SGLang: the weight-sync init container fetches and verifies
the newest version of the group's view, the engine execs from that directory with its version, the
sidecar applies later versions through `/update_weights_from_disk`. A cpu class requests no GPU, has no
GPU toleration and no GPU product affinity; its pods request the class's small CPU / memory defaults
(`samplerResources`, `trainerResources` and `syncResources`; a group's / the trainer's `resources` are
merged over the engine's and the trainer's). Its trainer
runs torchrun ranks on CPU (gloo).

Overrides: a YAML file named by `RLFLEET_CATALOG` (the Helm chart mounts a ConfigMap there) with
`classes: {name: {...}}`; fields of an existing class are merged over the built-in one (mappings
merge, lists replace, `null` removes an entry, e.g. `weightFormats: {fp8: null}`), a new name must be
complete. The CRD's accelerator enum and support-matrix CEL are generated from a catalog
(`rlfleet crds --catalog FILE` for an overridden one), so kubectl rejects what the catalog cannot run.

Core module: imports nothing of the product packages (and not kopf or torch).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from rlfleet.yamlfile import read_yaml

CATALOG_ENV = "RLFLEET_CATALOG"
PRODUCT_LABEL = "nvidia.com/gpu.product"
GKE_LABEL = "cloud.google.com/gke-accelerator"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_TOLERATION: dict[str, str] = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


class CatalogError(ValueError):
    """A group asks for something the catalog cannot give (unknown class, unsupported precision)."""


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class FormatProfile(_Model):
    """How one class runs one weight format."""

    mode: Literal["native", "degraded"] = "native"
    flags: list[str] = Field(default_factory=list)  # SGLang flags selecting the format and its kernels
    env: dict[str, str] = Field(default_factory=dict)
    note: str = ""  # what the mode means (shown in SamplerGroup status)


GPU_SAMPLER_RESOURCES: dict[str, dict[str, str]] = {"requests": {"cpu": "4", "memory": "32Gi"}}
GPU_TRAINER_RESOURCES: dict[str, dict[str, str]] = {"requests": {"cpu": "8", "memory": "64Gi"}}
GPU_SYNC_RESOURCES: dict[str, dict[str, str]] = {
    "requests": {"cpu": "500m", "memory": "1Gi"},
    "limits": {"memory": "4Gi"},
}
# A CPU class's pods share a few cores (a one-machine dev cluster has 2): small requests, memory limits
# sized for the tiny Qwen3 with headroom; raise them with a group's / the trainer's `resources`.
CPU_SAMPLER_RESOURCES: dict[str, dict[str, str]] = {
    "requests": {"cpu": "250m", "memory": "1Gi"},
    "limits": {"memory": "4Gi"},
}
CPU_TRAINER_RESOURCES: dict[str, dict[str, str]] = {
    "requests": {"cpu": "500m", "memory": "2Gi"},
    "limits": {"memory": "8Gi"},
}
CPU_SYNC_RESOURCES: dict[str, dict[str, str]] = {
    "requests": {"cpu": "50m", "memory": "256Mi"},
    "limits": {"memory": "1Gi"},
}


class AcceleratorClass(_Model):
    """One accelerator class: a GPU class (SGLang), or a CPU class (the reference engine)."""

    name: str
    display_name: str
    device: Literal["gpu", "cpu"] = "gpu"  # cpu: no nvidia.com/gpu request, toleration or product affinity
    engine: Literal["sglang", "reference"] = "sglang"  # what a sampler group of the class launches
    product_labels: list[str] = Field(default_factory=list)  # nvidia.com/gpu.product values (GFD)
    gke_accelerators: list[str] = Field(default_factory=list)  # cloud.google.com/gke-accelerator values
    compute_capability: str = ""  # "9.0" (GPU classes)
    memory_gib: int = Field(default=0, ge=0)  # GPU memory (0: a CPU class)
    weight_formats: dict[str, FormatProfile]
    unsupported: dict[str, str] = Field(default_factory=dict)  # format -> why not (for clear errors)
    kv_cache_dtypes: list[str]
    default_tensor_parallel: int = Field(default=1, ge=1, le=8)
    cost_per_gpu_hour: float = Field(ge=0.0)  # USD, list price; override per cluster
    # decode tokens/s per GPU relative to H100 at bf16, per weight format: how a reference fleet's
    # throughput is estimated from groups measured on other classes and formats (fleet.py); a format
    # missing here (and a CPU class) gives no estimate. Override per cluster with measured ratios.
    decode_throughput: dict[str, Annotated[float, Field(gt=0.0, le=1000.0)]] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)  # env for every engine server of the class
    # default requests/limits of the engine container and of the trainer container (the GPU count is
    # added for GPU classes; a group's / the trainer's `resources` are merged over these)
    sampler_resources: dict[str, dict[str, str]] = Field(
        default_factory=lambda: copy.deepcopy(GPU_SAMPLER_RESOURCES)
    )
    trainer_resources: dict[str, dict[str, str]] = Field(
        default_factory=lambda: copy.deepcopy(GPU_TRAINER_RESOURCES)
    )
    # the weight-fetch init container and the weight-sync sidecar of a sampler pod
    sync_resources: dict[str, dict[str, str]] = Field(
        default_factory=lambda: copy.deepcopy(GPU_SYNC_RESOURCES)
    )

    @model_validator(mode="after")
    def _check_device(self) -> AcceleratorClass:
        if self.device == "gpu":
            if not self.product_labels:
                raise ValueError("a gpu class needs productLabels (nvidia.com/gpu.product values)")
            if not self.compute_capability or self.memory_gib <= 0:
                raise ValueError("a gpu class needs computeCapability and memoryGib > 0")
        elif self.engine != "reference":
            raise ValueError("a cpu class runs engine reference (SGLang needs GPUs)")
        elif self.product_labels or self.gke_accelerators:
            raise ValueError("a cpu class has no GPU product labels (its pods request no GPU)")
        return self

    @property
    def gpu(self) -> bool:
        return self.device == "gpu"

    @property
    def sm(self) -> str:
        if not self.gpu:
            return "cpu"
        major, _, minor = self.compute_capability.partition(".")
        return f"sm{major}{minor or '0'}"

    def node_selector_terms(self) -> list[dict[str, Any]]:
        """Required node-affinity terms (ORed): GFD product labels, or GKE accelerator labels (none for a
        CPU class: its pods go wherever they fit and tolerate no GPU taint)."""
        if not self.product_labels:
            return []
        terms: list[dict[str, Any]] = [
            {
                "matchExpressions": [
                    {"key": PRODUCT_LABEL, "operator": "In", "values": list(self.product_labels)}
                ]
            }
        ]
        if self.gke_accelerators:
            terms.append(
                {
                    "matchExpressions": [
                        {"key": GKE_LABEL, "operator": "In", "values": list(self.gke_accelerators)}
                    ]
                }
            )
        return terms


_BASE_KV = ["auto", "bf16", "fp8_e4m3", "fp8_e5m2"]
_BLACKWELL_KV = [*_BASE_KV, "mxfp8", "nvfp4"]
_NVFP4_NEEDS_BLACKWELL = (
    "native NVFP4 needs Blackwell FP4 tensor cores (b200, b300, rtx-pro-6000); on {sm} SGLang could only "
    "run it as Marlin W4A16 weight-only, so use fp8 or bf16"
)
_FP8_W8A16_NOTE = (
    "FP8 W8A16 weight-only: A100 has no FP8 tensor cores, SGLang runs Marlin (FP8 block-128 weights, "
    "BF16 activations and compute)"
)
_MOE_ONLY = "MoE experts only: a dense model's linear layers stay BF16"
_MXFP4_HOPPER_NOTE = f"MXFP4 W4A16 without FP4 tensor cores (Triton/Marlin MoE kernels); {_MOE_ONLY}"


def _hopper_weight_formats() -> dict[str, FormatProfile]:
    """H100 and H200 (sm90) run the same kernels: native FP8 (DeepGEMM), MXFP4 only degraded."""
    return {
        "bf16": _BF16,
        "fp8": _fp8("deep_gemm"),
        "mxfp4": FormatProfile(mode="degraded", flags=["--quantization", "mxfp4"], note=_MXFP4_HOPPER_NOTE),
    }


def _blackwell_weight_formats(fp8_backend: str, fp4_backend: str) -> dict[str, FormatProfile]:
    """Blackwell (sm100/sm103/sm120) runs every format natively; only the GEMM backends differ."""
    return {
        "bf16": _BF16,
        "fp8": _fp8(fp8_backend),
        "nvfp4": _nvfp4(fp4_backend),
        "mxfp4": _MXFP4_NATIVE,
    }


def _fp8(backend: str) -> FormatProfile:
    return FormatProfile(
        mode="native",
        flags=["--quantization", "fp8", "--fp8-gemm-backend", backend],
        note=f"native FP8 W8A8 ({backend}): block-128 FP8 weights, activations FP8 per token-group of 128",
    )


def _nvfp4(backend: str) -> FormatProfile:
    return FormatProfile(
        mode="native",
        flags=["--quantization", "modelopt_fp4", "--fp4-gemm-backend", backend],
        note=f"native NVFP4 W4A4 ({backend}): ModelOpt NVFP4 checkpoint, dense and MoE layers",
    )


_MXFP4_NATIVE = FormatProfile(
    mode="native", flags=["--quantization", "mxfp4"], note=f"native MXFP4 W4A4; {_MOE_ONLY}"
)
_BF16 = FormatProfile(mode="native", flags=[], note="BF16, same precision as the trainer")
_REFERENCE_NOTE = (
    "emulated on CPU by the reference engine (rlfleet sampler serve --engine reference): {what}, "
    "BF16 activations; no GPU"
)


# HBM (GDDR7 on the RTX PRO 6000) bandwidth per GPU in TB/s, from NVIDIA's datasheets, of the SKU each
# class is priced at (SXM; PCIe and NVL parts of a class differ). Sampling in RL is decode: long
# rollouts, prompts prefilled once and prefix-cached; a decode step at a sampler's batch sizes reads
# every weight (and the KV cache) from memory and is bound by that bandwidth, not by the tensor TFLOPS
# that bound prefill, so the bandwidth ratio is the throughput ratio of the catalog's estimate.
DECODE_BANDWIDTH_TB_S: dict[str, float] = {
    "a100": 2.039,  # A100 80GB SXM: 2,039 GB/s (NVIDIA A100 Tensor Core GPU datasheet)
    "h100": 3.35,  # H100 SXM: 3.35 TB/s (NVIDIA H100 Tensor Core GPU datasheet)
    "h200": 4.8,  # H200 SXM: 4.8 TB/s (NVIDIA H200 Tensor Core GPU datasheet)
    "b200": 8.0,  # B200: 8 TB/s per GPU (NVIDIA DGX B200 / HGX B200 datasheet: 64 TB/s for 8 GPUs)
    "b300": 8.0,  # B300 (Blackwell Ultra): 8 TB/s per GPU (NVIDIA HGX B300 specifications)
    "rtx-pro-6000": 1.597,  # RTX PRO 6000 Blackwell Server Edition: 1,597 GB/s GDDR7 (NVIDIA datasheet)
}
# Bytes each weight reads per decode step in a weight format: bf16 2; fp8 1 (block-128 scales, one FP32
# per 128x128 block, are 0.02% more and left out; A100's W8A16 Marlin reads the same FP8 weights);
# nvfp4 0.5 + one FP8 E4M3 scale per 16 values = 0.5625; mxfp4 quantizes MoE experts only, a dense
# model's linear layers stay BF16, so it counts as bf16 (an MoE model decodes faster than that).
WEIGHT_BYTES_PER_PARAMETER: dict[str, float] = {"bf16": 2.0, "fp8": 1.0, "nvfp4": 0.5625, "mxfp4": 2.0}
THROUGHPUT_UNIT = "h100"  # decodeThroughput 1.0: this class at bf16


def catalog_decode_throughput(name: str, weight_formats: Mapping[str, FormatProfile]) -> dict[str, float]:
    """The built-in relative decode throughput of class `name` per weight format it runs: its bandwidth
    over H100's, times bf16's bytes per weight over the format's. The KV cache's reads do not shrink
    with the weight format, so at large batches a smaller format gains less than this."""
    bandwidth = DECODE_BANDWIDTH_TB_S[name] / DECODE_BANDWIDTH_TB_S[THROUGHPUT_UNIT]
    bf16 = WEIGHT_BYTES_PER_PARAMETER["bf16"]
    return {f: bandwidth * bf16 / WEIGHT_BYTES_PER_PARAMETER[f] for f in weight_formats}


def builtin_classes() -> dict[str, AcceleratorClass]:
    """The built-in catalog (a fresh copy)."""
    classes = [
        AcceleratorClass(
            name="a100",
            display_name="NVIDIA A100 (Ampere, sm80)",
            product_labels=[
                "NVIDIA-A100-SXM4-80GB",
                "NVIDIA-A100-SXM4-40GB",
                "NVIDIA-A100-80GB-PCIe",
                "NVIDIA-A100-PCIE-40GB",
            ],
            gke_accelerators=["nvidia-a100-80gb", "nvidia-tesla-a100"],
            compute_capability="8.0",
            memory_gib=80,
            weight_formats={
                "bf16": _BF16,
                "fp8": FormatProfile(mode="degraded", flags=["--quantization", "fp8"], note=_FP8_W8A16_NOTE),
            },
            unsupported={
                "nvfp4": _NVFP4_NEEDS_BLACKWELL.format(sm="sm80"),
                "mxfp4": "MXFP4 is not offered on sm80 (SGLang 0.5.23 quantizes only MoE experts in MXFP4, and the mxfp4 view is refused for Qwen3 models: docs/weights.md); use bf16 or fp8",
            },
            kv_cache_dtypes=list(_BASE_KV),
            default_tensor_parallel=1,
            cost_per_gpu_hour=1.79,
        ),
        AcceleratorClass(
            name="h100",
            display_name="NVIDIA H100 (Hopper, sm90)",
            product_labels=[
                "NVIDIA-H100-80GB-HBM3",
                "NVIDIA-H100-SXM5-80GB",
                "NVIDIA-H100-PCIe",
                "NVIDIA-H100-NVL",
            ],
            gke_accelerators=["nvidia-h100-80gb", "nvidia-h100-mega-80gb"],
            compute_capability="9.0",
            memory_gib=80,
            weight_formats=_hopper_weight_formats(),
            unsupported={"nvfp4": _NVFP4_NEEDS_BLACKWELL.format(sm="sm90")},
            kv_cache_dtypes=list(_BASE_KV),
            default_tensor_parallel=1,
            cost_per_gpu_hour=2.99,
        ),
        AcceleratorClass(
            name="h200",
            display_name="NVIDIA H200 (Hopper, sm90)",
            product_labels=["NVIDIA-H200", "NVIDIA-H200-NVL"],
            gke_accelerators=["nvidia-h200-141gb"],
            compute_capability="9.0",
            memory_gib=141,
            weight_formats=_hopper_weight_formats(),
            unsupported={"nvfp4": _NVFP4_NEEDS_BLACKWELL.format(sm="sm90")},
            kv_cache_dtypes=list(_BASE_KV),
            default_tensor_parallel=1,
            cost_per_gpu_hour=3.79,
        ),
        AcceleratorClass(
            name="b200",
            display_name="NVIDIA B200 (Blackwell, sm100)",
            product_labels=["NVIDIA-B200"],
            gke_accelerators=["nvidia-b200"],
            compute_capability="10.0",
            memory_gib=180,
            weight_formats=_blackwell_weight_formats(
                fp8_backend="flashinfer_trtllm", fp4_backend="flashinfer_cutlass"
            ),
            kv_cache_dtypes=list(_BLACKWELL_KV),
            default_tensor_parallel=1,
            cost_per_gpu_hour=5.99,
        ),
        AcceleratorClass(
            name="b300",
            display_name="NVIDIA B300 (Blackwell Ultra, sm103)",
            product_labels=["NVIDIA-B300-SXM6-AC", "NVIDIA-B300"],
            gke_accelerators=["nvidia-b300"],
            compute_capability="10.3",
            memory_gib=270,
            weight_formats=_blackwell_weight_formats(
                fp8_backend="flashinfer_trtllm", fp4_backend="flashinfer_cutlass"
            ),
            kv_cache_dtypes=list(_BLACKWELL_KV),
            default_tensor_parallel=1,
            cost_per_gpu_hour=7.49,
        ),
        AcceleratorClass(
            name="rtx-pro-6000",
            display_name="NVIDIA RTX PRO 6000 Blackwell Server Edition (sm120)",
            product_labels=[
                "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition",
                "NVIDIA-RTX-PRO-6000-Blackwell-Workstation-Edition",
            ],
            gke_accelerators=["nvidia-rtx-pro-6000"],
            compute_capability="12.0",
            memory_gib=96,
            weight_formats=_blackwell_weight_formats(fp8_backend="cutlass", fp4_backend="flashinfer_cudnn"),
            kv_cache_dtypes=list(_BLACKWELL_KV),
            default_tensor_parallel=1,
            cost_per_gpu_hour=1.89,
        ),
        AcceleratorClass(
            name="cpu",
            display_name="CPU (reference engine, precision emulated)",
            device="cpu",
            engine="reference",
            weight_formats={
                "bf16": FormatProfile(
                    flags=["--weight-format", "bf16"], note=_REFERENCE_NOTE.format(what="BF16 weights")
                ),
                "fp8": FormatProfile(
                    flags=["--weight-format", "fp8"],
                    note=_REFERENCE_NOTE.format(
                        what="the fp8 view's block-128 FP8 weights (served as stored)"
                    ),
                ),
                "nvfp4": FormatProfile(
                    flags=["--weight-format", "nvfp4"],
                    note=_REFERENCE_NOTE.format(what="the nvfp4 view's NVFP4 weights (served as stored)"),
                ),
            },
            unsupported={
                "mxfp4": "MXFP4 quantizes only MoE experts and the mxfp4 view is refused for dense Qwen3 models "
                "(docs/weights.md); use bf16, fp8 or nvfp4",
            },
            kv_cache_dtypes=["auto", "bf16", "fp8_e4m3"],
            default_tensor_parallel=1,
            cost_per_gpu_hour=0.0,
            sampler_resources=copy.deepcopy(CPU_SAMPLER_RESOURCES),
            trainer_resources=copy.deepcopy(CPU_TRAINER_RESOURCES),
            sync_resources=copy.deepcopy(CPU_SYNC_RESOURCES),
        ),
    ]
    for c in classes:  # the CPU class has no figure: its tokens/s say nothing of a GPU's
        if c.name in DECODE_BANDWIDTH_TB_S:
            c.decode_throughput = catalog_decode_throughput(c.name, c.weight_formats)
    return {c.name: c for c in classes}


class SpotNodeRequirement(_Model):
    """One node label requirement of the spot flavor (core/v1 NodeSelectorRequirement, In / Exists)."""

    key: str = Field(min_length=1, max_length=317)
    operator: Literal["In", "Exists"] = "In"
    values: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_values(self) -> SpotNodeRequirement:
        if (self.operator == "In") != bool(self.values):
            raise ValueError("operator In takes values, Exists none")
        return self


class SpotToleration(_Model):
    """One toleration of the spot flavor (core/v1 Toleration)."""

    key: str = Field(min_length=1, max_length=317)
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


class SpotFlavor(_Model):
    """Where a `spot: true` sampler group's pods go: nodes matching ONE of `nodeLabels` (ORed, each
    ANDed with the accelerator class's terms), tolerating `tolerations`. The built-in flavor names the
    spot capacity labels and taints of the common providers, so one catalog serves GKE, EKS (managed
    node groups and Karpenter) and AKS; a catalog override's top-level `spot:` replaces it whole (e.g. an
    on-prem pool's own label)."""

    node_labels: list[SpotNodeRequirement] = Field(min_length=1)
    tolerations: list[SpotToleration] = Field(default_factory=list)

    def node_selector_terms(self) -> list[dict[str, Any]]:
        """The required node terms (ORed): one per spot label."""
        terms: list[dict[str, Any]] = []
        for r in self.node_labels:
            requirement: dict[str, Any] = {"key": r.key, "operator": r.operator}
            if r.operator == "In":
                requirement["values"] = list(r.values)
            terms.append({"matchExpressions": [requirement]})
        return terms

    def toleration_wire(self) -> list[dict[str, Any]]:
        """The tolerations in core/v1 wire form."""
        return [t.model_dump(by_alias=True, exclude_none=True) for t in self.tolerations]


# The providers' spot capacity labels and taints: GKE Spot VMs label cloud.google.com/gke-spot=true (the
# taint of that key is the usual way to keep other pods off them); EKS managed node groups label
# eks.amazonaws.com/capacityType=SPOT, Karpenter karpenter.sh/capacity-type=spot; AKS spot node pools
# carry kubernetes.azure.com/scalesetpriority=spot as label and NoSchedule taint.
BUILTIN_SPOT_FLAVOR = SpotFlavor(
    node_labels=[
        SpotNodeRequirement(key="cloud.google.com/gke-spot", values=["true"]),
        SpotNodeRequirement(key="eks.amazonaws.com/capacityType", values=["SPOT"]),
        SpotNodeRequirement(key="karpenter.sh/capacity-type", values=["spot"]),
        SpotNodeRequirement(key="kubernetes.azure.com/scalesetpriority", values=["spot"]),
    ],
    tolerations=[
        SpotToleration(key="cloud.google.com/gke-spot", value="true", effect="NoSchedule"),
        SpotToleration(key="kubernetes.azure.com/scalesetpriority", value="spot", effect="NoSchedule"),
    ],
)


@dataclass(frozen=True)
class Catalog:
    """A set of accelerator classes by name."""

    classes: Mapping[str, AcceleratorClass]
    source: str = "built-in"
    spot: SpotFlavor = field(
        default_factory=lambda: BUILTIN_SPOT_FLAVOR
    )  # where `spot: true` groups' pods go

    def names(self) -> list[str]:
        return sorted(self.classes)

    def get(self, name: str) -> AcceleratorClass:
        try:
            return self.classes[name]
        except KeyError:
            raise CatalogError(
                f"unknown accelerator {name!r}: the catalog ({self.source}) has {', '.join(self.names())}"
            ) from None

    def decode_throughput(self, accelerator: str, weight_format: str) -> float | None:
        """Decode tokens/s per GPU of `accelerator` at `weight_format` relative to H100 at bf16 (the
        class's `decodeThroughput`); None for an unknown class or a format without a figure."""
        cls = self.classes.get(accelerator)
        return None if cls is None else cls.decode_throughput.get(weight_format)


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if value is None:  # `fp8: null` removes an entry (e.g. a format a class must not run here)
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def catalog_from_mapping(data: Any, source: str = "override") -> Catalog:
    """Built-in classes with `data` ({"classes": {name: fields}}) merged over them."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping) or not isinstance(data.get("classes", {}), Mapping):
        raise CatalogError(f"catalog {source}: expected a mapping with a 'classes' mapping")
    unknown_top = set(data) - {"classes", "spot"}
    if unknown_top:
        raise CatalogError(
            f"catalog {source}: unknown top-level keys {sorted(unknown_top)} (expected 'classes', 'spot')"
        )
    spot = BUILTIN_SPOT_FLAVOR
    if data.get("spot") is not None:
        try:
            spot = SpotFlavor.model_validate(data["spot"])
        except ValidationError as exc:
            errs = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
            raise CatalogError(f"catalog {source}: spot is invalid: {errs}") from None
    builtin = builtin_classes()
    merged: dict[str, AcceleratorClass] = dict(builtin)
    for name, fields in dict(data.get("classes", {})).items():
        if not isinstance(fields, Mapping):
            raise CatalogError(f"catalog {source}: class {name!r} must be a mapping")
        base = builtin[name].model_dump(by_alias=True) if name in builtin else {"name": name}
        try:
            merged[name] = AcceleratorClass.model_validate(_deep_merge(base, {**fields, "name": name}))
        except ValidationError as exc:
            errs = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
            raise CatalogError(f"catalog {source}: class {name!r} is invalid: {errs}") from None
    return Catalog(classes=merged, source=source, spot=spot)


def load_catalog(path: str | Path | None = None) -> Catalog:
    """The catalog: built-in, merged with the YAML file at `path` if given."""
    if path is None:
        return Catalog(classes=builtin_classes())
    path = Path(path)
    try:
        data = read_yaml(path)
    except ValueError as exc:
        raise CatalogError(f"catalog {path}: {exc}") from None
    return catalog_from_mapping(data, source=str(path))


@lru_cache(maxsize=8)
def _cached(path: str | None) -> Catalog:
    return load_catalog(path)


def get_catalog() -> Catalog:
    """The catalog in effect: built-in, or overridden by the file named in $RLFLEET_CATALOG."""
    return _cached(os.environ.get(CATALOG_ENV) or None)


def check_group(
    accelerator: str, weight_format: str, kv_cache_dtype: str = "auto", catalog: Catalog | None = None
) -> FormatProfile:
    """The format profile the class uses for this group, or CatalogError saying why not."""
    cat = catalog or get_catalog()
    cls = cat.get(accelerator)
    profile = cls.weight_formats.get(weight_format)
    if profile is None:
        why = cls.unsupported.get(weight_format, "not in the catalog's support list")
        raise CatalogError(
            f"accelerator {accelerator} ({cls.sm}) cannot run weightFormat {weight_format}: {why} "
            f"(supported: {', '.join(cls.weight_formats)})"
        )
    if kv_cache_dtype not in cls.kv_cache_dtypes:
        raise CatalogError(
            f"accelerator {accelerator} ({cls.sm}) cannot use kvCacheDtype {kv_cache_dtype} "
            f"(supported: {', '.join(cls.kv_cache_dtypes)}; {kv_note(cls)})"
        )
    return profile


def kv_note(cls: AcceleratorClass) -> str:
    """Why a class's KV-cache dtypes are what they are (error messages, CRD rule messages)."""
    if cls.engine == "reference":
        return "the reference engine emulates a bf16 or fp8_e4m3 KV cache"
    return "mxfp8 and nvfp4 KV caches need Blackwell"


REFERENCE_ONE_PROCESS = (
    "runs the reference engine, one CPU process per replica: tensorParallel must be 1 (or unset)"
)


def check_tensor_parallel(cls: AcceleratorClass, tensor_parallel: int | None) -> None:
    """CatalogError if a group of `cls` asks for a tensor parallelism its engine cannot run."""
    if cls.engine == "reference" and tensor_parallel not in (None, 1):
        raise CatalogError(f"accelerator {cls.name} {REFERENCE_ONE_PROCESS} (got {tensor_parallel})")


def selection_reason(cls: AcceleratorClass, weight_format: str, profile: FormatProfile) -> str:
    """Why a group runs where it runs (SamplerGroup status `selectionReason`)."""
    if not cls.gpu:
        return (
            f"{cls.display_name}: no GPU (any node the pod fits, no nvidia.com/gpu toleration); "
            f"{weight_format} {profile.mode} ({profile.note})"
        )
    terms = [f"{PRODUCT_LABEL} in [{', '.join(cls.product_labels)}]"]
    if cls.gke_accelerators:
        terms.append(f"{GKE_LABEL} in [{', '.join(cls.gke_accelerators)}]")
    return f"{cls.display_name}: nodes with {' or '.join(terms)}; {weight_format} {profile.mode} ({profile.note})"


@dataclass(frozen=True)
class GroupPrecision:
    """What a group's class runs for its format (SamplerGroup status), without a launch."""

    accelerator: str
    mode: Literal["native", "degraded"]
    note: str
    selection_reason: str

    @property
    def degraded(self) -> bool:
        return self.mode == "degraded"


def group_precision(group: Any, catalog: Catalog | None = None) -> GroupPrecision:
    """The class, mode and note a SamplerGroupSpec gets (CatalogError if the class cannot run it)."""
    cat = catalog or get_catalog()
    cls = cat.get(group.accelerator)
    profile = check_group(cls.name, group.weight_format, group.kv_cache_dtype, catalog=cat)
    return GroupPrecision(
        cls.name, profile.mode, profile.note, selection_reason(cls, group.weight_format, profile)
    )
