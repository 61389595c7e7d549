"""`rlfleet ablate`'s grid: the seeds and null-arm cells it runs, the worker processes (the same
results as in one process: every run is seeded), the claims evaluated over the records, and the
generated block of docs/ablation.md."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from rlfleet.trainer import ablation
from rlfleet.trainer.ablation import AblationConfig, grid, parse_seeds, run_grid, write_docs_block


def test_seeds_argument() -> None:
    assert parse_seeds("3") == [0, 1, 2]
    assert parse_seeds("4,1") == [4, 1]
    for bad in ("0", "1,1", "-1,2"):
        with pytest.raises(ValueError):
            parse_seeds(bad)


def test_grid_adds_the_null_arm_cells_once() -> None:
    cfg = AblationConfig(lag=2)
    jobs = grid(["pg", "sc_mis"], ["mixed"], [0, 1], cfg, null_control=True)
    cells = [(arm, fleet, c.seed, c.lag) for arm, fleet, c in jobs]
    assert cells[:4] == [("pg", "mixed", 0, 2), ("sc_mis", "mixed", 0, 2), ("pg", "mixed", 1, 2), ("sc_mis", "mixed", 1, 2)]
    null = sorted(c for c in cells if c[3] == 0)
    assert null == sorted((arm, "homogeneous", seed, 0) for seed in (0, 1) for arm in ("pg", "mis", "sc", "sc_mis"))
    # at lag 0 the asked cells already include the null control's lag
    assert len(grid(["pg"], ["homogeneous"], [0], replace(cfg, lag=0), null_control=True)) == 1


def test_worker_processes_give_the_serial_results(tmp_path: Path) -> None:
    """Two short seeded runs in 2 spawned workers equal the same runs in this process, metric for metric."""
    cfg = AblationConfig(steps=4, prompts=2, samples=2, max_new_tokens=3, lag=1, model_cache=str(tmp_path))
    jobs = [("pg", "mixed", cfg), ("sc_mis+topp", "homogeneous", replace(cfg, seed=1))]
    parallel = run_grid(jobs, workers=2)
    serial = run_grid(jobs, workers=1)
    assert [(r.arm, r.fleet) for r in parallel] == [("pg", "mixed"), ("sc_mis+topp", "homogeneous")]
    for p, s in zip(parallel, serial, strict=True):
        assert [h["reward_mean"] for h in p.history] == [h["reward_mean"] for h in s.history]
        assert [h["kl_k3"] for h in p.history] == [h["kl_k3"] for h in s.history]
    records = ablation.records_of(parallel, [c for _, _, c in jobs])
    assert [(r.arm, r.fleet, r.seed, r.lag, r.steps) for r in records] == [
        ("pg", "mixed", 0, 1, 4), ("sc_mis+topp", "homogeneous", 1, 1, 4)]


def test_docs_block_is_replaced_between_the_markers(tmp_path: Path) -> None:
    doc = tmp_path / "ablation.md"
    doc.write_text(f"intro\n{ablation.DOCS_BEGIN}\nold table\n{ablation.DOCS_END}\nafter\n")
    write_docs_block(doc, "new table")
    assert doc.read_text() == f"intro\n{ablation.DOCS_BEGIN}\nnew table\n{ablation.DOCS_END}\nafter\n"
    doc.write_text("no markers\n")
    with pytest.raises(SystemExit, match="needs the lines"):
        write_docs_block(doc, "x")
