"""`rlfleet ablate`: input checks and a tiny seeded run through the same train_step as local mode."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rlfleet_experiments import ablation


def test_rlfleet_ablate_is_the_experiments_command_and_the_product_does_not_name_it(tmp_path, capsys):
    """`rlfleet ablate` reaches this package through the `rlfleet.commands` entry point of its own
    distribution (experiments/pyproject.toml); the product's command table does not name it, so an
    image (which does not install the experiments) has no such command."""
    from rlfleet.cli import COMMANDS, main, plugin_commands

    assert plugin_commands()[("ablate",)][0] == ablation.__name__
    assert not any(module.startswith("rlfleet_experiments") for module, _ in COMMANDS.values())
    assert main(["ablate", "--arms", "pg,nope", "--out", str(tmp_path)]) == 2
    assert "unknown arm/fleet nope" in capsys.readouterr().err
    main(["--help"])
    assert "ablate" in capsys.readouterr().out


def test_ablate_rejects_unknown_arms_and_bad_budgets(tmp_path, capsys):
    assert ablation.cli(["--arms", "pg,nope", "--out", str(tmp_path)]) == 2
    assert "unknown arm/fleet nope" in capsys.readouterr().err
    assert ablation.cli(["--steps", "1", "--out", str(tmp_path)]) == 2
    assert ablation.cli(["--hidden-size", "200", "--out", str(tmp_path)]) == 2  # views need multiples of 128
    assert "--hidden-size a multiple of 128" in capsys.readouterr().err
    assert ablation.cli(["--warm-start", "-1", "--out", str(tmp_path)]) == 2
    assert "--warm-start >= 0" in capsys.readouterr().err
    for bad in ("-1", "nan", "inf"):
        assert ablation.cli(["--precision-error-scale", bad, "--out", str(tmp_path)]) == 2
        assert "a finite --precision-error-scale >= 0" in capsys.readouterr().err


def test_tiny_ablation_is_seeded_and_writes_table_and_plots(tmp_path, monkeypatch, one_torch_thread):
    monkeypatch.setenv(
        "RLFLEET_MODEL_CACHE", str(tmp_path / "models")
    )  # the tiny Qwen3 is built here, not in ~/.cache
    # one seed, no null-arm cells, in this process (one torch thread)
    args = [
        "--arms",
        "pg,sc_mis+topp",
        "--fleets",
        "homogeneous,mixed",
        "--steps",
        "4",
        "--prompts",
        "2",
        "--samples",
        "4",
        "--lag",
        "1",
        "--seeds",
        "1",
        "--no-null-control",
        "--jobs",
        "1",
        "--lr",
        "1e-3",
    ]
    assert ablation.cli([*args, "--out", str(tmp_path / "a")]) == 0
    report = (tmp_path / "a" / "ablation.md").read_text()
    table = report.split("### Seed 0, lag 1\n\n")[1]
    assert table.count("\n") == 2 + 4 and "| sc_mis+topp | mixed |" in table
    data = json.loads((tmp_path / "a" / "ablation.json").read_text())
    assert data["seeds"] == [0] and {r["seed"] for r in data["runs"]} == {0}
    assert {(r["arm"], r["fleet"]) for r in data["runs"]} == {
        ("pg", "homogeneous"),
        ("sc_mis+topp", "homogeneous"),
        ("pg", "mixed"),
        ("sc_mis+topp", "mixed"),
    }
    for r in data["runs"]:
        assert len(r["history"]) == 4 and r["history"][0]["staleness_mean"] == 0  # lag: step 1 is on-policy
        assert r["history"][-1]["staleness_mean"] == 1
        # replay arms record the exact support (no tail model), the others a head of q (rho measured)
        assert (r["max_sc_tail_ratio"] is None) == (r["arm"] == "sc_mis+topp")
    mixed = {r["arm"]: r for r in data["runs"] if r["fleet"] == "mixed"}
    homog = {r["arm"]: r for r in data["runs"] if r["fleet"] == "homogeneous"}
    # same seed, same init, step 1 on-policy: the mismatch is precision alone, larger on the mixed fleet
    assert mixed["pg"]["history"][0]["kl_k3"] > homog["pg"]["history"][0]["kl_k3"]
    # each run records the collapse detector's first alert and signals (what experiments/detector.py reads
    # back as the baseline), not the pre-registered collapse: a replay of its history says the same
    from rlfleet.api.rljob import SafetySpec
    from rlfleet.trainer.collapse import CollapseThresholds
    from rlfleet_experiments.detector import recorded, replay

    thresholds = CollapseThresholds.from_safety(SafetySpec())
    for r in data["runs"]:
        assert recorded(r) == replay(r["history"], thresholds)
    for name in ("ablation_reward_mean.png", "ablation_kl_k3.png", "ablation_oor_fraction.png"):
        assert (tmp_path / "a" / name).stat().st_size > 0
    # Pinned: re-pinned on 2026-12-01 from a run of the committed code (the tiny Qwen3 of
    # AblationConfig, HFBackend, torch on one thread), NOT derived independently: a change here means the
    # ablation's numbers changed; re-run `rlfleet ablate` and re-record docs/ablation.md. The tolerance is
    # the spread between CPUs, not within one: torch's fp32 sums round differently by instruction set
    # (ATen's SIMD width, MKL's kernels), and an AMD EPYC with AVX-512 gives kl_k3 1.6e-4 relative off
    # the recording machine's at step 3 (3.5e-5 at step 1 under ATEN_CPU_CAPABILITY=avx2); rewards,
    # which count sampled tokens, are equal (docs/ablation.md, "Reproducing a run").
    pinned = {
        "reward_mean": [0.020833333333333332, 0.0, 0.020833333333333332, 0.0],
        "kl_k3": [7.54502084520128e-05, 0.3081720272699992, 0.10264668862024943, 0.07425868511199951],
        "grad_norm": [0.2762294411659241, 0.0, 0.27907517552375793, 0.0],
    }
    for key, values in pinned.items():
        assert [h[key] for h in homog["pg"]["history"]] == pytest.approx(values, rel=1e-3, abs=1e-12), key
    # seeded: the same arguments give the same numbers
    assert ablation.cli([*args, "--arms", "pg", "--fleets", "homogeneous", "--out", str(tmp_path / "b")]) == 0
    again = json.loads((tmp_path / "b" / "ablation.json").read_text())["runs"][0]
    for key in ("reward_mean", "kl_k3", "grad_norm"):  # (timers differ, numbers do not)
        assert [h[key] for h in again["history"]] == [h[key] for h in homog["pg"]["history"]]


def test_lockstep_rollouts_run_tool_add_episodes_turn_by_turn(tmp_path, one_torch_thread):
    """The ablation's rollout source runs multi-turn episodes (tool_add) as the HTTP driver does: every
    turn is generated from the exact ids so far (prompt + sampled ids + the environment's ids), a
    session's turns all come from its one sampler group, and each trajectory is scored once."""
    from rlfleet.local.emulated import EmulatedSampler, SnapshotSink
    from rlfleet.model_source import read_safetensors_dir
    from rlfleet.numerics.engine_model import ModelShape
    from rlfleet.router.hashing import pick
    from rlfleet.sampler.protocol import SamplingConfig
    from rlfleet.tiny_qwen3 import cached_tiny_qwen3
    from rlfleet.trainer.envs.environments import ToyVocab

    cfg = ablation.AblationConfig(task="tool_add", prompts=4, samples=8, lag=0, logit_std=4.0)
    assert cfg.max_seq_len == 8 + 4 * (cfg.max_new_tokens + 3)  # every turn of an episode fits the context
    model_dir = cached_tiny_qwen3(tmp_path / "models", cfg.tiny_model())
    sink = SnapshotSink()
    sink.publish(read_safetensors_dir(model_dir), 0, step=0)
    groups = ablation.FLEETS["mixed"]
    samplers = {
        name: EmulatedSampler(name, fmt, kv, ModelShape.from_checkpoint(model_dir), seed=i)
        for i, (name, _, fmt, kv) in enumerate(groups)
    }
    sampling = SamplingConfig(
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        max_new_tokens=cfg.max_new_tokens,
        candidate_mode="head",
        head_size=8,
    )
    rc = replace(ablation.run_config("pg", "mixed", cfg), sampling=sampling)
    assert (rc.environment, rc.seed, rc.samples_per_prompt) == ("tool_add", 0, cfg.samples)
    source = ablation.LockstepRollouts(cfg, rc, sink, samplers)
    batch = source.take(cfg.prompts, timeout=0)
    rollouts = [r for g in batch for r in g.rollouts]
    assert len(rollouts) == cfg.prompts * cfg.samples
    assert max(len(r.turns) for r in rollouts) > 1  # multi-turn episodes happened
    calls = 0
    for r in rollouts:
        assert r.outcome is not None and r.outcome.num_turns == len(r.turns)
        so_far = list(r.prompt.input_ids)
        for turn, env_ids in zip(r.turns, r.env_ids, strict=True):
            assert turn.prompt_ids.tolist() == so_far  # never re-rendered
            assert turn.group == pick(r.uid, {g[0]: 1.0 for g in groups})  # session affinity
            out = turn.output_ids.tolist()
            assert 1 <= len(out) <= cfg.max_new_tokens
            if ToyVocab.CALL in out and env_ids:  # the tool answered (checked here from the ids)
                calls += 1
                args = out[out.index(ToyVocab.CALL) + 1 :]
                if (
                    out[-1] == ToyVocab.END_CALL
                    and len(args) == 3
                    and all(ToyVocab.is_digit(t) for t in args[:2])
                ):
                    s = (ToyVocab.value(args[0]) + ToyVocab.value(args[1])) % 10
                    assert env_ids == [ToyVocab.RESULT, ToyVocab.digit(s), ToyVocab.END_RESULT]
                else:
                    assert env_ids == [ToyVocab.RESULT, ToyVocab.ERR, ToyVocab.END_RESULT]
            so_far += out + env_ids
        assert r.token_ids().tolist() == so_far and len(so_far) <= cfg.max_seq_len
    assert calls > 0
