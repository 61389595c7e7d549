"""The reference sampler server over real HTTP (aiohttp on 127.0.0.1, free port): SGLang-shaped
responses that pass the client contract, sampling exactly per SGLang's rule, batching, weight updates
(also mid-generation), pause/continue, version conflicts, auth, metrics, and the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from rlfleet.numerics.tinygpt import KernelConfig, TinyGPT, TinyGPTConfig
from rlfleet.records import HEAD_MODE, SUPPORT_MODE
from rlfleet.sampler import server as srv_mod
from rlfleet.sampler.client import SamplerClient
from rlfleet.sampler.reference_engine import THROTTLE_BURST_S, EngineConfig, ReferenceEngine
from rlfleet.sampler.server import start_reference_server


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """2 shared cores: torch's default 2-thread pool spins against other processes (30x slower here)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


MODEL = TinyGPTConfig(vocab_size=128, n_layer=2, n_head=2, d_model=32, max_seq_len=64, seed=11)
FIXTURES = Path(__file__).parent / "fixtures"
SUPPORT = {"temperature": 0.9, "top_p": 0.8, "top_k": 40, "max_new_tokens": 12}


def engine(**kw) -> ReferenceEngine:
    return ReferenceEngine(EngineConfig(model=MODEL, **kw))


def exact_engine(**kw) -> ReferenceEngine:
    """fp32 weights, fp32 kernel: the sampler computes the trainer's logits (up to fp32 noise)."""
    return engine(weight_format="fp32", kernel=KernelConfig("float32"), **kw)


def kept_set_numpy(logits: np.ndarray, temperature: float, top_k: int, top_p: float):
    """Independent re-statement of SGLang's rule: sorted top-k, then exclusive-cumsum top-p."""
    z = logits.astype(np.float64) / temperature
    lp = z - z.max() - np.log(np.exp(z - z.max()).sum())
    order = np.argsort(-lp, kind="stable")
    p = np.exp(lp[order])
    keep = (np.arange(len(p)) < top_k) & ((np.cumsum(p) - p) <= top_p)
    ids = order[keep]
    ren = lp[ids] - np.log(np.exp(lp[ids]).sum())
    return ids, ren, lp


