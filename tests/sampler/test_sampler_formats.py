"""The low-precision formats reproduce their definitions (references.md): exact grids, block scales,
saturation, round-trip error bounds."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.numerics import formats as fm

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _weights(seed: int, n: int, k: int, scale: float) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * scale


def test_e2m1_grid_is_exact_and_signed():
    vals = fm.e2m1_values(torch.arange(16, dtype=torch.uint8))
    assert vals[:8].tolist() == GRID
    assert vals[8:].tolist() == [-g for g in GRID]
    # every grid value round-trips to itself
    x = torch.tensor(GRID + [-g for g in GRID[1:]])
    assert torch.equal(fm.e2m1_values(fm.e2m1_codes(x)), x)


def test_e2m1_rounding_ties_to_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.1, 100.0, -100.0, 0.26, 4.9, 5.1])
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -6.0, 0.5, 4.0, 6.0]
    assert fm.e2m1_values(fm.e2m1_codes(x)).tolist() == expected


@given(st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=1, max_size=64))
def test_e2m1_is_nearest_grid_value(xs):
    x = torch.tensor(xs, dtype=torch.float32)
    q = fm.e2m1_values(fm.e2m1_codes(x))
    grid = torch.tensor(GRID + [-g for g in GRID[1:]])
    best = (x[:, None] - grid[None]).abs().min(dim=1).values
    assert torch.allclose((x - q).abs(), best)


def test_fp4_pack_layout_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = fm.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(fm.unpack_fp4(packed), codes)


def test_fp8_e4m3_saturates_at_448():
    y = fm.fake_quantize_fp8_e4m3(torch.tensor([1000.0, -1e6, 448.0, 449.0]))
    assert y.tolist() == [448.0, -448.0, 448.0, 448.0]
    assert not torch.isnan(y).any()


@pytest.mark.parametrize("n,k", [(256, 384), (130, 200), (1, 7)])
def test_fp8_block_scale_is_block_amax_over_448(n, k):
    w = _weights(0, n, k, 0.05)
    q, s = fm.quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k)
    assert s.dtype == torch.float32 and s.shape == (math.ceil(n / 128), math.ceil(k / 128))
    assert torch.isclose(s[0, 0], w[:128, :128].abs().max() / 448)
    # each block's largest element maps to exactly +-448
    assert q.float()[:128, :128].abs().max() == 448.0
    err = (fm.dequantize_fp8_block(q, s) - w).abs()
    scale_full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    # E4M3: half an ulp is 2^-4 relative for normals; subnormal spacing is 2^-9 (times the scale)
    assert (err <= w.abs() * 2**-4 + scale_full * 2**-10 + 1e-12).all()


def test_fp8_per_channel_scale_and_bound():
    w = _weights(1, 64, 96, 3.0)
    q, s = fm.quantize_fp8_per_channel(w)
    assert s.shape == (64, 1)
    assert torch.allclose(s[:, 0], w.abs().amax(1) / 448)
    err = (fm.dequantize_fp8_per_channel(q, s) - w).abs()
    assert (err <= w.abs() * 2**-4 + s * 2**-10 + 1e-12).all()


def test_nvfp4_shapes_scales_and_bound():
    w = _weights(2, 32, 64, 0.1)
    packed, ws, ws2 = fm.quantize_nvfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (32, 32)
    assert ws.dtype == torch.float8_e4m3fn and ws.shape == (32, 4)
    assert ws2.dtype == torch.float32 and ws2.dim() == 0
    assert torch.isclose(ws2, w.abs().max() / (448 * 6))
    # the block holding the tensor amax gets the largest E4M3 block scale (448)
    assert ws.float().max() == 448.0
    deq = fm.dequantize_nvfp4(packed, ws, ws2)
    eff = (ws.float() * ws2).repeat_interleave(16, 1)  # [N, K] the scale each element used
    # nearest E2M1: error <= half the largest grid gap (1.0) times the scale; E4M3 rounding of the block
    # scale can push |x|/s to at most 6 * (1 + 2^-4), still within that bound after saturation
    assert ((deq - w).abs() <= eff * 1.0 + 1e-12).all()
    # dequantized values are grid values times the block scale
    ratio = (deq / eff).abs()
    assert ((ratio[..., None] - torch.tensor(GRID)).abs().min(-1).values < 1e-5).all()


def test_nvfp4_exact_on_representable_input():
    grid = torch.tensor(GRID)
    codes = torch.randint(0, 8, (4, 32), generator=torch.Generator().manual_seed(3))
    w = grid[codes] * torch.where(torch.rand(4, 32) > 0.5, 1.0, -1.0)
    w[:, ::16] = 6.0  # every block has amax 6 -> block scale 448 * ws2 = 1
    packed, ws, ws2 = fm.quantize_nvfp4(w)
    assert torch.equal(fm.dequantize_nvfp4(packed, ws, ws2), w)


def test_mxfp4_e8m0_scale_definition():
    w = _weights(4, 16, 128, 0.7)
    packed, scales = fm.quantize_mxfp4(w)
    assert packed.shape == (16, 64) and scales.dtype == torch.uint8 and scales.shape == (16, 4)
    amax = w.view(16, 4, 32).abs().amax(-1)
    expected = torch.floor(torch.log2(amax)) - 2 + 127
    assert torch.equal(scales.long(), expected.long())
    deq = fm.dequantize_mxfp4(packed, scales)
    scale = torch.exp2(scales.float() - 127).repeat_interleave(32, 1)
    ratio = (deq / scale).abs()
    assert torch.isin(ratio, torch.tensor(GRID)).all()
    # amax / scale is in [4, 8): values above 6 saturate, everything else rounds to nearest
    err = (deq - w).abs()
    assert (err <= torch.maximum(scale * 1.0, (w.abs() - 6 * scale).clamp(min=0)) + 1e-12).all()


def test_mxfp4_saturation_at_block_top():
    w = torch.zeros(1, 32)
    w[0, 0] = 7.9  # floor(log2 7.9) - 2 = 0 -> scale 1, 7.9 saturates to 6
    w[0, 1] = -3.2
    packed, scales = fm.quantize_mxfp4(w)
    assert scales.item() == 127
    deq = fm.dequantize_mxfp4(packed, scales)
    assert deq[0, 0].item() == 6.0 and deq[0, 1].item() == -3.0


def test_all_zero_tensor_round_trips_without_nan():
    z = torch.zeros(8, 64)
    for fmt in fm.FORMATS:
        assert torch.equal(fm.fake_quantize(z, fmt), z)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 40),
    k=st.integers(1, 70),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 10_000),
)
def test_fake_quantize_pads_and_keeps_shape(n, k, scale, seed):
    w = _weights(seed, n, k, scale)
    errs = {}
    for fmt in fm.FORMATS:
        out = fm.fake_quantize(w, fmt)
        assert out.shape == w.shape and out.dtype == torch.float32 and torch.isfinite(out).all()
        errs[fmt] = (out - w).abs().max().item() / w.abs().max().item()
    assert errs["fp32"] == 0.0
    assert errs["bf16"] <= 2**-8
    assert errs["fp8"] <= 2**-4 + 1e-6 and errs["fp8_block"] <= 2**-4 + 1e-6
    # fp4: at most one scale unit (amax/6 * (1 + 2^-4) for nvfp4, amax/4 for mxfp4) relative to amax
    assert errs["nvfp4"] <= 0.2
    assert errs["mxfp4"] <= 0.26


def test_fake_quantize_any_rank_and_error_order():
    w = _weights(5, 4 * 64, 96, 0.02).view(4, 64, 96)
    rms = {f: (fm.fake_quantize(w, f) - w).pow(2).mean().sqrt().item() for f in fm.FORMATS}
    assert rms["fp32"] == 0 < rms["bf16"] < rms["fp8"] < rms["nvfp4"]
    assert rms["fp8_block"] < rms["mxfp4"]
    v = torch.randn(10)
    assert fm.fake_quantize(v, "nvfp4").shape == (10,)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown weight format"):
        fm.fake_quantize(torch.ones(2, 2), "int3")
    with pytest.raises(ValueError, match="divisible by 16"):
        fm.quantize_nvfp4(torch.ones(2, 20))
    with pytest.raises(ValueError, match="divisible by 32"):
        fm.quantize_mxfp4(torch.ones(2, 48))
    with pytest.raises(ValueError, match="2-D"):
        fm.quantize_fp8_block(torch.ones(3))
