"""LoRA held against SGLang 0.5.23's own code on CPU and against PEFT (docs/sampler.md, "LoRA").

- An adapter directory as rlfleet writes it (`rlfleet.lora.adapter_config` + PEFT tensor names) is what
  SGLang's LoRAConfig reads (rank, alpha, target modules) and its LoRAAdapter loads (every tensor kept,
  q/k/v and gate/up fused into its qkv_proj / gate_up_proj buffers at the right shapes).
- `lora_path` in a /generate body passes SGLang's JSON contract gate and GenerateReqInput normalisation
  (one name for a batch, or one per request, null for the base).
- The reference engine's LoraRegistry answers a script of loads, unloads and requests exactly as SGLang's
  tokenizer side does (TokenizerManager.load_lora_adapter / unload_lora_adapter / _resolve_lora_path on
  its real LoRARegistry) with its scheduler side (LoRAManager's real load, validation and unload on
  stubbed GPU plumbing): the same success, messages, loaded adapters, LRU eviction, implicit reload, and
  an unload that waits for the request in flight on its adapter.
- The engine's output with an adapter equals transformers' Qwen3 wrapped by PEFT with that adapter: on
  the bf16 view to the engine-vs-transformers tolerance (1e-5, exact kernel), and on the fp8 and nvfp4
  views equal to PEFT over those quantized (dequantized) base weights, i.e. the adapter is added on the
  quantized base, not on bf16 weights.

Stubbed, because it cannot exist here: the TokenizerManager's process plumbing (it is built with
`__new__`; its communicator to the scheduler calls the LoRAManager methods directly) and the LoRA memory
pool's GPU buffers (its `can_support` is SGLang's own, on the pool's configured rank and modules).
"""

from __future__ import annotations

import asyncio
import functools
import json
import types
from pathlib import Path
from typing import Any

import pytest
import sglang_made as sm
import torch
from safetensors.torch import save_file

from rlfleet.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, adapter_config
from rlfleet.numerics.engine_model import (
    EngineModel,
    ModelShape,
    lora_modules,
    precision_view,
    read_lora_adapter,
)
from rlfleet.numerics.views import checkpoint_tensors
from rlfleet.sampler.reference_engine import LoraRegistry, LoraSettings

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
SETTINGS = LoraSettings(
    max_lora_rank=8, target_modules=tuple(ATTENTION), max_loras_per_batch=2, max_loaded_loras=3
)
EXACT_ATOL = 1e-5  # tests/sampler/test_sampler_engine_model.py: the engine against transformers


def sglang_shape() -> ModelShape:
    """The model of sglang_made's SGLang context (its config.json)."""
    return ModelShape.from_hf_config(json.loads((Path(sm.model_dir()) / "config.json").read_text()))


