"""`spec.model.path` -> a checkpoint directory (rlfleet/model_source.py) and the tiny Qwen3 checkpoint.

S3 sources run against the REAL S3-compatible server of the weight tests (moto's standalone server,
started by tests/weights/conftest.py's `start_moto`). The Hugging Face hub cannot be reached here: that
path is tested up to the `snapshot_download` call with `stub_snapshot_download` (named as a stub)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.moto import make_bucket, moto_endpoint

from rlfleet.model_source import CHECKSUMS_FILE, ModelSourceError, is_hf_checkpoint, resolve_model_source
from rlfleet.tiny_qwen3 import build_tiny_qwen3, vocabulary


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "qwen3", seed=0)


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with moto_endpoint() as endpoint:
        yield endpoint


# ------------------------------------------------------------------------------------ tiny Qwen3
def test_tiny_qwen3_is_a_real_qwen3_checkpoint_transformers_loads_and_seeded(
    tiny: Path, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        CHECKSUMS_FILE,
    } <= {p.name for p in tiny.iterdir()}
    config = json.loads((tiny / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.vocab_size == 64
    tok = AutoTokenizer.from_pretrained(tiny)
    # the toy environments' ids (trainer/envs/environments.py ToyVocab): BOS 1, EOS 2, SEP 3, digit d = 10 + d
    assert tok.convert_tokens_to_ids(["<s>", "</s>", "<sep>", "0", "7", "w20"]) == [1, 2, 3, 10, 17, 20]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "3 4"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<s> user 3 4 <sep> <s> assistant "
    with torch.no_grad():
        logits = model(torch.tensor([[1, 13, 14, 3]])).logits
    assert logits.shape == (1, 4, 64)
    again = build_tiny_qwen3(tmp_path / "again", seed=0)
    assert (again / CHECKSUMS_FILE).read_text() == (tiny / CHECKSUMS_FILE).read_text()
    other = build_tiny_qwen3(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()


def test_tiny_qwen3_cli_and_vocab_floor(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    run = subprocess.run(
        [Path(sys.executable).with_name("rlfleet"), "model", "tiny-qwen3", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert is_hf_checkpoint(out)
    with pytest.raises(ValueError, match="vocab_size must be >= 32"):
        vocabulary(16)


# ------------------------------------------------------------------------------------ local directories
def test_local_directory_sources(tiny: Path, tmp_path: Path) -> None:
    assert resolve_model_source(str(tiny)) == tiny
    assert resolve_model_source(f"file://{tiny}") == tiny
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelSourceError, match=r"has no config.json \(not a Hugging Face checkpoint\)"):
        resolve_model_source(str(tmp_path / "empty"))
    with pytest.raises(ModelSourceError, match="no such directory"):
        resolve_model_source(str(tmp_path / "missing"))
    with pytest.raises(ModelSourceError, match="unknown scheme 'gs'"):
        resolve_model_source("gs://bucket/model")


# ------------------------------------------------------------------------------------ Hugging Face ids
def test_hf_id_goes_to_snapshot_download_with_the_revision(tiny: Path, tmp_path: Path) -> None:
    calls: list[dict] = []

    def stub_snapshot_download(**kwargs: object) -> str:  # STUB: the hub is unreachable here
        calls.append(dict(kwargs))
        return str(tiny)

    got = resolve_model_source("Qwen/Qwen3-8B", revision="abc123", snapshot_download=stub_snapshot_download)
    assert got == tiny and calls == [{"repo_id": "Qwen/Qwen3-8B", "revision": "abc123"}]

    def stub_offline(**kwargs: object) -> str:  # STUB: what the hub raises when offline
        raise OSError("offline")

    with pytest.raises(
        ModelSourceError, match="Qwen/Qwen3-8B: Hugging Face download failed: OSError: offline"
    ):
        resolve_model_source("Qwen/Qwen3-8B", snapshot_download=stub_offline)

    def stub_not_a_checkpoint(**kwargs: object) -> str:  # STUB: a repo without config.json
        (tmp_path / "repo").mkdir(exist_ok=True)
        return str(tmp_path / "repo")

    with pytest.raises(ModelSourceError, match="has no config.json"):
        resolve_model_source("org/dataset-not-model", snapshot_download=stub_not_a_checkpoint)


# ------------------------------------------------------------------------------------ s3://
def _upload(endpoint: str, directory: Path, skip: set[str] = frozenset()) -> str:  # type: ignore[assignment]
    import boto3

    bucket = make_bucket(endpoint)
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for p in directory.iterdir():
        if p.name not in skip:
            client.upload_file(str(p), bucket, f"models/tiny/{p.name}")
    return bucket


def test_s3_prefix_is_downloaded_verified_and_cached(s3: str, tiny: Path, tmp_path: Path) -> None:
    import boto3

    bucket = _upload(s3, tiny)
    uri = f"s3://{bucket}/models/tiny?endpoint={s3}"
    got = resolve_model_source(uri, cache_dir=tmp_path / "cache")
    assert got.is_relative_to(tmp_path / "cache") and is_hf_checkpoint(got)
    for p in tiny.iterdir():
        assert (got / p.name).read_bytes() == p.read_bytes()
    assert resolve_model_source(uri, cache_dir=tmp_path / "cache") == got  # cached and intact: reused
    # torchrun's ranks resolve the same source at once: every one gets the one verified copy
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: resolve_model_source(uri, cache_dir=tmp_path / "racing"), range(3)))
    assert len(set(results)) == 1
    assert (results[0] / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()
    assert [p.name for p in results[0].parent.iterdir()] == ["tiny"]  # no staging left behind

    # tampered bytes in the bucket: refused, and the cache is not replaced by them
    client = boto3.client("s3", endpoint_url=s3, region_name="us-east-1")
    client.put_object(Bucket=bucket, Key="models/tiny/model.safetensors", Body=b"not the weights")
    with pytest.raises(ModelSourceError, match=r"model.safetensors has sha256 .* \(corrupted or tampered"):
        resolve_model_source(uri, cache_dir=tmp_path / "fresh")
    assert not (tmp_path / "fresh" / "s3" / bucket / "models/tiny").exists()


def test_s3_prefix_without_checksums_is_refused(s3: str, tiny: Path, tmp_path: Path) -> None:
    bucket = _upload(s3, tiny, skip={CHECKSUMS_FILE})
    with pytest.raises(ModelSourceError, match=f"no {CHECKSUMS_FILE} under the prefix"):
        resolve_model_source(f"s3://{bucket}/models/tiny?endpoint={s3}", cache_dir=tmp_path / "cache")


def test_builtin_tiny_qwen3_is_built_once_in_the_cache_and_equals_the_cli_checkpoint(tmp_path: Path) -> None:
    """`builtin:tiny-qwen3[?seed=N]` (examples/rljob-cpu.yaml): the same checkpoint `rlfleet model tiny-qwen3`
    writes, built once under the cache; anything else under builtin: is one clear line."""
    from rlfleet.model_source import parse_checksums

    cache = tmp_path / "cache"
    first = resolve_model_source("builtin:tiny-qwen3", cache_dir=cache)
    assert first.parent == cache and is_hf_checkpoint(first)
    assert (
        resolve_model_source("builtin:tiny-qwen3?seed=0", cache_dir=cache) == first
    )  # seed 0 is the default
    other = resolve_model_source("builtin:tiny-qwen3?seed=3", cache_dir=cache)
    assert other != first
    cli = build_tiny_qwen3(tmp_path / "cli")
    sums = parse_checksums((first / CHECKSUMS_FILE).read_text(), "builtin")
    assert sums == parse_checksums(
        (cli / CHECKSUMS_FILE).read_text(), "cli"
    )  # byte for byte, weights included
    for source, message in (
        ("builtin:llama", "unknown built-in model 'llama' (built in: tiny-qwen3)"),
        ("builtin:tiny-qwen3?size=big", "unknown parameter size (only seed)"),
        ("builtin:tiny-qwen3?seed=x", "seed must be an integer"),
    ):
        with pytest.raises(ModelSourceError) as info:
            resolve_model_source(source, cache_dir=cache)
        assert str(info.value) == f"model source {source}: {message}"
