"""Precision views of a state dict on disk: what the trainer publishes and sampler groups launch from.

Two layouts (docs/weights.md, "Layout of a published version"):

- **HF checkpoint** (the base model is a Hugging Face checkpoint directory, `base_checkpoint=`): a
  complete checkpoint SGLang 0.5.23 launches from and reloads: the base `config.json` with the view's
  `quantization_config` exactly as SGLang's parsers read it, tokenizer files and
  `generation_config.json` copied from the base, `model.safetensors` (or HF shards +
  `model.safetensors.index.json` above `max_shard_bytes`) with checkpoint tensor names (fused MoE
  experts of transformers' in-memory model split into `experts.{e}.{gate,up,down}_proj.weight`), and
  `rlfleet_view.json`.
- **tensor-only** (`save_view` without `base_checkpoint`; only the format tests write one, every
  production path publishes from an HF base): `model.safetensors` + `rlfleet_view.json`
  (`hf_checkpoint: false`); nothing launches from it (SGLang and the reference sampler read config.json).

Formats (the ONE implementation of each is `rlfleet.numerics.formats`):
- `bf16`:  every floating tensor in bfloat16.
- `fp8`:   block-128 FP8 (SGLang `Fp8Config` with `weight_block_size: [128, 128]`): `X.weight`
           float8_e4m3fn [N, K] and `X.weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)].
- `nvfp4`: ModelOpt NVFP4: `X.weight` packed E2M1 uint8 [N, K/2], `X.weight_scale` float8_e4m3fn
           [N, K/16], `X.weight_scale_2` fp32 [] SHARED by the members of a fused layer (q/k/v,
           gate/up; SGLang keeps one per fused layer), and in HF checkpoints `X.input_scale` fp32 []
           = calibrated activation amax / (448 * 6).
- `mxfp4`: `X.weight` packed E2M1 uint8 [N, K/2], `X.weight_scale` uint8 E8M0 [N, K/32]. Tensor-only
           (reference sampler): SGLang 0.5.23 can launch no Qwen3-family mxfp4 group, so an HF
           model's mxfp4 view is refused (`check_view_for_model`).

Embeddings, norms, `lm_head` and MoE routers stay bf16 in every view. A linear whose K does not fit
the format's block (nvfp4: 16, mxfp4: 32) stays bf16; `rlfleet_view.json` lists what is quantized.
Every file is written with its BLAKE3 digest computed in the same pass (`write_file_hashed`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from rlfleet.channel import VIEW_NAMES
from rlfleet.hf_config import is_moe_config
from rlfleet.numerics import formats
from rlfleet.store import FileDigest, write_file_hashed

VIEWS = VIEW_NAMES
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
VIEW_CONFIG_FILE = "rlfleet_view.json"
HF_QUANT_CONFIG_FILE = "hf_quant_config.json"
VIEW_FORMAT = "rlfleet.view/v2"
READABLE_FORMATS = ("rlfleet.view/v1", VIEW_FORMAT)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""Above this a view is sharded (HF's `model-0000i-of-0000n.safetensors` + index)."""
# Files of the base checkpoint every view carries unchanged (tokenizer, chat template, generation).
BASE_CHECKPOINT_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
# `--quantization` to launch SGLang with, per view (null: none). fp8 is auto-detected from config.json.
LAUNCH_QUANTIZATION = {"bf16": None, "fp8": "fp8", "nvfp4": "modelopt_fp4", "mxfp4": "mxfp4"}
# Modules kept in bf16 in every quantized view (real FP8 / NVFP4 checkpoints exclude them too);
# `.mlp.gate.` is an MoE router (SGLang builds it unquantized).
EXCLUDED_SUBSTRINGS = ("embed_tokens", "lm_head", "norm", ".mlp.gate.", "shared_expert_gate")
# Members of one fused SGLang layer: q/k/v -> qkv_proj, gate/up -> gate_up_proj (experts: w13).
_FUSED = re.compile(r"^(?P<base>.*)\.(?P<member>q|k|v|gate|up)_proj\.weight$")
_FUSED_NAME = {
    "q": "qkv_proj",
    "k": "qkv_proj",
    "v": "qkv_proj",
    "gate": "gate_up_proj",
    "up": "gate_up_proj",
}
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def check_view(view: str) -> str:
    if view not in VIEWS:
        raise ValueError(f"unknown weight view {view!r}; expected one of {', '.join(VIEWS)}")
    return view


