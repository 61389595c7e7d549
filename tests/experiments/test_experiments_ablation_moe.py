"""`rlfleet ablate --model qwen3_moe`: the ablation on the tiny Qwen3-MoE of local mode. A run is seeded,
measures the routing mismatch between its samplers and the trainer, and its R3 arms (`<arm>+r3`) train
every token through the experts its sampler routed it to (a mechanism check, no learning threshold)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlfleet_experiments import ablation

TINY_MOE = ablation.AblationConfig(
    steps=2, prompts=4, samples=4, lag=0, learning_rate=1e-3, architecture="qwen3_moe"
)


def test_moe_arms_and_options_are_checked_before_any_run(tmp_path: Path, capsys: Any) -> None:
    # R3 needs a router to replay: refused for the dense model, accepted (as an arm) for the MoE
    assert ablation.cli(["--arms", "pg+r3", "--out", str(tmp_path)]) == 2
    assert "unknown arm/fleet pg+r3" in capsys.readouterr().err
    assert ablation.unknown_arms(["pg+r3", "sc_mis+topp+r3", "pg+r3+r3", "nope+r3"], "qwen3_moe") == [
        "pg+r3+r3",
        "nope+r3",
    ]
    assert ablation.arm_parts("sc_mis+topp+r3") == ("sc_mis", True, True)
    assert ablation.arm_parts("sc_mis+topp") == ("sc_mis", True, False)
    assert ablation.cli(["--model", "qwen3_moe", "--precision-error-scale", "2", "--out", str(tmp_path)]) == 2
    assert "--precision-error-scale is for --model qwen3 only" in capsys.readouterr().err
    # the run config: the samplers asked for the MoE's top-2 experts, R3 on for the +r3 arm only
    assert ablation.run_config("pg", "mixed", TINY_MOE).sampling.routed_experts_top_k == 2
    assert ablation.run_config("pg", "mixed", ablation.AblationConfig()).sampling.routed_experts_top_k == 0
    assert ablation.run_config("pg+r3", "mixed", TINY_MOE).routing_replay
    assert not ablation.run_config("pg", "mixed", TINY_MOE).routing_replay


def test_a_moe_run_is_seeded_and_reports_its_routing_mismatch(tmp_path: Path, one_torch_thread: None) -> None:
    cfg = replace(TINY_MOE, model_cache=str(tmp_path / "models"))
    first = ablation.run_arm("pg", "mixed", cfg)
    again = ablation.run_arm("pg", "mixed", cfg)
    assert len(first.history) == cfg.steps
    # same seed, same numbers, to the bit (timers aside)
    for key in (
        "reward_mean",
        "kl_k3",
        "grad_norm",
        "routing_mismatch_tokens",
        "routing_mismatch_layers",
        "routing_tokens",
    ):
        assert [h[key] for h in first.history] == [h[key] for h in again.history], key
    groups = [name for name, _, _, _ in ablation.FLEETS["mixed"]]
    for h in first.history:
        # lag 0: every trained token was sampled at the trainer's version, so each one is compared
        assert h["routing_tokens"] == h["num_tokens"] > 0
        assert sum(h.get(f"group/{g}/routing_tokens", 0.0) for g in groups) == h["routing_tokens"]
        assert 0.0 <= h["routing_mismatch_layers"] <= h["routing_mismatch_tokens"] <= 1.0
    # the run's mismatch: its steps weighted by their compared tokens
    count = sum(h["routing_tokens"] for h in first.history)
    expected = sum(h["routing_mismatch_tokens"] * h["routing_tokens"] for h in first.history) / count
    assert first.routing_mismatch_tokens == expected
    # the dense model has no routing: no metric, no run mismatch
    dense = ablation.run_arm("pg", "mixed", replace(cfg, architecture="qwen3", steps=1))
    assert dense.routing_mismatch_tokens is None and "routing_tokens" not in dense.history[0]


def test_r3_trains_each_token_through_its_samplers_experts(
    tmp_path: Path, monkeypatch: Any, one_torch_thread: None
) -> None:
    """Observed from outside the backend: hooks on the transformers model see each training forward's
    packed ids and position ids, each router's own top-k and the experts each expert block was handed.
    Every trained token of every packed sequence (the positions whose logits give its reply tokens) goes
    to the experts its sampler's router returned, including tokens whose trainer router chose others."""
    from rlfleet.trainer.backends.backend_hf import HFBackend
    from rlfleet.trainer.backends.routing_replay import moe_routers

    forwards: list[dict[str, Any]] = []
    original = HFBackend.from_pretrained.__func__  # type: ignore[attr-defined]

    def observed(cls: type[HFBackend], *args: Any, **kwargs: Any) -> HFBackend:
        backend = original(cls, *args, **kwargs)
        model = backend.model

        def on_model(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
            if torch.is_grad_enabled():  # a training forward (not a no-grad evaluation)
                forwards.append(
                    {
                        "ids": kwargs["input_ids"][0].tolist(),
                        "pos": kwargs["position_ids"][0].tolist(),
                        "own": [],
                        "used": [],
                    }
                )

        model.register_forward_pre_hook(on_model, with_kwargs=True)
        # registered before the backend's replay hooks (added per forward), so these see the router's own choice
        for router in moe_routers(model):
            router.register_forward_hook(
                lambda _m, _a, out: (
                    forwards[-1]["own"].append(out[2].clone()) if torch.is_grad_enabled() else None
                )
            )
        experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
        assert len(experts) == len(moe_routers(model)) == TINY_MOE.num_hidden_layers
        for block in experts:  # Qwen3MoeExperts.forward(hidden_states, top_k_index, top_k_weights)
            block.register_forward_pre_hook(
                lambda _m, args: (
                    forwards[-1]["used"].append(args[1].clone()) if torch.is_grad_enabled() else None
                )
            )
        return backend

    monkeypatch.setattr(HFBackend, "from_pretrained", classmethod(observed))
    rollouts: list[Any] = []
    take = ablation.LockstepRollouts.take

    def recorded_take(self: ablation.LockstepRollouts, *args: Any, **kwargs: Any) -> Any:
        groups = take(self, *args, **kwargs)
        rollouts.extend(r for g in groups for r in g.rollouts)
        return groups

    monkeypatch.setattr(ablation.LockstepRollouts, "take", recorded_take)
    cfg = replace(TINY_MOE, model_cache=str(tmp_path / "models"))
    ablation.run_arm("pg+r3", "nvfp4", cfg)
    assert forwards and all(len(f["used"]) == len(f["own"]) == cfg.num_hidden_layers for f in forwards)

    checked = replayed_over_own = 0
    for f in forwards:
        used = np.stack([u.numpy() for u in f["used"]], axis=1)  # [pack, layers, k]
        own = np.stack([o.numpy() for o in f["own"]], axis=1)
        starts = [i for i, p in enumerate(f["pos"]) if p == 0] + [len(f["ids"])]
        for start, end in zip(starts, starts[1:], strict=False):
            segment = f["ids"][start:end]
            # the rollouts this packed sequence is (identical replies from several samples are possible)
            matches = [r for r in rollouts if r.token_ids()[: len(segment)].tolist() == segment]
            assert matches, "a packed sequence that no sampler produced"
            options = []
            for r in matches:
                (turn,) = r.turns
                p, n = len(turn.prompt_ids), turn.num_tokens
                assert turn.routed_experts is not None and turn.routed_experts.shape == (
                    p + n - 1,
                    cfg.num_hidden_layers,
                    2,
                )
                options.append((p, n, np.sort(turn.routed_experts[p - 1 : p + n - 1], axis=-1)))
            p, n, _ = options[0]
            rows = slice(start + p - 1, start + p + n - 1)  # the logits of the reply's n tokens
            trained = np.sort(used[rows], axis=-1)
            assert any(np.array_equal(trained, sampler) for _, _, sampler in options)
            checked += n
            replayed_over_own += int((trained != np.sort(own[rows], axis=-1)).any(axis=(1, 2)).sum())
    assert checked > 0
    # not vacuous: some trained tokens went to the sampler's experts where the trainer's router chose others
    assert replayed_over_own > 0
