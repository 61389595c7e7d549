"""Precision views: save_view / load_view use exactly the shared format implementation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.channel import safetensors_header
from rlfleet.numerics import formats
from rlfleet.numerics.views import (
    VIEWS,
    calibrate_activation_amax,
    calibrate_weights,
    calibration_batch,
    checkpoint_tensors,
    load_view,
    save_view,
)
from rlfleet.store import FileDigest
from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model

FAKE_QUANT = {"fp8": "fp8_block", "nvfp4": "nvfp4", "mxfp4": "mxfp4"}


_QKV = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
_GATE_UP = [f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up")]
FUSED_MEMBERS = {m: group for group in (_QKV, _GATE_UP) for m in group}


@pytest.fixture(scope="module")
def state_dict() -> dict[str, torch.Tensor]:
    model = tiny_model(TinyQwen3(num_hidden_layers=1, seed=3))  # the tiny Qwen3's HF-named tensors
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("view", VIEWS)
def test_roundtrip_equals_the_shared_format(
    view: str, state_dict: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    files = save_view(state_dict, view, tmp_path / view)
    assert {f.name for f in files} >= {"model.safetensors", "rlfleet_view.json"}
    loaded_view, loaded = load_view(tmp_path / view)
    assert loaded_view == view
    assert set(loaded) == set(state_dict)
    config = json.loads((tmp_path / view / "rlfleet_view.json").read_text())
    quantized = set(config["quantized"])
    if view == "bf16":
        assert quantized == set()
    else:
        # every projection is quantized, embeddings / norms / lm_head are not
        assert quantized == {n for n in state_dict if n.endswith("_proj.weight")}
    for name, w in state_dict.items():
        got = loaded[name]
        assert got.dtype == torch.float32 and got.shape == w.shape
        if name not in quantized:
            expected = w.to(torch.bfloat16).float()
        elif view == "nvfp4" and name in FUSED_MEMBERS:
            # one global scale per fused layer (q/k/v, gate/up): amax over all its members
            group = FUSED_MEMBERS[name]
            amax = max(float(state_dict[m].abs().amax()) for m in group)
            expected = formats.dequantize_nvfp4(*formats.quantize_nvfp4(w, amax))
        else:
            expected = formats.fake_quantize(w, FAKE_QUANT[view])
        assert torch.equal(got, expected), name


def test_view_tensor_layouts(state_dict: dict[str, torch.Tensor], tmp_path: Path) -> None:
    name = "model.layers.0.mlp.up_proj.weight"
    n, k = state_dict[name].shape
    base = name[: -len(".weight")]
    layouts = {}
    for view in VIEWS:
        save_view(state_dict, view, tmp_path / view)
        layouts[view] = safetensors_header(tmp_path / view / "model.safetensors")
    assert layouts["bf16"][name] == {"dtype": "BF16", "shape": [n, k]}
    assert layouts["fp8"][name] == {"dtype": "F8_E4M3", "shape": [n, k]}
    assert layouts["fp8"][f"{base}.weight_scale_inv"] == {
        "dtype": "F32",
        "shape": [-(-n // 128), -(-k // 128)],
    }
    assert layouts["nvfp4"][name] == {"dtype": "U8", "shape": [n, k // 2]}
    assert layouts["nvfp4"][f"{base}.weight_scale"] == {"dtype": "F8_E4M3", "shape": [n, k // 16]}
    assert layouts["nvfp4"][f"{base}.weight_scale_2"] == {"dtype": "F32", "shape": []}
    assert layouts["mxfp4"][name] == {"dtype": "U8", "shape": [n, k // 2]}
    assert layouts["mxfp4"][f"{base}.weight_scale"] == {"dtype": "U8", "shape": [n, k // 32]}
    for view in VIEWS:  # embeddings and norms stay bf16 everywhere
        assert layouts[view]["model.embed_tokens.weight"]["dtype"] == "BF16"
        assert layouts[view]["model.norm.weight"]["dtype"] == "BF16"
    sizes = {v: (tmp_path / v / "model.safetensors").stat().st_size for v in VIEWS}
    assert sizes["nvfp4"] < sizes["fp8"] < sizes["bf16"]
    assert sizes["mxfp4"] < sizes["fp8"]


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(1, 40),
    k_blocks=st.integers(1, 4),
    scale=st.floats(1e-3, 1e3),
    view=st.sampled_from(["fp8", "nvfp4", "mxfp4"]),
    seed=st.integers(0, 2**16),
)
def test_property_any_linear_shape_roundtrips_exactly(
    n: int, k_blocks: int, scale: float, view: str, seed: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    k = 32 * k_blocks
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * scale
    directory = tmp_path_factory.mktemp("prop")
    save_view({"model.layers.0.self_attn.q_proj.weight": w}, view, directory)
    _, loaded = load_view(directory)
    assert torch.equal(
        loaded["model.layers.0.self_attn.q_proj.weight"], formats.fake_quantize(w, FAKE_QUANT[view])
    )


def test_weights_that_do_not_fit_blocks_stay_bf16(tmp_path: Path) -> None:
    w = torch.randn(8, 24)  # K=24: not a multiple of 16 or 32
    for view in ("nvfp4", "mxfp4"):
        save_view({"model.layers.0.mlp.down_proj.weight": w}, view, tmp_path / view)
        config = json.loads((tmp_path / view / "rlfleet_view.json").read_text())
        assert config["quantized"] == []
        _, loaded = load_view(tmp_path / view)
        assert torch.equal(loaded["model.layers.0.mlp.down_proj.weight"], w.to(torch.bfloat16).float())
    save_view(
        {"model.layers.0.mlp.down_proj.weight": w}, "fp8", tmp_path / "fp8"
    )  # fp8 blocks pad: quantized
    assert json.loads((tmp_path / "fp8" / "rlfleet_view.json").read_text())["quantized"] == [
        "model.layers.0.mlp.down_proj.weight"
    ]


def test_nvfp4_fused_members_share_one_global_scale(
    state_dict: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    save_view(state_dict, "nvfp4", tmp_path / "v")
    raw = load_file(str(tmp_path / "v" / "model.safetensors"))
    for group in (_QKV, _GATE_UP):
        amax = max(float(state_dict[m].abs().amax()) for m in group)
        for m in group:  # amax / (448 * 6), the same fp32 value for every member
            assert raw[m.replace(".weight", ".weight_scale_2")].item() == torch.tensor(amax / 2688.0).item()
    o = "model.layers.0.self_attn.o_proj.weight"  # not fused: its own amax
    assert (
        raw[o.replace(".weight", ".weight_scale_2")].item()
        == torch.tensor(float(state_dict[o].abs().amax()) / 2688.0).item()
    )


def test_tensor_only_view_without_hf_config(state_dict: dict[str, torch.Tensor], tmp_path: Path) -> None:
    files = save_view(state_dict, "nvfp4", tmp_path / "v")
    assert {f.name for f in files} == {"model.safetensors", "rlfleet_view.json"}
    config = json.loads((tmp_path / "v" / "rlfleet_view.json").read_text())
    assert config["hf_checkpoint"] is False and "SGLang cannot" in config["note"]
    assert config["launch"] == {"quantization": None}


def test_save_view_digests_are_the_files_blake3(
    state_dict: dict[str, torch.Tensor], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digest computed while writing (a second thread, chunk by chunk) is BLAKE3 of the file's
    bytes as read back, computed here independently; several chunks per file (small CHUNK_BYTES)."""
    import blake3

    from rlfleet.store import digests

    monkeypatch.setattr(digests, "CHUNK_BYTES", 4096)  # several chunks per file: hash order matters
    files = save_view(state_dict, "fp8", tmp_path / "v")
    assert max(p.stat().st_size for p in files) > 4 * 4096
    for path, digest in files.items():
        data = path.read_bytes()
        assert digest == FileDigest("blake3", blake3.blake3(data).hexdigest(), len(data))