# --------------------------------------------------------------------------------- base checkpoint
def read_base_config(base_checkpoint: str | Path) -> dict[str, Any]:
    """The base checkpoint's `config.json` (a clear error when the directory is not a checkpoint)."""
    path = Path(base_checkpoint) / "config.json"
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError as e:
        raise ValueError(
            f"base checkpoint {base_checkpoint} has no config.json (not an HF checkpoint)"
        ) from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from e


def check_view_for_model(view: str, config: Mapping[str, Any] | None) -> None:
    """Refuse a view no SGLang 0.5.23 group can launch from for this model (docs/weights.md, "mxfp4").

    mxfp4 quantizes MoE experts only there (`Mxfp4Config.get_quant_method` gives linear layers no
    method on CUDA), so a dense model has no mxfp4 group; and Qwen3-MoE builds its attention linears
    with the model's quant config, which then fails at construction, so no Qwen3-family model has
    one either. Tensor-only views (no HF config) stay available to the reference sampler."""
    check_view(view)
    if view != "mxfp4" or config is None:
        return
    arch = ",".join(config.get("architectures") or [str(config.get("model_type", "?"))])
    if not is_moe_config(config):
        raise ValueError(
            f"mxfp4 view refused for the dense model {arch}: SGLang 0.5.23's mxfp4 quantizes MoE experts "
            "only (dense linears stay unquantized), so a dense mxfp4 group cannot exist; publish bf16, "
            "fp8 or nvfp4 for it (docs/weights.md)"
        )
    raise ValueError(
        f"mxfp4 view refused for {arch}: SGLang 0.5.23 builds this model's attention linears with the "
        "mxfp4 quant config, which has no linear method for them on NVIDIA GPUs, so an mxfp4 group of it "
        "fails at launch; publish bf16, fp8 or nvfp4 for it (docs/weights.md)"
    )


def checkpoint_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF checkpoint names of an in-memory state dict: transformers 5 keeps a Qwen3-MoE layer's
    experts fused (`mlp.experts.gate_up_proj` [E, 2I, H] with gate rows first, `mlp.experts.down_proj`
    [E, H, I]); its checkpoints (and SGLang's loader) use `mlp.experts.{e}.{gate,up,down}_proj.weight`."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if name.endswith(".mlp.experts.gate_up_proj") and t.dim() == 3:
            prefix, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith(".mlp.experts.down_proj") and t.dim() == 3:
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


# ------------------------------------------------------------------------------------ which tensors
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


def fused_layer_of(name: str) -> str | None:
    """The SGLang fused layer a checkpoint weight loads into (`...self_attn.qkv_proj`,
    `...mlp.gate_up_proj`, `...mlp.experts.{e}.gate_up_proj`), or None when it loads alone."""
    m = _FUSED.match(name)
    return None if m is None else f"{m.group('base')}.{_FUSED_NAME[m.group('member')]}"


def _fused_amax(state: Mapping[str, torch.Tensor], quantized: Iterable[str]) -> dict[str, torch.Tensor]:
    """Per fused layer, the amax over all its quantized members (their shared nvfp4 global scale)."""
    amax: dict[str, torch.Tensor] = {}
    for name in quantized:
        layer = fused_layer_of(name) or name
        a = state[name].detach().float().abs().amax()
        amax[layer] = torch.maximum(amax[layer], a) if layer in amax else a
    return amax


def _check_fp8_fused_shapes(state: Mapping[str, torch.Tensor], quantized: Iterable[str]) -> None:
    """SGLang's block-FP8 linears refuse a merged layer (q/k/v, gate/up) whose member N is not a
    multiple of the 128 block (fp8.py `validate_block_quant_shapes`): refuse it here, at publish."""
    for name in quantized:
        n = state[name].shape[0]
        if fused_layer_of(name) is not None and n % formats.FP8_BLOCK:
            raise ValueError(
                f"fp8 view: {name} has {n} output rows, not a multiple of {formats.FP8_BLOCK}; SGLang "
                "cannot load a block-128 FP8 fused layer with it (use bf16 or nvfp4 for this model)"
            )


def _quantization_config(view: str, excluded: list[str]) -> dict[str, Any] | None:
    """HF `quantization_config` exactly as SGLang 0.5.23 reads it (Fp8Config / ModelOptFp4Config /
    Mxfp4Config `from_config`; tests/weights/test_weights_sglang_loaders.py parses it with them)."""
    if view == "fp8":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [formats.FP8_BLOCK, formats.FP8_BLOCK],
            "ignored_layers": excluded,
        }
    if view == "nvfp4":
        return {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": formats.NVFP4_BLOCK,
            "kv_cache_quant_algo": None,
            "exclude_modules": excluded,
        }
    if view == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": excluded}
    return None


SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".weight_scale_2", ".input_scale")
"""The scale companions of a quantized `X.weight` (fp8: weight_scale_inv; nvfp4: the other three)."""


def scale_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The scale tensors of a view's tensors (copies on CPU): what the next version's `previous_scales` takes."""
    return {n: t.detach().to("cpu", copy=True) for n, t in tensors.items() if n.endswith(SCALE_SUFFIXES)}


def view_tensors(
    state_dict: Mapping[str, torch.Tensor],
    view: str,
    *,
    hf: bool = False,
    activation_amax: Mapping[str, float] | None = None,
    previous_scales: Mapping[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The tensors of one view (checkpoint names) and the names of the quantized weights.

    `activation_amax`: module name (e.g. `model.layers.0.self_attn.q_proj`) -> calibrated amax of its
    input; required for nvfp4 HF checkpoints (written as `input_scale`).
    `previous_scales`: the scale tensors of the previous version of this view (`scale_tensors`); fp8
    and nvfp4 keep them where the kept-scale rule allows (rlfleet.numerics.formats, docs/weights.md
    "Kept scales"), so unchanged blocks keep their codes. None: every scale fresh from the amax."""
    check_view(view)
    state = {n: t.detach().to("cpu") for n, t in checkpoint_tensors(state_dict).items()}
    quantized = [n for n, t in state.items() if is_quantized_in(n, t, view)]
    if view == "fp8" and hf:
        _check_fp8_fused_shapes(state, quantized)
    fused_amax = _fused_amax(state, quantized) if view == "nvfp4" else {}
    if view == "nvfp4" and hf:
        missing = [
            n[: -len(".weight")]
            for n in quantized
            if not (float((activation_amax or {}).get(n[: -len(".weight")], 0.0)) > 0.0)
        ]
        if missing:
            raise ValueError(
                f"nvfp4 checkpoint needs a calibrated activation amax > 0 per quantized linear "
                f"(input_scale); missing or zero for {len(missing)} modules, e.g. {missing[:3]} (see calibrate_activation_amax)"
            )
    previous = previous_scales or {}
    nvfp4 = _nvfp4_kept(state, quantized, previous) if view == "nvfp4" and previous_scales is not None else {}
    out: dict[str, torch.Tensor] = {}
    qset = set(quantized)
    for name, t in state.items():
        if name not in qset:
            out[name] = (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous()
            continue
        w = t.float()  # [N, K]
        base = name[: -len(".weight")]
        if view == "fp8":
            w_e4m3, scale_inv = formats.quantize_fp8_block_kept(w, previous.get(f"{base}.weight_scale_inv"))
            out[name], out[f"{base}.weight_scale_inv"] = w_e4m3, scale_inv
        elif view == "nvfp4":
            if name in nvfp4:
                packed, scale, scale_2 = nvfp4[name]
            else:
                packed, scale, scale_2 = formats.quantize_nvfp4(w, fused_amax[fused_layer_of(name) or name])
            out[name], out[f"{base}.weight_scale"], out[f"{base}.weight_scale_2"] = packed, scale, scale_2
            if hf:
                assert activation_amax is not None
                out[f"{base}.input_scale"] = formats.kept_global_scale(
                    previous.get(f"{base}.input_scale"), float(activation_amax[base])
                )
        else:
            packed, scales = formats.quantize_mxfp4(w)
            out[name], out[f"{base}.weight_scale"] = packed, scales
    return {k: v.contiguous() for k, v in out.items()}, quantized


def _nvfp4_kept(
    state: Mapping[str, torch.Tensor], quantized: Iterable[str], previous: Mapping[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """nvfp4 of every quantized weight with the previous version's scales kept where the rule allows,
    one fused layer at a time (its members share one weight_scale_2, kept or renewed together)."""
    layers: dict[str, list[str]] = {}
    for name in quantized:
        layers.setdefault(fused_layer_of(name) or name, []).append(name)
    out: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for members in layers.values():
        bases = [m[: -len(".weight")] for m in members]
        kept = [(previous.get(f"{b}.weight_scale"), previous.get(f"{b}.weight_scale_2")) for b in bases]
        pairs = [(s, s2) for s, s2 in kept if s is not None and s2 is not None]
        quantized_layer = formats.quantize_nvfp4_fused_kept(
            [state[m].float() for m in members], pairs if len(pairs) == len(members) else None
        )
        out.update(zip(members, quantized_layer, strict=True))
    return out


# -------------------------------------------------------------------------------------- safetensors
def _tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], path: Path, metadata: Mapping[str, str] | None = None
) -> FileDigest:
    """Write a safetensors file and return its digest (BLAKE3), computed while writing."""
    return write_file_hashed(path, safetensors_chunks(tensors, metadata))


def safetensors_chunks(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> Iterator[bytes | memoryview]:
    """The bytes of a safetensors file (8-byte little-endian header length, JSON header padded with
    spaces to 8 bytes, raw little-endian tensor bytes in header order) as chunks: the header, then
    each tensor's memory (no copy). The header is built (and dtypes checked) before this returns.
    Deterministic: the same tensors give the same bytes."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    names = sorted(tensors)
    for name in names:
        t = tensors[name]
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)

    def chunks() -> Iterator[bytes | memoryview]:
        yield len(raw).to_bytes(8, "little") + raw
        for name in names:
            yield _tensor_bytes(tensors[name])

    return chunks()


def _shards(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_json(path: Path, obj: Any) -> FileDigest:
    return write_file_hashed(path, [json.dumps(obj, indent=1, sort_keys=True).encode()])


def save_view(
    state_dict: Mapping[str, torch.Tensor],
    view: str,
    directory: str | Path,
    *,
    base_checkpoint: str | Path | None = None,
    activation_amax: Mapping[str, float] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    previous_scales: Mapping[str, torch.Tensor] | None = None,
    scales_used: dict[str, torch.Tensor] | None = None,
) -> dict[Path, FileDigest]:
    """Write one precision view of `state_dict` into `directory`; return every file written with its
    BLAKE3 digest and size (hashed while written; pass them to `WeightChannel.publish(digests=...)`).

    `base_checkpoint`: the HF checkpoint directory the model was loaded from (config.json, tokenizer,
    generation config). Given: the view is a complete HF checkpoint SGLang launches from. Absent: a
    tensor-only view (reference sampler only).
    `previous_scales`: the previous version's scale tensors of this view, kept where the rule allows
    (`view_tensors`); `scales_used`: filled with this version's scale tensors as written (CPU copies),
    the next version's `previous_scales`."""
    check_view(view)
    config = read_base_config(base_checkpoint) if base_checkpoint is not None else None
    hf = config is not None
    check_view_for_model(view, config)
    tensors, quantized = view_tensors(
        state_dict, view, hf=hf, activation_amax=activation_amax, previous_scales=previous_scales
    )
    if scales_used is not None:
        scales_used.update(scale_tensors(tensors))
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    qset = set(quantized)
    excluded = sorted(
        n[: -len(".weight")]
        for n, t in checkpoint_tensors(state_dict).items()
        if view != "bf16" and n.endswith(".weight") and n not in qset and t.dim() == 2
    )
    quant_config = _quantization_config(view, excluded)
    written: dict[Path, FileDigest] = {}
    shards = _shards(tensors, max_shard_bytes) if hf else [sorted(tensors)]
    # One metadata key only ("format": "pt", as transformers writes): deterministic bytes.
    if len(shards) == 1:
        weight_files = [WEIGHTS_FILE]
    else:
        weight_files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    # Shards are written (and hashed) in parallel: one file's write + hash is one core's work.
    with ThreadPoolExecutor(max_workers=max(1, min(len(shards), os.cpu_count() or 1))) as pool:
        digests = pool.map(
            lambda item: write_safetensors(
                {n: tensors[n] for n in item[1]}, directory / item[0], {"format": "pt"}
            ),
            zip(weight_files, shards, strict=True),
        )
        written.update({directory / file: d for file, d in zip(weight_files, digests, strict=True)})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = {n: file for file, names in zip(weight_files, shards, strict=True) for n in names}
        written[directory / INDEX_FILE] = _write_json(
            directory / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map}
        )
    written[directory / VIEW_CONFIG_FILE] = _write_json(
        directory / VIEW_CONFIG_FILE,
        {
            "format": VIEW_FORMAT,
            "view": view,
            "hf_checkpoint": hf,
            "weights": weight_files,
            "quantized": quantized,
            "quantization_config": quant_config,
            "launch": {"quantization": LAUNCH_QUANTIZATION[view] if hf else None},
            "note": None
            if hf
            else "tensor-only view (the model has no HF config): the reference sampler loads it, SGLang cannot",
        },
    )
    if config is None:
        return written
    assert base_checkpoint is not None
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    dtype_key = "dtype" if "dtype" in config or "torch_dtype" not in config else "torch_dtype"
    config[dtype_key] = "bfloat16"  # every unquantized tensor of every view is bf16
    if quant_config is not None:
        config["quantization_config"] = quant_config
    written[directory / "config.json"] = _write_json(directory / "config.json", config)
    if view == "nvfp4":  # ModelOpt's legacy nested form, read when config.json's is not
        written[directory / HF_QUANT_CONFIG_FILE] = _write_json(
            directory / HF_QUANT_CONFIG_FILE,
            {
                "producer": {"name": "modelopt"},
                "quantization": {
                    "quant_algo": "NVFP4",
                    "group_size": formats.NVFP4_BLOCK,
                    "kv_cache_quant_algo": None,
                    "exclude_modules": excluded,
                },
            },
        )
    for file in BASE_CHECKPOINT_FILES:
        source = Path(base_checkpoint) / file
        if source.is_file():
            written[directory / file] = write_file_hashed(directory / file, [source.read_bytes()])
    return written


# ---------------------------------------------------------------------------------------- calibration
@torch.no_grad()
def save_adapter(
    adapter: Mapping[str, torch.Tensor], config: Mapping[str, Any], directory: str | Path
) -> dict[Path, FileDigest]:
    """Write a LoRA adapter in PEFT's layout (the `lora` view, docs/weights.md "LoRA"): the tensors as
    PEFT's `get_peft_model_state_dict` names them, in bf16 (what SGLang keeps an adapter in), as
    adapter_model.safetensors, and `config` (rlfleet.lora.adapter_config) as adapter_config.json; each
    file's digest (BLAKE3) computed while it is written."""
    from rlfleet.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE

    if not adapter:
        raise ValueError("a LoRA adapter needs at least one tensor")
    odd = sorted(name for name in adapter if ".lora_A." not in name and ".lora_B." not in name)
    if odd:
        raise ValueError(f"not LoRA adapter tensors (PEFT's lora_A / lora_B names): {odd[:3]}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu", torch.bfloat16).contiguous() for name, t in sorted(adapter.items())}
    return {
        out / ADAPTER_WEIGHTS_FILE: write_safetensors(tensors, out / ADAPTER_WEIGHTS_FILE, {"format": "pt"}),
        out / ADAPTER_CONFIG_FILE: _write_json(out / ADAPTER_CONFIG_FILE, dict(config)),
    }


