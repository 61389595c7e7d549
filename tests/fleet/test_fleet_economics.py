"""A running fleet's figures (rlfleet/fleet.py `measured_economics`, docs/economics.md "Where the figures
show"): per group and fleet tokens/s, USD/h, usable share, USD per 1M usable tokens, the reference fleet
(the trainer's class at bf16: given, measured, or estimated through the catalog's decode-throughput
ratios) and the saving, from hand-computed inputs at the catalog's list prices and memory bandwidths."""

from __future__ import annotations

import math

import pytest

from rlfleet.catalog import CatalogError, catalog_from_mapping, get_catalog, load_catalog
from rlfleet.fleet import MeasuredGroup, estimated_reference_tokens_per_gpu_second, measured_economics

B200, H100, A100 = 5.99, 2.99, 1.79  # USD per GPU-hour, the built-in catalog's list prices
# memory bandwidth in TB/s from NVIDIA's datasheets (A100 80GB SXM, H100 SXM, H200, B200, RTX PRO 6000 Server)
BW_A100, BW_H100, BW_H200, BW_B200, BW_RTX = 2.039, 3.35, 4.8, 8.0, 1.597


def test_the_catalog_prices_the_figures_below_use() -> None:
    catalog = get_catalog()
    assert [catalog.get(c).cost_per_gpu_hour for c in ("b200", "h100", "a100")] == [B200, H100, A100]


def test_groups_fleet_reference_and_saving_by_hand() -> None:
    groups = [
        MeasuredGroup("b200-bf16", "b200", "bf16", 2, B200, 2000.0, 0.1),
        MeasuredGroup("b200-nvfp4", "b200", "nvfp4", 1, B200, 3000.0, 0.2),  # the class, not at bf16
        MeasuredGroup("h100-fp8", "h100", "fp8", 4, H100, 3000.0, None),  # no out-of-range share yet: 0
        MeasuredGroup("a100-idle", "a100", "bf16", 1, A100, 0.0, 0.0),  # pays, makes nothing
    ]
    e = measured_economics(groups, "b200")
    g = e.groups["b200-bf16"]
    assert g.cost_per_hour == pytest.approx(2 * 5.99, rel=1e-12)
    assert g.usable_fraction == pytest.approx(0.9, rel=1e-12)
    assert g.cost_per_1m_tokens == pytest.approx(11.98 / 3600 / 2000 * 1e6, rel=1e-12)
    assert g.cost_per_1m_usable_tokens == pytest.approx(11.98 / 3600 / 1800 * 1e6, rel=1e-12)
    assert e.groups["h100-fp8"].cost_per_1m_usable_tokens == pytest.approx(
        11.96 / 3600 / 3000 * 1e6, rel=1e-12
    )
    assert e.groups["a100-idle"].cost_per_1m_usable_tokens is None  # no token, no price per token
    # fleet: 11.98 + 5.99 + 11.96 + 1.79 = $31.72/h; 8000 tok/s of which 1800 + 2400 + 3000 = 7200 usable
    assert e.cost_per_hour == pytest.approx(31.72, rel=1e-12)
    assert e.tokens_per_second == 8000.0 and e.usable_fraction == pytest.approx(0.9, rel=1e-12)
    assert e.cost_per_1m_usable_tokens == pytest.approx(31.72 / 3600 / 7200 * 1e6, rel=1e-12)
    # reference: the b200-bf16 group only, 1000 tok/s per GPU, 10% out of range, $5.99/GPU-h
    assert e.reference_cost_per_1m_usable_tokens == pytest.approx(5.99 / 3600 / 900 * 1e6, rel=1e-12)
    assert e.saving == pytest.approx(1 - (31.72 / 7200) / (5.99 / 900), rel=1e-12)  # 0.33806...
    assert (e.reference_basis, e.reference_tokens_per_gpu_second) == ("measured", 1000.0)
    assert e.reference_source == "b200 bf16 measured on the fleet's b200 bf16 groups"
    # the measured group wins over the catalog's estimate
    assert measured_economics(groups, "b200", catalog=load_catalog()).reference_basis == "measured"


