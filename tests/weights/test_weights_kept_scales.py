"""Kept scales (docs/weights.md, "Kept scales"): fp8 and nvfp4 views keep the previous version's scales
where the values still fit under them, so unchanged blocks keep their codes; the squared error per tensor
stays within KEPT_SCALE_ERROR_BOUND x a fresh quantization's. Exact tests on hand-built tensors, a
property test, and the views' plumbing (`save_view(previous_scales=..., scales_used=...)`).
SGLang 0.5.23 loading a kept-scale version: tests/weights/test_weights_sglang_loaders.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from rlfleet.numerics import formats as fm
from rlfleet.numerics.views import SCALE_SUFFIXES, load_view, save_view

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

BOUND = fm.KEPT_SCALE_ERROR_BOUND


def sse(dequantized: torch.Tensor, w: torch.Tensor) -> float:
    return float((dequantized.double() - w.double()).square().sum())


def fp8_error_ratio(w: torch.Tensor, codes: torch.Tensor, scale_inv: torch.Tensor) -> float:
    fresh = sse(fm.dequantize_fp8_block(*fm.quantize_fp8_block(w)), w)
    return sse(fm.dequantize_fp8_block(codes, scale_inv), w) / fresh


def fp8_block(codes: torch.Tensor, i: int, j: int) -> torch.Tensor:
    return codes[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].view(torch.uint8)


# -------------------------------------------------------------------------------------------- fp8
def test_fp8_block_keeps_its_scale_and_codes_while_its_values_fit() -> None:
    """Four 128x128 blocks, version 1 quantized fresh; version 2: block (0,0) moves slightly (its amax
    element included), (0,1) grows beyond what its scale covers, (1,0) shrinks below half of it, (1,1)
    is unchanged."""
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(256, 256, generator=g) * 0.02
    codes1, scale1 = fm.quantize_fp8_block(w1)
    w2 = w1.clone()
    w2[:128, :128] += torch.randn(128, 128, generator=g) * 1e-6
    i, j = divmod(int(w2[:128, :128].abs().argmax()), 128)
    w2[i, j] *= 1.01  # the amax itself moves: a fresh scale would move with it
    w2[:128, 128:] *= 1.2  # amax / scale = 448 * 1.2 > 464: would clip
    w2[128:, :128] *= 0.4  # amax / scale = 448 * 0.4 < 224: too coarse
    codes2, scale2 = fm.quantize_fp8_block_kept(w2, scale1)
    fresh_codes, fresh_scale = fm.quantize_fp8_block(w2)
    assert scale2[0, 0] == scale1[0, 0] != fresh_scale[0, 0]  # kept, though the fresh scale moved
    assert torch.equal(codes2[:128, :128], fm.cast_fp8_e4m3(w2[:128, :128] / scale1[0, 0]))
    # only elements whose own value crossed a rounding boundary changed code; a fresh scale rewrites more
    changed_kept = int((fp8_block(codes2, 0, 0) != fp8_block(codes1, 0, 0)).sum())
    changed_fresh = int((fp8_block(fresh_codes, 0, 0) != fp8_block(codes1, 0, 0)).sum())
    assert changed_kept < changed_fresh
    # renewed with headroom: the amax at 1/sqrt(2) of the top code
    for i, j in ((0, 1), (1, 0)):
        amax = w2[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].abs().amax()
        assert scale2[i, j] == (amax * math.sqrt(2.0)) / 448.0
    assert scale2[1, 1] == scale1[1, 1] and torch.equal(fp8_block(codes2, 1, 1), fp8_block(codes1, 1, 1))
    assert fp8_error_ratio(w2, codes2, scale2) <= BOUND


def test_fp8_error_bound_renews_a_kept_scale_that_costs_error() -> None:
    """One block whose values are all +-a: a fresh scale (a / 448) represents them exactly (error 0);
    the kept scale of a 10% larger amax fits (x = 407) but rounds them (407 -> 416): over the bound
    of 1.01 x 0, so the block is renewed to the fresh quantization."""
    signs = torch.where(torch.randn(128, 128, generator=torch.Generator().manual_seed(1)) > 0, 1.0, -1.0)
    w1, w2 = signs * 0.011, signs * 0.01
    _, scale1 = fm.quantize_fp8_block(w1)
    assert 224 <= float(0.01 / scale1[0, 0]) <= 464  # the window alone would keep it
    codes2, scale2 = fm.quantize_fp8_block_kept(w2, scale1)
    fresh_codes, fresh_scale = fm.quantize_fp8_block(w2)
    assert torch.equal(scale2, fresh_scale) and torch.equal(
        codes2.view(torch.uint8), fresh_codes.view(torch.uint8)
    )
    assert sse(fm.dequantize_fp8_block(codes2, scale2), w2) == 0.0


def test_fp8_kept_codes_are_chosen_without_a_float8_where(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.6's CPU `torch.where` (Debian's torch, in the CPU images) has no Float8_e4m3fn kernel: the
    trainer pod crashed ("where_cpu" not implemented) at its first kept scale on the real node. The codes
    are chosen on their bytes; a `where` given float8 tensors fails this test on any torch."""
    real_where = torch.where

    def where(condition: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        assert all(a.dtype != torch.float8_e4m3fn for a in args if isinstance(a, torch.Tensor)), (
            "float8 where"
        )
        return real_where(condition, *args)

    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 384, generator=g) * 0.02
    codes0, scale0 = fm.quantize_fp8_block(w, 128)
    monkeypatch.setattr(torch, "where", where)
    codes, scale = fm.quantize_fp8_block_kept(w, scale0)
    assert codes.dtype == torch.float8_e4m3fn and torch.equal(scale, scale0)
    assert torch.equal(
        codes.view(torch.uint8), codes0.view(torch.uint8)
    )  # same weights, same scales: same codes