def calibrate_activation_amax(model: torch.nn.Module, batches: Iterable[torch.Tensor]) -> dict[str, float]:
    """Amax of the input of every linear of an HF model over calibration batches of token ids, keyed
    by checkpoint module name (what nvfp4's `input_scale` = amax / (448 * 6) needs).

    MoE experts kept fused by transformers (`mlp.experts`) are calibrated over ALL tokens entering
    the block (a superset of those routed to each expert, so no routed token is clipped): gate/up on
    the block input x, down on silu(x W_gate^T) * (x W_up^T) for that expert."""
    amax: dict[str, float] = {}
    expert_inputs: dict[str, list[torch.Tensor]] = {}
    hooks = []

    def record(name: str, x: torch.Tensor) -> None:
        amax[name] = max(amax.get(name, 0.0), float(x.detach().float().abs().amax()))

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_pre_hook(lambda m, a, n=name: record(n, a[0])))
        elif name.endswith(".mlp.experts") and hasattr(module, "gate_up_proj"):
            hooks.append(
                module.register_forward_pre_hook(
                    lambda m, a, n=name: expert_inputs.setdefault(n, []).append(a[0].detach().float())
                )
            )
    try:
        model.eval()
        for batch in batches:
            model(batch)
    finally:
        for h in hooks:
            h.remove()
    for name, xs in expert_inputs.items():
        experts = model.get_submodule(name)
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs])
        fused = experts.gate_up_proj
        assert isinstance(fused, torch.Tensor)  # a Parameter; nn.Module attributes are typed Tensor | Module
        gate_up = fused.detach().float()  # [E, 2I, H]
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            hidden = x @ gate_up[e].T
            act = torch.nn.functional.silu(hidden[:, :inter]) * hidden[:, inter:]
            a = float(x.abs().amax())
            amax[f"{name}.{e}.gate_proj"] = amax[f"{name}.{e}.up_proj"] = a
            amax[f"{name}.{e}.down_proj"] = float(act.abs().amax())
    return amax


