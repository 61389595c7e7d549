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

Kept scales (`quantize_fp8_block_kept`, `quantize_nvfp4_fused_kept`, `kept_global_scale`; the rule is
stated in docs/weights.md, "Kept scales"): between two versions a block keeps the previous version's
scale while its values still fit under it, so a block whose values did not change keeps its codes bit
for bit (a fresh amax scale moves with any change of the block's largest value, and with it every code
near a rounding boundary; nvfp4's global scale moves whole fused layers). Fits: the block's largest
value x = amax / scale rounds to the top code no worse than on the grid continued above it (x <= top
code + half its spacing: 464 for E4M3, 7 for E2M1) and the scale is not too coarse (x >= top code /
window: FP8_KEPT_WINDOW, NVFP4_KEPT_WINDOW). Per tensor, the squared error against the weights is at
most KEPT_SCALE_ERROR_BOUND x that of the fresh quantization (today's, from the amax), else the blocks
whose kept scale costs the most error are renewed, largest excess first, until it is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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
_E2M1_VALUES_T = torch.cat([_GRID_T, -_GRID_T])  # [16] the value of each code, sign bit 3 (code 8: -0.0)


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


def quantize_fp8_block_kept(
    w: torch.Tensor, previous_scale_inv: torch.Tensor | None, block: int = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8_block` keeping `previous_scale_inv` (the previous version's, same shape) in every
    block whose values fit under it (module doc: 224 <= amax / scale <= 464); a block that does not
    fit is renewed with headroom, amax * RENEWED_HEADROOM / 448, so that it fits again next version
    (E4M3's relative precision is the same a binade down). Then, while the tensor's squared error
    exceeds KEPT_SCALE_ERROR_BOUND x the fresh quantization's, the blocks costing the most error over
    their fresh quantization take it, largest excess first. None or another shape: fresh."""
    _check_2d(w)
    n, k = w.shape
    nb, kb = math.ceil(n / block), math.ceil(k / block)
    if previous_scale_inv is None or tuple(previous_scale_inv.shape) != (nb, kb):
        return quantize_fp8_block(w, block)
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    blocks = padded.view(nb, block, kb, block)
    block_amax = blocks.abs().amax(dim=(1, 3))  # [nb, kb]
    fresh = block_amax / FP8_E4M3_MAX  # quantize_fp8_block's own scale
    previous = previous_scale_inv.to(device=w.device, dtype=torch.float32)
    keep = _keeps_block_scale(block_amax, previous, FP8_E4M3_MAX, FP8_E4M3_TOP_HALF_SPACING, FP8_KEPT_WINDOW)
    chosen = torch.where(keep, previous, (block_amax * RENEWED_HEADROOM) / FP8_E4M3_MAX)

    def quantized(scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [nb, block, kb, block], squared error per block [nb, kb] float64) under these scales."""
        codes = cast_fp8_e4m3(_safe_div(blocks, scale_inv[:, None, :, None]))
        return codes, _block_sse(codes.float() * scale_inv[:, None, :, None], blocks, dims=(1, 3))

    chosen_codes, chosen_sse = quantized(chosen)
    fresh_codes, fresh_sse = quantized(fresh)
    renew = _blocks_to_renew(chosen_sse, fresh_sse, float(fresh_sse.sum()))
    assert renew is not None  # renewing every costly block is at most the fresh quantization's error
    scale_inv = torch.where(renew, fresh, chosen)
    # chosen on the codes' bytes: torch 2.6's CPU `where` has no Float8_e4m3fn kernel ("where_cpu" not
    # implemented), and the CPU images run Debian's torch 2.6 (the trainer crashed at its first kept scale)
    byte = torch.where(renew[:, None, :, None], fresh_codes.view(torch.uint8), chosen_codes.view(torch.uint8))
    codes = byte.view(fresh_codes.dtype)
    return codes.view(nb * block, kb * block)[:n, :k].contiguous(), scale_inv


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
    """float32 values of E2M1 codes (uint8 nibbles; code 8 is -0.0), one table lookup per element."""
    return _E2M1_VALUES_T.to(codes.device)[codes.to(torch.int64) & 15]


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


def quantize_nvfp4_fused_kept(
    members: Sequence[torch.Tensor], previous: Sequence[tuple[torch.Tensor, torch.Tensor]] | None
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """NVFP4 of the members of ONE fused layer (q/k/v, gate/up; or one unfused linear), sharing one
    `weight_scale_2`, keeping the previous version's scales where they fit (module doc).

    `previous`: per member, its previous (weight_scale e4m3 [N, K/16], weight_scale_2 fp32 []); None:
    the fresh quantization (`quantize_nvfp4` with the layer's amax). The global scale is kept while the
    top block scale under it, (layer amax / 6) / weight_scale_2, is within [448 / GLOBAL_KEPT_WINDOW,
    464] (`_keeps_global`; members whose previous global scales differ cannot keep it); else it is
    renewed with headroom (layer amax * RENEWED_HEADROOM / (448 * 6)) and every block scale with it
    (block scales are multiples of it). Under a kept global scale a block keeps its E4M3 block scale
    where its values fit (4.8 <= amax / (block scale * weight_scale_2) <= 7), else takes a fresh E4M3
    block scale under that global (round to nearest, as `quantize_nvfp4`). A member whose squared error
    then exceeds KEPT_SCALE_ERROR_BOUND x the fresh quantization's renews its costliest blocks first;
    if even that does not bring it within the bound, the whole layer is the fresh quantization."""
    amax = torch.stack([m.detach().float().abs().amax() for m in members]).amax()
    if previous is None or len(previous) != len(members):
        return [quantize_nvfp4(m, amax) for m in members]
    global_scales = [
        ws2.detach().to(device=amax.device, dtype=torch.float32).reshape(()) for _, ws2 in previous
    ]
    same = all(torch.equal(g, global_scales[0]) for g in global_scales[1:])
    keep_global = same and _keeps_global(amax, global_scales[0])
    weight_scale_2 = global_scales[0] if keep_global else nvfp4_global_scale(amax * RENEWED_HEADROOM)
    fresh_scale_2 = nvfp4_global_scale(amax)
    out = []
    for w, (prev_scale, _) in zip(members, previous, strict=True):
        n, k = w.shape
        if k % NVFP4_BLOCK:
            raise ValueError(f"nvfp4 needs K divisible by {NVFP4_BLOCK}, got shape {tuple(w.shape)}")
        blocks = w.float().view(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
        block_amax = blocks.abs().amax(dim=-1)  # [N, K/16]
        fresh = _NvFp4Blocks.of(
            blocks, cast_fp8_e4m3(_safe_div(block_amax / FP4_E2M1_MAX, fresh_scale_2)), fresh_scale_2
        )
        same_global = torch.equal(weight_scale_2, fresh_scale_2)
        renewed_scale = (
            fresh.scale
            if same_global
            else cast_fp8_e4m3(_safe_div(block_amax / FP4_E2M1_MAX, weight_scale_2))
        )
        chosen_scale = renewed_scale
        if keep_global and tuple(prev_scale.shape) == tuple(block_amax.shape):
            kept = prev_scale.to(device=w.device, dtype=torch.float32)
            keep = _keeps_block_scale(
                block_amax, kept * weight_scale_2, FP4_E2M1_MAX, FP4_E2M1_TOP_HALF_SPACING, NVFP4_KEPT_WINDOW
            )
            chosen_scale = torch.where(keep, kept, renewed_scale.float()).to(torch.float8_e4m3fn)
        if same_global and torch.equal(chosen_scale.view(torch.uint8), fresh.scale.view(torch.uint8)):
            chosen = fresh  # the fresh quantization itself
        else:
            chosen = _NvFp4Blocks.of(blocks, chosen_scale, weight_scale_2)
        fresh_total = float(fresh.sse.sum())
        if float(chosen.sse.sum()) <= KEPT_SCALE_ERROR_BOUND * fresh_total:
            out.append((pack_fp4(chosen.codes.view(n, k)), chosen.scale, weight_scale_2.clone()))
            continue
        # over the bound: blocks are renewed (a fresh E4M3 block scale under this global), costliest first
        renewed = fresh if same_global else _NvFp4Blocks.of(blocks, renewed_scale, weight_scale_2)
        renew = _blocks_to_renew(chosen.sse, renewed.sse, fresh_total)
        if renew is None:  # not within the bound under this global scale: the layer is quantized fresh
            return [quantize_nvfp4(m, amax) for m in members]
        scale = torch.where(renew, renewed.scale.float(), chosen.scale.float()).to(torch.float8_e4m3fn)
        codes = torch.where(renew[..., None], renewed.codes, chosen.codes).view(n, k)
        out.append((pack_fp4(codes), scale, weight_scale_2.clone()))
    return out


def kept_global_scale(previous: torch.Tensor | None, amax: torch.Tensor | float) -> torch.Tensor:
    """An NVFP4 per-tensor scale from an amax (`input_scale`, from a calibrated activation amax) keeping
    `previous` while the amax fits under it as `weight_scale_2` does (`_keeps_global`), else renewed
    with headroom, `nvfp4_global_scale(amax * RENEWED_HEADROOM)`. None: `nvfp4_global_scale(amax)`."""
    amax_t = torch.as_tensor(amax, dtype=torch.float32).reshape(())
    if previous is None:
        return nvfp4_global_scale(amax_t)
    kept = previous.detach().to(device=amax_t.device, dtype=torch.float32).reshape(())
    return kept.clone() if _keeps_global(amax_t, kept) else nvfp4_global_scale(amax_t * RENEWED_HEADROOM)


@dataclass(frozen=True)
class _NvFp4Blocks:
    """One NVFP4 quantization of a member's blocks: E4M3 block scales [N, K/16], E2M1 codes [N, K/16, 16]
    and the squared error per block [N, K/16] (float64), as `quantize_nvfp4` / `dequantize_nvfp4` compute."""

    scale: torch.Tensor
    codes: torch.Tensor
    sse: torch.Tensor

    @staticmethod
    def of(blocks: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> _NvFp4Blocks:
        eff_scale = (weight_scale.float() * weight_scale_2)[..., None]
        codes = e2m1_codes(_safe_div(blocks, eff_scale))
        return _NvFp4Blocks(
            weight_scale, codes, _block_sse(e2m1_values(codes) * eff_scale, blocks, dims=(-1,))
        )


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


# ------------------------------------------------------------------------------------- kept scales
KEPT_SCALE_ERROR_BOUND = 1.01
"""Per quantized tensor: squared error with kept scales <= this x the fresh quantization's of the same weights."""
FP8_KEPT_WINDOW = 2.0
"""An fp8 block keeps its scale while its amax reaches 448 / 2 under it: a binade down, E4M3 keeps the
same relative precision (measured: the error is within about 1% either way, docs/benchmarks.md)."""
NVFP4_KEPT_WINDOW = 1.25
"""An nvfp4 block keeps its E4M3 block scale while its amax reaches 6 / 1.25 = 4.8 under it: E2M1's eight
magnitudes are a fixed grid, so a coarser scale costs error in proportion (the tensor bound decides)."""
GLOBAL_KEPT_WINDOW = 2.0
"""nvfp4 `weight_scale_2` / `input_scale` are kept while the top block scale under them reaches 448 / 2:
a coarser global scale only moves the E4M3 block scales down their range (same relative precision)."""
RENEWED_HEADROOM = math.sqrt(2.0)
"""A renewed fp8 block scale or nvfp4 global scale puts the amax at 1/sqrt(2) of the top code, the
middle of its window in log scale, so small moves either way keep it."""
FP8_E4M3_TOP_HALF_SPACING = 16.0
"""Half the spacing of E4M3's top binade (416, 448, (480)): up to 448 + 16 rounds to 448 anyway."""
FP4_E2M1_TOP_HALF_SPACING = 1.0
"""Half the spacing of E2M1's top step (4, 6, (8)): up to 6 + 1 is no farther from 6 than from 8."""


def _keeps_block_scale(
    block_amax: torch.Tensor, scale: torch.Tensor, max_code: float, half_top_spacing: float, window: float
) -> torch.Tensor:
    """Per block: whether `scale` (the dequantization multiplier really applied) may be kept: the
    block's largest value x = amax / scale (the quantizer's own division) is within [max_code / window,
    max_code + half_top_spacing]: no clipping beyond rounding, and not too coarse. An all-zero block
    keeps a zero scale."""
    top_code = _safe_div(block_amax, scale)
    fits = (top_code <= max_code + half_top_spacing) & (top_code >= max_code / window)
    return torch.where(scale > 0, fits, block_amax == 0)


def _keeps_global(amax: torch.Tensor, weight_scale_2: torch.Tensor) -> bool:
    """Whether an nvfp4 global scale may be kept for this amax: the top block scale under it, (amax /
    6) / weight_scale_2 (the quantizer's arithmetic), is within [448 / GLOBAL_KEPT_WINDOW, 448 + 16]."""
    if not bool(weight_scale_2 > 0):
        return False
    top = (amax / FP4_E2M1_MAX) / weight_scale_2
    return bool(
        (top <= FP8_E4M3_MAX + FP8_E4M3_TOP_HALF_SPACING) & (top >= FP8_E4M3_MAX / GLOBAL_KEPT_WINDOW)
    )


def _block_sse(dequantized: torch.Tensor, w: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Sum of squared errors per block, float64 (the fp32 difference is exact: a quantized value is
    zero or within a factor 2 of its weight; its square is exact in float64)."""
    return (dequantized - w).double().square().sum(dim=dims)


def _blocks_to_renew(
    chosen_sse: torch.Tensor, renewed_sse: torch.Tensor, fresh_total: float
) -> torch.Tensor | None:
    """The fewest blocks to renew so that the tensor's squared error is within KEPT_SCALE_ERROR_BOUND x
    `fresh_total`: those whose chosen scale costs the most error over their renewed one, largest first
    (each renewal lowers the total by exactly its block's excess). None when renewing every block
    whose chosen scale costs error still exceeds the bound."""
    bound = KEPT_SCALE_ERROR_BOUND * fresh_total
    excess = (chosen_sse - renewed_sse).flatten()
    renew = torch.zeros_like(excess, dtype=torch.bool)
    if float(chosen_sse.sum()) <= bound:
        return renew.view(chosen_sse.shape)
    order = torch.argsort(excess, descending=True, stable=True)
    costly = int((excess > 0).sum())
    remaining = float(chosen_sse.sum()) - torch.cumsum(excess[order[:costly]], dim=0)
    within = (remaining <= bound).nonzero()
    if within.numel() == 0:
        return None
    chosen_flat, renewed_flat = chosen_sse.flatten(), renewed_sse.flatten()
    for count in range(int(within[0]) + 1, costly + 1):  # the cumulative sum's rounding, made exact
        renew[order[:count]] = True
        if float(torch.where(renew, renewed_flat, chosen_flat).sum()) <= bound:
            return renew.view(chosen_sse.shape)
    return None


def _check_2d(w: torch.Tensor) -> None:
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
