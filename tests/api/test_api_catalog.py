"""The accelerator catalog and the SGLang launch function: every class x format x KV dtype.

The expected flags below are written out by hand from references.md (SGLang 0.5.23), independently of
the catalog's data, so a wrong entry in the catalog fails here."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from support.sglang_launches import QUANTIZATION_CONFIGS, argv_printing_path, launch_of, launch_quantization

from rlfleet.api import KV_CACHE_DTYPES, WEIGHT_FORMATS, SamplerGroupSpec
from rlfleet.catalog import (
    CATALOG_ENV,
    CatalogError,
    check_group,
    engine_launch_for_group,
    get_catalog,
    load_catalog,
    sglang_launch,
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
    ("a100", "mxfp4"): "MXFP4 is not offered on sm80",
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
    assert CATALOG.names() == sorted([*SM, "cpu"])
    assert [n for n in CATALOG.names() if CATALOG.get(n).gpu] == sorted(
        SM
    )  # every other class is a GPU class
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
    ("cls", "fmt", "kv"),
    list(itertools.product(sorted(SM), WEIGHT_FORMATS, KV_CACHE_DTYPES)),
    ids=lambda v: str(v),
)
def test_every_class_format_kv_combination(cls: str, fmt: str, kv: str) -> None:
    accel = CATALOG.get(cls)
    kwargs = dict(
        accelerator=accel,
        weight_format=fmt,
        kv_cache_dtype=kv,
        model_path=f"/weights-cache/v3-{fmt}",
        served_model_name="m",
        weight_version=3,
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
        # launched from the view's own local checkpoint, labelled with its version
        assert launch.argv[launch.argv.index("--model-path") + 1] == f"/weights-cache/v3-{fmt}"
        assert launch.argv[launch.argv.index("--weight-version") + 1] == "3"
        assert launch.argv.count("--weight-version") == 1 and launch.argv.count("--model-path") == 1
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
            "name": "h100-fp8",
            "accelerator": "h100",
            "weightFormat": "fp8",
            "kvCacheDtype": "fp8_e4m3",
            "tensorParallel": 2,
            "extraArgs": ["--mem-fraction-static", "0.8"],
            "model": {"name": "qwen", "path": "Qwen/Qwen3-8B"},
            "port": 31000,
        }
    )
    launch = engine_launch_for_group(spec, model_path="/weights/v0/fp8", weight_version=7)
    assert launch.argv == [
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/weights/v0/fp8",
        "--served-model-name",
        "qwen",
        "--host",
        "0.0.0.0",
        "--port",
        "31000",
        "--tp-size",
        "2",
        "--dtype",
        "bfloat16",
        "--enable-metrics",
        "--sampling-mask-max-tokens",
        "4096",
        "--weight-version",
        "7",
        "--quantization",
        "fp8",
        "--fp8-gemm-backend",
        "deep_gemm",
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--mem-fraction-static",
        "0.8",
    ]
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


# --- pre-quantized checkpoints: SGLang 0.5.23's own quantization resolution ---------------------------

SGLANG = Path(__file__).resolve().parents[2] / ".venv/lib/python3.11/site-packages/sglang"


def sglang_resolve(quantization: str | None, quant_config: dict | None, model_dir: Path) -> str | None:
    """SGLang 0.5.23's ModelConfig._verify_quantization (the real method) on a checkpoint whose
    config.json carries `quant_config`: the quantization method the server would run, or ValueError.
    Only the attributes the method reads are provided (no GPU, no model load)."""
    import types

    from sglang.srt.configs.model_config import ModelConfig

    fake = types.SimpleNamespace(
        quantization=quantization,
        hf_config=types.SimpleNamespace(quantization_config=quant_config),
        model_path=str(model_dir),
        is_draft_model=False,
        is_draft_quantization_explicit=False,
    )
    for name in ("_parse_quant_hf_config", "_parse_modelopt_quant_config", "_find_quant_modelslim_config"):
        setattr(fake, name, types.MethodType(getattr(ModelConfig, name), fake))
    ModelConfig._verify_quantization(fake)  # type: ignore[arg-type]
    return fake.quantization


@pytest.mark.parametrize(("cls", "fmt"), sorted(EXPECTED), ids=lambda v: str(v))
def test_precision_flags_confirm_the_views_checkpoint_in_sglang(
    cls: str, fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The catalog's --quantization for a format is exactly what SGLang detects from that view's
    checkpoint (so it confirms it), and the weight-sync fetcher's check expects the same method.

    Stub: SGLang registers "mxfp4" only when `is_cpu() or is_cuda() or ...` (layers/quantization/
    __init__.py, checked below); this CPU-only build is neither, so the test registers the real
    Mxfp4Config the way a CUDA build does."""
    from sglang.srt.layers import quantization as q
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4Config

    from rlfleet.sampler.launch_checkpoint import VIEW_QUANT_METHODS

    source = (SGLANG / "srt/layers/quantization/__init__.py").read_text()
    assert "if is_cpu() or is_cuda() or _is_gfx95_supported or is_xpu():" in source
    assert '"mxfp4": Mxfp4Config,' in source
    monkeypatch.setitem(q.QUANTIZATION_METHODS, "mxfp4", Mxfp4Config)

    flag = launch_quantization(CATALOG.get(cls), fmt, tmp_path)
    detected = sglang_resolve(None, QUANTIZATION_CONFIGS[fmt], tmp_path)
    assert detected == VIEW_QUANT_METHODS[fmt] == flag
    assert sglang_resolve(flag, QUANTIZATION_CONFIGS[fmt], tmp_path) == detected
    # The flag on a checkpoint of ANOTHER quantized format: SGLang refuses some pairs and silently runs
    # others (ModelOpt configs override the flag; modelopt_fp4 accepts an fp8 checkpoint and
    # re-quantizes its MoE experts). The flag is no guard, hence the fetcher's check_launchable.
    for other in sorted({"fp8", "nvfp4", "mxfp4"} - {fmt}):
        if flag is not None:
            try:
                outcome = sglang_resolve(flag, QUANTIZATION_CONFIGS[other], tmp_path)
            except ValueError as exc:
                assert "does not match" in str(exc)
                outcome = "refused"
            assert outcome == CROSS_FORMAT[(flag, other)], (flag, other)