def test_reference_from_an_estimate_and_a_fleet_dearer_than_it() -> None:
    # no b200 group: the estimate gives the reference (no token out of range), at the given price
    groups = [MeasuredGroup("h100-bf16", "h100", "bf16", 1, H100, 500.0, 0.5)]
    e = measured_economics(
        groups, "b200", reference_cost_per_gpu_hour=B200, reference_tokens_per_gpu_second=1500.0
    )
    assert e.reference_cost_per_1m_usable_tokens == pytest.approx(5.99 / 3600 / 1500 * 1e6, rel=1e-12)
    assert e.cost_per_1m_usable_tokens == pytest.approx(2.99 / 3600 / 250 * 1e6, rel=1e-12)
    assert e.saving == pytest.approx(1 - (2.99 / 250) / (5.99 / 1500), rel=1e-12)
    assert e.saving is not None and e.saving < 0  # the fleet costs about 3x the reference per usable token
    assert e.reference_basis == "given" and e.reference_source == "b200 bf16 at the given tokens/s per GPU"
    # without an estimate nor a group of the class there is no reference and no saving
    bare = measured_economics(groups, "b200", reference_cost_per_gpu_hour=B200)
    assert bare.reference_cost_per_1m_usable_tokens is None and bare.saving is None
    assert bare.reference_basis is None and bare.reference_source is None


def test_unknown_prices_and_readings_give_no_figure_not_zero() -> None:
    groups = [
        MeasuredGroup("cpu", "cpu", "bf16", 1, 0.0, 100.0, 0.0),  # the catalog's 0: price unknown
        MeasuredGroup("new", "h100", "fp8", 1, H100, None, None),  # no reading yet
        MeasuredGroup("tiny", "h100", "fp8", 1, H100, 5e-324, 0.0),  # a subnormal rate overflows the price
    ]
    e = measured_economics(groups, "b200")
    assert e.groups["cpu"].cost_per_hour is None and e.groups["cpu"].cost_per_1m_usable_tokens is None
    assert e.groups["new"].cost_per_hour == 2.99 and e.groups["new"].cost_per_1m_usable_tokens is None
    assert e.groups["tiny"].cost_per_1m_usable_tokens is None
    assert e.cost_per_1m_usable_tokens == pytest.approx(5.98 / 3600 / 100 * 1e6, rel=1e-9)
    assert math.isfinite(e.cost_per_hour) and e.reference_cost_per_1m_usable_tokens is None
    only_unpriced = measured_economics(groups[:1], "b200")
    assert only_unpriced.cost_per_1m_usable_tokens is None and only_unpriced.saving is None


def test_the_catalogs_decode_throughput_ratios_are_bandwidth_over_h100s_times_bf16_bytes_over_the_formats() -> (
    None
):
    catalog = load_catalog()
    # bytes per weight: bf16 2, fp8 1, nvfp4 0.5 + an FP8 scale per 16 = 0.5625, mxfp4 as bf16 (dense layers)
    expected = {
        ("h100", "bf16"): 1.0,
        ("h100", "fp8"): 2.0,
        ("h100", "mxfp4"): 1.0,
        ("a100", "bf16"): BW_A100 / BW_H100,
        ("a100", "fp8"): BW_A100 / BW_H100 * 2,
        ("h200", "bf16"): BW_H200 / BW_H100,
        ("h200", "fp8"): BW_H200 / BW_H100 * 2,
        ("b200", "bf16"): BW_B200 / BW_H100,
        ("b200", "nvfp4"): BW_B200 / BW_H100 * 2 / 0.5625,
        ("b300", "fp8"): BW_B200 / BW_H100 * 2,
        ("rtx-pro-6000", "nvfp4"): BW_RTX / BW_H100 * 2 / 0.5625,
    }
    for (cls, fmt), ratio in expected.items():
        assert catalog.decode_throughput(cls, fmt) == pytest.approx(ratio, rel=1e-12), (cls, fmt)
    # no figure: a format the class does not run, the CPU class, an unknown class
    assert [
        catalog.decode_throughput(c, f) for c, f in [("a100", "nvfp4"), ("cpu", "bf16"), ("x", "bf16")]
    ] == [None] * 3
    # a catalog override replaces one figure and keeps the others; a figure must be positive
    measured = catalog_from_mapping({"classes": {"h100": {"decodeThroughput": {"fp8": 1.6}}}})
    assert (measured.decode_throughput("h100", "fp8"), measured.decode_throughput("h100", "bf16")) == (
        1.6,
        1.0,
    )
    with pytest.raises(CatalogError, match="decodeThroughput.fp8"):
        catalog_from_mapping({"classes": {"h100": {"decodeThroughput": {"fp8": 0}}}})