def test_fp8_without_previous_scales_or_of_another_shape_is_fresh() -> None:
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(2))
    fresh_codes, fresh_scale = fm.quantize_fp8_block(w)
    for previous in (None, torch.ones(3, 3)):
        codes, scale = fm.quantize_fp8_block_kept(w, previous)
        assert torch.equal(scale, fresh_scale) and torch.equal(
            codes.view(torch.uint8), fresh_codes.view(torch.uint8)
        )


# ------------------------------------------------------------------------------------------ nvfp4
def qkv(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 64, generator=g) * 0.02 for n in (64, 32, 32)]


def previous_of(
    quantized: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(scale, scale_2) for _, scale, scale_2 in quantized]


def test_nvfp4_fused_layer_keeps_its_global_scale_and_untouched_members_keep_every_byte() -> None:
    """q's largest element grows by 1%: a fresh quantization moves the layer's shared weight_scale_2 and
    with it k's and v's bytes; with kept scales k and v are byte for byte version 1 and q only changes
    where its own values changed."""
    w1 = qkv(3)
    v1 = fm.quantize_nvfp4_fused_kept(w1, None)
    amax1 = max(float(m.abs().amax()) for m in w1)
    assert all(float(ws2) == float(torch.tensor(amax1, dtype=torch.float32) / 2688.0) for _, _, ws2 in v1)
    w2 = [m.clone() for m in w1]
    top = max(range(3), key=lambda i: float(w1[i].abs().amax()))
    flat = w2[top].view(-1)
    flat[flat.abs().argmax()] *= 1.01
    fresh = fm.quantize_nvfp4_fused_kept(w2, None)
    kept = fm.quantize_nvfp4_fused_kept(w2, previous_of(v1))
    assert all(torch.equal(ws2, v1[0][2]) for _, _, ws2 in kept)  # kept, shared by q, k, v
    assert not torch.equal(fresh[0][2], v1[0][2])
    for i in range(3):
        if i == top:
            continue
        assert not torch.equal(fresh[i][0], v1[i][0])  # a fresh global scale rewrites the untouched members
        assert torch.equal(kept[i][0], v1[i][0]) and torch.equal(
            kept[i][1].view(torch.uint8), v1[i][1].view(torch.uint8)
        )
    changed_bytes = (kept[top][0] != v1[top][0]).sum()
    assert int(changed_bytes) <= 1  # the one element whose value moved (its byte holds two codes)
    for w, (packed, scale, ws2), (f_packed, f_scale, f_ws2) in zip(w2, kept, fresh, strict=True):
        assert sse(fm.dequantize_nvfp4(packed, scale, ws2), w) <= BOUND * sse(
            fm.dequantize_nvfp4(f_packed, f_scale, f_ws2), w
        )


