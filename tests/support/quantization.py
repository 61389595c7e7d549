"""The quantization a checkpoint declares (its config.json `quantization_config`) and the one the
catalog's SGLang launch asks for (`--quantization`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlfleet.catalog import AcceleratorClass, sglang_launch

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


def launch_quantization(accelerator: AcceleratorClass, weight_format: str, model_path: Path) -> str | None:
    """The `--quantization` value of the catalog's SGLang launch of `weight_format` on `accelerator` from
    `model_path` (None: the launch has no such flag)."""
    launch = sglang_launch(
        accelerator=accelerator,
        weight_format=weight_format,
        model_path=str(model_path),
        served_model_name="m",
        weight_version=0,
    )
    flags = launch.flags
    return flags[flags.index("--quantization") + 1] if "--quantization" in flags else None
