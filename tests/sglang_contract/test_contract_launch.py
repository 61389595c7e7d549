"""Every launch command the catalog can produce (each accelerator class x weight format x KV-cache dtype
it allows, `check_group`) through SGLang 0.5.23's own argparse: `ServerArgs.add_cli_args` then
`ServerArgs.from_cli_args`. Parsing only; nothing is launched. The parsed fields must be what we meant.
The flags a checkpoint adds (`checkpoint_engine_flags`: a mixture of experts' routed experts) are taken
further, into SGLang's runtime context and its RoutedExpertsCapturer on the tiny models' ModelConfig."""

from __future__ import annotations

import argparse
import functools

import pytest
from sglang.srt.server_args import ServerArgs

from rlfleet.catalog import check_group, get_catalog, sglang_launch

# What each weight format means to SGLang (references.md), independent of the catalog's flag lists.
QUANTIZATION = {"bf16": None, "fp8": "fp8", "nvfp4": "modelopt_fp4", "mxfp4": "mxfp4"}
MODULE = ["-m", "sglang.launch_server"]


@functools.cache
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(p)
    return p


def combinations() -> list[tuple[str, str, str]]:
    out = []
    catalog = get_catalog()
    for name, cls in catalog.classes.items():
        if (
            cls.engine != "sglang"
        ):  # the cpu class runs the reference engine (tests/sampler/test_sampler_cpu_pod.py)
            continue
        for weight_format in cls.weight_formats:
            for kv in cls.kv_cache_dtypes:
                check_group(name, weight_format, kv, catalog=catalog)  # the catalog allows it
                out.append((name, weight_format, kv))
    return out


def sglang_parse(argv: list[str]) -> ServerArgs:
    assert argv[1:3] == MODULE, argv
    try:
        return ServerArgs.from_cli_args(parser().parse_args(argv[3:]))
    except (argparse.ArgumentError, SystemExit) as exc:
        raise AssertionError(f"SGLang refuses {argv[3:]}: {exc}") from None


def test_every_catalog_format_is_covered() -> None:
    formats = {f for _, f, _ in combinations()}
    assert formats <= set(QUANTIZATION), formats - set(QUANTIZATION)
    assert len(combinations()) >= 20


@pytest.mark.parametrize(("accelerator", "weight_format", "kv_cache_dtype"), combinations())
def test_catalog_launch_parses_in_sglang_as_meant(
    accelerator: str, weight_format: str, kv_cache_dtype: str
) -> None:
    cls = get_catalog().get(accelerator)
    for tp in (None, 2):
        launch = sglang_launch(
            accelerator=cls,
            weight_format=weight_format,
            kv_cache_dtype=kv_cache_dtype,
            tensor_parallel=tp,
            model_path="/weights/views/fp8/v7",
            served_model_name="qwen3",
            weight_version=7,
            sampling_mask_max_tokens=2048,
            port=30001,
        )
        args = sglang_parse(launch.argv)
        assert args.model_path == "/weights/views/fp8/v7" and args.served_model_name == "qwen3"
        assert args.quantization == QUANTIZATION[weight_format]
        assert args.kv_cache_dtype == kv_cache_dtype
        assert args.sampling_mask_max_tokens == 2048
        assert args.weight_version == "7"  # SGLang keeps versions as strings; our client reads int("7")
        assert args.tp_size == (tp or cls.default_tensor_parallel) == launch.tensor_parallel
        assert args.enable_metrics is True and args.port == 30001 and args.dtype == "bfloat16"
        # every `--flag value` we pass lands, unchanged, in the field SGLang's parser binds the flag to
        rest = launch.argv[3:]
        for i, token in enumerate(rest):
            if token.startswith("--") and i + 1 < len(rest) and not rest[i + 1].startswith("--"):
                field = parser()._option_string_actions[token].dest
                assert str(getattr(args, field)) == rest[i + 1], (token, field, getattr(args, field))


