"""The reference engine serving the tiny Qwen3-MoE returns each position's routed experts as SGLang
0.5.23 does (`return_routed_experts`, `meta_info.routed_experts`; the encoding is held against SGLang's
own code in tests/sglang_contract/test_contract_routed_experts.py), read by our client: with the exact
kernel they are the top-k of transformers' router over prompt + output (its last token never
forwarded)."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch

from rlfleet.numerics.engine_model import KernelConfig
from rlfleet.sampler.client import SamplerClient
from rlfleet.sampler.http_app import start_reference_server
from rlfleet.sampler.reference_engine import EngineConfig, ReferenceEngine, tiny_shape
from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

SIZES = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
         "architecture": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}  # fmt: skip
SEED = 5
PROMPT = [1, 2, 3, 4, 5]
MOE = {"temperature": 0.9, "top_p": 0.8, "top_k": 40, "max_new_tokens": 7, "routed_experts_top_k": 2}


def exact_moe_engine() -> ReferenceEngine:
    """The tiny Qwen3-MoE's seeded init, fp32 weights and kernel: the trainer's model."""
    return ReferenceEngine(
        EngineConfig(
            model=tiny_shape(**SIZES), seed=SEED, weight_format="fp32", kernel=KernelConfig("float32")
        )
    )


async def test_the_engine_returns_the_experts_transformers_routes_each_position_to():
    async with (
        await start_reference_server(exact_moe_engine()) as server,
        SamplerClient(server.url) as client,
    ):
        turns = [await client.generate(PROMPT, MOE, sampling_seed=s) for s in range(3)]
        dense = await client.generate(PROMPT, {**MOE, "routed_experts_top_k": 0})
    hf = tiny_model(TinyQwen3(**SIZES, seed=SEED))
    for turn in turns:
        assert turn.valid.all() and turn.num_tokens == 7
        forwarded = torch.tensor([PROMPT + turn.output_ids.tolist()[:-1]])
        with torch.no_grad():
            router_logits = hf(forwarded, output_router_logits=True).router_logits  # per layer [positions, E]
        want = torch.stack([g.softmax(-1).topk(2, dim=-1).indices for g in router_logits], dim=1)
        assert turn.routed_experts is not None and turn.routed_experts.shape == (len(PROMPT) + 6, 2, 2)
        assert torch.equal(torch.from_numpy(turn.routed_experts).long(), want)
    assert dense.routed_experts is None


async def test_a_start_and_a_dense_model_as_sglang_answers_them():
    """routed_experts_start_len drops the first positions; one past the prompt is refused with SGLang's
    message; a dense model returns no routing even when asked (as SGLang without a mixture of experts)."""
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0.0},
        "return_routed_experts": True,
    }
    async with await start_reference_server(exact_moe_engine()) as server, httpx.AsyncClient() as http:
        whole = (await http.post(server.url + "/generate", json=body)).json()
        late = (
            await http.post(server.url + "/generate", json={**body, "routed_experts_start_len": 4})
        ).json()
        refused = await http.post(server.url + "/generate", json={**body, "routed_experts_start_len": 6})

    def rows(answer: dict) -> np.ndarray:
        return np.frombuffer(base64.b64decode(answer["meta_info"]["routed_experts"]), dtype="<i4").reshape(
            -1, 2, 2
        )

    assert rows(whole).shape[0] == len(PROMPT) + 3 - 1 and np.array_equal(rows(late), rows(whole)[4:])
    assert (
        refused.status_code == 400
        and "routed_experts_start_len=6 is higher than the number of input tokens" in refused.text
    )
    dense = ReferenceEngine(
        EngineConfig(
            model=tiny_shape(
                **{
                    k: v
                    for k, v in SIZES.items()
                    if k
                    in (
                        "vocab_size",
                        "hidden_size",
                        "intermediate_size",
                        "num_hidden_layers",
                        "num_attention_heads",
                        "num_key_value_heads",
                        "head_dim",
                        "max_position_embeddings",
                    )
                }
            ),
            seed=SEED,
        )
    )
    async with await start_reference_server(dense) as server, httpx.AsyncClient() as http:
        answer = (await http.post(server.url + "/generate", json=body)).json()
    assert "routed_experts" not in answer["meta_info"] and answer["meta_info"]["completion_tokens"] == 3