CALIBRATION_TOKENS = 32
"""The calibration batch: 2 sequences of 16 token ids sweeping the vocabulary (deterministic, no data)."""


def calibration_batch(vocab_size: int) -> torch.Tensor:
    """Token ids 0..31 modulo the vocabulary, as 2 x 16: what the publisher calibrates on."""
    return (torch.arange(CALIBRATION_TOKENS) % vocab_size).reshape(2, -1)


def calibrate_weights(
    state_dict: Mapping[str, torch.Tensor], base_checkpoint: str | Path
) -> dict[str, float]:
    """`calibrate_activation_amax` on `calibration_batch` of the model that HF-named weights make, so
    every trainer backend calibrates the same way from what it publishes (docs/weights.md, "nvfp4").

    The model is transformers' causal LM of the base checkpoint's config.json (without its
    `quantization_config`: the weights are full precision) built around the tensors themselves:
    `from_pretrained(None, config=..., state_dict=...)` initialises on the meta device and takes the
    tensors without copying them, ties tied embeddings, computes the rope buffers and loads in-memory
    (fused MoE experts) and checkpoint names alike. It runs in the dtype most of the weights have
    (the hf backend's fp32; megatron's bf16, whose fp32 norms are cast), as the trainer computes. A
    weight the model needs that `state_dict` lacks is an error (transformers would initialise it at
    random)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig
    from transformers.utils import logging as hf_logging

    data = {k: v for k, v in read_base_config(base_checkpoint).items() if k != "quantization_config"}
    config = AutoConfig.for_model(**data)
    elements: dict[torch.dtype, int] = {}
    for t in state_dict.values():
        if t.is_floating_point():
            elements[t.dtype] = elements.get(t.dtype, 0) + t.numel()
    dtype = max(elements, key=lambda d: elements[d])  # megatron's bf16 keeps its norms in fp32
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one "Loading weights" bar per published version is noise
    try:
        # transformers types the auto mappings' values as its tokenizer pairs (auto_factory.py
        # _LazyAutoMappingValue); this mapping's values are model classes
        model, info = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(  # type: ignore[attr-defined]
            None, config=config, state_dict=dict(state_dict), dtype=dtype, output_loading_info=True
        )
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    problems = ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")
    wrong = {k: sorted(info[k])[:3] for k in problems if info[k]}
    if wrong:
        raise ValueError(f"cannot calibrate: the weights do not make the model of {base_checkpoint}: {wrong}")
    return calibrate_activation_amax(model, [calibration_batch(int(config.vocab_size))])


# -------------------------------------------------------------------------------------------- reading
def read_view_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / VIEW_CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ValueError(f"{directory} is not a weight view (no {VIEW_CONFIG_FILE})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from e
    if config.get("format") not in READABLE_FORMATS:
        raise ValueError(f"{path}: unknown view format {config.get('format')!r}")
    check_view(config.get("view", ""))
    return config


def read_view_tensors(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(rlfleet_view.json, every stored tensor over all shards) of a view directory."""
    from safetensors.torch import load_file

    config = read_view_config(directory)
    files = config.get("weights", WEIGHTS_FILE)
    raw: dict[str, torch.Tensor] = {}
    for file in [files] if isinstance(files, str) else files:
        raw.update(load_file(str(Path(directory) / file)))
    return config, raw


