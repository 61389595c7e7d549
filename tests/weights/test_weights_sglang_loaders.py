"""Published versions held against SGLang 0.5.23's own loaders, on CPU.

A tiny Qwen3 (dense) and a tiny Qwen3-MoE are built with transformers, saved with `save_pretrained`
(plus a tokenizer built with the `tokenizers` library) as the BASE checkpoint; their weights go
through our `WeightPublisher` into a filesystem channel (two versions); each view is downloaded
(BLAKE3-verified); version 2 of each view is then also published into a second channel as a DELTA against
version 1 (`rlfleet.deltas.encode_delta` per safetensors file) and REBUILT from there (anchor v1 + delta v2,
`WeightChannel.obtain_view`, verified): that rebuilt version 2 is what every test below loads. The
publisher keeps the scales it published (docs/weights.md, "Kept scales"): version 2's fp8 and nvfp4 views
are quantized with version 1's scales kept where its values fit them (`test_version_2_keeps_version_1s_scales`
holds them against a fresh quantization of the same weights). Then:

- its `quantization_config` is parsed by SGLang's launch path (`ModelConfig` + `get_quant_config`,
  which call `Fp8Config` / `ModelOptFp4Config.from_config`; hf_quant_config.json parsed too);
  mxfp4 is refused for both models, for the reason SGLang's own `Mxfp4Config` gives (run below);
- its files are listed with SGLang's `filter_duplicate_safetensors_files` (index of shards) and read
  with SGLang's `safetensors_weights_iterator`;
- SGLang's REAL `Qwen3ForCausalLM.load_weights` / `Qwen3MoeForCausalLM.load_weights` (the
  stacked_params_mapping and FusedMoE expert mapping) runs on a "group" built from the launch-time
  view: SGLang's real `QKVParallelLinear`, `MergedColumnParallelLinear`, `RowParallelLinear`,
  `ReplicatedLinear` with the quant config parsed from version 1 (their parameters come from the real
  `Fp8LinearMethod` / `ModelOptFp4LinearMethod` / `UnquantizedLinearMethod.create_weights`, their
  weight loaders are SGLang's). Version 1 is loaded, then version 2 is reloaded into the SAME
  parameters (what `/update_weights_from_disk` does);
- the loaded parameters are dequantized with SGLang's reference unpacking
  (`sglang.test.quant_ref_utils.break_fp4_bytes`) and the semantics its
  `process_weights_after_loading` applies (one weight_scale_2 / input_scale per fused layer: `.max()`,
  source lines checked below) and compared with the trainer's fp32 weights within each format's error
  bound, derived from the format (round to nearest on the grid) in `within_bound` below.

Stubs (only for what cannot exist on CPU), named:
- `Group`: the model's module tree is a plain `torch.nn.Module` holding SGLang's real linear layers
  (with `parallel_group="replicated"`, i.e. tensor parallel size 1: no NCCL process groups here);
  norms, embeddings and lm_head are plain parameters loaded by SGLang's `default_weight_loader`
  (their SGLang modules need the CUDA runtime context); `pp_group` is a stand-in with
  `is_last_rank=True`.
- MoE experts: SGLang's `FusedMoE` and its quant methods' `create_weights` need SGLang's published
  runtime config bags, EP groups and a GPU MoE backend (checked: they raise on CPU). The expert
  parameters are therefore stubs with the names and shapes the quant methods register (those
  `register_parameter` source lines are asserted in `test_sglang_source_lines_the_stubs_rely_on`)
  and `stub_expert_loader` loads w1 (gate) into the first half of w13 and w3 (up) into the second,
  as `FusedMoE._load_w13` does (source lines asserted too).
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import blake3
import pytest
import torch

from rlfleet.channel import DeltaSource, SubscriberReport, WeightChannel
from rlfleet.deltas import DELTA_SUFFIX, encode_delta
from rlfleet.numerics import formats
from rlfleet.numerics.views import (
    calibrate_activation_amax,
    checkpoint_tensors,
    read_view_tensors,
    save_view,
    view_tensors,
)
from rlfleet.store import FileDigest, FilesystemStore
from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model
from rlfleet.trainer.publish.publisher import WeightPublisher

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from sglang.srt.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization.fp8 import Fp8LinearMethod
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config, ModelOptFp4LinearMethod
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4Config
    from sglang.srt.model_loader.weight_utils import (
        default_weight_loader,
        filter_duplicate_safetensors_files,
        safetensors_weights_iterator,
    )
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM
    from sglang.test.quant_ref_utils import break_fp4_bytes

SGLANG_SRC = Path(inspect.getfile(Qwen3ForCausalLM)).parents[1]  # .../sglang/srt
HIDDEN, INTER, MOE_INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB, EXPERTS = (
    128,
    256,
    128,
    2,
    2,
    64,
    2,
    256,
    4,
)
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=INTER,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
VIEWS_OF = {"dense": ["bf16", "fp8", "nvfp4"], "moe": ["bf16", "fp8", "nvfp4"]}
# dense: shards of <= 200 kB, so the sharded layout (index + shards) is what SGLang reads
SHARD_BYTES = {"dense": 200_000, "moe": None}
CALIBRATION = torch.arange(2 * 16).reshape(2, 16) % VOCAB


# ------------------------------------------------------------------------------------ base checkpoints
def build_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)


def build_model(kind: str, seed: int) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    if kind == "dense":
        return Qwen3ForCausalLM(Qwen3Config(**COMMON)).eval()
    # the project's tiny Qwen3-MoE (rlfleet/tiny_qwen3.py: MOE_SIZES, its seeded init) at this file's sizes
    moe = TinyQwen3(
        architecture="qwen3_moe", moe_intermediate_size=MOE_INTER, num_experts=EXPERTS, seed=seed, **COMMON
    )
    return tiny_model(moe)


@dataclass
class Published:
    kind: str
    base: Path
    model: torch.nn.Module
    trained: dict[int, dict[str, torch.Tensor]]  # version -> checkpoint-named fp32 trainer weights
    amax: dict[int, dict[str, float]]
    dirs: dict[tuple[int, str], Path]  # (version, view) -> downloaded, verified view directory
    channel: WeightChannel


@pytest.fixture(scope="module", params=["dense", "moe"])
def published(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Published:
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    model = build_model(kind, seed=0)
    base = root / "base"
    model.save_pretrained(base)
    build_tokenizer(base)
    store = FilesystemStore(root / "store", create=True)
    publisher = WeightPublisher(
        store,
        views=VIEWS_OF[kind],
        base_checkpoint=base,
        follow_subscribers=False,
        max_shard_bytes=SHARD_BYTES[kind],
    )
    trained, amax, dirs = {}, {}, {}
    for version in (1, 2):
        if version == 2:  # a training step's worth of change
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 1e-3)
        amax[version] = calibrate_activation_amax(model, [CALIBRATION])  # the oracle: hooks on THIS model
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        # the trainer's path: the publisher calibrates the weights it publishes itself (calibrate_weights)
        assert publisher.publish(state, version=version).advanced
        trained[version] = {k: v.float() for k, v in checkpoint_tensors(state).items()}
        for view in VIEWS_OF[kind]:
            dirs[(version, view)] = publisher.channel.obtain_view(
                version, view, root / "dl" / f"v{version}-{view}"
            ).directory
    for view in VIEWS_OF[kind]:
        dirs[(2, view)] = rebuilt_from_a_delta(root / "deltas" / view, view, dirs[(1, view)], dirs[(2, view)])
    return Published(kind, base, model, trained, amax, dirs, publisher.channel)


def rebuilt_from_a_delta(work: Path, view: str, first: Path, second: Path) -> Path:
    """`second` as a sampler of a channel with deltas gets it: `first` published as an anchor (v1), `second`
    as a delta against it (v2: per safetensors file, the changed elements), then v2 rebuilt by the channel's
    reader (anchor v1 + delta v2, every file verified). Returns the rebuilt directory, checked to be
    `second` byte for byte."""
    channel = WeightChannel(FilesystemStore(work / "store", create=True), publisher_id="deltas")
    channel.publish({view: first}, version=1)
    payloads = {}
    for shard in sorted(second.glob("*.safetensors")):
        out = work / "payloads" / (shard.name + DELTA_SUFFIX)
        out.parent.mkdir(parents=True, exist_ok=True)
        if encode_delta(first / shard.name, shard, out) is not None:
            payloads[shard.name] = out
    assert payloads, "versions 1 and 2 of a view have the same safetensors headers"
    channel.publish({view: second}, version=2, deltas={view: DeltaSource(1, payloads)})
    rebuilt = channel.obtain_view(2, view, work / "rebuilt")
    assert rebuilt.describe() == "anchor v1 + delta v2" and rebuilt.read_bytes["delta"] > 0
    files = sorted(p.relative_to(second).as_posix() for p in second.rglob("*") if p.is_file())
    assert (
        sorted(
            p.relative_to(rebuilt.directory).as_posix() for p in rebuilt.directory.rglob("*") if p.is_file()
        )
        == files
    )
    for rel in files:
        assert (rebuilt.directory / rel).read_bytes() == (second / rel).read_bytes(), rel
    return rebuilt.directory


# ---------------------------------------------------------------------------------- complete checkpoint
def test_every_view_is_a_complete_hf_checkpoint(published: Published) -> None:
    from transformers import AutoConfig, AutoTokenizer

    base_config = json.loads((published.base / "config.json").read_text())
    base_tok = AutoTokenizer.from_pretrained(published.base)
    manifest = published.channel.manifest(2)
    for (version, view), d in published.dirs.items():
        files = {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()}
        assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= files
        if version == 2:  # the manifest names every file, config and tokenizer included, with its BLAKE3
            entries = manifest.views[view].files
            assert set(entries) == files
            for rel, entry in entries.items():
                data = (d / rel).read_bytes()
                assert entry == FileDigest("blake3", blake3.blake3(data).hexdigest(), len(data))
        for rel in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (d / rel).read_bytes() == (published.base / rel).read_bytes()
        config = json.loads((d / "config.json").read_text())
        assert {k: v for k, v in config.items() if k not in ("quantization_config", "dtype")} == {
            k: v for k, v in base_config.items() if k != "dtype"
        }
        assert config["dtype"] == "bfloat16"
        assert ("quantization_config" in config) == (view != "bf16")
        assert AutoConfig.from_pretrained(d).model_type == base_config["model_type"]
        assert AutoTokenizer.from_pretrained(d)("t5 t7 t9")["input_ids"] == base_tok("t5 t7 t9")["input_ids"]
        shards = sglang_weight_files(d)
        if SHARD_BYTES[published.kind] is not None:
            assert len(shards) > 1 and "model.safetensors.index.json" in files
            weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
            assert set(weight_map.values()) == {Path(s).name for s in shards}
        else:
            assert [Path(s).name for s in shards] == ["model.safetensors"]


def test_bf16_view_loads_in_transformers(published: Published) -> None:
    """transformers' own loader (shard index, names, MoE expert fusing) reads the bf16 view back."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(published.dirs[(2, "bf16")])
    assert loaded.dtype == torch.bfloat16
    expected = {k: v.to(torch.bfloat16) for k, v in published.model.state_dict().items()}
    got = loaded.state_dict()
    assert set(got) == set(expected)
    for name, t in expected.items():
        assert torch.equal(got[name], t), name


