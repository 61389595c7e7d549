"""Precision views of a state dict on disk: what the trainer publishes and samplers load.

One directory per view, holding `model.safetensors` (Hugging Face tensor names) and
`rlfleet_view.json` naming the view (plus, if the publisher passes the model's HF config, a
`config.json` carrying the matching `quantization_config`, and for nvfp4 `hf_quant_config.json`, so a
real SGLang server recognises the pre-quantized checkpoint).

- `bf16`:  every floating tensor in bfloat16.
- `fp8`:   block-128 FP8 (DeepSeek / SGLang layout): `X.weight` float8_e4m3fn [N, K] and
           `X.weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)] (a dequantisation multiplier).
- `nvfp4`: `X.weight` packed E2M1 uint8 [N, K/2], `X.weight_scale` float8_e4m3fn [N, K/16],
           `X.weight_scale_2` fp32 scalar (ModelOpt layout).
- `mxfp4`: `X.weight` packed E2M1 uint8 [N, K/2], `X.weight_scale` uint8 E8M0 [N, K/32].

Quantized views quantize only 2-D linear weights (`*.weight` of projections): embeddings, norms and
`lm_head` stay bf16, as in FP8 / ModelOpt checkpoints. A linear weight whose K does not fit the
format's block (nvfp4: K % 16, mxfp4: K % 32) also stays bf16; `rlfleet_view.json` lists exactly
which tensors are quantized. All conversions are the ONE implementation in `rlfleet.numerics.formats`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rlfleet.channel import VIEW_NAMES
from rlfleet.numerics import formats

VIEWS = VIEW_NAMES
WEIGHTS_FILE = "model.safetensors"
VIEW_CONFIG_FILE = "rlfleet_view.json"
VIEW_FORMAT = "rlfleet.view/v1"
# Modules kept in bf16 in every quantized view (real FP8 / NVFP4 checkpoints exclude them too).
EXCLUDED_SUBSTRINGS = ("embed_tokens", "lm_head", "norm")


def check_view(view: str) -> str:
    if view not in VIEWS:
        raise ValueError(f"unknown weight view {view!r}; expected one of {', '.join(VIEWS)}")
    return view


def is_quantized_in(name: str, tensor: torch.Tensor, view: str) -> bool:
    """Whether `view` stores `name` quantized (2-D linear weight whose shape fits the format)."""
    if view == "bf16" or tensor.dim() != 2 or not name.endswith(".weight") or not tensor.is_floating_point():
        return False
    if any(s in name for s in EXCLUDED_SUBSTRINGS):
        return False
    k = tensor.shape[1]
    if view == "nvfp4":
        return k % formats.NVFP4_BLOCK == 0
    if view == "mxfp4":
        return k % formats.MXFP4_BLOCK == 0
    return True


def _quantization_config(view: str, excluded: list[str]) -> dict[str, Any] | None:
    """HF `quantization_config` as SGLang reads it for pre-quantized checkpoints."""
    if view == "fp8":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    if view == "nvfp4":
        return {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": 16,
            "exclude_modules": excluded,
        }
    if view == "mxfp4":
        return {"quant_method": "mxfp4", "group_size": 32, "modules_to_not_convert": excluded}
    return None


def view_tensors(
    state_dict: Mapping[str, torch.Tensor], view: str
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The tensors of one view (HF names) and the names of the quantized weights."""
    check_view(view)
    out: dict[str, torch.Tensor] = {}
    quantized: list[str] = []
    for name, tensor in state_dict.items():
        t = tensor.detach().to("cpu")
        if not is_quantized_in(name, t, view):
            out[name] = (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous()
            continue
        w = t.float()  # [N, K]
        base = name[: -len(".weight")]
        if view == "fp8":
            w_e4m3, scale_inv = formats.quantize_fp8_block(w)
            out[name], out[f"{base}.weight_scale_inv"] = w_e4m3, scale_inv
        elif view == "nvfp4":
            packed, scale, scale_2 = formats.quantize_nvfp4(w)
            out[name], out[f"{base}.weight_scale"], out[f"{base}.weight_scale_2"] = packed, scale, scale_2
        else:
            packed, scales = formats.quantize_mxfp4(w)
            out[name], out[f"{base}.weight_scale"] = packed, scales
        quantized.append(name)
    return {k: v.contiguous() for k, v in out.items()}, quantized


def save_view(
    state_dict: Mapping[str, torch.Tensor],
    view: str,
    directory: str | Path,
    *,
    model_config: Mapping[str, Any] | None = None,
) -> list[Path]:
    """Write one precision view of `state_dict` into `directory`; return the files written.

    `model_config`: optional Hugging Face model config (dict); written as `config.json` with the
    view's `quantization_config` so a real SGLang server loads the directory as a checkpoint."""
    tensors, quantized = view_tensors(state_dict, view)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    excluded = sorted(
        n[: -len(".weight")]
        for n, t in state_dict.items()
        if n.endswith(".weight") and n not in quantized and view != "bf16" and t.dim() == 2
    )
    files = [directory / WEIGHTS_FILE, directory / VIEW_CONFIG_FILE]
    # One metadata key only: safetensors serialises metadata from a hash map, so several keys would
    # make the bytes (and the published sha256) differ between two saves of the same weights.
    save_file(tensors, str(files[0]), metadata={"format": "pt"})
    quant_config = _quantization_config(view, excluded)
    files[1].write_text(
        json.dumps(
            {
                "format": VIEW_FORMAT,
                "view": view,
                "weights": WEIGHTS_FILE,
                "quantized": quantized,
                "quantization_config": quant_config,
            },
            indent=1,
            sort_keys=True,
        )
    )
    if model_config is not None:
        config = dict(model_config)
        if quant_config is not None:
            config["quantization_config"] = quant_config
        files.append(directory / "config.json")
        files[-1].write_text(json.dumps(config, indent=1, sort_keys=True))
    if view == "nvfp4":
        files.append(directory / "hf_quant_config.json")
        files[-1].write_text(
            json.dumps(
                {
                    "producer": {"name": "modelopt"},
                    "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": excluded},
                },
                indent=1,
            )
        )
    return files


