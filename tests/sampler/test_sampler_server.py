"""The reference sampler server over real HTTP (aiohttp on 127.0.0.1, free port): kept sets equal to
SGLang's torch sampler on the model's logits, batching and per-request seeds, weight updates (also
mid-generation: weight-version spans), pause/continue, version conflicts, auth, metrics, the CLI, and
the cross test with sampler/client.py. SGLang's own code checks the response shapes, validation and
metrics in tests/sglang_contract/test_sglang_reference_sampler.py; no hand-written fixture is used."""

from __future__ import annotations

import asyncio
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
from support.reference_serve import serve_reference_argv

from rlfleet.numerics.engine_model import KernelConfig
from rlfleet.records import HEAD_MODE, SUPPORT_MODE
from rlfleet.sampler import server as srv_mod
from rlfleet.sampler.client import SamplerClient
from rlfleet.sampler.http_app import start_reference_server
from rlfleet.sampler.reference_engine import THROTTLE_BURST_S, EngineConfig, ReferenceEngine, tiny_shape
from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


SIZES = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64}  # fmt: skip
SEED = 11
MODEL = tiny_shape(**SIZES)  # the tiny Qwen3 at test sizes; the engine serves its init from SEED
SUPPORT = {"temperature": 0.9, "top_p": 0.8, "top_k": 40, "max_new_tokens": 12}


def engine(**kw) -> ReferenceEngine:
    return ReferenceEngine(EngineConfig(model=MODEL, seed=SEED, **kw))


def trainer(seed: int = SEED) -> torch.nn.Module:
    """transformers' Qwen3ForCausalLM of the served model (seed SEED: the weights the engine starts with)."""
    return tiny_model(TinyQwen3(**SIZES, seed=seed))


def publish(model: torch.nn.Module, view: str, directory: Path, base: Path) -> None:
    """A published view of `model` (an HF checkpoint, completed from the save_pretrained checkpoint
    `base`, written first if absent), as the trainer's publisher writes it; nvfp4 with the activation
    amax calibrated on a few prompts."""
    from rlfleet.numerics import views

    if not (base / "config.json").is_file():
        model.save_pretrained(base)
    amax = None
    if view == "nvfp4":
        amax = views.calibrate_activation_amax(model, [torch.arange(1, 17)[None]])
    views.save_view(model.state_dict(), view, directory, base_checkpoint=base, activation_amax=amax)


def exact_engine(**kw) -> ReferenceEngine:
    """fp32 weights, fp32 kernel: the sampler computes the trainer's logits (up to fp32 noise)."""
    return engine(weight_format="fp32", kernel=KernelConfig("float32"), **kw)


def mask_body(input_ids: list[int], sampling: dict, **extra) -> dict:
    return {
        "input_ids": input_ids,
        "sampling_params": sampling,
        "return_logprob": True,
        "return_sampling_mask": True,
        "sampling_logprobs_mode": "support",
        **extra,
    }