def test_checkpoint_names_are_those_transformers_saves(published: Published) -> None:
    """Our in-memory -> checkpoint renaming (fused MoE experts split) equals transformers' own."""
    from safetensors.torch import load_file

    saved: dict[str, torch.Tensor] = {}
    for f in sorted(published.base.glob("*.safetensors")):
        saved.update(load_file(str(f)))
    ours = checkpoint_tensors(build_model(published.kind, seed=0).state_dict())
    assert set(ours) == set(saved)
    for name, t in saved.items():
        assert torch.equal(ours[name].to(t.dtype), t), name


# ------------------------------------------------------------------------------------- quant configs
LAUNCH_FLAG = {"bf16": None, "fp8": None, "nvfp4": "modelopt_fp4"}
"""`--quantization` a group launches with (fp8: none, SGLang detects it from config.json)."""


def parse_quant_config(d: Path, view: str, kind: str) -> Any:
    """The quant config SGLang's launch path builds for this checkpoint: its real `ModelConfig`
    (reads config.json / hf_quant_config.json, verifies `--quantization` against the checkpoint) and
    `get_quant_config` (what DefaultModelLoader calls, with the model class's packed_modules_mapping).
    (mxfp4 has no HF view: see test_mxfp4_is_refused_with_the_reason_sglang_gives.)"""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.weight_utils import get_quant_config

    config = json.loads((d / "config.json").read_text()).get("quantization_config")
    model_config = ModelConfig(str(d), quantization=LAUNCH_FLAG[view])
    if view == "bf16":
        assert config is None and model_config.quantization is None
        return None
    assert model_config.quantization == {"fp8": "fp8", "nvfp4": "modelopt_fp4"}[view]
    cls = Qwen3ForCausalLM if kind == "dense" else Qwen3MoeForCausalLM
    return get_quant_config(model_config, LoadConfig(), dict(getattr(cls, "packed_modules_mapping", {})))


