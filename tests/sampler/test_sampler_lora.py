"""The reference server's LoRA over real HTTP (docs/sampler.md, "LoRA"): the launch flags, /load_lora_adapter,
/unload_lora_adapter, /update_weight_version, /v1/models and `lora_path` in /generate, as the weight-sync
sidecar and the router use them. SGLang's own code holds the registry's answers and the math in
tests/sglang_contract/test_contract_lora.py; here the server and the scheduler around them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from rlfleet.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, adapter_config
from rlfleet.numerics.engine_model import ModelShape, lora_modules, read_lora_adapter
from rlfleet.sampler import server as srv_mod
from rlfleet.sampler.http_app import start_reference_server
from rlfleet.sampler.reference_engine import (
    EngineConfig,
    GenRequest,
    LoraSettings,
    ReferenceEngine,
    tiny_shape,
)
from rlfleet.sampler.sampling import RowParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

TINY = ["--vocab-size", "64", "--hidden-size", "32", "--num-hidden-layers", "1", "--num-attention-heads", "2",
        "--head-dim", "16", "--context-length", "64"]  # fmt: skip
LORA = ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj",
        "--max-loras-per-batch", "2", "--max-loaded-loras", "3"]  # fmt: skip
GREEDY = {"temperature": 0.0, "max_new_tokens": 8}


def write_adapter(directory: Path, shape: ModelShape, seed: int, rank: int = 4) -> str:
    """A strong attention adapter in PEFT's layout (rlfleet/lora.py's files)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (fan_in, fan_out) in lora_modules(shape).items():
        if "self_attn" in module:
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen)
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen)
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / ADAPTER_WEIGHTS_FILE))
    config = adapter_config(
        rank=rank, alpha=2.0 * rank, dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    (directory / ADAPTER_CONFIG_FILE).write_text(json.dumps(config))
    return str(directory)


def engine_of(*flags: str) -> ReferenceEngine:
    engine, _ = srv_mod._reference_engine(srv_mod._parser().parse_args([*TINY, *flags]))
    return engine


async def generate(http: httpx.AsyncClient, url: str, **body: Any) -> httpx.Response:
    return await http.post(url + "/generate", json={"sampling_params": GREEDY, **body})


async def test_adapters_load_serve_per_request_and_unload(tmp_path):
    engine = engine_of(*LORA)
    assert engine.config.lora == LoraSettings(8, ("q_proj", "k_proj", "v_proj", "o_proj"), 2, 3)
    shape = engine.config.model
    v1, v2 = write_adapter(tmp_path / "v1", shape, 1), write_adapter(tmp_path / "v2", shape, 2)
    async with await start_reference_server(engine) as server, httpx.AsyncClient(timeout=30) as http:
        url = server.url
        loaded = await http.post(url + "/load_lora_adapter", json={"lora_name": "v1", "lora_path": v1})
        assert loaded.status_code == 200
        assert loaded.json() == {"rid": None, "http_worker_ipc": None, "success": True, "error_message": "",
                                 "loaded_adapters": {"v1": v1}}  # fmt: skip
        assert (
            await http.post(url + "/load_lora_adapter", json={"lora_name": "v2", "lora_path": v2})
        ).is_success
        version = {"new_version": "2", "abort_all_requests": False}
        relabelled = (await http.post(url + "/update_weight_version", json=version)).json()
        assert relabelled == {"success": True, "message": "Weight version updated to 2", "new_version": "2"}
        assert (await http.get(url + "/model_info")).json()["weight_version"] == "2"
        models = (await http.get(url + "/v1/models")).json()["data"]
        assert [(m["id"], m["root"], m["parent"]) for m in models] == [
            ("tiny-qwen3", "tiny-qwen3", None), ("v1", v1, "tiny-qwen3"), ("v2", v2, "tiny-qwen3")
        ]  # fmt: skip

        ids = [3, 1, 4, 1, 5]
        base = (await generate(http, url, input_ids=ids)).json()
        on_v1 = (await generate(http, url, input_ids=ids, lora_path="v1")).json()
        on_v2 = (await generate(http, url, input_ids=ids, lora_path="v2")).json()
        assert len({tuple(r["output_ids"]) for r in (base, on_v1, on_v2)}) == 3  # each adapter computes
        assert on_v1["meta_info"]["weight_version"] == "2"
        batch = (await generate(http, url, input_ids=[ids, ids, ids], lora_path=["v2", None, "v1"])).json()
        assert [r["output_ids"] for r in batch] == [
            on_v2["output_ids"],
            base["output_ids"],
            on_v1["output_ids"],
        ]

        unknown = await generate(http, url, input_ids=ids, lora_path="v9")
        assert unknown.status_code == 400
        assert unknown.json()["error"]["message"].startswith(
            "Got LoRA adapter that has never been loaded: v9\n"
        )
        gone = await http.post(url + "/unload_lora_adapter", json={"lora_name": "v9"})
        assert gone.status_code == 400 and gone.json()["error_message"] == (
            "LoRA with name v9 does not exist. Loaded LoRAs: odict_keys(['v2', 'v1'])"  # LRU first
        )

        # unloaded, then named by a late request: SGLang loads it again from its path
        assert (await http.post(url + "/unload_lora_adapter", json={"lora_name": "v1"})).is_success
        again = (await generate(http, url, input_ids=ids, lora_path="v1")).json()
        assert again["output_ids"] == on_v1["output_ids"]
        assert "v1" in {m["id"] for m in (await http.get(url + "/v1/models")).json()["data"]}


async def test_an_unload_returns_when_the_requests_on_its_adapter_finished(tmp_path):
    engine = engine_of(*LORA, "--max-tokens-per-second", "40")
    v1 = write_adapter(tmp_path / "v1", engine.config.model, 1)
    async with await start_reference_server(engine) as server, httpx.AsyncClient(timeout=30) as http:
        url = server.url
        assert (
            await http.post(url + "/load_lora_adapter", json={"lora_name": "v1", "lora_path": v1})
        ).is_success
        body = {
            "input_ids": [1, 2],
            "lora_path": "v1",
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 24},
        }
        running = asyncio.ensure_future(http.post(url + "/generate", json=body))
        while not engine.running:  # the request is generating on v1
            await asyncio.sleep(0.01)
        unloaded = await http.post(url + "/unload_lora_adapter", json={"lora_name": "v1"})
        assert unloaded.json()["success"] is True and unloaded.json()["loaded_adapters"] == {}
        assert running.done()  # the unload waited for it
        done = (await running).json()
        assert len(done["output_ids"]) == 24 and done["meta_info"]["finish_reason"]["type"] == "length"


