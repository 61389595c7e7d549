"""The engine API closed by its key, and a foreign weight load undone (issue 32, the engine API).

Every part a real process on localhost: the reference sampler server with `--api-key` (as SGLang's), its
weight-sync sidecar with the key in RLFLEET_API_KEY (as the operator passes it), a filesystem channel
the trainer's WeightPublisher writes. Without the key the engine refuses `/update_weights_from_disk`
(401); an insider with the key loads other weights as version 1,000,000; the sidecar sees a version it
did not apply, applies the channel's version again (the served tokens are the channel's again), counts
it (`/status`, `rlfleet_weight_sync_foreign_versions_total`) and says so in its subscriber report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.reference_serve import serve_reference_argv
from test_weights_e2e import stop_processes, trained, wait_port

from rlfleet.channel import WeightChannel
from rlfleet.store import FilesystemStore
from rlfleet.trainer.publish.publisher import WeightPublisher

KEY = "test-engine-key-0123456789"
GROUP = "cpu-bf16"
PROMPT = {"input_ids": [1, 2, 3, 4], "sampling_params": {"temperature": 0.0, "max_new_tokens": 6}}


def rlfleet(*args: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "rlfleet.cli", *args],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def keyed_sampler(tmp_path: Path, tiny_qwen3_dir: Path) -> Iterator[tuple[Path, str, str]]:
    """(channel dir, engine url, sidecar url): the reference engine with --api-key, its sidecar."""
    store_dir = tmp_path / "channel"
    store_dir.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        log, port_file = tmp_path / "server.log", tmp_path / "server.port"
        procs.append(
            rlfleet(
                *serve_reference_argv(
                    port_file,
                    "--weight-format",
                    "bf16",
                    "--weight-version",
                    "0",
                    "--model-path",
                    str(tiny_qwen3_dir),
                    "--api-key",
                    KEY,
                ),
                log=log,
            )
        )
        engine = f"http://127.0.0.1:{wait_port(port_file, procs[-1], log)}"
        log, port_file = tmp_path / "sync.log", tmp_path / "sync.port"
        procs.append(
            rlfleet(
                "sampler",
                "sync",
                "--store",
                str(store_dir),
                "--view",
                "bf16",
                "--engine-url",
                engine,
                "--group",
                GROUP,
                "--replica",
                f"{GROUP}-0",
                "--cache-dir",
                str(tmp_path / "cache"),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--port-file",
                str(port_file),
                "--poll-interval",
                "0.2",
                "--initial-version",
                "0",
                log=log,
                env={"RLFLEET_API_KEY": KEY},
            )
        )
        sidecar = f"http://127.0.0.1:{wait_port(port_file, procs[-1], log)}"
        yield store_dir, engine, sidecar
    finally:
        stop_processes(procs)


def wait_until(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_foreign_weight_load_needs_the_key_and_is_undone_and_counted(
    keyed_sampler: tuple[Path, str, str], tiny_qwen3_dir: Path
) -> None:
    store_dir, engine, sidecar = keyed_sampler
    auth = {"Authorization": f"Bearer {KEY}"}
    store = FilesystemStore(store_dir)
    WeightPublisher(store, views=["bf16"], base_checkpoint=tiny_qwen3_dir).publish(trained(1), version=1)
    with httpx.Client(timeout=30) as client:
        wait_until(lambda: client.get(f"{sidecar}/status").json()["applied_version"] == 1, "v1 applied")
        channel_tokens = client.post(f"{engine}/generate", json=PROMPT, headers=auth).json()
        assert channel_tokens["meta_info"]["weight_version"] == "1"

        # The API is closed: no key, a wrong key -> 401 and nothing loaded; health and metrics stay open.
        foreign = {"model_path": str(tiny_qwen3_dir), "weight_version": "1000000"}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = client.post(f"{engine}/update_weights_from_disk", json=foreign, headers=headers)
            assert refused.status_code == 401, refused.text
            assert client.post(f"{engine}/generate", json=PROMPT, headers=headers).status_code == 401
        assert client.get(f"{engine}/health").status_code == 200
        assert client.get(f"{engine}/metrics").status_code == 200
        assert client.get(f"{engine}/model_info", headers=auth).json()["weight_version"] == "1"

        # An insider (the key) loads the base checkpoint as v1,000,000: served at once ...
        loaded = client.post(f"{engine}/update_weights_from_disk", json=foreign, headers=auth)
        assert loaded.status_code == 200 and loaded.json().get("success") is not False, loaded.text
        foreign_tokens = client.post(f"{engine}/generate", json=PROMPT, headers=auth).json()
        assert foreign_tokens["meta_info"]["weight_version"] == "1000000"
        assert foreign_tokens["output_ids"] != channel_tokens["output_ids"]  # other weights, other tokens

        # ... until the sidecar sees a version it did not apply and applies the channel's v1 again.
        status = wait_until(
            lambda: (s := client.get(f"{sidecar}/status").json())["foreign_versions"] and s,
            "the sidecar to count the foreign version",
        )
        assert status["applied_version"] == 1 and status["lag"] == 0
        assert status["foreign"].startswith("foreign weight version: the engine served v1000000, not v1")
        # a generation in flight while the weights are swapped is made of both (its `weight_versions` spans
        # say so): wait for one made of v1 alone (the sidecar re-applies v1 from its local copy at once)
        restored = wait_until(
            lambda: (
                (b := client.post(f"{engine}/generate", json=PROMPT, headers=auth).json())["meta_info"][
                    "weight_versions"
                ]
                == [{"version": "1", "start": 0, "end": 6}]
                and b
            ),
            "the engine to serve v1 again",
        )
        assert restored["output_ids"] == channel_tokens["output_ids"]  # the channel's weights, not a label
        metrics = client.get(f"{sidecar}/metrics").text
        assert f'rlfleet_weight_sync_foreign_versions_total{{group="{GROUP}",view="bf16"}} 1.0' in metrics
        assert f'rlfleet_weight_sync_applied_version{{group="{GROUP}",view="bf16"}} 1.0' in metrics

        # The subscriber report (hence the WeightChannel's and SamplerGroup's status) says it.
        reports = wait_until(
            lambda: [r for r in WeightChannel(store).subscribers() if r.last_error], "the report"
        )
        assert [(r.applied_version, r.last_error.split(";")[0]) for r in reports] == [
            (
                1,
                "foreign weight version: the engine served v1000000, not v1 that this sidecar applied (another "
                "client called its weight-update API, or it restarted from other weights)",
            )
        ]

        # A newer publish is applied as usual and the foreign note is history.
        WeightPublisher(store, views=["bf16"], base_checkpoint=tiny_qwen3_dir).publish(trained(2), version=2)
        wait_until(lambda: client.get(f"{sidecar}/status").json()["applied_version"] == 2, "v2 applied")
        assert client.get(f"{sidecar}/status").json()["foreign"] is None
        assert json.loads(client.get(f"{sidecar}/status").text)["foreign_versions"] == 1