def test_quantization_configs_parse_with_sglang(published: Published) -> None:
    for (_, view), d in published.dirs.items():
        qc = parse_quant_config(d, view, published.kind)
        if view == "fp8":
            assert qc.is_checkpoint_fp8_serialized and qc.weight_block_size == [128, 128]
            assert qc.activation_scheme == "dynamic"
            layer = QKVParallelLinear(
                HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=False, quant_config=qc, parallel_group="replicated"
            )
            assert isinstance(layer.quant_method, Fp8LinearMethod) and layer.quant_method.block_quant
        elif view == "nvfp4":
            legacy = ModelOptFp4Config.from_config(json.loads((d / "hf_quant_config.json").read_text()))
            assert isinstance(qc, ModelOptFp4Config)
            for parsed in (qc, legacy):
                assert parsed.is_checkpoint_nvfp4_serialized and parsed.group_size == 16
                assert parsed.is_layer_excluded("lm_head")
                assert not parsed.is_layer_excluded("model.layers.0.self_attn.qkv_proj")
                assert not parsed.is_layer_excluded("model.layers.0.mlp.experts")
                if published.kind == "moe":
                    assert parsed.is_layer_excluded("model.layers.0.mlp.gate")
            layer = QKVParallelLinear(
                HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=False, quant_config=qc, parallel_group="replicated"
            )
            assert isinstance(layer.quant_method, ModelOptFp4LinearMethod)
        meta = json.loads((d / "rlfleet_view.json").read_text())
        assert meta["hf_checkpoint"] is True
        assert (
            meta["launch"]["quantization"]
            == {"bf16": None, "fp8": "fp8", "nvfp4": "modelopt_fp4", "mxfp4": "mxfp4"}[view]
        )