async def test_responses_have_sglang_shape_and_pass_the_client_contract():
    async with (
        await start_reference_server(exact_engine()) as server,
        SamplerClient(server.url, group="g") as client,
    ):
        raw = (
            await client._http.post(
                server.url + "/generate",
                json={
                    "input_ids": [1, 2, 3],
                    "sampling_params": {**SUPPORT, "stop_token_ids": []},
                    "return_logprob": True,
                    "return_sampling_mask": True,
                    "sampling_logprobs_mode": "support",
                },
            )
        ).json()
        turn = await client.generate([1, 2, 3], SUPPORT, sampling_seed=5)
    fixture = json.loads((FIXTURES / "sglang_support_topp.json").read_text())["response"]
    assert set(fixture) <= set(raw) and raw["text"] == ""
    sglang_keys = set(fixture["meta_info"]) - {"input_token_logprobs"}  # prompt logprobs: not served
    assert sglang_keys <= set(raw["meta_info"])
    for key in sglang_keys:
        assert type(raw["meta_info"][key]) is type(fixture["meta_info"][key]), key
    triple = raw["meta_info"]["output_token_logprobs"][0]
    assert isinstance(triple[0], float) and isinstance(triple[1], int) and triple[2] is None
    assert raw["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert turn.candidate_mode == SUPPORT_MODE and turn.num_tokens == 12 and turn.valid.all()
    assert (turn.weight_versions == 0).all() and turn.group == "g"


async def test_support_and_logprobs_are_exactly_sglangs_rule_on_the_model():
    eng = exact_engine()
    trainer = TinyGPT(MODEL).eval()
    async with await start_reference_server(eng) as server, SamplerClient(server.url) as client:
        prompt = [5, 17, 33, 2]
        turn = await client.generate(prompt, SUPPORT, sampling_seed=123)
    with torch.no_grad():
        logits = trainer(torch.tensor([prompt + turn.output_ids.tolist()]))[0].numpy()  # [S, V]
    for i in range(turn.num_tokens):
        ids, ren, lp = kept_set_numpy(logits[len(prompt) - 1 + i], 0.9, 40, 0.8)
        got_ids, got_lp = turn.support(i)
        assert got_ids.tolist() == ids.tolist()
        assert np.allclose(got_lp, ren, atol=1e-4)
        y = int(turn.output_ids[i])
        assert abs(turn.logprobs[i] - lp[y]) < 1e-4  # full-vocab log q at the temperature
    # head mode: top-K of the full-vocab q, with the full-vocab logprob
    async with await start_reference_server(exact_engine()) as server, SamplerClient(server.url) as client:
        head = await client.generate(
            prompt, {"temperature": 1.0, "max_new_tokens": 3, "head_size": 8}, sampling_seed=1
        )
    assert head.candidate_mode == HEAD_MODE and head.valid.all() and (head.support_sizes == 8).all()
    with torch.no_grad():
        lg = trainer(torch.tensor([prompt + head.output_ids.tolist()]))[0, len(prompt) - 1].double()
    top = torch.log_softmax(lg, -1).sort(descending=True)
    assert head.support(0)[0].tolist() == top.indices[:8].tolist()


async def test_seed_is_deterministic_under_batching_and_greedy_is_top1():
    async with await start_reference_server(engine()) as server, SamplerClient(server.url) as client:
        alone = await client.generate([9, 8, 7], SUPPORT, sampling_seed=42)
        crowd = await asyncio.gather(
            *[client.generate([9, 8, 7], SUPPORT, sampling_seed=42 if i == 3 else i) for i in range(8)]
        )
        greedy = await client.generate([9, 8, 7], {"temperature": 0.0, "max_new_tokens": 5})
    assert crowd[3].output_ids.tolist() == alone.output_ids.tolist()
    assert np.array_equal(crowd[3].support_ids, alone.support_ids)
    assert len({tuple(t.output_ids.tolist()) for t in crowd}) > 1  # different seeds, different samples
    assert (greedy.support_sizes == 1).all() and np.allclose(greedy.sampled_logprobs, 0.0)


async def test_concurrent_requests_are_batched():
    eng = engine(max_running_requests=8)
    steps: list[int] = []
    original = eng._step

    def counting_step(admitted):
        produced, finished = original(admitted)
        steps.append(produced)
        return produced, finished

    eng._step = counting_step
    async with await start_reference_server(eng) as server, SamplerClient(server.url) as client:
        turns = await asyncio.gather(
            *[client.generate([i + 1], {**SUPPORT, "max_new_tokens": 10}) for i in range(8)]
        )
    assert all(t.num_tokens == 10 for t in turns)
    assert sum(steps) == 80 and max(steps) > 1  # several requests advanced in one step
    assert len(steps) < 80


async def test_mask_rule_and_bad_requests_are_400():
    async with await start_reference_server(engine(sampling_mask_max_tokens=64)) as server:
        async with httpx.AsyncClient() as http:
            base = {
                "input_ids": [1, 2],
                "return_logprob": True,
                "return_sampling_mask": True,
                "sampling_logprobs_mode": "support",
            }
            for top_k in (-1, 65):
                r = await http.post(
                    server.url + "/generate", json={**base, "sampling_params": {"top_p": 0.9, "top_k": top_k}}
                )
                assert (
                    r.status_code == 400 and "sampling_mask_max_tokens (64)" in r.json()["error"]["message"]
                )
            r = await http.post(
                server.url + "/generate", json={**base, "sampling_params": {"top_k": 64, "max_new_tokens": 1}}
            )
            assert r.status_code == 200
            for bad in (
                {"input_ids": []},
                {"input_ids": [999]},
                {"input_ids": [1], "sampling_params": {"top_p": 0}},
                [1, 2],
            ):
                r = await http.post(server.url + "/generate", json=bad)
                assert r.status_code == 400 and r.json()["error"]["message"]
            r = await http.post(server.url + "/generate", content=b"{not json")
            assert r.status_code == 400


async def test_client_shrinks_top_k_against_the_server_cap():
    async with await start_reference_server(engine(sampling_mask_max_tokens=64)) as server:
        async with SamplerClient(server.url) as client:
            turn = await client.generate([1, 2], {"top_p": 0.9, "top_k": 256, "max_new_tokens": 2})
            assert turn.valid.all() and client.stats.retries["shrink_top_k"] == 2  # 256 -> 128 -> 64
            assert await client.discover_mask_cap() == 64


async def test_update_weights_from_disk_and_version_conflicts(tmp_path):
    views = pytest.importorskip("rlfleet.numerics.views")
    new_weights = TinyGPT(TinyGPTConfig(**{**MODEL.__dict__, "seed": 99})).state_dict()
    views.save_view(new_weights, "bf16", tmp_path / "v5")
    views.save_view(new_weights, "nvfp4", tmp_path / "v6")
    eng = engine()
    async with await start_reference_server(eng) as server, SamplerClient(server.url) as client:
        http = client._http
        r = await http.post(
            server.url + "/generate", json={"input_ids": [1]}, headers={"X-Min-Weight-Version": "5"}
        )
        assert r.status_code == 409 and r.headers["Retry-After"]
        r = await http.post(
            server.url + "/update_weights_from_disk",
            json={"model_path": str(tmp_path / "nope"), "weight_version": "5"},
        )
        assert r.status_code == 400 and r.json()["success"] is False
        assert (await http.get(server.url + "/get_weight_version")).json() == {"weight_version": "0"}
        r = await http.post(
            server.url + "/update_weights_from_disk",
            json={
                "model_path": str(tmp_path / "v5"),
                "weight_version": "5",
                "flush_cache": True,
                "abort_all_requests": False,
            },
        )
        assert r.status_code == 200 and r.json()["success"] is True
        info = (await http.get(server.url + "/model_info")).json()
        assert info["weight_version"] == "5" and info["weight_format"] == "bf16"
        turn = await client.generate([1, 2], SUPPORT, min_weight_version=5)
        assert (turn.weight_versions == 5).all()
        expected = eng.model.state_dict()["model.layers.0.mlp.up_proj.weight"]
        assert torch.equal(
            expected, new_weights["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16).float()
        )
        r = await http.post(
            server.url + "/update_weights_from_disk",
            json={"model_path": str(tmp_path / "v6"), "weight_version": 6},
        )
        assert r.status_code == 200
        assert (await http.get(server.url + "/model_info")).json()["weight_format"] == "nvfp4"


async def test_update_mid_generation_gives_per_token_versions(tmp_path):
    views = pytest.importorskip("rlfleet.numerics.views")
    views.save_view(
        TinyGPT(TinyGPTConfig(**{**MODEL.__dict__, "seed": 5})).state_dict(), "bf16", tmp_path / "v3"
    )
    eng = engine(max_tokens_per_second=40.0)  # slow: the update lands while the request runs
    async with await start_reference_server(eng) as server, SamplerClient(server.url) as client:
        pending = asyncio.create_task(client.generate([1, 2], {**SUPPORT, "max_new_tokens": 24}))
        while eng.stats.generation_tokens_total < 4:
            await asyncio.sleep(0.01)
        r = await client._http.post(
            server.url + "/update_weights_from_disk",
            json={"model_path": str(tmp_path / "v3"), "weight_version": 3},
        )
        assert r.json()["success"]
        turn = await pending
    versions = turn.weight_versions.tolist()
    assert versions[0] == 0 and versions[-1] == 3 and set(versions) == {0, 3}
    assert versions == sorted(versions)  # monotone: once updated, never back
    assert turn.valid.all()


async def test_abort_all_requests_on_update_and_pause_continue(tmp_path):
    views = pytest.importorskip("rlfleet.numerics.views")
    views.save_view(TinyGPT(MODEL).state_dict(), "bf16", tmp_path / "v1")
    eng = engine(max_tokens_per_second=40.0)
    async with await start_reference_server(eng) as server, SamplerClient(server.url) as client:
        pending = asyncio.create_task(client.generate([1], {**SUPPORT, "max_new_tokens": 40}))
        while eng.stats.generation_tokens_total < 2:
            await asyncio.sleep(0.01)
        r = await client._http.post(
            server.url + "/update_weights_from_disk",
            json={"model_path": str(tmp_path / "v1"), "weight_version": 1, "abort_all_requests": True},
        )
        assert r.json()["num_aborted_requests"] == 1
        aborted = await pending
        assert aborted.finish_reason == "abort" and 0 < aborted.num_tokens < 40 and aborted.valid.all()
        # pause (in place): a request waits; continue: it completes
        assert (
            await client._http.post(server.url + "/pause_generation", json={"mode": "in_place"})
        ).status_code == 200
        waiting = asyncio.create_task(client.generate([1], {**SUPPORT, "max_new_tokens": 2}))
        await asyncio.sleep(0.3)
        assert not waiting.done() and eng.stats.generation_tokens_total == aborted.num_tokens
        assert (await client._http.post(server.url + "/continue_generation", json={})).status_code == 200
        assert (await waiting).num_tokens == 2


async def test_client_disconnect_frees_the_request():
    eng = engine(max_tokens_per_second=40.0)
    async with await start_reference_server(eng) as server:
        async with httpx.AsyncClient(timeout=0.3) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(
                    server.url + "/generate",
                    json={"input_ids": [1], "sampling_params": {"max_new_tokens": 50}},
                )
        for _ in range(200):  # the engine notices at its next step
            if not eng.running and not eng.waiting:
                break
            await asyncio.sleep(0.02)
        assert not eng.running and len(eng.free_slots) == eng.config.max_running_requests
        assert eng.stats.generation_tokens_total < 50


async def test_throttle_bounds_the_token_rate():
    eng = engine(max_tokens_per_second=100.0)
    async with await start_reference_server(eng) as server, SamplerClient(server.url) as client:
        t0 = time.monotonic()
        await asyncio.gather(*[client.generate([i + 1], {**SUPPORT, "max_new_tokens": 10}) for i in range(3)])
        elapsed = time.monotonic() - t0
    # 30 tokens at <= 100 tokens/s (the bucket may bank THROTTLE_BURST_S of budget): the throttle cannot
    # be beaten, only a slow machine adds time
    assert elapsed >= (30 - 3) / 100.0 - THROTTLE_BURST_S


async def test_metrics_health_info_and_api_key():
    async with await start_reference_server(engine(), api_key="s3cret") as server:
        async with httpx.AsyncClient() as http:
            assert (await http.get(server.url + "/health")).status_code == 200
            assert (await http.get(server.url + "/health_generate")).status_code == 200
            assert (await http.post(server.url + "/generate", json={"input_ids": [1]})).status_code == 401
            auth = {"Authorization": "Bearer s3cret"}
            r = await http.post(
                server.url + "/generate",
                json={"input_ids": [1], "sampling_params": {"max_new_tokens": 3}},
                headers=auth,
            )
            assert (
                r.status_code == 200 and "output_token_logprobs" not in r.json()["meta_info"]
            )  # not asked for
            info = (await http.get(server.url + "/server_info", headers=auth)).json()
            assert info["sampling_mask_max_tokens"] == 4096 and info["weight_version"] == "0"
            text = (await http.get(server.url + "/metrics")).text
    lab = '{model_name="tinygpt",tp_rank="0"}'
    for name in (
        "sglang:gen_throughput",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
    ):
        assert f"{name}{lab}" in text
    assert f"sglang:generation_tokens_total{lab} 4.0" in text  # 1 (health_generate) + 3
    assert f"sglang:num_requests_total{lab} 2.0" in text
    assert f"sglang:prompt_tokens_total{lab} 2.0" in text
    assert (
        "sglang:time_to_first_token_seconds_bucket" in text
        and "sglang:e2e_request_latency_seconds_count" in text
    )


def test_sglang_engine_argv_uses_the_catalog(capsys):
    """No SGLang (nor GPU) here: only the command line is checked, never executed."""
    pytest.importorskip("rlfleet.catalog")
    rc = srv_mod.cli(
        [
            "--engine",
            "sglang",
            "--accelerator",
            "h100",
            "--weight-format",
            "fp8",
            "--model-path",
            "/models/m",
            "--port",
            "30001",
            "--weight-version",
            "4",
            "--print-argv",
            "--",
            "--mem-fraction-static",
            "0.8",
        ]
    )
    out = capsys.readouterr().out.split()
    assert rc == 0
    assert out[1:3] == ["-m", "sglang.launch_server"]
    for flag, value in (
        ("--model-path", "/models/m"),
        ("--port", "30001"),
        ("--sampling-mask-max-tokens", "4096"),
        ("--weight-version", "4"),
        ("--host", "0.0.0.0"),
        ("--mem-fraction-static", "0.8"),
    ):
        assert out[out.index(flag) + 1] == value
    assert "--enable-metrics" in out
    assert (
        srv_mod.cli(
            [
                "--engine",
                "sglang",
                "--accelerator",
                "a100",
                "--weight-format",
                "nvfp4",
                "--model-path",
                "/m",
                "--print-argv",
            ]
        )
        == 2
    )
    assert "cannot run" in capsys.readouterr().err
    assert srv_mod.cli(["--engine", "sglang", "--accelerator", "h100", "--print-argv"]) == 2
    assert srv_mod.cli(["--weight-format", "int3"]) == 2


@pytest.mark.slow
def test_cli_serves_reference_over_http(tmp_path):
    port_file = tmp_path / "port"
    env = {**os.environ, "PYTHONPATH": ""}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from rlfleet.cli import main; sys.exit(main())",
            "sampler",
            "serve",
            "--engine",
            "reference",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--vocab-size",
            "64",
            "--d-model",
            "32",
            "--n-head",
            "2",
            "--max-seq-len",
            "32",
            "--weight-format",
            "nvfp4",
            "--kv-cache-dtype",
            "fp8_e4m3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        assert httpx.get(url + "/health").status_code == 200
        info = httpx.get(url + "/model_info").json()
        assert (
            info["weight_format"] == "nvfp4"
            and info["kv_cache_dtype"] == "fp8_e4m3"
            and info["vocab_size"] == 64
        )
        r = httpx.post(
            url + "/generate",
            json={
                "input_ids": [1, 2],
                "sampling_params": {"max_new_tokens": 4, "top_k": 8},
                "return_logprob": True,
                "return_sampling_mask": True,
            },
        )
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


def test_cli_model_path_loads_a_view_and_infers_dims(tmp_path):
    views = pytest.importorskip("rlfleet.numerics.views")
    weights = TinyGPT(MODEL).state_dict()
    views.save_view(weights, "nvfp4", tmp_path / "view")
    args = srv_mod._parser().parse_args(
        [
            "--model-path",
            str(tmp_path / "view"),
            "--n-head",
            "2",
            "--max-seq-len",
            "64",
            "--weight-format",
            "nvfp4",
        ]
    )
    eng, view = srv_mod._reference_engine(args)
    assert view == "nvfp4" and eng.effective_format == "nvfp4"
    c = eng.config.model
    assert (c.vocab_size, c.n_layer, c.d_model, c.ffn_dim) == (
        MODEL.vocab_size,
        MODEL.n_layer,
        MODEL.d_model,
        MODEL.ffn_dim,
    )
    _, dequantized = views.load_view(tmp_path / "view")
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(eng.model.state_dict()[name], dequantized[name])  # served as loaded, not re-quantized
    assert not torch.equal(eng.model.state_dict()[name], weights[name])  # and it is really 4-bit
    bad = srv_mod._parser().parse_args(["--model-path", str(tmp_path / "missing")])
    with pytest.raises(srv_mod.CliError, match="cannot load"):
        srv_mod._reference_engine(bad)