def write_adapter(
    directory: Path, shape: ModelShape, rank: int, targets: list[str], seed: int, alpha: float = 16.0
) -> Path:
    """An adapter directory as rlfleet writes it: adapter_config.json from `rlfleet.lora.adapter_config`,
    adapter_model.safetensors with PEFT's names (`base_model.model.<module>.lora_A.weight`), bf16."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (fan_in, fan_out) in lora_modules(shape).items():
        if module.rpartition(".")[2] in targets:
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (0.3 * torch.randn(rank, fan_in, generator=gen)).bfloat16()
            tensors[f"{prefix}.lora_B.weight"] = (0.3 * torch.randn(fan_out, rank, generator=gen)).bfloat16()
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / ADAPTER_WEIGHTS_FILE))
    config = adapter_config(rank=rank, alpha=alpha, dropout=0.0, target_modules=targets)
    (directory / ADAPTER_CONFIG_FILE).write_text(json.dumps(config))
    return directory


@functools.cache
def lora_context() -> Any:
    """SGLang's runtime context of the group launch's LoRA flags (rlfleet/catalog/launch.py)."""
    from sglang.srt.runtime_context import create_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=sm.model_dir(),
        skip_tokenizer_init=True,
        device="cpu",
        enable_lora=True,
        max_lora_rank=SETTINGS.max_lora_rank,
        lora_target_modules=list(SETTINGS.target_modules),
        max_loras_per_batch=SETTINGS.max_loras_per_batch,
        max_loaded_loras=SETTINGS.max_loaded_loras,
    )
    return create_context(args, role="tokenizer")


def test_sglangs_lora_config_and_adapter_read_rlfleets_adapter_directory(tmp_path):
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.lora.lora import LoRAAdapter
    from sglang.srt.lora.lora_config import LoRAConfig
    from sglang.srt.runtime_context import use_context

    shape = sglang_shape()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    path = write_adapter(tmp_path / "v3", shape, rank=4, targets=targets, seed=1, alpha=12.0)
    config = LoRAConfig(str(path))
    assert (config.r, config.lora_alpha, sorted(config.target_modules)) == (4, 12.0, sorted(targets))
    assert not config.use_dora and config.lora_added_tokens_size == 0
    base = types.SimpleNamespace(
        num_hidden_layers=shape.num_hidden_layers, architectures=["Qwen3ForCausalLM"]
    )
    with use_context(lora_context()):
        adapter = LoRAAdapter("v3-id", config, base, LoadConfig(), None)
        adapter.initialize_weights()  # SGLang's own reading of adapter_model.safetensors
    assert adapter.scaling == 12.0 / 4 == read_lora_adapter(path, shape).scaling
    weights = adapter.layers[0].weights
    at, mlp = "base_model.model.model.layers.0.self_attn.", "base_model.model.model.layers.0.mlp."
    h, q, kv, i = shape.hidden_size, shape.q_size, shape.kv_size, shape.intermediate_size
    assert {k: tuple(v.shape) for k, v in weights.items()} == {
        at + "qkv_proj.lora_A.weight": (3 * 4, h),
        at + "qkv_proj.lora_B.weight": (q + 2 * kv, 4),
        at + "o_proj.lora_A.weight": (4, q),
        at + "o_proj.lora_B.weight": (h, 4),
        mlp + "gate_up_proj.lora_A.weight": (2 * 4, h),
        mlp + "gate_up_proj.lora_B.weight": (2 * i, 4),
        mlp + "down_proj.lora_A.weight": (4, i),
        mlp + "down_proj.lora_B.weight": (h, 4),
    }
    ours = read_lora_adapter(path, shape).weights
    # SGLang's fused q/k/v B is ours stacked: the same numbers reach the same projections
    fused_b = torch.cat([ours[f"model.layers.0.self_attn.{m}_proj"][1] for m in "qkv"])
    assert torch.equal(weights[at + "qkv_proj.lora_B.weight"].float(), fused_b)


def test_sglang_accepts_lora_path_as_the_router_sends_it():
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers.io_struct import GenerateReqInput

    body = {"input_ids": [1, 2, 3], "lora_path": "v7", "sampling_params": {"max_new_tokens": 2}}
    sm.admit(body)  # the whole request gate (raises Rejected on a refusal)
    assert generate_contract_error({**body, "lora_path": 7}) is not None  # the gate does check it
    single = GenerateReqInput(**body)
    single.normalize_batch_and_arguments()
    assert single.lora_path == "v7"
    batch = GenerateReqInput(input_ids=[[1, 2], [3]], lora_path=["v7", None])
    batch.normalize_batch_and_arguments()
    assert (batch[0].lora_path, batch[1].lora_path) == ("v7", None)
    shared = GenerateReqInput(input_ids=[[1, 2], [3]], lora_path="v8")
    shared.normalize_batch_and_arguments()
    assert shared.lora_path == ["v8", "v8"]


# ------------------------------------------------------------------------------- the registry oracle
class SGLangLora:
    """SGLang's tokenizer-side LoRA (its TokenizerManager methods, real LoRARegistry) over its
    scheduler-side LoRAManager methods (real load, validation, weight reading, unload)."""

    def __init__(self) -> None:
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.lora.lora_manager import LoRAManager
        from sglang.srt.lora.lora_registry import LoRARegistry
        from sglang.srt.lora.mem_pool import LoRAMemoryPool
        from sglang.srt.lora.utils import get_normalized_target_modules
        from sglang.srt.managers import tokenizer_manager as tmm

        shape = sglang_shape()
        pool = types.SimpleNamespace(
            max_lora_rank=SETTINGS.max_lora_rank,
            lora_added_tokens_size=0,
            target_modules=get_normalized_target_modules(SETTINGS.target_modules),
            remove_lora=lambda lora_id: None,
        )
        pool.can_support = functools.partial(LoRAMemoryPool.can_support, pool)
        base = types.SimpleNamespace(vocab_size=shape.vocab_size, num_hidden_layers=shape.num_hidden_layers)
        mgr = types.SimpleNamespace(
            lora_refs={}, loras={}, configs={}, num_pinned_loras=0, attn_dp_enabled=False, memory_pool=pool,
            max_loras_per_batch=SETTINGS.max_loras_per_batch, base_hf_config=base, load_config=LoadConfig(),
            lora_backend=None, base_model=None, speculative_algorithm=None,
        )  # fmt: skip
        for name in ("validate_new_adapter", "load_lora_weights", "create_lora_update_result"):
            setattr(mgr, name, functools.partial(getattr(LoRAManager, name), mgr))
        self.mgr = mgr

        async def communicator(obj: Any) -> list[Any]:
            from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput

            if isinstance(obj, LoadLoRAAdapterReqInput):
                return [LoRAManager._load_lora_adapter(mgr, obj.to_ref())]
            return [LoRAManager._unload_lora_adapter(mgr, obj.to_ref())]

        tm = tmm.TokenizerManager.__new__(tmm.TokenizerManager)
        tm.auto_create_handle_loop = lambda: None
        tm.enable_lora = True
        tm.lora_registry = LoRARegistry()
        tm.lora_update_lock = asyncio.Lock()
        tm.lora_ref_cache = {}
        tm.pending_lora_unloads = {}
        tm.update_lora_adapter_communicator = communicator
        self.tm = tm

    async def load(self, name: str, path: str) -> dict[str, Any]:
        from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput

        out = await self.tm.load_lora_adapter(LoadLoRAAdapterReqInput(lora_name=name, lora_path=path))
        return {"success": out.success, "error_message": out.error_message, "loaded": out.loaded_adapters}

    async def unload(self, name: str) -> dict[str, Any]:
        from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

        out = await self.tm.unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name=name))
        return {"success": out.success, "error_message": out.error_message, "loaded": out.loaded_adapters}

    async def acquire(self, names: list[str | None]) -> Any:
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(input_ids=[[1]] * len(names), lora_path=names)
        obj.normalize_batch_and_arguments()
        await self.tm._validate_and_resolve_lora(obj)
        return obj.lora_id

    async def release(self, handle: Any) -> None:
        await self.tm.lora_registry.release(handle)

    def registered(self) -> list[str]:
        return list(self.tm.lora_registry.get_all_adapters())


class OurLora:
    def __init__(self) -> None:
        self.registry = LoraRegistry(SETTINGS, sglang_shape())

    async def load(self, name: str, path: str) -> dict[str, Any]:
        out = await self.registry.load(name, path)
        return {
            "success": out["success"],
            "error_message": out["error_message"],
            "loaded": out["loaded_adapters"],
        }

    async def unload(self, name: str) -> dict[str, Any]:
        out = await self.registry.unload(name)
        return {
            "success": out["success"],
            "error_message": out["error_message"],
            "loaded": out["loaded_adapters"],
        }

    async def acquire(self, names: list[str | None]) -> Any:
        return await self.registry.acquire(names)

    async def release(self, handle: Any) -> None:
        self.registry.release(handle)

    def registered(self) -> list[str]:
        return list(self.registry.registry)


async def run_script(side: Any, paths: dict[str, str]) -> list[Any]:
    """Loads, unloads and requests in the order the weight-sync sidecar and the router make them, and the
    mistakes SGLang answers: each step's answer (messages, loaded adapters) and the registered names."""
    from sglang.srt.runtime_context import use_context

    trace: list[Any] = []

    async def step(what: str, coro: Any) -> None:
        try:
            out = await coro
        except ValueError as exc:
            out = f"ValueError: {exc}"
        if isinstance(out, list):  # a request's adapters: which ones, not the ids (fresh per load)
            out = f"acquired {len(out)}"
        trace.append((what, out, side.registered()))

    with use_context(lora_context()):
        for name in ("v1", "v2", "v3"):
            await step(f"load {name}", side.load(name, paths[name]))
        await step("load v2 again", side.load("v2", paths["v2"]))
        await step("load v4 over max-loaded-loras", side.load("v4", paths["v4"]))
        await step("request v1 (evicted: reloaded)", side.acquire(["v1"]))
        await step("request v9 (never loaded)", side.acquire(["v9"]))
        await step("request v3, v4, v1, base", side.acquire(["v3", "v4", "v1", None]))
        await step("unload v9", side.unload("v9"))
        await step("load rank 16", side.load("big", paths["big"]))
        await step("load mlp adapter", side.load("mlp", paths["mlp"]))
        # an unload waits for the request in flight on its adapter; new requests cannot take it meanwhile
        held = await side.acquire(["v4"])
        unload = asyncio.ensure_future(side.unload("v4"))
        await asyncio.sleep(0.05)
        trace.append(("unload v4 while a request holds it: done", unload.done(), side.registered()))
        await side.release(held)
        await step("unload v4 after the request", unload)
        await step("request v4 (unloaded: reloaded)", side.acquire(["v4"]))
    return trace