def test_mxfp4_is_refused_with_the_reason_sglang_gives(tmp_path: Path) -> None:
    """SGLang 0.5.23's mxfp4 quantizes MoE experts only: `Mxfp4Config.get_quant_method` returns no
    method for a linear layer on NVIDIA GPUs, and Qwen3 / Qwen3-MoE build their attention linears with
    the model's quant config, so such a group fails at construction (run here with SGLang's real
    QKVParallelLinear). Our publisher refuses both models' mxfp4 views before any training step."""
    with pytest.raises(AssertionError):
        QKVParallelLinear(
            HIDDEN,
            HEAD_DIM,
            HEADS,
            KV_HEADS,
            bias=False,
            quant_config=Mxfp4Config.from_config({"quant_method": "mxfp4"}),
            parallel_group="replicated",
        )
    for cls in (Qwen3ForCausalLM, Qwen3MoeForCausalLM):  # attention takes the model's quant config
        src = inspect.getsource(inspect.getmodule(cls))
        assert re.search(r"self\.qkv_proj = QKVParallelLinear\([^)]*quant_config=quant_config", src), cls
    store = FilesystemStore(tmp_path / "store", create=True)
    for kind, message in (
        ("dense", "dense model Qwen3ForCausalLM.*MoE experts only"),
        ("moe", "Qwen3MoeForCausalLM.*fails at launch"),
    ):
        model = build_model(kind, seed=0)
        model.save_pretrained(tmp_path / kind)
        with pytest.raises(ValueError, match=f"mxfp4 view refused for (the )?{message}"):
            WeightPublisher(store, views=["bf16", "mxfp4"], base_checkpoint=tmp_path / kind)
        with pytest.raises(ValueError, match="mxfp4 view refused"):
            save_view(model.state_dict(), "mxfp4", tmp_path / "v", base_checkpoint=tmp_path / kind)
    with pytest.raises(ValueError, match="calibrated activation amax"):  # nvfp4 needs input_scale
        save_view(model.state_dict(), "nvfp4", tmp_path / "v", base_checkpoint=tmp_path / "moe")
    with pytest.raises(ValueError, match="has no config.json"):
        WeightPublisher(store, views=["bf16"], base_checkpoint=tmp_path)
    # a group that reports following mxfp4 is logged and skipped, never published for (training goes on)
    publisher = WeightPublisher(store, views=["bf16"], base_checkpoint=tmp_path / "moe")
    publisher.channel.report(SubscriberReport("g", "r0", "mxfp4", None, []))
    publisher.channel.report(SubscriberReport("h", "r0", "fp8", None, []))
    assert publisher.views_needed() == ["bf16", "fp8"]


# ------------------------------------------------------------------------------- the launch-time group
def sglang_weight_files(d: Path) -> list[str]:
    """The files SGLang's DefaultModelLoader reads: *.safetensors filtered by the shard index."""
    files = sorted(str(p) for p in d.glob("*.safetensors"))
    return filter_duplicate_safetensors_files(files, str(d), "model.safetensors.index.json")


def stub_expert_loader(
    param: torch.Tensor, loaded: torch.Tensor, name: str, shard_id: str, expert_id: int
) -> None:
    """FusedMoE's loading rule for one expert (stub: FusedMoE needs SGLang's runtime; see module doc)."""
    target = param.data[expert_id]
    if target.dim() == 1 and target.numel() == 2:  # per-tensor scales of w13: [w1, w3]
        target = target[0 if shard_id == "w1" else 1]
    elif target.dim() >= 1 and shard_id in ("w1", "w3"):
        half = target.shape[0] // 2
        target = target[:half] if shard_id == "w1" else target[half:]
    assert tuple(target.shape) == tuple(loaded.shape), (
        name,
        shard_id,
        tuple(target.shape),
        tuple(loaded.shape),
    )
    target.copy_(loaded.to(target.dtype))


