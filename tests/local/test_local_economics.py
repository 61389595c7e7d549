"""A local run's cost figures per step (rlfleet/local/main.py `step_economics`, `cost_line`; the formula is
rlfleet/fleet.py's): what the report's metrics and the live table show, from hand-computed inputs at the
built-in catalog's list prices (b200 $5.99, h100 $2.99 per GPU-hour) and its relative decode throughputs
(memory bandwidth over H100's 3.35 TB/s, times bf16's 2 bytes per weight over the format's: b200 8 TB/s,
fp8 1 byte, nvfp4 0.5625). The CPU's tokens/s price the groups' precisions and out-of-range shares; the
saving is only the estimate at the classes' catalog speeds, never one from CPU speeds."""

from __future__ import annotations

import pytest

from rlfleet.local.main import SUMMARY_METRICS, cost_line, step_economics, window_mean
from rlfleet.trainer.config import GroupSpec

B200_BF16 = 8 / 3.35  # b200 at bf16, relative to h100 at bf16
H100_FP8 = 1.0 * 2 / 1  # h100 at fp8
B200_NVFP4 = 8 / 3.35 * 2 / 0.5625  # b200 at nvfp4
GROUPS = [
    GroupSpec("b200-bf16", "b200", "bf16"),
    GroupSpec("h100-fp8", "h100", "fp8", tensor_parallel=2),
    GroupSpec("b200-nvfp4", "b200", "nvfp4"),  # made no token this step
]
# one step of GROUPS: b200-bf16 at 100 tok/s, a fifth of them out of range; h100-fp8 at 300, none
STEP = {
    "step": 1.0,
    "group/b200-bf16/tokens_per_second": 100.0,
    "group/b200-bf16/oor_fraction": 0.2,
    "group/h100-fp8/tokens_per_second": 300.0,
    "group/h100-fp8/oor_fraction": 0.0,
}


def test_step_figures_per_group_and_fleet_and_the_saving(example_run) -> None:
    rc = example_run(groups=GROUPS, reference_accelerator="b200")
    m = STEP
    e = step_economics(rc, m)
    # b200-bf16: 1 GPU at $5.99 over 80 usable tok/s; h100-fp8: 2 GPUs at $2.99 over 300
    assert e["group/b200-bf16/cost_per_hour"] == 5.99 and e["group/h100-fp8/cost_per_hour"] == 5.98
    assert e["group/b200-bf16/usable_fraction"] == pytest.approx(0.8, rel=1e-12)
    assert e["group/b200-bf16/cost_per_1m_usable_tokens"] == pytest.approx(5.99 / 3600 / 80 * 1e6, rel=1e-12)
    assert e["group/h100-fp8/cost_per_1m_usable_tokens"] == pytest.approx(5.98 / 3600 / 300 * 1e6, rel=1e-12)
    # no tokens this step: it pays ($5.99/h) but has no price per token and no usable share
    assert e["group/b200-nvfp4/cost_per_hour"] == 5.99
    assert (
        "group/b200-nvfp4/cost_per_1m_usable_tokens" not in e and "group/b200-nvfp4/usable_fraction" not in e
    )
    # fleet: $17.96/h over 380 usable of 400 tok/s; reference: the b200-bf16 group, $5.99 over 80 usable
    assert e["cost_per_hour"] == pytest.approx(17.96, rel=1e-12)
    assert e["usable_fraction"] == pytest.approx(0.95, rel=1e-12)
    assert e["cost_per_1m_usable_tokens"] == pytest.approx(17.96 / 3600 / 380 * 1e6, rel=1e-12)
    assert e["reference_cost_per_1m_usable_tokens"] == pytest.approx(5.99 / 3600 / 80 * 1e6, rel=1e-12)
    assert e["reference_estimated"] == 0.0  # measured on the b200-bf16 group
    # no saving from CPU speeds; the estimate: every group at its class's catalog speed per GPU, the usable
    # shares as measured (b200-nvfp4: no reading, all usable), against b200 bf16 at its catalog speed with the
    # out-of-range share of the run's b200-bf16 group
    assert "saving" not in e
    fleet = 17.96 / (B200_BF16 * 0.8 + H100_FP8 * 2 + B200_NVFP4 * 1)
    assert e["estimated_saving"] == pytest.approx(
        1 - fleet / (5.99 / (B200_BF16 * 0.8)), rel=1e-12
    )  # 0.6022...
    line = cost_line(rc, m | e)
    assert line == (
        "fleet $18/h, $13.1 per 1M usable tokens at CPU speed; b200 bf16 $20.8; "
        "estimated saving 60.2% against b200 bf16 (catalog throughput ratios)"
    )