async def test_the_registry_answers_as_sglangs_tokenizer_and_scheduler(tmp_path):
    shape = sglang_shape()
    paths = {
        f"v{n}": str(write_adapter(tmp_path / f"v{n}", shape, 4, ATTENTION, seed=n)) for n in range(1, 5)
    }
    paths["big"] = str(write_adapter(tmp_path / "big", shape, 16, ATTENTION, seed=9))
    paths["mlp"] = str(write_adapter(tmp_path / "mlp", shape, 4, ["q_proj", "v_proj", "down_proj"], seed=8))
    theirs = await run_script(SGLangLora(), paths)
    ours = await run_script(OurLora(), paths)
    for a, b in zip(theirs, ours, strict=True):
        assert a == b
    by_step = {what: (out, registered) for what, out, registered in ours}
    # the script really exercised what it names
    assert by_step["load v4 over max-loaded-loras"][1] == ["v2", "v3", "v4"]
    assert by_step["request v1 (evicted: reloaded)"] == ("acquired 1", ["v3", "v4", "v1"])
    assert "never been loaded: v9" in by_step["request v9 (never loaded)"][0]
    assert "rank 16 is incompatible" in by_step["load rank 16"][0]["error_message"]
    assert "rank 4 is incompatible" in by_step["load mlp adapter"][0]["error_message"]
    assert "does not exist" in by_step["unload v9"][0]["error_message"]
    assert by_step["unload v4 while a request holds it: done"][0] is False
    assert by_step["unload v4 after the request"][0]["success"] is True


