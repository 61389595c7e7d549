"""The accelerator catalog and the SGLang launch function: every class x format x KV dtype.

The expected flags below are written out by hand from references.md (SGLang 0.5.23), independently of
the catalog's data, so a wrong entry in the catalog fails here."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from rlfleet.api import KV_CACHE_DTYPES, WEIGHT_FORMATS, SamplerGroupSpec
from rlfleet.catalog import (
    CATALOG_ENV,
    CatalogError,
    check_group,
    cost_per_1m_tokens,
    get_catalog,
    load_catalog,
    sglang_launch,
    sglang_launch_for_group,
)

CATALOG = load_catalog(None)
FP8 = ["--quantization", "fp8"]
NVFP4 = ["--quantization", "modelopt_fp4", "--fp4-gemm-backend"]
MXFP4 = ["--quantization", "mxfp4"]
# (class, format) -> (precision flags, degraded?)
EXPECTED: dict[tuple[str, str], tuple[list[str], bool]] = {
    ("a100", "bf16"): ([], False),
    ("a100", "fp8"): (FP8, True),  # Marlin W8A16 weight-only
    ("h100", "bf16"): ([], False),
    ("h100", "fp8"): ([*FP8, "--fp8-gemm-backend", "deep_gemm"], False),
    ("h100", "mxfp4"): (MXFP4, True),
    ("h200", "bf16"): ([], False),
    ("h200", "fp8"): ([*FP8, "--fp8-gemm-backend", "deep_gemm"], False),
    ("h200", "mxfp4"): (MXFP4, True),
    ("b200", "bf16"): ([], False),
    ("b200", "fp8"): ([*FP8, "--fp8-gemm-backend", "flashinfer_trtllm"], False),
    ("b200", "nvfp4"): ([*NVFP4, "flashinfer_cutlass"], False),
    ("b200", "mxfp4"): (MXFP4, False),
    ("b300", "bf16"): ([], False),
    ("b300", "fp8"): ([*FP8, "--fp8-gemm-backend", "flashinfer_trtllm"], False),
    ("b300", "nvfp4"): ([*NVFP4, "flashinfer_cutlass"], False),
    ("b300", "mxfp4"): (MXFP4, False),
    ("rtx-pro-6000", "bf16"): ([], False),
    ("rtx-pro-6000", "fp8"): ([*FP8, "--fp8-gemm-backend", "cutlass"], False),
    ("rtx-pro-6000", "nvfp4"): ([*NVFP4, "flashinfer_cudnn"], False),
    ("rtx-pro-6000", "mxfp4"): (MXFP4, False),
}
REJECTED_FORMAT_WHY = {
    ("a100", "nvfp4"): "native NVFP4 needs Blackwell",
    ("a100", "mxfp4"): "MXFP4 kernels need sm90",
    ("h100", "nvfp4"): "native NVFP4 needs Blackwell",
    ("h200", "nvfp4"): "native NVFP4 needs Blackwell",
}
BLACKWELL = {"b200", "b300", "rtx-pro-6000"}
SM = {
    "a100": "sm80",
    "h100": "sm90",
    "h200": "sm90",
    "b200": "sm100",
    "b300": "sm103",
    "rtx-pro-6000": "sm120",
}


def kv_ok(cls: str, kv: str) -> bool:
    return kv in ("auto", "bf16", "fp8_e4m3", "fp8_e5m2") or cls in BLACKWELL


def test_classes_and_node_labels() -> None:
    assert CATALOG.names() == sorted(SM)
    for name, sm in SM.items():
        assert CATALOG.get(name).sm == sm
    a100 = CATALOG.get("a100")
    assert {
        "NVIDIA-A100-SXM4-80GB",
        "NVIDIA-A100-SXM4-40GB",
        "NVIDIA-A100-80GB-PCIe",
        "NVIDIA-A100-PCIE-40GB",
    } <= set(a100.product_labels)
    h100 = CATALOG.get("h100")
    assert {"NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-SXM5-80GB", "NVIDIA-H100-PCIe", "NVIDIA-H100-NVL"} <= set(
        h100.product_labels
    )
    assert CATALOG.get("b300").product_labels[0] == "NVIDIA-B300-SXM6-AC"
    assert "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition" in CATALOG.get("rtx-pro-6000").product_labels
    terms = CATALOG.get("h200").node_selector_terms()
    assert terms == [
        {
            "matchExpressions": [
                {
                    "key": "nvidia.com/gpu.product",
                    "operator": "In",
                    "values": ["NVIDIA-H200", "NVIDIA-H200-NVL"],
                }
            ]
        },
        {
            "matchExpressions": [
                {"key": "cloud.google.com/gke-accelerator", "operator": "In", "values": ["nvidia-h200-141gb"]}
            ]
        },
    ]
    # no product string belongs to two classes (selection is by label, never by order)
    labels = [label for n in CATALOG.names() for label in CATALOG.get(n).product_labels]
    assert len(labels) == len(set(labels))


@pytest.mark.parametrize(
    ("cls", "fmt", "kv"), list(itertools.product(sorted(SM), WEIGHT_FORMATS, KV_CACHE_DTYPES)),
    ids=lambda v: str(v),
)  # fmt: skip
def test_every_class_format_kv_combination(cls: str, fmt: str, kv: str) -> None:
    accel = CATALOG.get(cls)
    kwargs = dict(
        accelerator=accel, weight_format=fmt, kv_cache_dtype=kv, model_path="/m", served_model_name="m"
    )
    if (cls, fmt) in EXPECTED and kv_ok(cls, kv):
        launch = sglang_launch(**kwargs)
        flags, degraded = EXPECTED[(cls, fmt)]
        kv_flags = [] if kv == "auto" else ["--kv-cache-dtype", kv]
        assert launch.flags == flags + kv_flags
        assert launch.argv[-len(launch.flags) :] == launch.flags if launch.flags else True
        assert launch.degraded is degraded
        assert launch.argv[:3] == ["python3", "-m", "sglang.launch_server"]
        assert launch.argv.count("--quantization") == (1 if fmt != "bf16" else 0)
        assert launch.argv[launch.argv.index("--tp-size") + 1] == "1"
        assert "--enable-metrics" in launch.argv
    else:
        with pytest.raises(CatalogError) as info:
            sglang_launch(**kwargs)
        msg = str(info.value)
        assert f"accelerator {cls} ({SM[cls]})" in msg
        if (cls, fmt) not in EXPECTED:
            assert f"cannot run weightFormat {fmt}" in msg and REJECTED_FORMAT_WHY[(cls, fmt)] in msg
        else:
            assert f"cannot use kvCacheDtype {kv}" in msg and "need Blackwell" in msg


def test_launch_for_group_spec_full_command_line() -> None:
    spec = SamplerGroupSpec.model_validate(
        {
            "name": "h100-fp8", "accelerator": "h100", "weightFormat": "fp8", "kvCacheDtype": "fp8_e4m3",
            "tensorParallel": 2, "extraArgs": ["--mem-fraction-static", "0.8"],
            "model": {"name": "qwen", "path": "/weights/v0/fp8"}, "port": 31000,
        }
    )  # fmt: skip
    launch = sglang_launch_for_group(spec, weight_version=7)
    assert launch.argv == [
        "python3", "-m", "sglang.launch_server",
        "--model-path", "/weights/v0/fp8", "--served-model-name", "qwen",
        "--host", "0.0.0.0", "--port", "31000", "--tp-size", "2", "--dtype", "bfloat16", "--enable-metrics",
        "--sampling-mask-max-tokens", "4096", "--weight-version", "7",
        "--quantization", "fp8", "--fp8-gemm-backend", "deep_gemm", "--kv-cache-dtype", "fp8_e4m3",
        "--mem-fraction-static", "0.8",
    ]  # fmt: skip
    assert launch.tensor_parallel == 2 and not launch.degraded
    assert "NVIDIA-H100-80GB-HBM3" in launch.selection_reason and "native" in launch.selection_reason


def test_unknown_class_is_a_clear_error() -> None:
    with pytest.raises(
        CatalogError, match=r"unknown accelerator 'v100': the catalog \(built-in\) has a100, b200"
    ):
        check_group("v100", "bf16")


def test_override_file_merges_and_adds_classes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "catalog.yaml"
    path.write_text(
        "classes:\n"
        "  h100:\n    costPerGpuHour: 1.5\n    productLabels: [NVIDIA-H100-CUSTOM]\n"
        "  a100:\n    weightFormats:\n      nvfp4: {mode: degraded, flags: [--quantization, modelopt_fp4, --fp4-gemm-backend, marlin],"
        " note: Marlin W4A16}\n"
        "  h200:\n    weightFormats: {mxfp4: null}\n"
        "  l4:\n    displayName: NVIDIA L4\n    productLabels: [NVIDIA-L4]\n    computeCapability: '8.9'\n"
        "    memoryGib: 24\n    weightFormats: {bf16: {}}\n    kvCacheDtypes: [auto]\n    costPerGpuHour: 0.7\n"
    )
    monkeypatch.setenv(CATALOG_ENV, str(path))
    cat = get_catalog()
    assert cat.get("h100").cost_per_gpu_hour == 1.5 and cat.get("h100").product_labels == [
        "NVIDIA-H100-CUSTOM"
    ]
    assert cat.get("h100").weight_formats["fp8"].flags[-1] == "deep_gemm"  # untouched fields kept
    assert check_group("a100", "nvfp4").mode == "degraded"  # an override can enable Marlin W4A16
    assert cat.get("l4").sm == "sm89" and "l4" in cat.names()
    assert list(cat.get("h200").weight_formats) == ["bf16", "fp8"]  # null removed mxfp4
    monkeypatch.delenv(CATALOG_ENV)
    with pytest.raises(CatalogError, match="cannot run weightFormat nvfp4"):
        check_group("a100", "nvfp4")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("classes: [a]\n", "expected a mapping with a 'classes' mapping"),
        ("klasses: {}\n", "unknown top-level keys"),
        ("classes:\n  l4: {displayName: x}\n", "class 'l4' is invalid"),
        ("classes:\n  h100: {memoryGib: -1}\n", "memoryGib"),
        ("classes: {unclosed\n", "not valid YAML"),
    ],
)
def test_bad_override_files_are_clear_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(CatalogError, match=message):
        load_catalog(path)


def test_cost_per_million_tokens() -> None:
    b200 = CATALOG.get("b200")
    # 8 GPUs at 5.99 $/h delivering 10,000 tok/s: 47.92 $/h / 36e6 tok/h * 1e6
    assert cost_per_1m_tokens(b200, 8, 10_000.0) == pytest.approx(5.99 * 8 / 36.0)
    assert cost_per_1m_tokens(b200, 8, 0.0) is None
