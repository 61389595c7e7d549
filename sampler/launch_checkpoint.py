"""The checkpoint an engine launches from and reloads: which version of a view to take, whether SGLang
would load a directory in the view's format, and the cache's launch file that names it.

SGLang must START from a checkpoint already in its group's format (`/update_weights_from_disk`
reloads into the launch-time model with its launch-time quantization method; docs/weights.md), so
the sidecar checks every directory it hands the engine with `check_launchable`, and the launch file
("<version> <dir>", then the checkpoint's own SGLang flags if any; rlfleet.catalog.LAUNCH_FILE) tells a
(re)starting engine container where to start and with what (`checkpoint_flags_of`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rlfleet.catalog import LAUNCH_FILE, checkpoint_engine_flags
from rlfleet.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE


class NotLaunchableError(ValueError):
    """A downloaded view is not a checkpoint SGLang would load in the view's format."""


def _hf_config(directory: Path) -> dict[str, Any] | None:
    """The checkpoint's config.json (None: there is none); NotLaunchableError if it is no JSON object."""
    config_path = directory / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise NotLaunchableError(f"{config_path}: not JSON: {e}") from None
    if not isinstance(config, dict):
        raise NotLaunchableError(f"{config_path}: not a JSON object")
    return config


def _quant_method(directory: Path, require_config: bool = True) -> tuple[str | None, dict[str, Any] | None]:
    """(method, quantization config) the way SGLang 0.5.23's ModelConfig._parse_quant_hf_config reads
    a local checkpoint: config.json `quantization_config`, else hf_quant_config.json; a ModelOpt config
    (quant_method "modelopt" or absent) resolves through its quant_algo (NVFP4 -> modelopt_fp4)."""
    config = _hf_config(directory)
    if config is None:
        if not require_config:
            return None, None
        raise NotLaunchableError(f"{directory}: no config.json (not a launchable checkpoint)")
    quant = config.get("quantization_config")
    if quant is None and (directory / "hf_quant_config.json").is_file():
        raw = json.loads((directory / "hf_quant_config.json").read_text())
        quant = raw.get("quantization", raw) if isinstance(raw, dict) else None
    if not isinstance(quant, dict):
        return None, None
    method = str(quant.get("quant_method", "modelopt")).lower()
    if method == "modelopt":
        algo = str(quant.get("quant_algo", "")).upper()
        method = "modelopt_fp4" if "FP4" in algo else ("modelopt_fp8" if algo == "FP8" else method)
    return method, quant


VIEW_QUANT_METHODS: dict[str, str | None] = {
    "bf16": None,
    "fp8": "fp8",
    "nvfp4": "modelopt_fp4",
    "mxfp4": "mxfp4",
}
"""The quantization method SGLang must detect in each view's checkpoint (the catalog's
`--quantization` value for the format; bf16: none)."""


def check_launchable(directory: Path, view: str, *, require_config: bool = True) -> str | None:
    """Raise NotLaunchableError unless `directory` is a checkpoint SGLang loads in `view`'s format;
    return the detected quantization method. Catches a BF16 checkpoint handed to an fp8 / nvfp4 group
    (SGLang would quantize it online and never take a later update). `require_config=False` (engines
    that read rlfleet's own view files, e.g. the reference sampler) accepts a view without config.json
    but still refuses one whose config.json declares another format."""
    if not require_config and not (directory / "config.json").is_file():
        return None
    method, quant = _quant_method(directory, require_config)
    expected = VIEW_QUANT_METHODS[view]
    if method != expected:
        raise NotLaunchableError(
            f"{directory}: view {view} needs a checkpoint with quantization method {expected or 'none'}, "
            f"its config declares {method or 'none'}"
        )
    if view == "fp8" and list((quant or {}).get("weight_block_size") or []) != [128, 128]:
        raise NotLaunchableError(f"{directory}: fp8 view needs weight_block_size [128, 128] (block FP8)")
    if not any(directory.glob("*.safetensors")):
        raise NotLaunchableError(f"{directory}: no *.safetensors weights")
    return method


def check_adapter(directory: Path) -> None:
    """Raise NotLaunchableError unless `directory` is a LoRA adapter in PEFT's layout as SGLang's
    /load_lora_adapter reads it: adapter_config.json (a JSON object, peft_type LORA) and the weights."""
    config_path = directory / ADAPTER_CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise NotLaunchableError(f"{directory}: no {ADAPTER_CONFIG_FILE} (not a LoRA adapter)") from None
    except ValueError as e:
        raise NotLaunchableError(f"{config_path}: not JSON: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise NotLaunchableError(f"{config_path}: not a LoRA adapter config (peft_type LORA)")
    if not (directory / ADAPTER_WEIGHTS_FILE).is_file():
        raise NotLaunchableError(f"{directory}: no {ADAPTER_WEIGHTS_FILE}")


def checkpoint_flags_of(directory: Path) -> list[str]:
    """The SGLang flags the checkpoint in `directory` calls for: `rlfleet.catalog.checkpoint_engine_flags`
    of its config.json (none without one: the reference engine's tensor-only views). What the launch
    file carries and `rlfleet sampler serve --engine sglang --model-path DIR` adds."""
    return checkpoint_engine_flags(_hf_config(directory))


def read_launch_file(cache_dir: Path) -> tuple[int, Path] | None:
    """(version, directory) from the cache's launch file's first line, None if absent or malformed."""
    try:
        text = (cache_dir / LAUNCH_FILE).read_text()
    except FileNotFoundError:
        return None
    version, _, directory = (text.splitlines() or [""])[0].strip().partition(" ")
    if not version.isdigit() or not directory:
        return None
    return int(version), Path(directory)


def write_launch_file(cache_dir: Path, version: int, directory: Path) -> None:
    """Atomically (temp file + rename) name the checkpoint SGLang launches from, and on a second line
    the flags it calls for (`checkpoint_flags_of`; no second line when none)."""
    flags = checkpoint_flags_of(directory)
    tmp = cache_dir / f".{LAUNCH_FILE}.{os.getpid()}.tmp"
    tmp.write_text(f"{version} {directory}\n" + (f"{' '.join(flags)}\n" if flags else ""))
    os.replace(tmp, cache_dir / LAUNCH_FILE)
