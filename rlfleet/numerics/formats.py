"""Low-precision weight formats, one implementation each (torch; on the tensors' device: the publisher and
the reference sampler run them on CPU, scripts/gpu-check on a GPU).

Used by the reference sampler (precision emulation), by the weight views the trainer publishes and by
tests. Definitions (references.md):

- FP8 E4M3: max finite 448, 3 mantissa bits. Per-channel (one fp32 scale per output row) or 128x128
  blocks (DeepSeek-style `weight_scale_inv` [ceil(N/128), ceil(K/128)]). In both cases the stored
  scale is the DEQUANTISATION multiplier: w ~= w_e4m3.float() * scale.
- FP4 E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} plus a sign bit; round to nearest, ties to the even
  code (as the hardware converts), saturating at 6. Two codes per byte: element 2j in the low nibble,
  element 2j+1 in the high nibble; bit 3 of a nibble is the sign.
- NVFP4: 16-element blocks along K with an FP8 E4M3 block scale and an FP32 per-tensor scale
  `weight_scale_2 = amax / (448 * 6)`; w ~= e2m1 * weight_scale.float() * weight_scale_2.
- MXFP4: 32-element blocks along K sharing an E8M0 scale 2^(floor(log2 amax) - 2) (stored biased by
  127 in a uint8); w ~= e2m1 * 2^(byte - 127).

`fake_quantize(w, fmt)` is the round trip used by the emulation; it pads shapes that do not fit the
blocks internally (zeros never change a block's amax) and accepts any rank (last dim = K).
"""

from __future__ import annotations

import math

import torch

FP8_E4M3_MAX = 448.0
FP8_E5M2_MAX = 57344.0
FP4_E2M1_MAX = 6.0
# The eight non-negative E2M1 magnitudes, indexed by their 3-bit code.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
FP8_BLOCK = 128
E8M0_BIAS = 127

FORMATS = ("fp32", "bf16", "fp8", "fp8_block", "nvfp4", "mxfp4")

_GRID_T = torch.tensor(E2M1_GRID, dtype=torch.float32)
_MIDPOINTS_T = (_GRID_T[1:] + _GRID_T[:-1]) / 2  # [7] decision boundaries between neighbouring codes


# ----------------------------------------------------------------------------------------- FP8 E4M3
def cast_fp8_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast to float8_e4m3fn (torch's own cast rounds to nearest even; we clamp first because
    the format has no infinity and out-of-range values would otherwise become NaN)."""
    return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def fake_quantize_fp8_e4m3(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Round trip through E4M3 with a fixed per-tensor scale (SGLang's fp8_e4m3 KV cache uses k/v scale
    1.0 unless the checkpoint provides one). Returns float32, same shape."""
    return cast_fp8_e4m3(x.float() / scale).float() * scale


