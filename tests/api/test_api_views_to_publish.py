"""The one rule for the views a channel publishes (rlfleet.api.common.views_to_publish), and the
trainer's run config taking it from every group of the RLJob, a group at 0 replicas included."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from rlfleet.api.common import views_to_publish
from rlfleet.api.rljob import load_rljob
from rlfleet.trainer.config import resolve_run

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rljob.yaml"


@pytest.mark.parametrize("n", range(5))
def test_every_subset_in_any_order_and_multiplicity_gives_the_canonical_list(n: int) -> None:
    canonical = ["bf16", "fp8", "nvfp4", "mxfp4"]
    for subset in itertools.combinations(canonical, n):
        for order in itertools.permutations(subset):
            assert views_to_publish([*order, *order]) == list(subset)  # duplicates collapse


def test_an_unknown_format_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown weight format\(s\) \['int4'\]"):
        views_to_publish(["bf16", "int4"])


def test_the_trainer_publishes_the_view_of_a_group_at_zero_replicas() -> None:
    job = load_rljob(EXAMPLE)
    assert [g.weight_format for g in job.spec.sampler_groups if g.weight_format == "nvfp4"]
    scaled_down = job.model_copy(deep=True)
    for g in scaled_down.spec.sampler_groups:
        if g.weight_format == "nvfp4":
            g.replicas = 0
    rc = resolve_run(scaled_down, local=False)
    assert "nvfp4" not in {g.weight_format for g in rc.groups}  # the run does not sample from it now
    assert rc.views == ["bf16", "fp8", "nvfp4"]  # but publishes its view for when it is scaled up