async def generate(http: httpx.AsyncClient, url: str, body: dict) -> dict:
    r = await http.post(url + "/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def test_the_client_reads_the_server():
    """The cross test with sampler/client.py: a support-mode and a head-mode turn parse and validate
    (the response shapes themselves are held against SGLang's code in tests/sglang_contract)."""
    async with (
        await start_reference_server(exact_engine()) as server,
        SamplerClient(server.url, group="g") as client,
    ):
        turn = await client.generate([1, 2, 3], SUPPORT, sampling_seed=5)
        head = await client.generate([1, 2, 3], {"temperature": 1.0, "max_new_tokens": 3, "head_size": 8})
    assert turn.candidate_mode == SUPPORT_MODE and turn.num_tokens == 12 and turn.valid.all()
    assert (turn.weight_versions == 0).all() and turn.group == "g"
    assert head.candidate_mode == HEAD_MODE and head.valid.all() and (head.support_sizes == 8).all()


async def test_support_and_logprobs_are_sglangs_sampler_on_the_model():
    """The served kept sets are what SGLang's torch sampler keeps on the trainer's logits."""
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch

    hf = trainer()
    prompt = [5, 17, 33, 2]
    async with await start_reference_server(exact_engine()) as server, httpx.AsyncClient() as http:
        out = await generate(http, server.url, mask_body(prompt, {**SUPPORT, "sampling_seed": 123}))
    meta = out["meta_info"]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out["output_ids"]])).logits[0]  # [S, V]
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(out["output_ids"])] / 0.9
    probs = torch.softmax(rows, -1)
    n = probs.shape[0]
    _, weights, ids, _ = top_k_top_p_min_p_sampling_from_probs_torch(
        probs.clone(),
        torch.full((n,), 40),
        torch.full((n,), 0.8),
        torch.zeros(n),
        False,
        None,
        torch.zeros(n),
        return_filtered_probs=True,
    )
    for i in range(n):
        kept = int((weights[i] > 0).sum())
        assert meta["output_token_sampling_mask"][i] == ids[i, :kept].tolist()
        expected = torch.log(weights[i, :kept] / weights[i, :kept].sum())
        assert np.allclose(meta["output_token_sampling_logprobs"][i], expected.numpy(), atol=1e-4)
        lp, y, _ = meta["output_token_logprobs"][i]
        assert y == out["output_ids"][i] and abs(lp - float(torch.log(probs[i, y]))) < 1e-4


async def test_seed_is_deterministic_under_batching_and_greedy_is_top1():
    async with await start_reference_server(engine()) as server, httpx.AsyncClient() as http:

        def body(seed: int | None) -> dict:
            return mask_body([9, 8, 7], {**SUPPORT, **({} if seed is None else {"sampling_seed": seed})})

        alone = await generate(http, server.url, body(42))
        crowd = await asyncio.gather(
            *[generate(http, server.url, body(42 if i == 3 else i)) for i in range(8)]
        )
        greedy = await generate(
            http, server.url, mask_body([9, 8, 7], {"temperature": 0.0, "max_new_tokens": 5})
        )
    assert crowd[3]["output_ids"] == alone["output_ids"]
    assert (
        crowd[3]["meta_info"]["output_token_sampling_mask"]
        == alone["meta_info"]["output_token_sampling_mask"]
    )
    assert len({tuple(c["output_ids"]) for c in crowd}) > 1  # different seeds, different samples
    gm = greedy["meta_info"]
    assert gm["output_token_sampling_mask"] == [[t] for t in greedy["output_ids"]]
    assert gm["output_token_sampling_logprobs"] == [[0.0]] * 5


async def test_concurrent_requests_are_batched():
    eng = engine(max_running_requests=8)
    steps: list[int] = []
    original = eng._step

    def counting_step(admitted):
        produced, finished = original(admitted)
        steps.append(produced)
        return produced, finished

    eng._step = counting_step
    async with await start_reference_server(eng) as server, httpx.AsyncClient() as http:
        outs = await asyncio.gather(
            *[
                generate(http, server.url, mask_body([i + 1], {**SUPPORT, "max_new_tokens": 10}))
                for i in range(8)
            ]
        )
    assert all(o["meta_info"]["completion_tokens"] == 10 for o in outs)
    assert sum(steps) == 80 and max(steps) > 1  # several requests advanced in one step
    assert len(steps) < 80