def expert_params(view: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Parameters a FusedMoE layer registers per format (names / shapes from the create_weights
    source lines asserted in test_sglang_source_lines_the_stubs_rely_on)."""
    e, h, i = EXPERTS, HIDDEN, MOE_INTER
    if view == "bf16":
        return {"w13_weight": ((e, 2 * i, h), torch.bfloat16), "w2_weight": ((e, h, i), torch.bfloat16)}
    if view == "fp8":
        f8, b = torch.float8_e4m3fn, 128
        return {
            "w13_weight": ((e, 2 * i, h), f8),
            "w2_weight": ((e, h, i), f8),
            "w13_weight_scale_inv": ((e, 2 * math.ceil(i / b), math.ceil(h / b)), torch.float32),
            "w2_weight_scale_inv": ((e, math.ceil(h / b), math.ceil(i / b)), torch.float32),
        }
    if view == "nvfp4":
        return {
            "w13_weight": ((e, 2 * i, h // 2), torch.uint8),
            "w2_weight": ((e, h, i // 2), torch.uint8),
            "w13_weight_scale": ((e, 2 * i, h // 16), torch.float8_e4m3fn),
            "w2_weight_scale": ((e, h, i // 16), torch.float8_e4m3fn),
            "w13_weight_scale_2": ((e, 2), torch.float32),
            "w2_weight_scale_2": ((e,), torch.float32),
            "w13_input_scale": ((e, 2), torch.float32),
            "w2_input_scale": ((e,), torch.float32),
        }
    raise AssertionError(view)


class Group(torch.nn.Module):
    """The launch-time model a sampler group holds (stub tree around SGLang's real linear layers)."""

    def __init__(self, kind: str, view: str, quant_config: Any) -> None:
        super().__init__()
        self.config = SimpleNamespace(tie_word_embeddings=False, num_experts=EXPERTS)
        self.pp_group = SimpleNamespace(is_last_rank=True)
        self.model = torch.nn.Module()
        self.loaded: set[str] = set()
        bf16 = torch.bfloat16

        def plain(*shape: int) -> torch.nn.Parameter:
            p = torch.nn.Parameter(torch.zeros(*shape, dtype=bf16), requires_grad=False)
            p.weight_loader = default_weight_loader  # type: ignore[attr-defined]
            return p

        self.model.embed_tokens = torch.nn.Module()
        self.model.embed_tokens.weight = plain(VOCAB, HIDDEN)
        self.model.norm = torch.nn.Module()
        self.model.norm.weight = plain(HIDDEN)
        self.lm_head = torch.nn.Module()
        self.lm_head.weight = plain(VOCAB, HIDDEN)
        self.model.layers = torch.nn.ModuleList()
        for i in range(LAYERS):
            p = f"model.layers.{i}"
            layer = torch.nn.Module()
            layer.input_layernorm, layer.post_attention_layernorm = torch.nn.Module(), torch.nn.Module()
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight = plain(HIDDEN), plain(HIDDEN)
            attn = layer.self_attn = torch.nn.Module()
            kw: dict[str, Any] = dict(
                bias=False, quant_config=quant_config, params_dtype=bf16, parallel_group="replicated"
            )
            attn.qkv_proj = QKVParallelLinear(
                HIDDEN, HEAD_DIM, HEADS, KV_HEADS, prefix=f"{p}.self_attn.qkv_proj", **kw
            )
            attn.o_proj = RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, prefix=f"{p}.self_attn.o_proj", **kw)
            attn.q_norm, attn.k_norm = torch.nn.Module(), torch.nn.Module()
            attn.q_norm.weight, attn.k_norm.weight = plain(HEAD_DIM), plain(HEAD_DIM)
            mlp = layer.mlp = torch.nn.Module()
            if kind == "dense":
                mlp.gate_up_proj = MergedColumnParallelLinear(
                    HIDDEN, [INTER, INTER], prefix=f"{p}.mlp.gate_up_proj", **kw
                )
                mlp.down_proj = RowParallelLinear(INTER, HIDDEN, prefix=f"{p}.mlp.down_proj", **kw)
            else:  # SGLang's Qwen3-MoE builds the router unquantized (source line asserted below)
                mlp.gate = ReplicatedLinear(
                    HIDDEN, EXPERTS, bias=False, quant_config=None, params_dtype=bf16, prefix=f"{p}.mlp.gate"
                )
                mlp.experts = torch.nn.Module()
                for name, (shape, dtype) in expert_params(view).items():
                    param = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
                    param.weight_loader = stub_expert_loader  # type: ignore[attr-defined]
                    mlp.experts.register_parameter(name, param)
            self.model.layers.append(layer)
        for name, param in self.named_parameters():  # record which parameters a checkpoint reaches
            self._record(name, param)

    def _record(self, name: str, param: torch.nn.Parameter) -> None:
        attr = "_weight_loader" if hasattr(param, "_weight_loader") else "weight_loader"
        inner: Callable[..., None] = getattr(param, attr)

        def loader(*args: Any, **kwargs: Any) -> None:
            inner(*args, **kwargs)
            self.loaded.add(name)

        setattr(param, attr, loader)

    def load(self, d: Path) -> int:
        """SGLang's own load_weights over SGLang's iterator of the view's files; returns #tensors."""
        count = 0

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for item in safetensors_weights_iterator(sglang_weight_files(d)):
                count += 1
                yield item

        self.loaded.clear()
        cls = (
            Qwen3ForCausalLM
            if isinstance(self.model.layers[0].mlp, torch.nn.Module)
            and hasattr(self.model.layers[0].mlp, "gate_up_proj")
            else Qwen3MoeForCausalLM
        )
        cls.load_weights(self, weights())  # type: ignore[arg-type]
        return count

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.data for n, p in self.named_parameters()}