def test_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown weight view"):
        save_view({"a.weight": torch.zeros(2, 2)}, "int4", tmp_path / "x")
    with pytest.raises(ValueError, match="not a weight view"):
        load_view(tmp_path)
    save_view({"model.layers.0.mlp.up_proj.weight": torch.randn(4, 32)}, "nvfp4", tmp_path / "v")
    # a view whose scale tensor went missing is refused with a clear message
    from safetensors.torch import load_file, save_file

    raw = load_file(str(tmp_path / "v" / "model.safetensors"))
    del raw["model.layers.0.mlp.up_proj.weight_scale_2"]
    save_file(raw, str(tmp_path / "v" / "model.safetensors"))
    with pytest.raises(ValueError, match="scale tensor"):
        load_view(tmp_path / "v")


# ------------------------------------------------------------------------------------ calibration
@pytest.mark.parametrize("kind", ["dense_tied", "moe_tied"])
def test_calibrate_weights_is_the_amax_of_the_model_they_make(kind: str, tmp_path: Path) -> None:
    """`calibrate_weights` (what the publisher calibrates nvfp4's input_scale with, for any backend)
    equals `calibrate_activation_amax` run by hooks on the transformers model itself, on the same
    batch, exactly: for every linear and every MoE expert, with in-memory (fused experts) and
    checkpoint names, lm_head absent from tied weights (as both backends export them), and a base
    whose config.json carries a quantization_config (an nvfp4 view as model source)."""
    architecture = "qwen3_moe" if kind == "moe_tied" else "qwen3"
    model = tiny_model(TinyQwen3(architecture=architecture, seed=5, tie_word_embeddings=True))
    model.save_pretrained(tmp_path / "base")
    vocab = model.config.vocab_size
    expected = calibrate_activation_amax(model, [torch.arange(32).reshape(2, 16) % vocab])
    assert torch.equal(calibration_batch(vocab), torch.arange(32).reshape(2, 16) % vocab)
    in_memory = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    for weights in (in_memory, checkpoint_tensors(in_memory)):
        assert calibrate_weights(weights, tmp_path / "base") == expected
    if kind == "moe_tied":
        assert {f"model.layers.1.mlp.experts.3.{n}_proj" for n in ("gate", "up", "down")} <= set(expected)
        config = json.loads((tmp_path / "base" / "config.json").read_text())
        config["quantization_config"] = {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": 16,
            "kv_cache_quant_algo": None,
            "exclude_modules": ["lm_head"],
        }
        (tmp_path / "base" / "config.json").write_text(json.dumps(config))
        assert calibrate_weights(in_memory, tmp_path / "base") == expected
    missing = {k: v for k, v in in_memory.items() if k != "model.layers.0.post_attention_layernorm.weight"}
    with pytest.raises(ValueError, match="do not make the model"):  # never calibrated on random weights
        calibrate_weights(missing, tmp_path / "base")


def test_calibrate_weights_runs_in_the_dtype_most_weights_have(tmp_path: Path) -> None:
    """Megatron exports bf16 linears and embeddings with fp32 norms: calibrated in bf16 (the norms
    cast), as transformers' bf16 model loaded with those weights computes; all-fp32 weights in fp32."""
    model = tiny_model(TinyQwen3(seed=5))
    model.save_pretrained(tmp_path / "base")
    weights = {
        k: v.detach().clone() if "norm" in k else v.detach().to(torch.bfloat16)
        for k, v in model.state_dict().items()
    }
    from transformers import Qwen3ForCausalLM

    bf16 = Qwen3ForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.bfloat16)  # rope buffers stay fp32
    bf16.load_state_dict(weights)
    expected = calibrate_activation_amax(bf16, [calibration_batch(model.config.vocab_size)])
    got = calibrate_weights(weights, tmp_path / "base")
    assert got == expected
    fp32 = calibrate_weights({k: v.float() for k, v in weights.items()}, tmp_path / "base")
    assert fp32 != got and all(
        abs(fp32[k] - got[k]) <= 0.02 * fp32[k] for k in got
    )  # bf16 rounding, not another model