def _safe_div(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, with all-zero blocks (scale 0) mapping to 0 instead of NaN."""
    return x / torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (w_e4m3 [N, K] float8_e4m3fn, scale fp32 [N, 1]) with scale = row amax / 448."""
    _check_2d(w)
    w32 = w.float()
    scale = w32.abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX  # [N, 1]
    return cast_fp8_e4m3(_safe_div(w32, scale)), scale


def dequantize_fp8_per_channel(w_e4m3: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return w_e4m3.float() * scale.float()


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (w_e4m3 [N, K], scale_inv fp32 [ceil(N/block), ceil(K/block)]), scale_inv = block amax / 448.

    Edge blocks are partial (padded with zeros internally, which never changes their amax)."""
    _check_2d(w)
    n, k = w.shape
    nb, kb = math.ceil(n / block), math.ceil(k / block)
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    blocks = padded.view(nb, block, kb, block)  # [nb, block, kb, block]
    scale_inv = blocks.abs().amax(dim=(1, 3)) / FP8_E4M3_MAX  # [nb, kb]
    q = cast_fp8_e4m3(_safe_div(blocks, scale_inv[:, None, :, None]))
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), scale_inv


def dequantize_fp8_block(
    w_e4m3: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK
) -> torch.Tensor:
    n, k = w_e4m3.shape
    scale_full = scale_inv.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return w_e4m3.float() * scale_full


# ----------------------------------------------------------------------------------------- FP4 E2M1
def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (uint8 nibble, bit 3 = sign) for each element of x (already scaled).

    Magnitudes above 6 saturate to 6; exact ties between two grid values go to the even code
    (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4)."""
    x = x.float()
    mag = x.abs().clamp(max=FP4_E2M1_MAX)
    midpoints = _MIDPOINTS_T.to(mag.device)
    lo = torch.bucketize(mag, midpoints, right=False)  # ties -> lower code
    hi = torch.bucketize(mag, midpoints, right=True)  # ties -> upper code
    idx = torch.where(lo == hi, lo, torch.where(lo % 2 == 0, lo, hi))
    sign = (x < 0) & (idx > 0)  # -0 is stored as +0
    return (idx | (sign.to(torch.int64) << 3)).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes (uint8 nibbles)."""
    c = codes.to(torch.int64)
    mag = _GRID_T.to(c.device)[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., K] (K even) -> packed uint8 [..., K/2]: element 2j low nibble, 2j+1 high."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., K/2] -> codes uint8 [..., K]."""
    low = packed & 0x0F
    high = (packed >> 4) & 0x0F
    return torch.stack((low, high), dim=-1).flatten(-2)


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """The NVFP4 per-tensor (global) scale amax / (448 * 6), fp32 scalar. ModelOpt uses the same
    formula for a weight's `weight_scale_2` and for an activation's `input_scale`."""
    return torch.as_tensor(amax, dtype=torch.float32).reshape(()) / (FP8_E4M3_MAX * FP4_E2M1_MAX)


def quantize_nvfp4(
    w: torch.Tensor, global_amax: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (K % 16 == 0) -> (packed uint8 [N, K//2], weight_scale e4m3 [N, K//16], weight_scale_2 fp32 []).

    weight_scale_2 = amax / (448 * 6); block scale = block_amax / 6 / weight_scale_2 rounded to E4M3,
    so the largest block scale uses the full E4M3 range. `global_amax` (>= this tensor's amax): the
    amax shared by every member of a fused layer (q/k/v, gate/up), because an engine that fuses
    them keeps ONE weight_scale_2 per fused layer (docs/weights.md, "nvfp4")."""
    _check_2d(w)
    n, k = w.shape
    if k % NVFP4_BLOCK:
        raise ValueError(f"nvfp4 needs K divisible by {NVFP4_BLOCK}, got shape {tuple(w.shape)}")
    w32 = w.float()
    amax = w32.abs().amax() if global_amax is None else torch.as_tensor(global_amax, dtype=torch.float32)
    if global_amax is not None and bool(amax < w32.abs().amax()):
        raise ValueError("global_amax is below the tensor's own amax: block scales would overflow E4M3")
    weight_scale_2 = nvfp4_global_scale(amax)  # fp32 scalar
    blocks = w32.view(n, k // NVFP4_BLOCK, NVFP4_BLOCK)  # [N, K/16, 16]
    block_amax = blocks.abs().amax(dim=-1)  # [N, K/16]
    weight_scale = cast_fp8_e4m3(_safe_div(block_amax / FP4_E2M1_MAX, weight_scale_2))  # [N, K/16] e4m3
    eff_scale = weight_scale.float() * weight_scale_2  # [N, K/16] the scale really applied
    codes = e2m1_codes(_safe_div(blocks, eff_scale[..., None])).view(n, k)
    return pack_fp4(codes), weight_scale, weight_scale_2.reshape(())


def dequantize_nvfp4(
    packed: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor
) -> torch.Tensor:
    n = packed.shape[0]
    vals = e2m1_values(unpack_fp4(packed))  # [N, K]
    k = vals.shape[1]
    eff_scale = weight_scale.float() * weight_scale_2.float()  # [N, K/16]
    return (vals.view(n, k // NVFP4_BLOCK, NVFP4_BLOCK) * eff_scale[..., None]).view(n, k)


def e8m0_scale_exponent(block_amax: torch.Tensor) -> torch.Tensor:
    """Shared MX exponent floor(log2 amax) - 2 (2 = emax of E2M1), clamped to E8M0's [-127, 127];
    all-zero blocks get the smallest scale."""
    safe = torch.where(block_amax > 0, block_amax, torch.ones_like(block_amax))
    exp = torch.floor(torch.log2(safe)) - 2
    exp = torch.where(block_amax > 0, exp, torch.full_like(exp, -E8M0_BIAS))
    return exp.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int64)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (K % 32 == 0) -> (packed uint8 [N, K//2], scales uint8 e8m0 [N, K//32])."""
    _check_2d(w)
    n, k = w.shape
    if k % MXFP4_BLOCK:
        raise ValueError(f"mxfp4 needs K divisible by {MXFP4_BLOCK}, got shape {tuple(w.shape)}")
    blocks = w.float().view(n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    exp = e8m0_scale_exponent(blocks.abs().amax(dim=-1))  # [N, K/32]
    scale = torch.exp2(exp.float())
    codes = e2m1_codes(blocks / scale[..., None]).view(n, k)
    return pack_fp4(codes), (exp + E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n = packed.shape[0]
    vals = e2m1_values(unpack_fp4(packed))
    k = vals.shape[1]
    scale = torch.exp2(scales.to(torch.int64).float() - E8M0_BIAS)  # [N, K/32]
    return (vals.view(n, k // MXFP4_BLOCK, MXFP4_BLOCK) * scale[..., None]).view(n, k)


# ------------------------------------------------------------------------------------- round trips
def fake_quantize(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantize-dequantize round trip. fmt in fp32 | bf16 | fp8 (per-channel) | fp8_block | nvfp4 | mxfp4.

    Any rank: the last dim is K, leading dims are flattened into N (1-D tensors are one row).
    Returns float32 of the same shape."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {', '.join(FORMATS)}")
    shape = w.shape
    w2 = w.float().reshape(1, -1) if w.dim() <= 1 else w.float().reshape(-1, shape[-1])
    if fmt == "fp32":
        out = w2.clone()
    elif fmt == "bf16":
        out = w2.to(torch.bfloat16).float()
    elif fmt == "fp8":
        out = dequantize_fp8_per_channel(*quantize_fp8_per_channel(w2))
    elif fmt == "fp8_block":
        out = dequantize_fp8_block(*quantize_fp8_block(w2))
    else:
        block = NVFP4_BLOCK if fmt == "nvfp4" else MXFP4_BLOCK
        k = w2.shape[1]
        k_pad = math.ceil(k / block) * block
        padded = torch.nn.functional.pad(w2, (0, k_pad - k)) if k_pad != k else w2
        if fmt == "nvfp4":
            out = dequantize_nvfp4(*quantize_nvfp4(padded))[:, :k]
        else:
            out = dequantize_mxfp4(*quantize_mxfp4(padded))[:, :k]
    return out.reshape(shape).contiguous()


def _check_2d(w: torch.Tensor) -> None:
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