def test_without_a_bf16_group_of_the_class_the_reference_is_estimated_by_the_catalogs_ratios() -> None:
    groups = [
        MeasuredGroup("h100-fp8", "h100", "fp8", 4, H100, 3000.0, 0.0),
        MeasuredGroup("a100-bf16", "a100", "bf16", 1, A100, 600.0, 0.1),
        MeasuredGroup("a100-idle", "a100", "bf16", 1, A100, 0.0, None),  # pays, implies nothing
        MeasuredGroup("cpu", "cpu", "bf16", 1, 0.0, 50.0, 0.0),  # no ratio: left out of the estimate
    ]
    # on b200 at bf16 the h100-fp8 group's 3000 tok/s would be 3000 x (8/3.35) / 2 on its 4 GPUs, the
    # a100-bf16 group's 600 would be 600 x (8/3.35) / (2.039/3.35) on 1: per GPU, their sum over 5 GPUs
    per_gpu = (3000 * (BW_B200 / BW_H100) / 2 + 600 * BW_B200 / BW_A100) / 5  # 1187.237 tok/s
    catalog = load_catalog()
    assert estimated_reference_tokens_per_gpu_second(groups, "b200", catalog) == pytest.approx(
        per_gpu, rel=1e-12
    )
    e = measured_economics(groups, "b200", catalog=catalog)  # the price: the catalog's b200
    assert e.reference_basis == "estimated" and e.reference_tokens_per_gpu_second == pytest.approx(
        per_gpu, rel=1e-12
    )
    assert e.reference_source == "b200 bf16 estimated from catalog throughput ratios"
    # no bf16 group of the class: no token of the reference counted out of range
    assert e.reference_cost_per_1m_usable_tokens == pytest.approx(B200 / 3600 / per_gpu * 1e6, rel=1e-12)
    # the fleet: 4 x $2.99 + 2 x $1.79 = $15.54/h (the cpu group is unpriced) over 3000 + 540 + 50 usable tok/s
    assert e.cost_per_1m_usable_tokens == pytest.approx(15.54 / 3600 / 3590 * 1e6, rel=1e-12)
    assert e.saving == pytest.approx(1 - (15.54 / 3590) / (B200 / per_gpu), rel=1e-12)  # 0.1421...
    # a reference class the fleet runs at bf16 on the same GPUs estimates the same throughput as measured
    a100 = estimated_reference_tokens_per_gpu_second(groups[1:3], "a100", catalog)
    assert a100 == pytest.approx(600.0, rel=1e-12)
    # no group with a ratio, or no ratio for the reference class: no estimate, no reference
    assert estimated_reference_tokens_per_gpu_second(groups[3:], "b200", catalog) is None
    assert (
        measured_economics(groups[:3], "cpu", reference_cost_per_gpu_hour=1.0, catalog=catalog).saving is None
    )