def read_view_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / VIEW_CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ValueError(f"{directory} is not a weight view (no {VIEW_CONFIG_FILE})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from e
    if config.get("format") != VIEW_FORMAT:
        raise ValueError(f"{path}: unknown view format {config.get('format')!r}")
    check_view(config.get("view", ""))
    return config


def load_view(directory: str | Path) -> tuple[str, dict[str, torch.Tensor]]:
    """(view, dequantized float32 state dict with HF names) of a view directory."""
    config = read_view_config(directory)
    view = config["view"]
    raw = load_file(str(Path(directory) / config.get("weights", WEIGHTS_FILE)))
    quantized = set(config.get("quantized", []))
    companions = {
        f"{n[: -len('.weight')]}.{s}"
        for n in quantized
        for s in ("weight_scale_inv", "weight_scale", "weight_scale_2")
    }
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name in companions:
            continue
        if name not in quantized:
            out[name] = t.float() if t.is_floating_point() else t
            continue
        base = name[: -len(".weight")]
        try:
            if view == "fp8":
                out[name] = formats.dequantize_fp8_block(t, raw[f"{base}.weight_scale_inv"])
            elif view == "nvfp4":
                out[name] = formats.dequantize_nvfp4(
                    t, raw[f"{base}.weight_scale"], raw[f"{base}.weight_scale_2"]
                )
            elif view == "mxfp4":
                out[name] = formats.dequantize_mxfp4(t, raw[f"{base}.weight_scale"])
            else:
                raise ValueError(f"view {view} has no quantized tensors, but {name} is listed")
        except KeyError as e:
            raise ValueError(f"{directory}: quantized {name} lacks its scale tensor {e}") from e
    missing = quantized - set(out)
    if missing:
        raise ValueError(f"{directory}: quantized tensors listed but absent: {sorted(missing)[:3]}")
    return view, out