async def test_mask_rule_and_bad_requests_are_sglangs_400s():
    """Status and body shape per SGLang stage (the full grid against SGLang's gate is in
    tests/sglang_contract/test_sglang_reference_sampler.py); here the server's own extra checks."""
    async with await start_reference_server(engine(sampling_mask_max_tokens=64)) as server:
        async with httpx.AsyncClient() as http:
            for top_k in (-1, 65):
                r = await http.post(
                    server.url + "/generate", json=mask_body([1, 2], {"top_p": 0.9, "top_k": top_k})
                )
                assert r.status_code == 400 and "1 < top_k <= 64; got top_k=" in r.json()["error"]["message"]
            r = await http.post(
                server.url + "/generate", json=mask_body([1, 2], {"top_k": 64, "max_new_tokens": 1})
            )
            assert r.status_code == 200
            for bad in (
                {"input_ids": [999]},
                {"input_ids": [1], "stream": True},
                {"text": "hi"},
                {"input_ids": [1], "return_logprob": True, "logprob_start_len": 0},  # no prompt logprobs here
                {"input_ids": [1], "token_ids_logprob": [[3]]},
            ):
                r = await http.post(server.url + "/generate", json=bad)
                assert r.status_code == 400 and r.json()["error"]["message"]
            r = await http.post(
                server.url + "/generate",
                json={"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}},
            )
            assert r.status_code == 400 and "not supported" in r.json()["error"]["message"]
            r = await http.post(server.url + "/generate", json=[1, 2])
            assert r.status_code == 400 and r.json()["object"] == "error"
            r = await http.post(server.url + "/generate", content=b"{not json")
            assert (
                r.status_code == 400 and r.json()["object"] == "error" and r.json()["type"] == "Bad Request"
            )


async def test_flashinfer_ties_overflow_the_cap_mid_request():
    """All logits equal (a zero lm_head): with `--sampling-backend flashinfer` the ties at the top-k
    cutoff keep the whole vocabulary, more than the cap, and the request aborts with SGLang's 400; the
    pytorch path keeps exactly top_k (the message is held against SGLang's in tests/sglang_contract)."""
    from rlfleet.sampler.reference_engine import mask_abort_reason

    weights = trainer().state_dict()
    weights["lm_head.weight"] = torch.zeros_like(weights["lm_head.weight"])
    body = mask_body([1, 2], {"top_k": 8, "max_new_tokens": 2})
    for backend, status in (("flashinfer", 400), ("pytorch", 200)):
        eng = ReferenceEngine(
            EngineConfig(model=MODEL, sampling_mask_max_tokens=64, sampling_backend=backend), weights, "fp32"
        )
        async with await start_reference_server(eng) as server, httpx.AsyncClient() as http:
            r = await http.post(server.url + "/generate", json=body)
        assert r.status_code == status, r.text
        if status == 400:
            assert r.json() == {"error": {"message": mask_abort_reason(1, 64)["message"]}}
            assert eng.stats.generation_tokens_total == 0  # the overflowing token was not committed
        else:
            assert [len(m) for m in r.json()["meta_info"]["output_token_sampling_mask"]] == [8, 8]


async def test_client_shrinks_top_k_against_the_server_cap():
    async with await start_reference_server(engine(sampling_mask_max_tokens=64)) as server:
        async with SamplerClient(server.url) as client:
            turn = await client.generate([1, 2], {"top_p": 0.9, "top_k": 256, "max_new_tokens": 2})
            assert turn.valid.all() and client.stats.retries["shrink_top_k"] >= 1
            assert await client.discover_mask_cap() == 64


async def test_update_weights_from_disk_and_version_conflicts(tmp_path):
    new_model = trainer(seed=99)
    new_weights = new_model.state_dict()
    publish(new_model, "bf16", tmp_path / "v5", tmp_path / "base")
    publish(new_model, "nvfp4", tmp_path / "v6", tmp_path / "base")
    eng = engine()
    async with await start_reference_server(eng) as server, httpx.AsyncClient() as http:
        r = await http.post(
            server.url + "/generate", json={"input_ids": [1]}, headers={"X-Min-Weight-Version": "5"}
        )
        assert r.status_code == 409 and r.headers["Retry-After"]
        r = await http.post(
            server.url + "/update_weights_from_disk",
            json={"model_path": str(tmp_path / "nope"), "weight_version": "5"},
        )
        assert r.status_code == 400 and r.json()["success"] is False
        other = tiny_model(TinyQwen3(**{**SIZES, "num_hidden_layers": 1}))
        publish(other, "bf16", tmp_path / "other", tmp_path / "other-base")
        r = await http.post(
            server.url + "/update_weights_from_disk",
            json={"model_path": str(tmp_path / "other"), "weight_version": "5"},
        )  # another architecture: refused before the engine is touched
        assert r.status_code == 400 and "differs from the served model" in r.json()["message"]
        assert (await http.get(server.url + "/model_info")).json()["weight_version"] == "0"
        assert (await http.get(server.url + "/get_weight_version")).status_code == 404  # not in SGLang
        r = await http.post(
            server.url + "/update_weights_from_disk",
            json={"model_path": str(tmp_path / "v5"), "weight_version": "5", "flush_cache": True},
        )
        assert r.status_code == 200 and r.json()["success"] is True
        info = (await http.get(server.url + "/model_info")).json()
        assert info["weight_version"] == "5" and info["weight_format"] == "bf16"
        out = await generate(http, server.url, mask_body([1, 2], SUPPORT))
        assert out["meta_info"]["weight_versions"] == [{"version": "5", "start": 0, "end": 12}]
        expected = eng.model.state_dict()["model.layers.0.mlp.up_proj.weight"]
        assert torch.equal(
            expected, new_weights["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16).float()
        )
        r = await http.post(
            server.url + "/update_weights_from_disk", json={"model_path": str(tmp_path / "v6")}
        )
        assert r.status_code == 200  # no weight_version: SGLang keeps the version
        info = (await http.get(server.url + "/model_info")).json()
        assert info["weight_format"] == "nvfp4" and info["weight_version"] == "5"


async def test_update_mid_generation_gives_weight_version_spans(tmp_path):
    publish(trainer(seed=5), "bf16", tmp_path / "v3", tmp_path / "base")
    eng = engine(max_tokens_per_second=40.0)  # slow: the update lands while the request runs
    async with await start_reference_server(eng) as server, httpx.AsyncClient(timeout=30) as http:
        pending = asyncio.create_task(
            generate(http, server.url, mask_body([1, 2], {**SUPPORT, "max_new_tokens": 24}))
        )
        while eng.stats.realtime_decode_tokens < 4:
            await asyncio.sleep(0.01)
        r = await http.post(
            server.url + "/update_weights_from_disk",
            json={"model_path": str(tmp_path / "v3"), "weight_version": 3},
        )
        assert r.json()["success"]
        meta = (await pending)["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "3"] and meta["weight_version"] == "3"
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] >= 4 and spans[1]["end"] == 24


async def test_abort_all_requests_on_update_and_pause_continue(tmp_path):
    publish(trainer(), "bf16", tmp_path / "v1", tmp_path / "base")
    eng = engine(max_tokens_per_second=40.0)
    async with await start_reference_server(eng) as server, httpx.AsyncClient(timeout=30) as http:
        pending = asyncio.create_task(
            generate(http, server.url, mask_body([1], {**SUPPORT, "max_new_tokens": 40}))
        )
        while eng.stats.realtime_decode_tokens < 2:
            await asyncio.sleep(0.01)
        r = await http.post(
            server.url + "/update_weights_from_disk",
            json={"model_path": str(tmp_path / "v1"), "weight_version": 1, "abort_all_requests": True},
        )
        assert r.json()["success"] and set(r.json()) == {"success", "message", "num_paused_requests"}
        aborted = (await pending)["meta_info"]  # an abort without a status is a 200 with partial output
        assert aborted["finish_reason"]["type"] == "abort" and aborted["finish_reason"]["status_code"] is None
        assert 0 < aborted["completion_tokens"] < 40
        assert len(aborted["output_token_sampling_mask"]) == aborted["completion_tokens"]
        # pause (in place): a request waits; continue: it completes
        assert (
            await http.post(server.url + "/pause_generation", json={"mode": "in_place"})
        ).status_code == 200
        produced = eng.stats.realtime_decode_tokens
        waiting = asyncio.create_task(
            generate(http, server.url, mask_body([1], {**SUPPORT, "max_new_tokens": 2}))
        )
        await asyncio.sleep(0.3)
        assert not waiting.done() and eng.stats.realtime_decode_tokens == produced
        assert (await http.post(server.url + "/continue_generation", json={})).status_code == 200
        assert (await waiting)["meta_info"]["completion_tokens"] == 2


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
        assert eng.stats.realtime_decode_tokens < 50


async def test_throttle_bounds_the_token_rate():
    eng = engine(max_tokens_per_second=100.0)
    async with await start_reference_server(eng) as server, httpx.AsyncClient() as http:
        t0 = time.monotonic()
        await asyncio.gather(
            *[
                generate(http, server.url, mask_body([i + 1], {**SUPPORT, "max_new_tokens": 10}))
                for i in range(3)
            ]
        )
        elapsed = time.monotonic() - t0
    # 30 tokens at <= 100 tokens/s (the bucket may bank THROTTLE_BURST_S of budget): the throttle cannot
    # be beaten, only a slow machine adds time
    assert elapsed >= (30 - 3) / 100.0 - THROTTLE_BURST_S


async def test_metrics_health_info_and_api_key():
    async with await start_reference_server(engine(), api_key="s3cret") as server:
        async with httpx.AsyncClient() as http:
            assert (await http.get(server.url + "/health")).status_code == 200
            assert (await http.get(server.url + "/health_generate")).status_code == 200
            r = await http.post(server.url + "/generate", json={"input_ids": [1]})
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
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
    sched = 'engine_type="unified",model_name="tiny-qwen3",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    for name in (
        "sglang:gen_throughput",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
    ):
        assert f"{name}{{{sched}}}" in text
    tok = '{engine_type="unified",is_streaming="false",model_name="tiny-qwen3"}'
    assert f"sglang:generation_tokens_total{tok} 3.0" in text  # health_generate is not counted (log_metrics)
    assert f"sglang:num_requests_total{tok} 1.0" in text
    assert f"sglang:prompt_tokens_total{tok} 1.0" in text
    decode = (
        'engine_type="unified",mode="decode",model_name="tiny-qwen3",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    )
    assert f"sglang:realtime_tokens_total{{{decode}}} 4.0" in text  # the scheduler sees both requests
    assert (
        "sglang:time_to_first_token_seconds_bucket" in text
        and "sglang:e2e_request_latency_seconds_count" in text
    )


def test_sglang_engine_argv_uses_the_catalog(capsys):
    """No SGLang (nor GPU) here: only the command line is checked, never executed."""
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


def test_sglang_engine_argv_adds_the_flags_a_local_checkpoint_calls_for(capsys, tiny_qwen3_factory, tmp_path):
    """`--engine sglang --model-path DIR` reads DIR's config.json as the weight sync does for a cluster
    group's launch file: a Qwen3-MoE gets `--enable-return-routed-experts` (once, also when passed after
    --), a dense Qwen3 and a hub id (no local directory) do not; a config.json that is no JSON is one line."""

    def argv(model_path: str, *extra: str) -> list[str]:
        rc = srv_mod.cli(
            [
                "--engine",
                "sglang",
                "--accelerator",
                "h100",
                "--model-path",
                model_path,
                "--print-argv",
                *extra,
            ]
        )
        assert rc == 0
        return capsys.readouterr().out.split()

    moe = str(tiny_qwen3_factory(architecture="qwen3_moe"))
    assert argv(moe).count("--enable-return-routed-experts") == 1
    assert argv(moe, "--", "--enable-return-routed-experts").count("--enable-return-routed-experts") == 1
    assert "--enable-return-routed-experts" not in argv(str(tiny_qwen3_factory()))
    assert "--enable-return-routed-experts" not in argv("Qwen/Qwen3-30B-A3B")
    (tmp_path / "config.json").write_text("{not json")
    assert (
        srv_mod.cli(
            ["--engine", "sglang", "--accelerator", "h100", "--model-path", str(tmp_path), "--print-argv"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        err.startswith(f"rlfleet sampler serve: {tmp_path / 'config.json'}: not JSON")
        and err.count("\n") == 1
    )


def test_cli_refuses_bad_tiny_qwen3_sizes(capsys):
    """transformers' own config validation (an odd head_dim has no rotary pairs) is a CLI error, not a
    stack trace; so is an engine shape check."""
    assert srv_mod.cli(["--engine", "reference", "--head-dim", "15", "--port", "0"]) == 2
    assert "even rotary dimension" in capsys.readouterr().err
    assert srv_mod.cli(["--engine", "reference", "--hidden-size", "0", "--port", "0"]) == 2
    assert "hidden_size must be positive" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_serves_reference_over_http(tmp_path):
    port_file = tmp_path / "port"
    env = {**os.environ, "PYTHONPATH": ""}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from rlfleet.cli import main; sys.exit(main())",
            *serve_reference_argv(
                port_file,
                "--vocab-size",
                "64",
                "--hidden-size",
                "32",
                "--num-attention-heads",
                "2",
                "--head-dim",
                "16",
                "--context-length",
                "32",
                "--weight-format",
                "nvfp4",
                "--kv-cache-dtype",
                "fp8_e4m3",
                "--weight-version",
                "4",
            ),
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
            and info["weight_version"] == "4"  # --weight-version: what it serves before any update
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
        meta = r.json()["meta_info"]
        assert r.status_code == 200 and meta["completion_tokens"] == 4
        assert meta["weight_versions"] == [{"version": "4", "start": 0, "end": 4}]
        assert meta["output_token_sampling_mask_length"] == 4  # selected mode by default
        assert all(isinstance(x, float) for x in meta["output_token_sampling_logprobs"])
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


def test_cli_model_path_loads_a_view_or_a_checkpoint_and_reads_its_config(tmp_path):
    """`--model-path`: a published nvfp4 view is served as loaded (not re-quantized), a plain
    save_pretrained checkpoint is quantized online to --weight-format; the architecture comes from
    config.json; a directory without one is a CLI error."""
    from rlfleet.numerics import views

    model = trainer()
    weights = model.state_dict()
    publish(model, "nvfp4", tmp_path / "view", tmp_path / "base")
    args = srv_mod._parser().parse_args(["--model-path", str(tmp_path / "view"), "--weight-format", "nvfp4"])
    eng, view = srv_mod._reference_engine(args)
    assert view == "nvfp4" and eng.effective_format == "nvfp4"
    assert eng.config.model == MODEL  # every dimension read from the view's config.json
    _, dequantized = views.load_view(tmp_path / "view")
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(eng.model.state_dict()[name], dequantized[name])  # served as loaded, not re-quantized
    assert not torch.equal(eng.model.state_dict()[name], weights[name])  # and it is really 4-bit
    base = srv_mod._parser().parse_args(["--model-path", str(tmp_path / "base"), "--weight-format", "bf16"])
    eng, view = srv_mod._reference_engine(base)
    assert view == "fp32" and eng.effective_format == "bf16" and eng.config.model == MODEL
    assert torch.equal(eng.model.state_dict()[name], weights[name].to(torch.bfloat16).float())
    # a tensor-only view has no config.json: the engine cannot know the architecture
    views.save_view(weights, "bf16", tmp_path / "tensor-only")
    for missing in ("missing", "tensor-only"):
        bad = srv_mod._parser().parse_args(["--model-path", str(tmp_path / missing)])
        with pytest.raises(srv_mod.CliError, match="cannot load .*no config.json"):
            srv_mod._reference_engine(bad)
