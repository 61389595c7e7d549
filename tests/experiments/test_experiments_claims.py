"""experiments/claims.py: the ablation's pre-registered definitions and claims, on hand-made runs.

Every expected number here is worked out by hand in the comments (none is computed by claims.py).
The synthetic ablation (`world`) uses window 2, chance 0, peak margin 0.5, 10 steps, 3 seeds, lag 1:
`collapse_after(c)` = c ones then zeros, whose rolling-2 mean is >= 0.5 up to step c + 1 and 0 from
step c + 2 (peak 1), so it collapses at step c + 2 with final reward 0; `stable(v)` = nine ones then v,
whose last rolling mean (1 + v) / 2 >= 0.5, so it never collapses, with final reward v.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet_experiments import ablation
from rlfleet_experiments.claims import (
    ARM_ORDER,
    FLEET_ORDER,
    NULL_ARMS,
    Claim,
    ClaimResult,
    CollapseDefinition,
    DetectorAlerts,
    RunRecord,
    claims_table,
    collapse_step,
    detector_table,
    evaluate_claims,
    final_reward,
    is_stable_run,
    kl_growth,
    lock_step,
    null_noise_floor,
    paired_difference,
    paper_claims,
    score_detector,
    summary_table,
    tail_steps,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "ablation.md"


# ----------------------------------------------------------------------------- collapse_step
def test_collapse_that_recovers_is_not_a_collapse():
    # rolling-2 means at steps 2..8: 1, .5, 0, 0, .5, 1, 1: below .5 at 4-5, but back to 1 later
    assert collapse_step([1, 1, 0, 0, 0, 1, 1, 1], 2, chance=0.0, peak_margin=0.5) is None


def test_collapse_at_the_last_step():
    # rolling-2 means at steps 2..6: 1, 1, 1, .5, 0: only the last is < .5
    assert collapse_step([1, 1, 1, 1, 0, 0], 2, chance=0.0, peak_margin=0.5) == 6


def test_peak_must_clear_chance_plus_margin():
    rewards = [0.4, 0.4, 0.0, 0.0, 0.0]  # rolling-2 means 0.4, 0.2, 0, 0 at steps 2..5; peak 0.4
    assert collapse_step(rewards, 2, chance=0.0, peak_margin=0.5) is None
    # peak 0.4 >= 0.25: half is 0.2; step 3's 0.2 is not below it, step 4's 0 is
    assert collapse_step(rewards, 2, chance=0.0, peak_margin=0.25) == 4
    # a peak exactly at chance + margin qualifies (0.25 + 0.25 = 0.5): means .5, .25, 0 at steps 2..4
    assert collapse_step([0.5, 0.5, 0.0, 0.0], 2, chance=0.25, peak_margin=0.25) == 4
    assert collapse_step([0.5, 0.5, 0.0, 0.0], 2, chance=0.25, peak_margin=0.3) is None


def test_half_of_the_running_peak_at_t_and_strictly_below():
    # window 1: step 2's 0.2 is below half of the peak 0.5 but the run recovers; the peak becomes 1 at
    # step 3 and from step 4 on everything is 0.4 < 0.5
    assert collapse_step([0.5, 0.2, 1.0, 0.4, 0.4], 1, chance=0.0, peak_margin=0.25) == 4
    # exactly half is not below half: step 2 (0.5) does not count, step 3 (0) does
    assert collapse_step([1.0, 0.5, 0.0], 1, chance=0.0, peak_margin=0.5) == 3


def test_window_edges():
    assert collapse_step([1.0] * 9, 10, chance=0.0) is None  # no full window yet
    assert collapse_step([1.0, 0.0], 1, chance=0.0, peak_margin=0.5) == 2  # window 1 = the raw rewards
    # window 3 over [1,1,1,0,0,0]: means 1, 2/3, 1/3, 0 at steps 3..6; the first mean is the peak, so the
    # earliest possible collapse is step window + 1; here 1/3 < 1/2 first at step 5
    assert collapse_step([1, 1, 1, 0, 0, 0], 3, chance=0.0, peak_margin=0.5) == 5
    # the default window of 10 and margin 0.2, chance 0.1: ten steps at 0.5, then ten at 0.1: rolling
    # means 0.5 at step 10 (the peak, >= 0.3), then 0.46, 0.42, 0.38, 0.34, 0.30, 0.26 (step 16, not
    # < 0.25), 0.22 at step 17 and lower after
    assert collapse_step([0.5] * 10 + [0.1] * 10, chance=0.1) == 17
    assert collapse_step([0.25] * 10 + [0.0] * 10, chance=0.1) is None  # peak 0.25 < 0.1 + 0.2


def test_bad_definitions_are_refused():
    with pytest.raises(ValueError, match="window"):
        collapse_step([1.0], 0, chance=0.0)
    with pytest.raises(ValueError, match="chance"):
        collapse_step([1.0], 1, chance=-0.1)
    with pytest.raises(ValueError, match="finite"):
        collapse_step([1.0, math.nan], 1, chance=0.0)
    with pytest.raises(ValueError, match="chance"):
        CollapseDefinition(chance=math.inf)


grid = st.integers(0, 64).map(lambda i: i / 64)  # rewards in [0, 1] on a binary grid (exact arithmetic)


@settings(max_examples=150, deadline=None)
@given(
    prefix=st.lists(grid, max_size=20),
    window=st.integers(1, 5),
    zeros=st.integers(1, 10),
    chance=st.sampled_from([0.0, 0.125]),
)
def test_appending_zeros_after_a_collapse_changes_nothing(prefix, window, zeros, chance):
    # By definition: a window of ones makes the peak 1 >= chance + 0.2 and a window of zeros ends the
    # run below half of it, so the run collapses; appended zeros (rewards are >= 0) only add rolling
    # means that are <= the last one and cannot make an earlier step qualify.
    rewards = [*prefix, *([1.0] * window), *([0.0] * window)]
    step = collapse_step(rewards, window, chance=chance)
    assert step is not None
    assert collapse_step(rewards + [0.0] * zeros, window, chance=chance) == step


@settings(max_examples=150, deadline=None)
@given(rewards=st.lists(grid, max_size=30), window=st.integers(1, 5))
def test_collapse_step_is_invariant_to_the_reward_scale(rewards, window):
    # doubling rewards, chance and margin doubles every mean and threshold exactly (binary floats)
    assert collapse_step([2 * r for r in rewards], window, chance=0.25, peak_margin=0.5) == collapse_step(
        rewards, window, chance=0.125, peak_margin=0.25
    )


# -------------------------------------------------------------------- kl_growth, final_reward
def test_tail_steps_final_reward_and_kl_growth_by_hand():
    assert (tail_steps(120), tail_steps(25), tail_steps(9), tail_steps(1)) == (12, 2, 1, 1)
    with pytest.raises(ValueError):
        tail_steps(0)
    assert final_reward([0.0] * 18 + [1.0, 0.5]) == 0.75  # last 2 of 20
    assert final_reward([0.0] * 8 + [0.25]) == 0.25  # last 1 of 9
    kls = [float(i) for i in range(1, 11)]
    assert kl_growth(kls, 0) == 10 / 2  # last 1 step (10) over mean of steps 1..3 (2)
    assert kl_growth(kls, 1) == pytest.approx(10 / 3)  # steps 2..4: mean 3
    # 20 steps, lag 2: last 2 steps mean 19.5 over steps 3..5 mean 4
    assert kl_growth([float(i) for i in range(1, 21)], 2) == 19.5 / 4
    with pytest.raises(ValueError, match="steps 3..5"):
        kl_growth([1.0] * 4, 2)
    with pytest.raises(ValueError, match="undefined"):
        kl_growth([0.0, 0.0, 0.0, 1.0], 0)


# ------------------------------------------------------------------------- records and pairs
def history(rewards, kls=None, entropy=1.0):
    kls = kls or [0.0625] * len(rewards)
    return [
        {"step": float(i + 1), "reward_mean": r, "kl_k3": k, "entropy": entropy}
        for i, (r, k) in enumerate(zip(rewards, kls, strict=True))
    ]


def test_run_records_are_validated():
    with pytest.raises(ValueError, match="expected 2"):
        RunRecord(
            "pg",
            "mixed",
            0,
            1,
            [
                {"step": 1.0, "reward_mean": 0.0, "kl_k3": 0.0},
                {"step": 3.0, "reward_mean": 0.0, "kl_k3": 0.0},
            ],
        )
    with pytest.raises(ValueError, match="'kl_k3'"):
        RunRecord("pg", "mixed", 0, 1, [{"step": 1.0, "reward_mean": 0.0}])
    with pytest.raises(ValueError, match="empty history"):
        RunRecord("pg", "mixed", 0, 1, [])
    one = RunRecord("pg", "mixed", 0, 1, history([0.0]))
    with pytest.raises(ValueError, match="two runs of pg/mixed/lag 1 with seed 0"):
        paired_difference([one, one], "pg", "pg", "mixed", 1)


def test_paired_difference_by_hand():
    a = [RunRecord("sc_mis+topp", "mixed", s, 1, history([v])) for s, v in enumerate([0.5, 1.0, 0.25])]
    b = [RunRecord("pg", "mixed", s, 1, history([0.25])) for s in range(4)]  # seed 3 has no partner
    d = paired_difference(a + b, "sc_mis+topp", "pg", "mixed", 1)
    # differences 0.25, 0.75, 0: mean 1/3; deviations -1/12, 5/12, -4/12 -> sum of squares 42/144,
    # sample variance 21/144 = 7/48
    assert (d.seeds, d.differences, d.n, d.min, d.max) == ((0, 1, 2), (0.25, 0.75, 0.0), 3, 0.0, 0.75)
    assert d.mean == pytest.approx(1 / 3)
    assert d.std == pytest.approx(math.sqrt(7 / 48))
    with pytest.raises(ValueError, match="share no seed"):
        paired_difference(a, "sc_mis+topp", "pg", "mixed", 1)


# --------------------------------------------------------------------------- the synthetic ablation
STEPS, LAG, SEEDS = 10, 1, (0, 1, 2)
DEF = CollapseDefinition(chance=0.0, window=2, peak_margin=0.5)


def collapse_after(c):
    return [1.0] * c + [0.0] * (STEPS - c)


def stable(last=1.0):
    return [1.0] * (STEPS - 1) + [last]


def mixed_kls(end=0.25, first=0.25):
    # step 1 (on-policy) `first`, steps 2..9 at 0.25, step 10 `end`: growth at lag 1 = end / 0.25
    return [first] + [0.25] * (STEPS - 2) + [end]


HOMOG_KLS = [0.0625] * STEPS  # on-policy 1/16: mixed / homogeneous = 0.25 / 0.0625 = 4


def world(**cells):
    """Cells "arm/fleet" (lag 1) or "arm/null" (homogeneous, lag 0) -> per-seed rewards (or (rewards, kls));
    keyword overrides replace a cell, None removes it."""
    base = {
        "pg/mixed": [(collapse_after(c), mixed_kls(end=1.0)) for c in (2, 3, 4)],  # collapse 4, 5, 6
        "pg/homogeneous": [collapse_after(6), collapse_after(7), stable()],  # 8, 9, never
        "mis/mixed": [collapse_after(4), collapse_after(6), stable()],  # 6, 8, never
        "sc/mixed": [collapse_after(c) for c in (3, 5, 7)],  # 5, 7, 9
        "pg+topp/mixed": [stable()] * 3,
        "sc_mis/mixed": [stable()] * 3,
        "sc_mis/homogeneous": [stable()] * 3,
        "sc_mis+topp/mixed": [stable(0.75), stable(0.5), stable(1.0)],
        "sc_mis+topp/homogeneous": [stable()] * 3,
        "pg/null": [stable(0.5)] * 3,
        "mis/null": [stable(0.5), stable(0.75), stable(0.25)],
        "sc/null": [stable(0.75), stable(0.5), stable(0.5)],
        "sc_mis/null": [stable(0.5), stable(0.5), stable(0.75)],
    }
    base.update({k.replace("__", "/").replace("_plus_", "+"): v for k, v in cells.items()})
    records = []
    for key, runs in base.items():
        if runs is None:
            continue
        arm, where = key.split("/")
        fleet, lag = ("homogeneous", 0) if where == "null" else (where, LAG)
        for seed, run in zip(SEEDS, runs, strict=True):
            rewards, kls = (
                run if isinstance(run, tuple) else (run, mixed_kls() if fleet == "mixed" else HOMOG_KLS)
            )
            records.append(RunRecord(arm, fleet, seed, lag, history(rewards, kls)))
    return records


def results(records, min_seeds=3):
    return {c.id: r for c, r in evaluate_claims(paper_claims(DEF, LAG, min_seeds=min_seeds), records)}


def test_every_claim_passes_on_the_papers_story():
    res = results(world())
    assert {k: r.status for k, r in res.items()} == {f"C{i}": "PASS" for i in range(1, 8)}
    assert "collapsed in 3/3 seeds" in res["C1"].evidence and "0: 4, 1: 5, 2: 6" in res["C1"].evidence
    # pg homogeneous (8 + 9 + 11) / 3 = 9.3 vs mixed (4 + 5 + 6) / 3 = 5.0
    assert "homogeneous collapsed 2/3, mean step 9.3" in res["C2"].evidence
    assert "mixed collapsed 3/3, mean step 5.0" in res["C2"].evidence
    assert "sc_mis+topp/mixed/lag 1 0/3" in res["C3"].evidence
    # mis (6 + 8 + 11) / 3 = 8.3, sc (5 + 7 + 9) / 3 = 7.0, pg+topp 11.0, all between pg 5.0 and sc_mis 11.0
    assert "mis 2/3 collapsed, mean step 8.3 (between)" in res["C4"].evidence
    assert "sc 3/3 collapsed, mean step 7.0 (between)" in res["C4"].evidence
    # pg, sc_mis, sc_mis+topp on both fleets x 3 seeds, each 0.25 / 0.0625
    assert (
        "over 9 (arm, seed) pairs of pg, sc_mis, sc_mis+topp: median 4x, range 4x..4x" in res["C5"].evidence
    )
    # sc_mis+topp - pg: 0.75, 0.5, 1.0 -> mean 0.75, std 0.25; null floor max |mean| = 1/12 = 0.083 (see below)
    assert "mean 0.750, std 0.250, min 0.500, max 1.000, n 3" in res["C6"].evidence
    assert "largest absolute mean paired difference 0.083" in res["C6"].evidence
    # growth pg 1.0 / 0.25 = 4, sc_mis 0.25 / 0.25 = 1
    assert "in 3/3 seeds" in res["C7"].evidence and "median pg 4.00x, sc_mis 1.00x" in res["C7"].evidence


def test_claims_read_the_low_precision_fleet_they_are_given():
    """The same story on a fleet named `nvfp4` (`rlfleet ablate --fleets homogeneous,nvfp4`): with
    low_fleet="nvfp4" every claim passes with the same evidence, the fleet's name in it; with the
    default ("mixed") the cells are missing and no claim that reads them runs."""
    renamed = [replace(r, fleet="nvfp4") if r.fleet == "mixed" else r for r in world()]
    res = {
        c.id: r for c, r in evaluate_claims(paper_claims(DEF, LAG, min_seeds=3, low_fleet="nvfp4"), renamed)
    }
    assert {k: r.status for k, r in res.items()} == {f"C{i}": "PASS" for i in range(1, 8)}
    assert "pg/nvfp4/lag 1 collapsed in 3/3 seeds" in res["C1"].evidence
    assert "nvfp4 collapsed 3/3, mean step 5.0" in res["C2"].evidence
    assert "step-1 kl_k3 nvfp4 / homogeneous over 9" in res["C5"].evidence
    default = results(renamed)
    assert {k for k, r in default.items() if r.status == "not run"} == {
        "C1",
        "C2",
        "C4",
        "C5",
        "C6",
        "C7",
        "C3",
    }
    assert "pg/mixed/lag 1 (no runs)" in default["C1"].evidence
    with pytest.raises(ValueError, match="not against itself"):
        paper_claims(DEF, LAG, low_fleet="homogeneous")


def test_null_arm_noise_floor_by_hand():
    floor = null_noise_floor(world())
    # final rewards by seed: pg .5 .5 .5, mis .5 .75 .25, sc .75 .5 .5, sc_mis .5 .5 .75; pair means:
    # pg-mis 0, pg-sc -1/12, pg-sc_mis -1/12, mis-sc -1/12, mis-sc_mis -1/12, sc-sc_mis 0
    assert [(p.a, p.b) for p in floor.pairs] == [
        ("pg", "mis"),
        ("pg", "sc"),
        ("pg", "sc_mis"),
        ("mis", "sc"),
        ("mis", "sc_mis"),
        ("sc", "sc_mis"),
    ]
    assert [p.mean for p in floor.pairs] == pytest.approx([0, -1 / 12, -1 / 12, -1 / 12, -1 / 12, 0])
    assert floor.max_abs_mean == pytest.approx(1 / 12)
    # sample variances 3/48, 1/48, 1/48, 4/48, 7/48, 3/48 with 2 df each: pooled 19/288
    assert floor.pooled_std == pytest.approx(math.sqrt(19 / 288))
    assert tuple(NULL_ARMS) == ("pg", "mis", "sc", "sc_mis")


def test_c1_needs_two_thirds_of_seeds():
    assert results(world(pg__mixed=[collapse_after(2), stable(), stable()]))["C1"].status == "FAIL"  # 1/3
    r = results(world(pg__mixed=[collapse_after(2), collapse_after(3), stable()]))["C1"]  # 2/3 is enough
    assert r.status == "PASS" and "2/3" in r.evidence and "2: never" in r.evidence


def test_c2_later_on_average_or_in_fewer_seeds():
    same = [collapse_after(c) for c in (2, 3, 4)]
    assert results(world(pg__homogeneous=same))["C2"].status == "FAIL"  # 5.0 vs 5.0, 3 vs 3
    # mixed 8, 9, 9 (mean 8.7, 3 seeds); homogeneous 3, 3, never (mean (3 + 3 + 11) / 3 = 5.7, 2 seeds):
    # earlier on average but in fewer seeds
    r = results(
        world(
            pg__mixed=[collapse_after(c) for c in (6, 7, 7)],
            pg__homogeneous=[collapse_after(1), collapse_after(1), stable()],
        )
    )["C2"]
    assert r.status == "PASS" and "mean step 5.7" in r.evidence and "mean step 8.7" in r.evidence


def test_c3_fails_on_one_collapse():
    r = results(world(sc_mis_plus_topp__homogeneous=[stable(), collapse_after(5), stable()]))["C3"]
    assert r.status == "FAIL"
    assert "sc_mis+topp/homogeneous/lag 1 1/3 (0: never, 1: 7, 2: never)" in r.evidence


def test_c4_in_between_and_not_vacuous():
    r = results(world(sc__mixed=[collapse_after(1)] * 3))["C4"]  # sc collapses at 3: earlier than pg's 5.0
    assert r.status == "FAIL" and "sc 3/3 collapsed, mean step 3.0 (NOT between)" in r.evidence
    # nothing collapses on the mixed fleet: every arm is trivially "between", which is no evidence
    r = results(world(pg__mixed=[stable()] * 3, mis__mixed=[stable()] * 3, sc__mixed=[stable()] * 3))["C4"]
    assert r.status == "FAIL" and "nothing in between" in r.evidence
    # a single correction better than sc_mis: sc_mis collapses at 10 (c = 8) in every seed, pg+topp never
    r = results(world(sc_mis__mixed=[collapse_after(8)] * 3))["C4"]
    assert r.status == "FAIL" and "pg+topp 0/3 collapsed, mean step 11.0 (NOT between)" in r.evidence


def test_c5_every_seed_above_one():
    kls = mixed_kls(end=1.0, first=1 / 32)  # 1/32 over 1/16 = 0.5 for pg seed 2
    pg = [(collapse_after(c), mixed_kls(end=1.0)) for c in (2, 3)] + [(collapse_after(4), kls)]
    r = results(world(pg__mixed=pg))["C5"]
    assert r.status == "FAIL" and "range 0.5x..4x" in r.evidence and "not > 1: pg seed 2: 0.5" in r.evidence


def test_c6_against_zero_and_the_noise_floor():
    # null pg ends at 1, the others at 0: pg - mis has mean 1 > the effect 0.75
    r = results(
        world(
            pg__null=[stable(1.0)] * 3,
            mis__null=[stable(0.0)] * 3,
            sc__null=[stable(0.0)] * 3,
            sc_mis__null=[stable(0.0)] * 3,
        )
    )["C6"]
    assert r.status == "FAIL" and "largest absolute mean paired difference 1.000" in r.evidence
    # sc_mis+topp ends at 0.5, pg (stable) at 1: mean -0.5
    r = results(world(pg__mixed=[stable()] * 3, sc_mis_plus_topp__mixed=[stable(0.5)] * 3))["C6"]
    assert r.status == "FAIL" and "mean -0.500" in r.evidence


def test_c7_kl_growth_in_two_thirds_of_seeds():
    flat = [(collapse_after(c), mixed_kls(end=0.25)) for c in (2, 3, 4)]  # growth 1 = sc_mis's: not greater
    assert results(world(pg__mixed=flat))["C7"].status == "FAIL"
    two = flat[:1] + [(collapse_after(c), mixed_kls(end=1.0)) for c in (3, 4)]
    r = results(world(pg__mixed=two))["C7"]
    assert r.status == "PASS" and "in 2/3 seeds" in r.evidence and "0: 1.00x vs 1.00x" in r.evidence


def test_missing_cells_are_not_run_and_named():
    r = results(world(sc_mis__homogeneous=None))
    assert r["C3"].status == "not run" and r["C3"].passed is None
    assert r["C3"].missing == ("sc_mis/homogeneous/lag 1 (no runs)",)
    assert r["C5"].status == "PASS"  # sc_mis is no longer on both fleets: pg and sc_mis+topp remain
    r = results(world(sc__null=None))
    assert r["C6"].missing == ("sc/homogeneous/lag 0 (no runs)",) and r["C1"].status == "PASS"
    r = results(world(), min_seeds=4)
    assert {x.status for x in r.values()} == {"not run"}
    assert "pg/mixed/lag 1 (3 seeds < 4)" in r["C1"].missing
    # cells with enough seeds each but not the same ones
    records = [x for x in world() if not (x.arm == "pg" and x.fleet == "mixed" and x.seed == 2)]
    records.append(RunRecord("pg", "mixed", 7, LAG, history(collapse_after(2), mixed_kls(end=1.0))))
    r = results(records)["C2"]
    assert r.status == "not run" and r.missing == ("pg/homogeneous/lag 1, pg/mixed/lag 1 share 2 seeds < 3",)


def test_claims_table_and_summary_table():
    claims = paper_claims(DEF, LAG, min_seeds=3)
    md = claims_table(evaluate_claims(claims, world(sc_mis__homogeneous=None)))
    lines = md.splitlines()
    assert lines[0] == "| claim | statement | result | evidence |" and len(lines) == 2 + 7
    assert lines[2].startswith(f"| C1 | {claims[0].text} | PASS | pg/mixed/lag 1 collapsed in 3/3 seeds")
    assert lines[4] == f"| C3 | {claims[2].text} | not run | missing: sc_mis/homogeneous/lag 1 (no runs) |"
    assert lines[7].count(" | ") == 3  # no stray cell separators in text or evidence
    odd = Claim("X", "a|b", lambda records: ClaimResult(True, "c|d"))
    assert claims_table(evaluate_claims([odd], [])).splitlines()[2] == "| X | a\\|b | PASS | c\\|d |"

    rows = summary_table(world(), DEF).splitlines()
    assert len(rows) == 2 + 13
    # lag 0 first, then homogeneous before mixed, arms in the ablation's order; null pg: finals .5 x 3,
    # KL flat at 1/16 (growth 1), entropy 1
    assert (
        rows[2] == "| pg | homogeneous | 0 | 3 | 0/3 | 0/3 | 11.0 | 0.500 ± 0.000 | 1.00 | 0.0625 | 1.000 |"
    )
    assert "| pg | mixed | 1 | 3 | 3/3 | 0/3 | 5.0 | 0.000 ± 0.000 | 4.00 | 0.25 | 1.000 |" in rows
    assert "| sc_mis+topp | mixed | 1 | 3 | 0/3 | 0/3 | 11.0 | 0.750 ± 0.250 | 1.00 | 0.25 | 1.000 |" in rows


def test_lock_step_is_the_start_of_a_uniform_tail_of_at_least_min_steps():
    assert lock_step([0.5, 1.0, 0.7] + [1.0] * 10) == 4  # the uniform tail starts at step 4
    assert lock_step([0.5] + [1.0] * 9) is None  # 9 steps < 10
    assert lock_step([0.5] + [1.0] * 9, min_steps=9) == 2
    assert lock_step([1.0] * 12) == 1
    assert lock_step([1.0] * 11 + [0.875]) is None  # the last step still trains something
    assert lock_step([None] * 3 + [1.0] * 10) == 4  # a step without the metric is not uniform
    with pytest.raises(ValueError, match="min_steps"):
        lock_step([1.0], min_steps=0)
    uniform_tail = [
        {"step": i + 1, "reward_mean": 0.1, "kl_k3": 0.0, "uniform_group_fraction": 1.0 if i >= 2 else 0.5}
        for i in range(12)
    ]
    assert RunRecord("pg", "mixed", 0, 4, uniform_tail).uniform_fractions[:3] == [0.5, 0.5, 1.0]
    rows = summary_table([RunRecord("pg", "mixed", 0, 4, uniform_tail)], DEF).splitlines()
    assert rows[2].startswith(
        "| pg | mixed | 4 | 1 | 0/1 | 1/1 |"
    )  # locked in, not collapsed (never learned)


def test_names_match_the_ablation_and_the_doc_states_every_claim():
    assert set(ARM_ORDER) <= set(ablation.ARMS) and set(FLEET_ORDER) <= set(ablation.FLEETS)
    doc = DOC.read_text()
    section = doc[doc.index("## Pre-registered claims") :]
    for claim in paper_claims(CollapseDefinition(chance=0.1), lag=4):
        assert f"| {claim.id} | {claim.text} |" in section


def test_ablation_picks_the_fleet_its_claims_compare():
    assert ablation.claims_fleet(["homogeneous", "mixed"]) == "mixed"
    assert ablation.claims_fleet(["homogeneous", "mixed_4bit", "mixed"]) == "mixed"
    assert ablation.claims_fleet(["homogeneous", "nvfp4"]) == "nvfp4"
    assert ablation.claims_fleet(["nvfp4", "mixed_4bit"]) == "nvfp4"
    assert ablation.claims_fleet(["homogeneous"]) == "mixed"  # nothing to compare: its claims are not run


def test_detector_score_puts_each_run_in_one_row_by_hand():
    """Two runs collapse at step 26 (reward 0.9 for 20 steps, then 0: the rolling-10 mean first drops
    below half of 0.9 with 6 zeros in the window); the detector fired on one at step 26 (ahead) and on
    the other at 27 (after). A locked run (its last 10 steps uniform) is its own row even on a stable arm.
    Stable: sc_mis anywhere and the null cells (pg on the homogeneous fleet at lag 0); pg on the mixed
    fleet at lag 0 is not a null cell."""
    definition = CollapseDefinition(chance=0.1)
    falls = history([0.9] * 20 + [0.0] * 20)
    flat = history([0.5] * 40)
    locked = [{**h, "uniform_group_fraction": 1.0 if h["step"] > 30 else 0.5} for h in flat]
    runs = [
        (RunRecord("pg", "mixed", 0, 4, falls), DetectorAlerts(26, ("rho_blowup",))),
        (RunRecord("pg", "homogeneous", 0, 4, falls), DetectorAlerts(27, ("reward_cliff",))),
        (RunRecord("sc_mis", "mixed", 0, 4, locked), DetectorAlerts(None, ())),
        (RunRecord("sc_mis", "mixed", 1, 4, flat), DetectorAlerts(12, ("kl_surge",))),
        (RunRecord("pg", "homogeneous", 0, 0, flat), DetectorAlerts(30, ("kl_surge", "reward_cliff"))),
        (RunRecord("sc_mis+topp", "homogeneous", 0, 4, flat), DetectorAlerts(None, ())),
        (RunRecord("pg", "mixed", 1, 4, flat), DetectorAlerts(40, ("grad_norm_spike",))),
        (RunRecord("pg", "mixed", 0, 0, flat), DetectorAlerts(None, ())),
        (RunRecord("mis", "homogeneous", 0, 4, flat), DetectorAlerts(None, ())),
    ]
    assert definition.step([h["reward_mean"] for h in falls]) == 26
    assert [is_stable_run(r) for r, _ in runs] == [False, False, True, True, True, True, False, False, False]
    score = score_detector([r for r, _ in runs], [a for _, a in runs], definition)
    assert (score.collapsed, score.collapsed_fired, score.collapsed_ahead) == (2, 2, 1)
    assert (score.locked, score.locked_fired) == (1, 0)
    assert (score.stable, score.stable_fired) == (3, 2)
    assert (score.other, score.other_fired) == (3, 1)
    assert score.false_alarm_signals == {"kl_surge": 2, "reward_cliff": 1}
    table = detector_table(score)
    assert "| collapsed by the definition: 2 | 2 (1 at or before the collapse step) |" in table
    assert "Signals in the false alarms (runs): kl_surge 2, reward_cliff 1." in table
    with pytest.raises(ValueError, match="9 runs but 8 detector results"):
        score_detector([r for r, _ in runs], [a for _, a in runs][:8], definition)