CROSS_FORMAT = {  # (--quantization, checkpoint view) -> what SGLang 0.5.23 does
    ("fp8", "nvfp4"): "modelopt_fp4",
    ("fp8", "mxfp4"): "refused",
    ("modelopt_fp4", "fp8"): "modelopt_fp4",
    ("modelopt_fp4", "mxfp4"): "refused",
    ("mxfp4", "fp8"): "refused",
    ("mxfp4", "nvfp4"): "modelopt_fp4",
}


def test_online_quantization_of_a_bf16_checkpoint_is_silent_in_sglang(tmp_path: Path) -> None:
    """Why the fetcher checks the checkpoint (sampler/sync.py check_launchable): SGLang accepts
    `--quantization fp8` / `modelopt_fp4` on a BF16 checkpoint without a word (online quantization,
    whose model takes no later /update_weights_from_disk)."""
    assert sglang_resolve("fp8", None, tmp_path) == "fp8"
    assert sglang_resolve("modelopt_fp4", None, tmp_path) == "modelopt_fp4"


def test_precision_notes_say_what_sglang_really_runs() -> None:
    """The notes shown in SamplerGroup status, held against the SGLang 0.5.23 source lines they rest on."""
    fp8_utils = (SGLANG / "srt/layers/quantization/fp8_utils.py").read_text()
    modelopt = (SGLANG / "srt/layers/quantization/modelopt_quant.py").read_text()
    mxfp4 = (SGLANG / "srt/layers/quantization/mxfp4.py").read_text()
    assert "return 80 <= sm < 89" in fp8_utils  # Marlin FP8 (weight-only) on sm80-sm88
    assert "Use --fp4-gemm-backend marlin on SM80-SM90." in modelopt  # no native FP4 GEMM below SM100
    assert "elif isinstance(layer, FusedMoE):" in mxfp4 and "return Mxfp4MoEMethod(prefix=prefix)" in mxfp4

    a100 = CATALOG.get("a100").weight_formats["fp8"]
    assert a100.mode == "degraded" and "W8A16" in a100.note and "Marlin" in a100.note
    for cls in ("a100", "h100", "h200"):
        assert "Marlin W4A16" in CATALOG.get(cls).unsupported["nvfp4"]
    for cls in SM:  # the GPU classes (SGLang); the cpu class emulates (tests/api/test_api_cpu_class.py)
        profiles = CATALOG.get(cls).weight_formats
        if "mxfp4" in profiles:
            assert "MoE experts only" in profiles["mxfp4"].note and "BF16" in profiles["mxfp4"].note
        if "nvfp4" in profiles:
            assert "W4A4" in profiles["nvfp4"].note and profiles["nvfp4"].mode == "native"
    for cls in ("h100", "h200", "b200", "b300", "rtx-pro-6000"):
        assert "W8A8" in CATALOG.get(cls).weight_formats["fp8"].note


