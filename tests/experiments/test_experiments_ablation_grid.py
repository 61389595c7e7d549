"""`rlfleet ablate`'s grid: the seeds and null-arm cells it runs, the worker processes (the same
results as in one process: every run is seeded), the claims evaluated over the records, and the
generated block of docs/ablation.md."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from rlfleet_experiments import ablation
from rlfleet_experiments.ablation import AblationConfig, grid, parse_seeds, run_grid, write_docs_block


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
    assert cells[:4] == [
        ("pg", "mixed", 0, 2),
        ("sc_mis", "mixed", 0, 2),
        ("pg", "mixed", 1, 2),
        ("sc_mis", "mixed", 1, 2),
    ]
    null = sorted(c for c in cells if c[3] == 0)
    assert null == sorted(
        (arm, "homogeneous", seed, 0) for seed in (0, 1) for arm in ("pg", "mis", "sc", "sc_mis")
    )
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
        ("pg", "mixed", 0, 1, 4),
        ("sc_mis+topp", "homogeneous", 1, 1, 4),
    ]


def test_docs_block_is_replaced_between_the_markers(tmp_path: Path) -> None:
    doc = tmp_path / "ablation.md"
    doc.write_text(f"intro\n{ablation.DOCS_BEGIN}\nold table\n{ablation.DOCS_END}\nafter\n")
    write_docs_block(doc, "new table")
    assert doc.read_text() == f"intro\n{ablation.DOCS_BEGIN}\nnew table\n{ablation.DOCS_END}\nafter\n"
    doc.write_text("no markers\n")
    with pytest.raises(SystemExit, match="needs the lines"):
        write_docs_block(doc, "x")


def test_warm_start_checkpoint_is_the_trained_policy_and_is_built_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--warm-start N`: every arm starts from the tiny Qwen3 after N steps of pg on the homogeneous fleet
    at lag 0. The checkpoint holds those trained weights (bf16, as every checkpoint here), its
    SHA256SUMS match its files, one checkpoint serves every lag and step count of the config (not
    another learning rate), and a second call reuses it instead of training again."""
    import torch

    from rlfleet.model_source import parse_checksums, read_safetensors_dir
    from rlfleet.store import hash_file
    from rlfleet.tiny_qwen3 import cached_tiny_qwen3

    cfg = AblationConfig(
        steps=5,
        prompts=2,
        samples=4,
        max_new_tokens=4,
        lag=3,
        warm_start=2,
        task="retry_digit",
        model_cache=str(tmp_path),
    )
    base = cached_tiny_qwen3(tmp_path, cfg.tiny_model())
    warm = ablation.start_checkpoint(cfg)
    assert warm != base and ablation.start_checkpoint(replace(cfg, warm_start=0)) == base

    sums = parse_checksums((warm / "SHA256SUMS").read_text(), str(warm))
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(sums)
    assert all(hash_file(warm / name, "sha256").hexdigest == digest for name, digest in sums.items())

    trained, _, _ = ablation.train_arm("pg", "homogeneous", replace(cfg, steps=2, lag=0, warm_start=0), base)
    saved, untrained = read_safetensors_dir(warm), read_safetensors_dir(base)
    expected = {k: v.to(torch.bfloat16) for k, v in trained.weights().items()}
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in saved)
    assert any(not torch.equal(saved[k], untrained[k]) for k in saved)

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("the warm start was trained again")

    monkeypatch.setattr(ablation, "train_arm", no_training)
    assert ablation.start_checkpoint(replace(cfg, lag=0, steps=40)) == warm
    # the warm start trains on the bf16 fleet: the precision lever is not part of it
    assert ablation.start_checkpoint(replace(cfg, precision_error_scale=3.0)) == warm
    with pytest.raises(AssertionError, match="trained again"):
        ablation.start_checkpoint(replace(cfg, learning_rate=1e-3))


def test_scaled_view_multiplies_the_rounding_error_of_quantised_tensors_only() -> None:
    """`--precision-error-scale K`: weights + K * (view - weights) on what the format quantises (the
    decoder's projections), the view's own bf16 values elsewhere; the view itself at K = 1 and for a
    bf16 group (its rounding is not a format's quantisation)."""
    import torch

    proj, norm = "model.layers.0.mlp.up_proj.weight", "model.norm.weight"
    weights = {proj: torch.tensor([[1.0, 2.0]]), norm: torch.tensor([1.0])}
    view = {proj: torch.tensor([[1.5, 1.0]]), norm: torch.tensor([1.25])}
    scaled = ablation.scaled_view(weights, view, "nvfp4", 3.0)
    assert torch.equal(scaled[proj], torch.tensor([[2.5, -1.0]])) and torch.equal(
        scaled[norm], torch.tensor([1.25])
    )
    assert torch.equal(ablation.scaled_view(weights, view, "fp8", 0.0)[proj], weights[proj])
    assert ablation.scaled_view(weights, view, "nvfp4", 1.0) is view
    assert ablation.scaled_view(weights, view, "bf16", 3.0) is view


def test_precision_error_scale_reaches_the_samplers(tmp_path: Path) -> None:
    """The lever acts on what the samplers compute with: on the NVFP4 fleet the step-1 (on-policy, lag 0)
    sampler/trainer KL grows with the scale (about as its square: KL is quadratic in a small error),
    and scale 0 leaves only the bf16 rounding and kernel of the groups."""
    from rlfleet.tiny_qwen3 import cached_tiny_qwen3

    cfg = AblationConfig(steps=1, prompts=2, samples=4, max_new_tokens=3, lag=0, model_cache=str(tmp_path))
    base = cached_tiny_qwen3(tmp_path, cfg.tiny_model())
    kl = {
        scale: ablation.train_arm("pg", "nvfp4", replace(cfg, precision_error_scale=scale), base)[
            1
        ].state.history[0]["kl_k3"]
        for scale in (0.0, 1.0, 3.0)
    }
    assert kl[0.0] < kl[1.0] / 10 and kl[3.0] > 4 * kl[1.0], kl