async def test_lora_disabled_answers_are_sglangs():
    """Without --enable-lora: SGLang's load answer and its /generate refusal of a request naming one."""
    from sglang.srt.managers.io_struct import GenerateReqInput, LoadLoRAAdapterReqInput
    from sglang.srt.runtime_context import use_context

    side = SGLangLora()
    side.tm.enable_lora = False
    ours = LoraRegistry(None, sglang_shape())
    with use_context(sm.context("tokenizer")):  # LoRA not enabled
        theirs = await side.tm.load_lora_adapter(LoadLoRAAdapterReqInput(lora_name="v1", lora_path="/x"))
        obj = GenerateReqInput(input_ids=[1], lora_path="v1")
        with pytest.raises(ValueError) as refused:
            await side.tm._validate_and_resolve_lora(obj)
    answer = await ours.load("v1", "/x")
    assert (answer["success"], answer["error_message"]) == (False, theirs.error_message)
    assert "not enabled" in theirs.error_message
    with pytest.raises(ValueError) as ours_refused:
        await ours.acquire(["v1"])
    assert str(ours_refused.value) == str(refused.value)


# ------------------------------------------------------------------------------- the math: PEFT
def _peft_model(weights: dict[str, torch.Tensor], config: dict[str, Any], adapter_dir: Path) -> Any:
    """transformers' Qwen3 of `config` with `weights` (float32), PEFT-wrapped with the adapter in
    `adapter_dir` (PEFT's own loading of the directory)."""
    from peft import PeftModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hf = Qwen3ForCausalLM(Qwen3Config(**config)).float().eval()
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return PeftModel.from_pretrained(hf, str(adapter_dir)).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[dict[str, Any], dict[str, torch.Tensor], Path, Path]:
    """A tiny Qwen3 (bf16 checkpoint weights, as tests/support's) and two adapters of it."""
    from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model

    sizes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 64}  # fmt: skip
    hf = tiny_model(TinyQwen3(**sizes, seed=5)).to(torch.bfloat16)
    config = hf.config.to_dict()
    weights = {k: v.float() for k, v in checkpoint_tensors(hf.state_dict()).items()}
    shape = ModelShape.from_hf_config(config)
    root = tmp_path_factory.mktemp("lora")
    a = write_adapter(
        root / "a", shape, 4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 1
    )
    b = write_adapter(root / "b", shape, 8, ["q_proj", "v_proj"], 2, alpha=8.0)
    return config, weights, a, b