# ------------------------------------------------------------------------ error bounds of the formats
def e2m1_half_spacing(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest error bound on the E2M1 grid {0,.5,1,1.5,2,3,4,6} at |x| (scaled units):
    half the local spacing (.25 up to 2, .5 up to 4, 1 up to 6); beyond 6 it saturates to 6, an error
    of |x| - 6 (at most 1 where |x| <= 7)."""
    a = x.abs()
    return torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, torch.clamp(a - 6, min=1.0)))


def within_bound(
    view: str, w: torch.Tensor, deq: torch.Tensor, scale: torch.Tensor, kept_scales: bool = False
) -> None:
    """`scale`: the per-element dequantization scale actually applied (broadcast to w's shape);
    `kept_scales`: a version quantized with an earlier version's scales kept (docs/weights.md, "Kept
    scales"), whose largest values may reach the top code + half its spacing (fp8 464: still within
    2^-4 relative; nvfp4 7)."""
    err = (w - deq).abs()
    if view == "bf16":  # 8 significant bits: round to nearest is within 2^-8 relative
        assert bool((err <= w.abs() * 2.0**-8).all())
    elif view == "fp8":  # E4M3: 4 significant bits -> 2^-4 relative; subnormal spacing 2^-9 -> 2^-10 absolute
        assert bool((err <= torch.maximum(w.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)).all())
    else:
        x = w / scale
        # nvfp4: a fresh E4M3 block scale rounds to nearest (<= 2^-4 relative), so |x| <= 6 / (1 - 2^-4);
        # a kept one is kept while |x| <= 6 + 1 (as near 6 as 8, the next value of the grid continued)
        top = 7.0 if kept_scales else 6 / (1 - 2.0**-4)
        assert float(x.abs().max()) <= top * (1 + 1e-6)
        assert bool((err <= scale * (e2m1_half_spacing(x) + 1e-5)).all())


def dequant_linear(
    view: str, params: dict[str, torch.Tensor], base: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized weight, per-element scale) of one SGLang linear from its loaded parameters."""
    w = params[f"{base}.weight"]
    if view == "bf16":
        return w.float(), torch.ones_like(w, dtype=torch.float32)
    n, k = w.shape[0], w.shape[1] * (1 if view == "fp8" else 2)
    if view == "fp8":
        s = (
            params[f"{base}.weight_scale_inv"]
            .float()
            .repeat_interleave(128, 0)[:n]
            .repeat_interleave(128, 1)[:, :k]
        )
        return w.float() * s, s
    # nvfp4: SGLang applies ONE weight_scale_2 per fused layer: the max over its shards
    s = (
        params[f"{base}.weight_scale"].float().repeat_interleave(16, 1)
        * params[f"{base}.weight_scale_2"].max()
    )
    return break_fp4_bytes(w) * s, s


def dequant_experts(
    view: str, w: torch.Tensor, params: dict[str, torch.Tensor], prefix: str, expert: int
) -> tuple[torch.Tensor, torch.Tensor]:
    q = params[f"{prefix}_weight"][expert]
    if view == "bf16":
        return q.float(), torch.ones_like(q, dtype=torch.float32)
    if view == "fp8":
        n, k = q.shape
        s = (
            params[f"{prefix}_weight_scale_inv"][expert]
            .float()
            .repeat_interleave(128, 0)[:n]
            .repeat_interleave(128, 1)[:, :k]
        )
        return q.float() * s, s
    ws2 = params[f"{prefix}_weight_scale_2"][expert]  # nvfp4; w13: [gate, up], equal (asserted)
    s = params[f"{prefix}_weight_scale"][expert].float().repeat_interleave(16, 1) * ws2.reshape(-1)[0]
    return break_fp4_bytes(q) * s, s


# ------------------------------------------------------------------------- launch + reload + compare
def test_views_load_into_their_group_with_sglang_load_weights(published: Published) -> None:
    for view in VIEWS_OF[published.kind]:
        # the group LAUNCHES from version 1 of its view (its quant config fixes the parameters) ...
        group = Group(
            published.kind, view, parse_quant_config(published.dirs[(1, view)], view, published.kind)
        )
        for version in (1, 2):  # ... and RELOADS version 2 into the same parameters
            count = group.load(published.dirs[(version, view)])
            expected_params = {n for n, _ in group.named_parameters()}  # every parameter, once loaded
            assert group.loaded == expected_params, (view, expected_params ^ group.loaded)
            assert count == len(
                json.loads(published.channel.manifest(version).to_bytes())["views"][view]["tensors"]
            )
            check_values(published, group, view, version)


def test_a_group_cannot_take_another_views_version(published: Published) -> None:
    """Why a group must follow its own view. An fp8 version into a bf16 group: SGLang's Qwen3 raises
    (KeyError on `gate_up_proj.weight_scale_inv`), its Qwen3-MoE skips the unknown scale names and
    casts the fp8 codes to bf16 without their scales: wrong weights, no error. An nvfp4 version into
    an fp8 group fails in SGLang's loaders (packed shapes)."""
    bf16_group = Group(published.kind, "bf16", None)
    if published.kind == "dense":
        with pytest.raises(KeyError, match="weight_scale_inv"):
            bf16_group.load(published.dirs[(1, "fp8")])
    else:
        bf16_group.load(published.dirs[(1, "fp8")])
        with pytest.raises(AssertionError):
            check_values(published, bf16_group, "bf16", 1)
    fp8_config = parse_quant_config(published.dirs[(1, "fp8")], "fp8", published.kind)
    with pytest.raises((AssertionError, KeyError, RuntimeError, ValueError)):
        Group(published.kind, "fp8", fp8_config).load(published.dirs[(1, "nvfp4")])


def check_values(published: Published, group: Group, view: str, version: int) -> None:
    trained, params, amax = published.trained[version], group.params(), published.amax[version]
    dense_view = view
    kept = version > 1  # quantized with version 1's scales kept where they fit
    first = read_view_tensors(published.dirs[(1, view)])[1] if kept and view == "nvfp4" else {}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        fused = {
            f"{p}.self_attn.qkv_proj": [f"{p}.self_attn.{x}_proj" for x in "qkv"],
            f"{p}.self_attn.o_proj": [f"{p}.self_attn.o_proj"],
        }
        if published.kind == "dense":
            fused[f"{p}.mlp.gate_up_proj"] = [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"]
            fused[f"{p}.mlp.down_proj"] = [f"{p}.mlp.down_proj"]
        for sglang_name, members in fused.items():
            w = torch.cat([trained[f"{m}.weight"] for m in members])
            deq, scale = dequant_linear(dense_view, params, sglang_name)
            within_bound(dense_view, w, deq, scale, kept_scales=kept)
            if dense_view == "nvfp4":
                ws2, inp = params[f"{sglang_name}.weight_scale_2"], params[f"{sglang_name}.input_scale"]
                group_amax = max(float(trained[f"{m}.weight"].abs().amax()) for m in members)
                if not kept:  # fresh: amax / (448 * 6), one per fused layer; input_scale from the amax
                    assert torch.equal(ws2, torch.full_like(ws2, group_amax / 2688.0))
                    assert torch.equal(
                        inp, torch.tensor([amax[m] / 2688.0 for m in members], dtype=torch.float32)
                    )
                    continue
                # kept from version 1 or renewed with headroom; either way one per fused layer, with its
                # top E4M3 block scale (amax / 6) / scale within [224, 464]
                assert torch.equal(ws2, torch.full_like(ws2, float(ws2[0])))
                checks = [(float(ws2[0]), group_amax, "weight_scale_2")]
                checks += [
                    (float(s), amax[m], "input_scale") for s, m in zip(inp.tolist(), members, strict=True)
                ]
                for value, module_amax, stored in checks:
                    earlier = {float(first[f"{m}.{stored}"]) for m in members}
                    renewed = float(torch.tensor(module_amax, dtype=torch.float32) * math.sqrt(2.0) / 2688.0)
                    assert value in earlier | {renewed, float(torch.tensor(module_amax / 2688.0))}
                    assert 224.0 <= module_amax / 6 / value <= 464.0 * (1 + 1e-6)
        if published.kind == "moe":
            assert params[f"{p}.mlp.gate.weight"].dtype == torch.bfloat16
            within_bound(
                "bf16", trained[f"{p}.mlp.gate.weight"], params[f"{p}.mlp.gate.weight"].float(), torch.ones(1)
            )
            for e in range(EXPERTS):
                ex = f"{p}.mlp.experts.{e}"
                w13 = torch.cat([trained[f"{ex}.gate_proj.weight"], trained[f"{ex}.up_proj.weight"]])
                for prefix, w in (
                    (f"{p}.mlp.experts.w13", w13),
                    (f"{p}.mlp.experts.w2", trained[f"{ex}.down_proj.weight"]),
                ):
                    deq, scale = dequant_experts(view, w, params, prefix, e)
                    within_bound(view, w, deq, scale, kept_scales=kept)
                if view == "nvfp4":
                    ws2 = params[f"{p}.mlp.experts.w13_weight_scale_2"][e]
                    assert float(ws2[0]) == float(ws2[1])  # gate/up share it (SGLang warns otherwise)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        within_bound("bf16", trained[name], params[name].float(), torch.ones(1))


def test_version_2_keeps_version_1s_scales(published: Published) -> None:
    """The publisher quantized version 2 with version 1's scales kept where they fit (docs/weights.md,
    "Kept scales"), against a fresh quantization of version 2's weights (`view_tensors` without them):
    scale elements of version 1 that a fresh quantization moves are still there, fewer stored elements
    differ from version 1, and every quantized tensor's squared error is within 1.01x the fresh one's."""
    for view in ("fp8", "nvfp4"):
        _, first = read_view_tensors(published.dirs[(1, view)])
        config, second = read_view_tensors(published.dirs[(2, view)])
        fresh, quantized = view_tensors(
            published.trained[2], view, hf=True, activation_amax=published.amax[2]
        )
        assert set(fresh) == set(second) and sorted(quantized) == sorted(config["quantized"])

        def bits(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(-1).view(torch.uint8).view(-1, t.element_size())

        def differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # per element, bit for bit
            return (bits(a) != bits(b)).any(dim=-1)

        scales = [n for n in second if n.endswith(("weight_scale_inv", "weight_scale", "weight_scale_2"))]
        kept = sum(int((~differ(second[n], first[n]) & differ(fresh[n], first[n])).sum()) for n in scales)
        assert kept > 0, view
        changed = sum(int(differ(second[n], first[n]).sum()) for n in second)
        changed_fresh = sum(int(differ(fresh[n], first[n]).sum()) for n in second)
        assert changed < changed_fresh, (view, changed, changed_fresh)
        for name in quantized:
            w = published.trained[2][name]
            kept_error, fresh_error = (squared_error(view, t, name, w) for t in (second, fresh))
            assert kept_error <= formats.KEPT_SCALE_ERROR_BOUND * fresh_error * (1 + 1e-12), (view, name)


def squared_error(view: str, tensors: dict[str, torch.Tensor], name: str, w: torch.Tensor) -> float:
    """Squared error of a view's quantized `name` (dequantized with its scales) against the weights `w`."""
    base = name[: -len(".weight")]
    if view == "fp8":
        deq = formats.dequantize_fp8_block(tensors[name], tensors[f"{base}.weight_scale_inv"])
    else:
        deq = formats.dequantize_nvfp4(
            tensors[name], tensors[f"{base}.weight_scale"], tensors[f"{base}.weight_scale_2"]
        )
    return float((deq.double() - w.double()).square().sum())


def test_input_scale_is_the_calibrated_activation_amax(published: Published) -> None:
    """q/k/v's input is input_layernorm(hidden state entering the layer), computed here with
    transformers' own modules, not with our calibration hooks."""
    model = build_model(published.kind, seed=0)  # version 1's weights
    with torch.no_grad():
        hidden = model(CALIBRATION, output_hidden_states=True).hidden_states
        for i in range(LAYERS):
            x = model.model.layers[i].input_layernorm(hidden[i])
            assert published.amax[1][f"model.layers.{i}.self_attn.q_proj"] == float(x.abs().amax())


def test_sglang_source_lines_the_stubs_rely_on() -> None:
    fp8 = (SGLANG_SRC / "layers/quantization/fp8.py").read_text()
    modelopt = (SGLANG_SRC / "layers/quantization/modelopt_quant.py").read_text()
    moe = (SGLANG_SRC / "layers/moe/fused_moe_triton/layer.py").read_text()
    for name in ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"):
        assert f'layer.register_parameter("{name}"' in fp8
    for name in (
        "w13_weight_scale",
        "w13_weight_scale_2",
        "w2_weight_scale_2",
        "w13_input_scale",
        "w2_input_scale",
    ):
        assert f'layer.register_parameter("{name}"' in modelopt
    assert "(layer.num_experts, num_shards)" in modelopt  # w13_input_scale [E, 2]
    # FusedMoE._load_w13: gate (w1) -> first half, up (w3) -> second half
    assert "shard_size = expert_data.shape[shard_dim] // 2" in moe
    assert "# w1, gate_proj: Load into first logical weight of w13." in moe
    assert "# w3, up_proj: Load into second logical weight of w13." in moe
    # dense NVFP4: one global weight / input scale per fused layer
    src = inspect.getsource(ModelOptFp4LinearMethod.process_weights_after_loading)
    assert "weight_scale_2 = layer.weight_scale_2.max()" in src
    assert "input_scale_2 = layer.input_scale.max()" in src
    # Qwen3-MoE's router: unquantized unless the config is modelslim (the Group builds it so)
    qwen3_moe = (SGLANG_SRC / "models/qwen3_moe.py").read_text()
    assert "quant_config=gate_quant_config" in qwen3_moe
    assert 'if (quant_config is not None and quant_config.get_name() == "modelslim")' in qwen3_moe
    # the real expert mapping Qwen3-MoE's load_weights uses
    mapping = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", num_experts=2)
    assert ("experts.w13_", "experts.1.up_proj.", 1, "w3") in mapping


logging.getLogger("sglang").setLevel(logging.ERROR)