def test_nvfp4_global_scale_renewed_with_headroom_when_the_layer_outgrows_it() -> None:
    """v's amax grows 10% beyond the layer's: the top block scale under the kept global would be
    448 * 1.1 > 464, so the global scale is renewed at amax * sqrt(2) / 2688 for all three members
    (shared: SGLang keeps one per fused layer) and every block scale with it."""
    w1 = qkv(4)
    v1 = fm.quantize_nvfp4_fused_kept(w1, None)
    amax1 = max(float(m.abs().amax()) for m in w1)
    w2 = [m.clone() for m in w1]
    w2[2][0, 0] = amax1 * 1.1
    kept = fm.quantize_nvfp4_fused_kept(w2, previous_of(v1))
    amax2 = torch.tensor(amax1 * 1.1, dtype=torch.float32)
    expected = (amax2 * math.sqrt(2.0)) / 2688.0
    assert all(torch.equal(ws2, expected) for _, _, ws2 in kept)
    for w, (packed, scale, ws2) in zip(w2, kept, strict=True):
        blocks = w.view(w.shape[0], -1, 16).abs().amax(dim=-1)
        assert torch.equal(scale.float(), fm.cast_fp8_e4m3(blocks / 6.0 / expected).float())
        fresh = fm.quantize_nvfp4(w, amax2)
        assert sse(fm.dequantize_nvfp4(packed, scale, ws2), w) <= BOUND * sse(fm.dequantize_nvfp4(*fresh), w)


def test_nvfp4_error_bound_renews_the_costliest_blocks_first() -> None:
    """Every value shrinks 10%: the global scale and every block scale still fit (x >= 4.8), but each
    kept block scale is now 10% coarse: over 1.01 x the fresh error, so blocks are renewed (fresh E4M3
    block scale under the kept global), the costliest first, until the tensor is within the bound."""
    g = torch.Generator().manual_seed(5)
    w1 = torch.randn(64, 256, generator=g) * 0.02
    v1 = fm.quantize_nvfp4_fused_kept([w1], None)
    w2 = w1 * 0.9
    ((packed, scale, ws2),) = fm.quantize_nvfp4_fused_kept([w2], previous_of(v1))
    assert torch.equal(ws2, v1[0][2])  # global kept: top block scale 448 * 0.9 >= 224
    block_amax = w2.view(64, -1, 16).abs().amax(dim=-1)
    fresh = sse(fm.dequantize_nvfp4(*fm.quantize_nvfp4(w2)), w2)
    renewed = scale.float() != v1[0][1].float()
    renewed_scale = fm.cast_fp8_e4m3(block_amax / 6.0 / ws2)  # a fresh block scale under the kept global
    assert torch.equal(scale.float(), torch.where(renewed, renewed_scale.float(), v1[0][1].float()))
    assert 0 < int(renewed.sum()) < renewed.numel()
    assert sse(fm.dequantize_nvfp4(packed, scale, ws2), w2) <= BOUND * fresh
    # every block scale kept would not be within the bound
    codes_all_kept = fm.e2m1_codes(w2.view(64, -1, 16) / (v1[0][1].float() * ws2)[..., None]).view(64, 256)
    assert sse(fm.dequantize_nvfp4(fm.pack_fp4(codes_all_kept), v1[0][1], ws2), w2) > BOUND * fresh