@torch.no_grad()
def test_engine_with_an_adapter_equals_peft_on_the_bf16_view(tiny):
    config, weights, a, b = tiny
    shape = ModelShape.from_hf_config(config)
    engine = EngineModel(shape).eval()  # the exact kernel, as the engine-vs-transformers tests
    view = precision_view(weights, "bf16")
    engine.load_weights(view)
    ids = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    adapter_a, adapter_b = read_lora_adapter(a, shape), read_lora_adapter(b, shape)
    peft_a = _peft_model(view, config, a)(ids).logits.float()
    assert float((engine(ids, adapters=[adapter_a] * 3) - peft_a).abs().max()) <= EXACT_ATOL
    base = engine(ids)
    assert float((base - peft_a).abs().max()) > 100 * EXACT_ATOL  # the adapter matters
    # one batch mixing adapters and the base, through the slot cache (prefill, then one-token decodes)
    peft_b = _peft_model(view, config, b)(ids).logits.float()
    cache, rows = engine.new_cache(3), torch.arange(3)
    mixed = [adapter_a, None, adapter_b]
    parts = [engine(ids[:, :5], cache, rows, adapters=mixed)]
    parts += [engine(ids[:, t : t + 1], cache, rows, adapters=mixed) for t in range(5, 9)]
    logits = torch.cat(parts, 1)
    for row, want in enumerate((peft_a, base, peft_b)):
        assert float((logits[row] - want[row]).abs().max()) <= EXACT_ATOL, row


@pytest.mark.parametrize("weight_format", ["fp8", "nvfp4"])
@torch.no_grad()
def test_the_adapter_is_added_on_the_quantized_base(tiny, weight_format):
    """The engine of a quantized view with an adapter equals PEFT's adapter on those quantized weights
    (dequantized: what the engine computes with), and not PEFT's on the bf16 weights."""
    config, weights, a, _ = tiny
    shape = ModelShape.from_hf_config(config)
    quantized = precision_view(weights, weight_format)
    engine = EngineModel(shape).eval()
    engine.load_weights(quantized)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    ours = engine(ids, adapters=[read_lora_adapter(a, shape)] * 2)
    on_quantized = _peft_model(quantized, config, a)(ids).logits.float()
    on_bf16 = _peft_model(precision_view(weights, "bf16"), config, a)(ids).logits.float()
    assert float((ours - on_quantized).abs().max()) <= EXACT_ATOL
    assert float((ours - on_bf16).abs().max()) > 100 * EXACT_ATOL
