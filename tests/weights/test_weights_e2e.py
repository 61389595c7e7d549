"""End to end on localhost, every part a real process: three reference sampler servers
(`rlfleet sampler serve --engine reference`, views bf16 / fp8 / nvfp4) each with its weight-sync
sidecar (`rlfleet sampler sync`), a trainer-side WeightPublisher publishing three versions into a
filesystem channel. Every sampler converges to every version, its /generate responses carry the
serving version, and the channel status shows every group at the latest version."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from rlfleet.channel import read_channel_status
from rlfleet.store import FilesystemStore
from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model
from rlfleet.trainer.publish.publisher import WeightPublisher

GROUPS = {"a100-bf16": "bf16", "h100-fp8": "fp8", "b200-nvfp4": "nvfp4"}


def rlfleet(*args: str, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "rlfleet.cli", *args], stdout=open(log, "wb"), stderr=subprocess.STDOUT
    )


def stop_processes(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process, then wait for each (SIGKILL after 15 s): the fixtures' one teardown."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_port(port_file: Path, proc: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited {proc.returncode}: {log.read_text()[-2000:]}")
        if port_file.exists() and port_file.read_text().strip():
            return int(port_file.read_text())
        time.sleep(0.1)
    raise AssertionError(f"{proc.args} did not start: {log.read_text()[-2000:]}")


def trained(step: int) -> dict[str, torch.Tensor]:
    """Weights of 'training step' `step`: the tiny Qwen3's init (the base checkpoint's model) plus a
    deterministic step-dependent perturbation (the publisher calibrates the nvfp4 view's amax on them)."""
    model = tiny_model(TinyQwen3())
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def start_each(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], role: str, argv: Callable[[str, str], list[str]]
) -> dict[str, str]:
    """`rlfleet <argv(group, view)> --port 0 --port-file FILE` for every group at once (each appended to
    `procs`, its output in tmp_path/<group>-<role>.log), then each one's URL once it listens."""
    started = []
    for group, view in GROUPS.items():
        log, port_file = tmp_path / f"{group}-{role}.log", tmp_path / f"{group}-{role}.port"
        procs.append(rlfleet(*argv(group, view), "--port", "0", "--port-file", str(port_file), log=log))
        started.append((group, procs[-1], port_file, log))
    return {
        group: f"http://127.0.0.1:{wait_port(port_file, proc, log)}"
        for group, proc, port_file, log in started
    }


@pytest.fixture
def fleet(tmp_path: Path, tiny_qwen3_dir: Path) -> Iterator[tuple[Path, dict[str, str], dict[str, str]]]:
    """Servers (serving the tiny Qwen3 checkpoint until the first update) + sidecars; yields
    (store dir, group -> server url, group -> sidecar url)."""
    store_dir = tmp_path / "channel"
    store_dir.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        servers = start_each(
            tmp_path,
            procs,
            "server",
            lambda group, view: [
                "sampler",
                "serve",
                "--engine",
                "reference",
                "--weight-format",
                view,
                "--weight-version",
                "0",
                "--model-path",
                str(tiny_qwen3_dir),
            ],
        )
        sidecars = start_each(
            tmp_path,
            procs,
            "sync",
            lambda group, view: [
                "sampler",
                "sync",
                "--store",
                str(store_dir),
                "--view",
                view,
                "--engine-url",
                servers[group],
                "--group",
                group,
                "--replica",
                f"{group}-0",
                "--cache-dir",
                str(tmp_path / f"{group}-cache"),
                "--host",
                "127.0.0.1",
                "--poll-interval",
                "0.2",
            ],
        )
        yield store_dir, servers, sidecars
    finally:
        stop_processes(procs)


@pytest.mark.slow
def test_three_views_converge_to_three_versions(
    fleet: tuple[Path, dict[str, str], dict[str, str]], tiny_qwen3_dir: Path
) -> None:
    store_dir, servers, sidecars = fleet
    store = FilesystemStore(store_dir)
    publisher = WeightPublisher(
        store, views=["bf16", "fp8", "nvfp4"], keep_versions=2, base_checkpoint=tiny_qwen3_dir
    )
    prompt = {
        "input_ids": [1, 2, 3, 4],
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 4, "sampling_seed": 7},
        "return_logprob": True,
    }
    with httpx.Client(timeout=30) as client:
        before = {g: client.post(f"{u}/generate", json=prompt).json() for g, u in servers.items()}
        assert {b["meta_info"]["weight_version"] for b in before.values()} == {"0"}
        previous = {g: b["meta_info"]["output_token_logprobs"] for g, b in before.items()}
        for version in (1, 2, 3):
            result = publisher.publish(trained(version), version=version)
            assert (result.version, result.advanced) == (version, True)
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                status = {g: client.get(f"{u}/status").json() for g, u in sidecars.items()}
                if all(s["applied_version"] == version for s in status.values()):
                    break
                time.sleep(0.2)
            assert all(s["applied_version"] == version for s in status.values()), status
            for group, url in servers.items():
                info = client.get(f"{url}/model_info").json()
                assert info["weight_version"] == str(version)
                assert info["weight_format"] == GROUPS[group]  # the engine serves its own view
                body = client.post(f"{url}/generate", json=prompt).json()
                meta = body["meta_info"]
                assert meta["weight_version"] == str(version)
                assert set(meta.get("output_token_weight_versions", [version])) == {version}
                logprobs = meta["output_token_logprobs"]
                assert logprobs != previous[group]  # new weights, new distribution
                previous[group] = logprobs
                metrics = client.get(f"{sidecars[group]}/metrics").text
                assert (
                    f'rlfleet_weight_sync_applied_version{{group="{group}",view="{GROUPS[group]}"}} {float(version)}'
                    in metrics
                )
    channel_status = read_channel_status(store)
    assert channel_status.latest_version == 3
    assert {a.view for a in channel_status.artifacts} == {"bf16", "fp8", "nvfp4"}
    assert {(g.group, g.view, g.applied_version, g.lag) for g in channel_status.groups} == {
        (group, view, 3, 0) for group, view in GROUPS.items()
    }
    assert (
        channel_status.retained_versions[-1] == 3 and 1 not in channel_status.retained_versions
    )  # retention ran
    # the three views differ in bytes as they should
    sizes = {a.view: a.bytes for a in channel_status.artifacts}
    assert sizes["nvfp4"] < sizes["fp8"] < sizes["bf16"]