@pytest.mark.parametrize("architecture", ["qwen3_moe", "qwen3"])
def test_a_moe_checkpoints_flag_turns_on_sglangs_routed_experts_capture(
    tiny_qwen3_factory, architecture: str
) -> None:
    """The checkpoint's own flags (`checkpoint_engine_flags` of the tiny model's real config.json, what the
    launch file carries and `rlfleet sampler serve` adds) on the catalog's launch, through SGLang 0.5.23's
    own argparse, ServerArgs resolution and runtime context: the feature under which SGLang builds its
    RoutedExpertsCapturer at launch (`get_exec().features.enable_return_routed_experts`, which
    `RoutedExpertsCapturer.create` reads) is on exactly for the mixture of experts; for the dense model
    `create` builds none. (`--device cpu` only lets ServerArgs resolve on this GPU-less machine.)"""
    import json

    from sglang.srt.runtime_context import create_context, get_exec, use_context
    from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer

    from rlfleet.catalog import checkpoint_engine_flags

    checkpoint = tiny_qwen3_factory(architecture=architecture)
    config = json.loads((checkpoint / "config.json").read_text())
    launch = sglang_launch(
        accelerator=get_catalog().get("h100"),
        weight_format="bf16",
        model_path=str(checkpoint),
        served_model_name="m",
        weight_version=0,
        extra_args=checkpoint_engine_flags(config),
    )
    moe = architecture == "qwen3_moe"
    assert ("--enable-return-routed-experts" in launch.argv) is moe
    assert sglang_parse(launch.argv).enable_return_routed_experts is moe
    args = ServerArgs.from_cli_args(parser().parse_args([*launch.argv[3:], "--device", "cpu"]))
    with use_context(create_context(args, role="scheduler")):
        assert get_exec().features.enable_return_routed_experts is moe
        if not moe:  # returns before it reads the model or its config
            capturer = RoutedExpertsCapturer.create(
                model=None, model_config=None, num_tokens=8, max_running_requests=2, device="cpu"
            )
            assert capturer is None


def test_sglangs_capturer_reads_num_experts_per_tok_which_a_dense_config_lacks(tiny_qwen3_factory) -> None:
    """Why the flag cannot always be on: SGLang 0.5.23's RoutedExpertsCapturer (built at launch under it)
    sizes its buffers from the model config's `num_experts_per_tok`. Its real constructor on SGLang's real
    ModelConfig of the tiny dense Qwen3 fails on that missing attribute before anything else (the launch
    would fail); the tiny Qwen3-MoE's config has it, its top-k."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer

    dense = ModelConfig(str(tiny_qwen3_factory()))
    with pytest.raises(AttributeError, match="num_experts_per_tok"):
        RoutedExpertsCapturer(
            dense, num_tokens=8, max_running_requests=2, num_fused_shared_experts=0, device="cpu"
        )
    moe = ModelConfig(str(tiny_qwen3_factory(architecture="qwen3_moe")))
    assert moe.hf_text_config.num_experts_per_tok == 2  # rlfleet/tiny_qwen3.py MOE_SIZES: top 2 of 4


@pytest.mark.parametrize(
    "targets", [["q_proj", "k_proj", "v_proj", "o_proj"], ["q_proj", "v_proj", "down_proj"]]
)
def test_a_lora_groups_flags_land_in_sglangs_lora_fields(targets: list[str]) -> None:
    """A SamplerGroup's `spec.lora` through `engine_launch_for_group` into SGLang 0.5.23's own argparse and
    ServerArgs: LoRA enabled with the adapters' rank and modules, 2 adapters a batch, 3 loaded (which its
    check_lora_server_args accepts: max_loaded_loras >= max_loras_per_batch); the model is the base view."""
    from rlfleet.api import SamplerGroupSpec
    from rlfleet.api.lora_spec import LoraSpec
    from rlfleet.catalog import engine_launch_for_group

    spec = SamplerGroupSpec.model_validate(
        {"name": "g", "model": {"name": "qwen3", "path": "s3://m"}, "accelerator": "h100", "weightFormat": "fp8",
         "lora": {"rank": 32, "alpha": 64, "targetModules": targets}}
    )  # fmt: skip
    assert spec.lora == LoraSpec(rank=32, alpha=64, target_modules=targets)
    launch = engine_launch_for_group(spec, model_path="/weights/views/fp8/v0", weight_version=0)
    args = sglang_parse(launch.argv)
    assert args.enable_lora is True and args.max_lora_rank == 32
    assert set(args.lora_target_modules) == set(targets)
    assert (args.max_loras_per_batch, args.max_loaded_loras) == (3, 4)
    assert args.model_path == "/weights/views/fp8/v0" and args.quantization == "fp8"
    without = spec.model_copy(update={"lora": None})
    plain = sglang_parse(engine_launch_for_group(without, model_path="/m", weight_version=0).argv)
    assert not plain.enable_lora and plain.max_lora_rank is None
