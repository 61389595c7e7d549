"""A `cpu` class sampler pod, run for real on this machine: the EXACT commands the operator's builder puts
in the pod (weight-fetch init container, reference-engine container, weight-sync sidecar), as processes on
localhost against a filesystem weight channel that the trainer's own publisher filled from the built-in
tiny Qwen3. Only what the kubelet would do is done here: `$(POD_NAME)` expanded, the pod's paths mapped
into a temporary directory, the ports made free ones, `rlfleet` on PATH.

It checks the launch contract end to end: the init container verifies version 0 of the group's view and
writes the launch file; the engine starts from that directory with that version (tokens say "0") and
serves the group's precision; a later published version reaches the engine through the sidecar's
`/update_weights_from_disk` (tokens say "1") and is written back to the launch file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.ports import free_port
from support.processes import stop
from support.waits import wait_for

from rlfleet.api import SamplerGroup, load_rljob
from rlfleet.catalog import load_catalog
from rlfleet.operator import builders
from rlfleet.operator import naming as n

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's bin: `rlfleet` (the images' ENTRYPOINT) lives there
POD = "cpu-group-7d9f-abcde"


def pod_for(tmp: Path, group: str, port: int) -> dict:
    """The Deployment's pod spec the operator builds for `group` of examples/rljob-cpu.yaml, with the
    channel on a local directory instead of the PVC and the engine on `port`."""
    job = load_rljob(REPO / "examples" / "rljob-cpu.yaml")
    wire = job.to_wire()
    wire["spec"]["weightChannel"]["store"] = {"type": "filesystem", "path": str(tmp / "store")}
    job = type(job).from_manifest(wire)
    manifest = next(
        c
        for c in builders.build_job_children(job, "rl", None, load_catalog(None))
        if c["kind"] == "SamplerGroup" and c["spec"]["name"] == group
    )
    manifest["spec"]["port"] = port
    sg = SamplerGroup.from_manifest(manifest)
    dep = builders.build_sampler_deployment(sg, "rl", None, load_catalog(None), job.spec.weight_channel.store)
    return dep["spec"]["template"]["spec"]


API_KEY = "the-jobs-engine-key"  # what the job's <job>-api-key Secret would hold
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def as_kubelet_runs(container: dict, cache: Path, sync_port: int) -> tuple[list[str], dict[str, str]]:
    """argv and env of `container`: $(POD_NAME) expanded; the pod's cache path and sidecar port mapped."""

    def fix(
        arg: str,
    ) -> str:  # the kubelet expands $(VAR) from the container's env, the key's Secret included
        return (
            arg.replace("$(POD_NAME)", POD)
            .replace(f"$({n.API_KEY_ENV})", API_KEY)
            .replace(n.WEIGHTS_CACHE, str(cache))
        )

    argv = [fix(a) for a in [*container["command"], *container["args"]]]
    if "--port" in argv and argv[argv.index("--port") + 1] == str(n.SYNC_PORT):
        argv[argv.index("--port") + 1] = str(sync_port)
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    env["POD_NAME"] = POD
    if any(e["name"] == n.API_KEY_ENV for e in container.get("env", [])):
        env[n.API_KEY_ENV] = API_KEY  # the job's key Secret, by secretKeyRef
    env["HOME"] = env["HF_HOME"] = str(cache.parent / "home")
    env["PATH"] = f"{BIN}:{os.environ['PATH']}"
    return argv, {**os.environ, **env}


@pytest.fixture()
def processes() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    yield procs
    stop(procs)


def start_until_healthy(
    argv: list[str],
    env: dict[str, str],
    processes: list[subprocess.Popen],
    what: str,
    url: str,
    timeout: float,
) -> None:
    """Start a container's `argv` (appended to `processes`) and wait until its `url`/health answers 200,
    failing at once if one of `processes` exits."""
    processes.append(
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    )
    wait_for(
        f"{what} /health",
        lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200,
        timeout=timeout,
        interval=0.2,
        running=processes,
    )


def generate(url: str) -> dict:
    body = {
        "input_ids": [3, 10, 11, 12],
        "sampling_params": {"max_new_tokens": 4, "temperature": 1.0},
        "return_logprob": True,
    }
    response = httpx.post(f"{url}/generate", json=body, headers=AUTH, timeout=60)
    response.raise_for_status()
    return response.json()


