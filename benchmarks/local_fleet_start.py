"""Local mode's fleet host from start to first rollout, and what it writes into its cache directory.

    .venv/bin/python benchmarks/local_fleet_start.py [--versions 3] [--repeats 3]

What `rlfleet run --local` does around the fleet host (rlfleet/local/fleet.py), with the example
RLJob's groups and tiny model (examples/rljob.yaml): the trainer's publisher puts version 0 in a
filesystem channel, the fleet host subprocess starts (`python -m rlfleet.local.fleet SPEC.json`), and
the benchmark times, from the moment the subprocess has imported its libraries (torch, the router:
several seconds that no change here touches): its ready line (servers and router listening), every
group serving version 0 (`/model_info`), and one rollout answered through the router; and the CPU
seconds the host spent over the same span (/proc: less sensitive than wall time to a busy machine). Then it
publishes `--versions` more versions and waits until every group serves each, recording every file
that appears under the cache directory: its bytes are what the sidecar loops wrote there (a version
is pruned only once two newer ones are there, and the directory is listed after every version).

The fleet host's code comes from this checkout, or from `--pythonpath DIR` (e.g. an older commit laid
out as an importable `rlfleet` package) to compare two versions on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


# The host, with its imports done before it reports "imported" (then exactly `python -m rlfleet.local.fleet`).
HOST = (
    "import sys, torch, httpx, rlfleet.router.service, rlfleet.sampler.reference_engine, "
    "rlfleet.numerics.engine_model; from rlfleet.local.fleet import main; print('imported', flush=True); "
    "sys.exit(main(sys.argv[1:]))"
)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def cache_files(cache: Path) -> dict[str, int]:
    return {str(p.relative_to(cache)): p.stat().st_size for p in cache.rglob("*") if p.is_file()}


async def wait_serving(servers: dict[str, str], version: int, timeout: float = 300.0) -> None:
    async with httpx.AsyncClient(timeout=5.0) as client:
        deadline = time.monotonic() + timeout
        pending = dict(servers)
        while pending:
            for name, url in list(pending.items()):
                try:
                    v = (await client.get(url + "/model_info")).json().get("weight_version")
                except (httpx.HTTPError, ValueError):
                    continue
                if v is not None and int(v) >= version:
                    pending.pop(name)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{sorted(pending)} did not serve version {version}")
            await asyncio.sleep(0.02)


def one_run(work: Path, versions: int, pythonpath: str | None, sizes: dict[str, int]) -> dict[str, float]:
    import torch

    from rlfleet.api import load_rljob
    from rlfleet.local.fleet import FleetSpec, GroupSpec
    from rlfleet.store import open_store
    from rlfleet.tiny_qwen3 import cached_tiny_qwen3, tiny_model
    from rlfleet.trainer.config import resolve_run
    from rlfleet.trainer.publish.publisher import WeightPublisher

    torch.set_num_threads(1)
    rc = resolve_run(load_rljob(REPO / "examples" / "rljob.yaml"))
    assert rc.model is not None  # resolve_run(local=True): the RLJob's tiny model
    spec_model = replace(
        rc.model, warm_start="none", **sizes
    )  # the fleet's start does not depend on the weights
    model_dir = cached_tiny_qwen3(work.parent / "models", spec_model)
    channel, cache = work / "channel", work / "cache"
    channel.mkdir(parents=True)
    store = open_store(str(channel))
    publisher = WeightPublisher(
        store, views=rc.views, keep_versions=4, follow_subscribers=False, base_checkpoint=model_dir
    )
    model = tiny_model(spec_model)
    publisher.publish({k: v.detach() for k, v in model.state_dict().items()}, version=0)
    spec = FleetSpec(
        groups=[GroupSpec(g.name, g.accelerator, g.weight_format, g.kv_cache_dtype) for g in rc.groups],
        store=str(channel),
        cache_dir=str(cache),
        model_path=str(model_dir),
        seed=rc.seed,
    )
    spec_path = work / "fleet.json"
    spec_path.write_text(spec.to_json())
    env = {**os.environ, "RLFLEET_ROUTER_ADMIN_TOKEN": "bench", "PYTHONUNBUFFERED": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    log = open(work / "fleet.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-c", HOST, str(spec_path)],
        cwd=work,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"imported"
        t0, cpu0 = time.monotonic(), cpu_seconds(proc.pid)
        urls = json.loads(proc.stdout.readline())
        t_ready = time.monotonic() - t0
        asyncio.run(wait_serving(urls["servers"], 0))
        t_serving = time.monotonic() - t0
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8, "temperature": 1.0}}
        httpx.post(urls["router"] + "/generate", json=body, timeout=60).raise_for_status()
        t_rollout = time.monotonic() - t0
        cpu_rollout = cpu_seconds(proc.pid) - cpu0
        seen = cache_files(cache)
        bytes_v0 = sum(seen.values())
        for v in range(1, versions + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * torch.randn_like(p))
            publisher.publish({k: t.detach() for k, t in model.state_dict().items()}, version=v)
            asyncio.run(wait_serving(urls["servers"], v))
            seen |= cache_files(cache)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        store.close()
    return {
        "ready_s": t_ready,
        "serving_v0_s": t_serving,
        "first_rollout_s": t_rollout,
        "host_cpu_to_first_rollout_s": cpu_rollout,
        "cache_bytes_v0": bytes_v0,
        "cache_bytes_total": sum(seen.values()),
        "groups": len(rc.groups),
        "versions": versions + 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", type=int, default=3, help="versions published after version 0")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pythonpath", default=None, help="import the fleet host's rlfleet from here")
    parser.add_argument("--vocab-size", type=int, help="override the example's tiny model")
    parser.add_argument("--hidden-size", type=int, help="override the example's tiny model")
    parser.add_argument("--num-hidden-layers", type=int, help="override the example's tiny model")
    args = parser.parse_args()
    sizes = {
        k: getattr(args, k)
        for k in ("vocab_size", "hidden_size", "num_hidden_layers")
        if getattr(args, k) is not None
    }
    if "hidden_size" in sizes:
        sizes["intermediate_size"] = 2 * sizes["hidden_size"]
    runs = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="rlfleet-fleet-bench-") as tmp:
            work = Path(tmp) / f"run{i}"
            work.mkdir()
            runs.append(one_run(work, args.versions, args.pythonpath, sizes))
        print(json.dumps(runs[-1]), flush=True)
    summary = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print("median", json.dumps(summary))


if __name__ == "__main__":
    main()