def test_no_group_of_the_trainer_class_at_bf16_gives_a_reference_estimated_by_the_catalogs_ratios(
    example_run,
) -> None:
    rc = example_run(groups=GROUPS[1:], reference_accelerator="b200")
    e = step_economics(rc, {"group/h100-fp8/tokens_per_second": 300.0})  # no out-of-range share yet: 0
    assert e["cost_per_1m_usable_tokens"] == pytest.approx((5.98 + 5.99) / 3600 / 300 * 1e6, rel=1e-12)
    # b200 bf16 from the h100-fp8 group: 300 tok/s x (8 TB/s / 3.35 TB/s) / 2 (fp8 reads half bf16's bytes)
    # on its 2 GPUs; the b200-nvfp4 group made no token and implies nothing
    per_gpu = 300 * 8 / 3.35 / 2 / 2  # 179.1 tok/s
    assert e["reference_estimated"] == 1.0
    assert e["reference_cost_per_1m_usable_tokens"] == pytest.approx(5.99 / 3600 / per_gpu * 1e6, rel=1e-12)
    # at CPU speed this fleet costs 1.19x the reference per usable token (the CPU runs nvfp4 no faster than
    # bf16): that comparison is no saving and is not reported as one; at the classes' speeds it saves 61.8%
    assert "saving" not in e
    fleet = (5.98 + 5.99) / (H100_FP8 * 2 + B200_NVFP4 * 1)
    assert e["estimated_saving"] == pytest.approx(1 - fleet / (5.99 / B200_BF16), rel=1e-12)  # 0.6180...
    line = (
        "fleet $12/h, $11.1 per 1M usable tokens at CPU speed; b200 bf16 (estimated from catalog throughput ratios) "
        "$9.29; estimated saving 61.8% against b200 bf16 (catalog throughput ratios)"
    )
    assert cost_line(rc, e) == line
    # a reference class without a ratio (the CPU class) and no bf16 group of it: no reference, no estimate
    cpu = step_economics(
        example_run(groups=GROUPS[1:], reference_accelerator="cpu"),
        {"group/h100-fp8/tokens_per_second": 300.0},
    )
    assert (
        "reference_cost_per_1m_usable_tokens" not in cpu
        and "estimated_saving" not in cpu
        and "reference_estimated" not in cpu
    )
    # a group on a class without a ratio: no estimate (it would price a smaller fleet than the one paid)
    mixed = step_economics(
        example_run(groups=[*GROUPS[1:], GroupSpec("cpu-bf16", "cpu", "bf16")], reference_accelerator="b200"),
        {"group/h100-fp8/tokens_per_second": 300.0},
    )
    assert "estimated_saving" not in mixed and "cost_per_1m_usable_tokens" in mixed


def test_the_summary_averages_the_cost_and_the_estimated_saving_over_the_first_and_last_steps() -> None:
    assert SUMMARY_METRICS["cost_per_1m_usable_tokens"] == "cost_per_1m_usable_tokens"
    assert "saving" not in SUMMARY_METRICS
    history = [{"step": 1.0, "estimated_saving": 0.2}, {"step": 2.0}, {"step": 3.0, "estimated_saving": 0.4}]
    assert window_mean(history, SUMMARY_METRICS["estimated_saving"], 1, "last") == 0.4


def test_the_summary_line_states_the_estimated_saving_and_the_cpu_figure_for_what_it_is(
    example_run, capsys, tmp_path
) -> None:
    from rlfleet.local.main import _print_summary

    rc = example_run(groups=GROUPS, reference_accelerator="b200")
    summary = {
        "reward_first": 0.1,
        "reward_last": 0.5,
        "summary_window_steps": 2,
        "steps": 4,
        "seconds": 12.0,
        "entropy_first": None,
        "cost_per_1m_usable_tokens_last": 37.04,
        "estimated_saving_last": 0.6022,
        "collapse_alerts": [],
        "groups": {},
    }
    _print_summary(rc, summary, tmp_path)
    line = capsys.readouterr().out.strip()
    assert (
        "; $37 per 1M usable tokens at CPU speed and list prices; estimated saving 60.2% against b200 bf16 "
        "(catalog throughput ratios); 0 collapse alerts;"
    ) in line
    assert "saving -" not in line


def test_the_live_table_shows_each_groups_cost_per_usable_token_and_the_fleet_line(example_run) -> None:
    from rich.console import Console

    from rlfleet.local.main import Progress

    rc = example_run(groups=GROUPS, reference_accelerator="b200")
    m = STEP | {"group/b200-bf16/num_tokens": 100.0, "group/h100-fp8/num_tokens": 300.0}
    m.update(step_economics(rc, m))
    console = Console(record=True, width=200)
    console.print(Progress(rc, live=False)._render(m, []))
    lines = console.export_text().splitlines()
    header = next(line for line in lines if "tok/s" in line)
    assert [c.strip() for c in header.split("┃")][-2:] == ["$/1M", "reward"]

    def cost_cell(group: str) -> str:
        return next(line for line in lines if line.startswith(group)).split("│")[-2].strip()

    # 5.99 / 3600 / 80 * 1e6 = 20.80, 5.98 / 3600 / 300 * 1e6 = 5.537; no tokens: no price
    assert (cost_cell("b200-bf16"), cost_cell("h100-fp8"), cost_cell("b200-nvfp4")) == ("$20.8", "$5.54", "-")
    assert (
        "fleet $18/h, $13.1 per 1M usable tokens at CPU speed; b200 bf16 $20.8; estimated saving 60.2% against "
        "b200 bf16 (catalog throughput ratios)"
    ) in lines


def test_the_plain_step_line_ends_with_the_fleet_cost_per_usable_token(example_run, capsys) -> None:
    from rlfleet.local.main import Progress

    rc = example_run(groups=GROUPS, reference_accelerator="b200")
    m = STEP | {"step": 2.0}
    progress = Progress(rc, live=False)
    progress.update(m | step_economics(rc, m), [])
    progress.update({"step": 3.0}, [])  # no tokens: no figure
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith("step 2/") and first.endswith(" usd_per_1m_usable=13.13")  # 17.96/3600/380*1e6
    assert "usd_per_1m_usable" not in second