@pytest.mark.parametrize(("group", "kv"), [("fp8", "fp8_e4m3"), ("nvfp4", "auto")])
def test_the_builders_cpu_pod_fetches_launches_and_updates_for_real(
    tmp_path: Path, processes, group: str, kv: str
) -> None:
    import torch
    from safetensors.torch import load_file

    from rlfleet.model_source import resolve_model_source
    from rlfleet.sampler.launch_checkpoint import read_launch_file
    from rlfleet.store import FilesystemStore
    from rlfleet.trainer.publish.publisher import WeightPublisher

    # the trainer's side: the built-in tiny Qwen3 (what `model.path: builtin:tiny-qwen3` resolves to), and
    # version 0 of every view the example's groups serve, published by the trainer's publisher
    base = resolve_model_source("builtin:tiny-qwen3", cache_dir=tmp_path / "models")
    assert (base / "config.json").is_file() and (base / "SHA256SUMS").is_file()
    assert resolve_model_source("builtin:tiny-qwen3", cache_dir=tmp_path / "models") == base  # built once
    store = FilesystemStore(tmp_path / "store", create=True)
    publisher = WeightPublisher(store, views=["bf16", "fp8", "nvfp4"], base_checkpoint=base)
    weights = {k: v.float() for k, v in load_file(str(base / "model.safetensors")).items()}
    publisher.publish(weights, version=0)

    port, sync_port = free_port(), free_port()
    pod = pod_for(tmp_path, group, port)
    (fetch,) = pod["initContainers"]
    engine, sidecar = pod["containers"]
    cache = tmp_path / "weights-cache"
    cache.mkdir()

    # 1. the init container: waits for, downloads and verifies version 0 of the group's view, writes the launch file
    argv, env = as_kubelet_runs(fetch, cache, sync_port)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert read_launch_file(cache) == (0, cache / f"v0-{group}")

    # 2. the engine container: /bin/sh execs `rlfleet sampler serve --engine reference` from the launch file
    argv, env = as_kubelet_runs(engine, cache, sync_port)
    assert argv[:2] == ["/bin/sh", "-c"] and "rlfleet sampler serve --engine reference" in argv[2]
    url = f"http://127.0.0.1:{port}"
    start_until_healthy(argv, env, processes, "engine", url, timeout=300)
    info = httpx.get(f"{url}/model_info", headers=AUTH, timeout=10).json()
    assert (info["weight_version"], info["weight_format"], info["kv_cache_dtype"]) == ("0", group, kv)
    assert info["model_path"] == str(cache / f"v0-{group}") and info["served_model_name"] == "tiny-qwen3"
    assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 200  # the readiness probe
    out = generate(url)
    assert out["meta_info"]["weight_version"] == "0" and len(out["output_ids"]) >= 1

    # 3. the sidecar: a newer version reaches the engine through /update_weights_from_disk
    argv, env = as_kubelet_runs(sidecar, cache, sync_port)
    start_until_healthy(argv, env, processes, "sidecar", f"http://127.0.0.1:{sync_port}", timeout=120)
    publisher.publish({k: v + 0.01 * torch.randn_like(v) for k, v in weights.items()}, version=1)
    # applied: the engine serves v1 and the sidecar has recorded it (the sidecar tells the engine first, then
    # records the version and writes the launch file in one step of its loop, which /status waits behind)
    wait_for(
        "version 1 applied",
        lambda: (
            httpx.get(f"{url}/model_info", headers=AUTH, timeout=5).json()["weight_version"] == "1"
            and httpx.get(f"http://127.0.0.1:{sync_port}/status", timeout=5).json().get("applied_version")
            == 1
        ),
        timeout=120,
        interval=0.2,
        running=processes,
    )
    assert read_launch_file(cache) == (
        1,
        cache / f"v1-{group}",
    )  # a restarted engine launches from what it serves
    info = httpx.get(f"{url}/model_info", headers=AUTH, timeout=5).json()
    assert (info["model_path"], info["weight_format"]) == (str(cache / f"v1-{group}"), group)
    out = generate(url)
    assert out["meta_info"]["weight_version"] == "1"
    status = httpx.get(f"http://127.0.0.1:{sync_port}/status", timeout=5).json()
    assert json.dumps(status) and status.get("applied_version", status.get("appliedVersion")) == 1
    # the sidecar's subscriber report names the pod (what retention and the operator's status read)
    reports = list((tmp_path / "store" / "subscribers").rglob("*.json"))
    assert [r.name for r in reports] == [f"{POD}.json"]