def load_view(directory: str | Path) -> tuple[str, dict[str, torch.Tensor]]:
    """(view, dequantized float32 state dict with checkpoint names) of a view directory."""
    config, raw = read_view_tensors(directory)
    view = config["view"]
    quantized = set(config.get("quantized", []))
    return view, _dequantize(view, raw, quantized, str(directory))


def view_weights(state_dict: Mapping[str, torch.Tensor], view: str) -> dict[str, torch.Tensor]:
    """The float32 weights a sampler serving `view` of `state_dict` computes with: the publisher's own
    quantization (`view_tensors`: block-128 FP8, NVFP4 with one global scale per fused layer, ...)
    dequantized as `load_view` reads it back, without the disk. In-process samplers use it
    (rlfleet/local/emulated.py)."""
    tensors, quantized = view_tensors(state_dict, view)
    return _dequantize(view, tensors, set(quantized), f"{view} view")


def _dequantize(
    view: str, raw: Mapping[str, torch.Tensor], quantized: set[str], where: str
) -> dict[str, torch.Tensor]:
    """Float32 weights of a view's stored tensors (scale companions consumed, not returned)."""
    companions = {
        f"{n[: -len('.weight')]}.{s}"
        for n in quantized
        for s in ("weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale")
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
            raise ValueError(f"{where}: quantized {name} lacks its scale tensor {e}") from e
    missing = quantized - set(out)
    if missing:
        raise ValueError(f"{where}: quantized tensors listed but absent: {sorted(missing)[:3]}")
    return out


def load_checkpoint_weights(directory: str | Path) -> tuple[str | None, dict[str, torch.Tensor]]:
    """The HF-named tensors of a checkpoint directory and which view they are: one of the channel's
    views (`rlfleet_view.json`: `load_view`, dequantized; the view's format) or a plain Hugging Face
    checkpoint (every `*.safetensors` file in its stored dtype; None). The one reader the trainer's
    base model and the reference engine share."""
    from rlfleet.model_source import read_safetensors_dir

    if (Path(directory) / VIEW_CONFIG_FILE).is_file():
        return load_view(directory)
    return None, read_safetensors_dir(directory)
