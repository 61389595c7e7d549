"""A running fleet's figures (rlfleet/fleet.py `measured_economics`, docs/economics.md "Where the figures
show"): per group and fleet tokens/s, USD/h, usable share, USD per 1M usable tokens, the reference fleet
(the trainer's class at bf16) and the saving, from hand-computed inputs at the catalog's list prices."""

from __future__ import annotations

import math

import pytest

from rlfleet.catalog import get_catalog
from rlfleet.fleet import MeasuredGroup, measured_economics

B200, H100, A100 = 5.99, 2.99, 1.79  # USD per GPU-hour, the built-in catalog's list prices


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
    assert e.groups["h100-fp8"].cost_per_1m_usable_tokens == pytest.approx(11.96 / 3600 / 3000 * 1e6, rel=1e-12)
    assert e.groups["a100-idle"].cost_per_1m_usable_tokens is None  # no token, no price per token
    # fleet: 11.98 + 5.99 + 11.96 + 1.79 = $31.72/h; 8000 tok/s of which 1800 + 2400 + 3000 = 7200 usable
    assert e.cost_per_hour == pytest.approx(31.72, rel=1e-12)
    assert e.tokens_per_second == 8000.0 and e.usable_fraction == pytest.approx(0.9, rel=1e-12)
    assert e.cost_per_1m_usable_tokens == pytest.approx(31.72 / 3600 / 7200 * 1e6, rel=1e-12)
    # reference: the b200-bf16 group only, 1000 tok/s per GPU, 10% out of range, $5.99/GPU-h
    assert e.reference_cost_per_1m_usable_tokens == pytest.approx(5.99 / 3600 / 900 * 1e6, rel=1e-12)
    assert e.saving == pytest.approx(1 - (31.72 / 7200) / (5.99 / 900), rel=1e-12)  # 0.33806...


def test_reference_from_an_estimate_and_a_fleet_dearer_than_it() -> None:
    # no b200 group: the estimate gives the reference (no token out of range), at the given price
    groups = [MeasuredGroup("h100-bf16", "h100", "bf16", 1, H100, 500.0, 0.5)]
    e = measured_economics(groups, "b200", reference_cost_per_gpu_hour=B200, reference_tokens_per_gpu_second=1500.0)
    assert e.reference_cost_per_1m_usable_tokens == pytest.approx(5.99 / 3600 / 1500 * 1e6, rel=1e-12)
    assert e.cost_per_1m_usable_tokens == pytest.approx(2.99 / 3600 / 250 * 1e6, rel=1e-12)
    assert e.saving == pytest.approx(1 - (2.99 / 250) / (5.99 / 1500), rel=1e-12)
    assert e.saving is not None and e.saving < 0  # the fleet costs about 3x the reference per usable token
    # without an estimate nor a group of the class there is no reference and no saving
    bare = measured_economics(groups, "b200", reference_cost_per_gpu_hour=B200)
    assert bare.reference_cost_per_1m_usable_tokens is None and bare.saving is None


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