def test_checkpoint_engine_flags_return_routed_experts_for_a_moe_only() -> None:
    """THE decision of the flags a checkpoint calls for, on the tiny models' real HF configs: a
    Qwen3-MoE gets SGLang's routed-experts switch, a dense Qwen3 (whose config has no
    num_experts_per_tok, which SGLang's capturer reads: tests/sglang_contract/test_contract_launch.py)
    and a view without config.json get nothing."""
    from rlfleet.catalog import checkpoint_engine_flags
    from rlfleet.tiny_qwen3 import TinyQwen3

    dense = TinyQwen3().hf_config().to_dict()
    moe = TinyQwen3(architecture="qwen3_moe").hf_config().to_dict()
    assert "num_experts_per_tok" not in dense and moe["num_experts_per_tok"] == 2
    assert checkpoint_engine_flags(moe) == ["--enable-return-routed-experts"]
    assert checkpoint_engine_flags(dense) == []
    assert checkpoint_engine_flags(None) == []


def test_launch_from_file_runs_the_argv_with_the_files_version_and_dir(tmp_path: Path) -> None:
    """The engine container's /bin/sh wrapper (real sh; `python3` is a stub printing its argv): argv
    exactly as sglang_launch builds it with the launch file's version and directory, plus the flags of
    its second line for SGLang (`checkpoint_flags=True`), none for the reference engine; a missing file
    is one clear line and exit 1."""
    import json
    import subprocess

    from rlfleet.catalog import MODEL_DIR_REF, WEIGHT_VERSION_REF, launch_from_file

    accel, template = CATALOG.get("b200"), ["--chat-template", "it's $HOME *"]
    placeholder = launch_of(accel, "nvfp4", MODEL_DIR_REF, WEIGHT_VERSION_REF, template)
    launch_file = tmp_path / "cache" / "launch"
    command = launch_from_file(placeholder.argv, str(launch_file), checkpoint_flags=True)
    unflagged = launch_from_file(placeholder.argv, str(launch_file), checkpoint_flags=False)
    env = argv_printing_path(tmp_path / "bin")
    for script in (command, unflagged):
        missing = subprocess.run(script, capture_output=True, text=True, env=env)
        assert (
            missing.returncode == 1
            and missing.stderr.strip() == f"no verified weights: {launch_file} missing"
        )
    launch_file.parent.mkdir()
    real = launch_of(accel, "nvfp4", f"{tmp_path}/cache/v12-nvfp4", 12, template)
    expected = real.argv[1:]

    def launched(script: list[str], text: str) -> list[str]:
        launch_file.write_text(text)
        return json.loads(subprocess.run(script, capture_output=True, text=True, env=env, check=True).stdout)

    dense, moe = (
        f"12 {tmp_path}/cache/v12-nvfp4\n",
        f"12 {tmp_path}/cache/v12-nvfp4\n--enable-return-routed-experts\n",
    )
    assert launched(command, dense) == expected
    assert launched(command, moe) == [*expected, "--enable-return-routed-experts"]
    assert launched(command, moe.rstrip("\n")) == [
        *expected,
        "--enable-return-routed-experts",
    ]  # no last newline
    assert launched(unflagged, dense) == launched(unflagged, moe) == expected
    # a flag line is split into words, never globbed (a `*` stays a `*`)
    assert launched(command, f"{dense}--a *\n") == [*expected, "--a", "*"]