async def test_without_enable_lora_the_answers_are_sglangs(tmp_path):
    engine = engine_of()
    async with await start_reference_server(engine) as server, httpx.AsyncClient(timeout=30) as http:
        url = server.url
        load = await http.post(
            url + "/load_lora_adapter", json={"lora_name": "v1", "lora_path": str(tmp_path)}
        )
        assert load.status_code == 400
        assert (
            load.json()["error_message"] == "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
        )
        refused = await generate(http, url, input_ids=[1, 2], lora_path="v1")
        assert refused.status_code == 400
        assert refused.json()["error"]["message"].startswith(
            "LoRA adapter 'v1' was requested, but LoRA is not enabled."
        )
        assert [m["id"] for m in (await http.get(url + "/v1/models")).json()["data"]] == ["tiny-qwen3"]


def test_a_batch_holds_at_most_max_loras_per_batch_adapters(tmp_path):
    """SGLang's scheduler: a request whose adapter would be one too many waits; the base counts as one."""
    shape = tiny_shape(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)  # fmt: skip
    settings = LoraSettings(
        8, ("q_proj", "k_proj", "v_proj", "o_proj"), max_loras_per_batch=2, max_loaded_loras=3
    )
    engine = ReferenceEngine(EngineConfig(model=shape, lora=settings))
    a, b = (read_lora_adapter(write_adapter(tmp_path / n, shape, s), shape) for n, s in (("a", 1), ("b", 2)))

    def request(adapter: Any) -> GenRequest:
        return GenRequest([1, 2], RowParams(0.0, 1.0, -1, 0.0), 4, frozenset(), lora=adapter)

    reqs = [request(a), request(None), request(b), request(a)]
    engine.waiting.extend(r for r in reqs if engine._prepare(r))
    admitted = engine._admit()
    assert admitted == [reqs[0], reqs[1], reqs[3]] and list(engine.waiting) == [reqs[2]]
    engine._step(admitted)
    engine.run_batch([])  # the admitted ones finish, then b's is admitted
    assert all(len(r.out_ids) == 4 for r in reqs)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--enable-lora", "--max-lora-rank", "8"],
            "need to specify both --max-lora-rank and --lora-target-modules",
        ),
        (
            [*LORA[:-4], "--max-loras-per-batch", "4", "--max-loaded-loras", "3"],
            "max_loaded_loras should be greater",
        ),
    ],
)
def test_lora_flags_are_checked_as_sglang_checks_them(flags, message, capsys):
    assert srv_mod.cli([*TINY, *flags]) == 2
    assert message in capsys.readouterr().err