def test_input_scale_is_kept_while_the_activation_amax_fits() -> None:
    previous = torch.tensor(1.0)  # covers an activation amax of 2688
    assert fm.kept_global_scale(previous, 2688.0 * 0.9) is not previous
    assert torch.equal(fm.kept_global_scale(previous, 2688.0 * 0.9), previous)
    assert torch.equal(fm.kept_global_scale(previous, 2688.0 * 1.03), previous)  # top block scale 461 <= 464
    for amax in (2688.0 * 1.04, 2688.0 * 0.49):  # would clip / half of it unused: renewed with headroom
        expected = (torch.tensor(amax, dtype=torch.float32) * math.sqrt(2.0)) / 2688.0
        assert torch.equal(fm.kept_global_scale(previous, amax), expected)
    assert torch.equal(fm.kept_global_scale(None, 2688.0 * 0.9), fm.nvfp4_global_scale(2688.0 * 0.9))


# ------------------------------------------------------------------------------------------ property
@settings(max_examples=25, deadline=None)
@given(
    fmt=st.sampled_from(["fp8", "nvfp4"]),
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 3),
    growth=st.floats(0.3, 1.5),
    moved_share=st.floats(0.0, 1.0),
    step=st.sampled_from([1e-6, 1e-4, 5e-3]),
)
def test_property_kept_scales_stay_within_the_error_bound_and_keep_unchanged_blocks(
    fmt: str, seed: int, rows: int, growth: float, moved_share: float, step: float
) -> None:
    """Version 2 = version 1 with a random share of its blocks moved (scaled by `growth` and nudged):
    with version 1's scales kept, every tensor's squared error is within KEPT_SCALE_ERROR_BOUND x its
    fresh quantization's, no value clips beyond rounding (x <= 464 / 7), a fused layer shares one
    global scale, and every block whose values did not move and whose scale was kept has its codes."""
    g = torch.Generator().manual_seed(seed)
    block_rows, block_cols = (128, 128) if fmt == "fp8" else (1, 16)
    members = [torch.randn(rows * 64, 256, generator=g) * 0.02 for _ in range(2 if fmt == "nvfp4" else 1)]
    moved_masks = []
    changed = []
    for w in members:
        n_br, n_bc = -(-w.shape[0] // block_rows), w.shape[1] // block_cols
        moved = torch.rand(n_br, n_bc, generator=g) < moved_share
        full = moved.repeat_interleave(block_rows, 0)[: w.shape[0]].repeat_interleave(block_cols, 1)
        nudged = w * growth + torch.randn(w.shape, generator=g) * step
        changed.append(torch.where(full, nudged, w))
        moved_masks.append(moved)
    if fmt == "fp8":
        (w1,), (w2,) = members, changed
        codes1, scale1 = fm.quantize_fp8_block(w1)
        codes2, scale2 = fm.quantize_fp8_block_kept(w2, scale1)
        fresh = sse(fm.dequantize_fp8_block(*fm.quantize_fp8_block(w2)), w2)
        assert sse(fm.dequantize_fp8_block(codes2, scale2), w2) <= BOUND * fresh * (1 + 1e-12)
        per_element = scale2.repeat_interleave(128, 0)[: w2.shape[0]].repeat_interleave(128, 1)
        assert float(torch.nan_to_num(w2.abs() / per_element).max()) <= 464.0
        keep = (scale2 == scale1) & ~moved_masks[0]
        for i, j in keep.nonzero().tolist():
            assert torch.equal(fp8_block(codes2, i, j), fp8_block(codes1, i, j))
        return
    v1 = fm.quantize_nvfp4_fused_kept(members, None)
    v2 = fm.quantize_nvfp4_fused_kept(changed, previous_of(v1))
    fresh_v2 = fm.quantize_nvfp4_fused_kept(changed, None)
    assert len({float(ws2) for _, _, ws2 in v2}) == 1  # one global scale per fused layer
    for w, (packed, scale, ws2), fresh, old, moved in zip(
        changed, v2, fresh_v2, v1, moved_masks, strict=True
    ):
        assert sse(fm.dequantize_nvfp4(packed, scale, ws2), w) <= BOUND * sse(
            fm.dequantize_nvfp4(*fresh), w
        ) * (1 + 1e-12)
        eff = (scale.float() * ws2).repeat_interleave(16, 1)
        assert float(torch.nan_to_num(w.abs() / eff).max()) <= 7.0
        if torch.equal(ws2, old[2]):
            keep = (scale.float() == old[1].float()) & ~moved
            codes, old_codes = (
                fm.unpack_fp4(packed).view(keep.shape[0], -1, 16),
                fm.unpack_fp4(old[0]).view(keep.shape[0], -1, 16),
            )
            assert torch.equal(codes[keep], old_codes[keep])


# --------------------------------------------------------------------------------------------- views
LAYER = "model.layers.0"
NAMES = [f"{LAYER}.self_attn.{p}_proj.weight" for p in "qkvo"]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (shape, dtype and bytes)."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def changed_bytes(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.reshape(-1).view(torch.uint8) != b.reshape(-1).view(torch.uint8)).sum())


def two_versions() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(6)
    v1 = {n: torch.randn(128, 128, generator=g) * 0.02 for n in NAMES}
    v1[NAMES[0]][0, 0] = 0.2  # q holds the q/k/v layer's amax (randn * 0.02 stays below 0.2)
    v1["model.norm.weight"] = torch.ones(128)
    v2 = {n: t.clone() for n, t in v1.items()}
    v2[NAMES[0]][0, 0] *= 1.005  # q's (and the layer's) largest value moves; nothing else does
    return v1, v2


@pytest.mark.parametrize("view", ["fp8", "nvfp4"])
def test_save_view_keeps_the_previous_versions_scales(view: str, tmp_path: Path) -> None:
    """`scales_used` holds exactly the scale tensors written; passed back as `previous_scales`, version 2
    keeps them: the tensors whose values did not change are byte for byte version 1's (with fresh scales
    nvfp4's k and v move with q's amax), and load_view reads the kept-scale view."""
    v1, v2 = two_versions()
    scales: dict[str, torch.Tensor] = {}
    save_view(v1, view, tmp_path / "v1", scales_used=scales)
    raw1 = load_file(str(tmp_path / "v1" / "model.safetensors"))
    assert set(scales) == {n for n in raw1 if n.endswith(SCALE_SUFFIXES)} != set()
    assert all(same(scales[n], raw1[n]) for n in scales)
    save_view(v2, view, tmp_path / "fresh")
    save_view(v2, view, tmp_path / "kept", previous_scales=scales)
    fresh = load_file(str(tmp_path / "fresh" / "model.safetensors"))
    kept = load_file(str(tmp_path / "kept" / "model.safetensors"))

    unchanged = [n for n in raw1 if not n.startswith(f"{LAYER}.self_attn.q_proj")]
    assert all(same(kept[n], raw1[n]) for n in unchanged)
    if view == "nvfp4":
        assert not same(fresh[f"{LAYER}.self_attn.k_proj.weight"], raw1[f"{LAYER}.self_attn.k_proj.weight"])
    q = f"{LAYER}.self_attn.q_proj.weight"
    assert changed_bytes(kept[q], raw1[q]) < changed_bytes(fresh[q], raw1[q])
    _, loaded = load_view(tmp_path / "kept")
    ratio = sse(loaded[q], v2[q]) / sse(load_view(tmp_path / "fresh")[1][q], v2[q])
    assert ratio <= BOUND
