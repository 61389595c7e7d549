"""The trainer on the `cpu` class: the operator's trainer container (its exact torchrun command line, env
and ConfigMap) run for real on this machine against a real sampler fleet (rlfleet/local/fleet.py: reference
engines of the example's three groups, their weight-sync loops and the router), two CPU ranks with gloo.

- torch backend (examples/rljob-cpu-torch.yaml): FSDP2 data parallel over 2 processes, in the main venv;
- megatron backend (examples/rljob-cpu.yaml): tensor parallel 2 over 2 processes, with the product's CPU
  shims (trainer/backends/megatron_cpu.py) and nothing of the test tier's, under an interpreter with megatron-core
  AND the trainer's dependencies: .venv312 (scripts/megatron-cpu.txt), or `RLFLEET_MEGATRON_PYTHON`.

Only what the kubelet does is done here: `$(VAR)` references expanded from the container's env, the
ConfigMap mounted (written to a file), the pod-0 rendezvous on 127.0.0.1, the store on a local directory.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.ports import free_port

from rlfleet.api import RLJob, load_rljob
from rlfleet.catalog import load_catalog
from rlfleet.operator import builders
from rlfleet.operator import naming as n

REPO = Path(__file__).resolve().parents[2]
CATALOG = load_catalog(None)
TRAINER_DEPS = "import megatron.core, httpx, aiohttp, prometheus_client, boto3, transformers, blake3"


def test_trainer_device_comes_from_the_env_the_operator_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlfleet.trainer.entrypoint import DEVICE_ENV, trainer_device

    for value, expected in (("cpu", "cpu"), ("CUDA", "cuda"), ("", None), ("auto", None)):
        monkeypatch.setenv(DEVICE_ENV, value)
        assert trainer_device() == expected
    monkeypatch.setenv(DEVICE_ENV, "tpu")
    with pytest.raises(SystemExit, match="RLFLEET_TRAINER_DEVICE must be cpu or cuda, got 'tpu'"):
        trainer_device()
    monkeypatch.delenv(DEVICE_ENV)
    assert trainer_device() is None


def megatron_python() -> str | None:
    candidates = [os.environ.get("RLFLEET_MEGATRON_PYTHON"), str(REPO / ".venv312" / "bin" / "python")]
    for python in filter(None, candidates):
        if (
            Path(python).exists()
            and subprocess.run([python, "-c", TRAINER_DEPS], capture_output=True).returncode == 0
        ):
            return python
    return None


def trainer_container(job: RLJob, store: Path) -> tuple[dict, str]:
    """The StatefulSet's trainer container and the ConfigMap's rljob.yaml, for `job` with its channel on
    the local directory `store`."""
    wire = job.to_wire()
    wire["spec"]["weightChannel"]["store"] = {"type": "filesystem", "path": str(store)}
    wire["spec"]["trainer"]["totalSteps"] = 2
    job = RLJob.from_manifest(wire)
    out = {c["kind"]: c for c in builders.build_job_children(job, "rl", None, CATALOG)}
    (container,) = out["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    return container, out["ConfigMap"]["data"][n.CONFIG_FILE]


def run_trainer_pod(example: str, python: str, tmp: Path) -> tuple[subprocess.CompletedProcess, Path]:
    from rlfleet.local.fleet import FleetSpec, GroupSpec
    from rlfleet.model_source import resolve_model_source

    job = load_rljob(REPO / "examples" / example)
    models = tmp / "models"
    base = resolve_model_source(job.spec.model.path, cache_dir=models)  # the fleet's engines start from it
    store = tmp / "store"
    store.mkdir()
    # As on a cluster, the router's address is known before any sampler is up: the fleet's engines start
    # from the channel's version 0, which only the trainer publishes (so the fleet is not waited for here)
    router_port = free_port()
    spec = FleetSpec(
        groups=[
            GroupSpec(g.name, g.accelerator, g.weight_format, g.kv_cache_dtype)
            for g in job.spec.sampler_groups
        ],
        store=str(store),
        cache_dir=str(tmp / "fleet-cache"),
        model_path=str(base),
        router_port=router_port,
    )
    (tmp / "fleet.json").write_text(spec.to_json())
    fleet = subprocess.Popen(
        [sys.executable, "-m", "rlfleet.local.fleet", str(tmp / "fleet.json")],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        router = f"http://127.0.0.1:{router_port}"
        container, config = trainer_container(job, store)
        config_path = tmp / "rljob.yaml"
        config_path.write_text(config)
        env = {e["name"]: e.get("value") for e in container["env"]}
        env.update(
            NODE_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            RLFLEET_ROUTER_URL=router,
            POD_NAME=f"{job.name}-trainer-0",
            RLFLEET_NAMESPACE="rl",
            HOME=str(tmp),
            HF_HOME=str(tmp / "hf"),
            RLFLEET_MODEL_CACHE=str(models),
            OMP_NUM_THREADS="1",
        )
        env = {k: v for k, v in env.items() if v is not None}

        def expand(arg: str) -> str:  # the kubelet's $(VAR) expansion from the container's env
            return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)

        args = [
            expand(a).replace(f"{n.CONFIG_MOUNT}/{n.CONFIG_FILE}", str(config_path))
            for a in container["args"]
        ]
        assert container["command"] == ["rlfleet", "trainer", "launch"]  # torchrun (trainer/launch.py)
        argv = [python, "-m", "rlfleet.cli", "trainer", "launch", *args, "--metrics-port", str(free_port())]
        done = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    finally:
        fleet.stdin.close()  # type: ignore[union-attr]  (EOF stops the fleet host)
        try:
            fleet.wait(30)
        except subprocess.TimeoutExpired:
            fleet.kill()
            fleet.wait()
    return done, store


def assert_trained_and_published(done: subprocess.CompletedProcess, store: Path, nproc: str) -> None:
    from rlfleet.channel import WeightChannel
    from rlfleet.store import FilesystemStore

    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-6000:])
    assert "training finished at step 2" in done.stderr
    channel = WeightChannel(FilesystemStore(store))
    assert channel.versions() == [0, 1, 2]
    assert sorted(channel.manifest(2).views) == ["bf16", "fp8", "nvfp4"]
    assert nproc == "2"


@pytest.mark.slow
def test_the_cpu_torch_trainer_pod_trains_two_steps_on_two_cpu_ranks(tmp_path: Path) -> None:
    torchrun_python = sys.executable
    done, store = run_trainer_pod("rljob-cpu-torch.yaml", torchrun_python, tmp_path)
    job = load_rljob(REPO / "examples" / "rljob-cpu-torch.yaml")
    env = {e["name"]: e.get("value") for e in trainer_container(job, store)[0]["env"]}
    assert_trained_and_published(done, store, env["NPROC_PER_NODE"])
    # torchrun exits 0 only when both workers did; rank 0 drives, rank 1 only follows its commands
    assert done.stderr.count("training finished at step 2") == 1


@pytest.mark.slow
def test_the_cpu_megatron_trainer_pod_trains_at_tensor_parallel_2_on_cpu(tmp_path: Path) -> None:
    python = megatron_python()
    assert python is not None, (
        ".venv312 lacks megatron-core or the trainer's dependencies: run scripts/bootstrap"
    )
    done, store = run_trainer_pod("rljob-cpu.yaml", python, tmp_path)
    job = load_rljob(REPO / "examples" / "rljob-cpu.yaml")
    env = {e["name"]: e.get("value") for e in trainer_container(job, store)[0]["env"]}
    assert_trained_and_published(done, store, env["NPROC_PER_NODE"])
    assert job.spec.trainer.parallelism.tensor == 2
    # the checkpoint holds both TP ranks' shards (rank 0's state_dict carries every rank's)
    assert (store / "checkpoints").is_dir() and any((store / "checkpoints").iterdir())
    assert (
        yaml.safe_load((tmp_path / "rljob.yaml").read_text())["spec"]["trainer"]["processesPerReplica"] == 2
    )
