"""The catalog's SGLang launches as the tests build them (served model name m), what they ask of a
checkpoint (its config.json `quantization_config`, the launch's `--quantization`), and a stand-in for the
engine program to run the engine container's real /bin/sh launch script with."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlfleet.catalog import AcceleratorClass, SGLangLaunch, sglang_launch

QUANTIZATION_CONFIGS: dict[str, dict[str, Any] | None] = {
    "bf16": None,
    "fp8": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
    "nvfp4": {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "exclude_modules": ["lm_head"],
    },
    "mxfp4": {"quant_method": "mxfp4", "group_size": 32, "modules_to_not_convert": ["lm_head"]},
}
"""config.json `quantization_config` per weight view, as docs/weights.md publishes it and SGLang 0.5.23
auto-detects it (tests/api/test_api_catalog.py runs SGLang's own resolution on these). Written out here,
not read from rlfleet/numerics/views.py: the tests hold the product to them."""


def launch_of(
    accelerator: AcceleratorClass,
    weight_format: str,
    model_path: str | Path,
    weight_version: int | str = 0,
    extra_args: Sequence[str] = (),
) -> SGLangLaunch:
    """The catalog's SGLang launch of `weight_format` on `accelerator` serving `model_path` as model m."""
    return sglang_launch(
        accelerator=accelerator,
        weight_format=weight_format,
        model_path=str(model_path),
        served_model_name="m",
        weight_version=weight_version,
        extra_args=extra_args,
    )


def launch_quantization(accelerator: AcceleratorClass, weight_format: str, model_path: Path) -> str | None:
    """The `--quantization` value of `launch_of` (None: the launch has no such flag)."""
    flags = launch_of(accelerator, weight_format, model_path).flags
    return flags[flags.index("--quantization") + 1] if "--quantization" in flags else None


def argv_printing_path(directory: Path, program: str = "python3") -> dict[str, str]:
    """This process's environment with `directory` first on PATH, where `program` is now a stub that
    prints the arguments it was started with (argv[1:]) as JSON: the engine a launch script execs."""
    directory.mkdir(parents=True, exist_ok=True)
    stub = directory / program
    stub.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    stub.chmod(0o755)
    return {**os.environ, "PATH": f"{directory}:{os.environ['PATH']}"}
