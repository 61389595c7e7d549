"""An rlfleet local fleet as slime's rollout endpoint, end to end on CPU (issue 43, docs/slime.md):
`rlfleet run examples/rljob-slime.yaml --local --publish-dir DIR` serves the example's three groups
(bf16, fp8 with an fp8 KV cache, nvfp4) behind the router; a stand-in for slime's trainer
(tests/support/slime_publisher.py: slime's full and delta disk formats as its code writes them) publishes
20 versions into DIR, and slime's request (its POST helper's retry semantics, tests/support/
slime_requests.py, with the request hook's `weight_version` and key) asks each version exactly: every
answer is that version's, from every group."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from support.slime_publisher import SlimeStandIn
from support.slime_requests import rollout_meta, rollout_payload, slime_post
from support.waits import wait_for

from rlfleet.channel import WeightChannel
from rlfleet.store import FilesystemStore

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "rljob-slime.yaml"
VERSIONS = 20
SESSIONS = 6  # per version: enough that every group is asked (sessions stick to groups by hashing)

pytestmark = pytest.mark.timeout(900)


def test_twenty_slime_versions_are_served_exactly_by_a_mixed_precision_local_fleet(tmp_path: Path) -> None:
    out, publish_dir = tmp_path / "run", tmp_path / "slime-updates"
    env = {**os.environ, "RLFLEET_MODEL_CACHE": str(tmp_path / "models")}
    serving = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlfleet.cli",
            "run",
            str(EXAMPLE),
            "--local",
            "--out",
            str(out),
            "--publish-dir",
            str(publish_dir),
        ],  # fmt: skip
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        endpoint_file = out / "endpoint.json"
        wait_for("endpoint.json", endpoint_file.is_file, timeout=300, running=[serving])
        endpoint = json.loads(endpoint_file.read_text())
        assert endpoint["groups"] == {"bf16": "bf16", "fp8": "fp8", "nvfp4": "nvfp4"}
        assert (endpoint_file.stat().st_mode & 0o777) == 0o600  # it holds the router's key
        slime = SlimeStandIn(publish_dir, Path(endpoint["model"]))
        answered = asyncio.run(_drive(slime, endpoint))
        assert sorted(answered) == list(range(1, VERSIONS + 1))
        assert all(versions == {v} for v, versions in answered.items()), answered
        channel = WeightChannel(FilesystemStore(out / "channel"))
        pointer = channel.latest()
        assert pointer is not None and pointer.version == VERSIONS
        assert sorted(channel.manifest(VERSIONS).views) == ["bf16", "fp8", "nvfp4"]
        # every group's engine comes to serve the last version (a group no session asked last may still be
        # loading it): the three precisions all take every version
        wanted = dict.fromkeys(endpoint["groups"], VERSIONS)
        wait_for(
            "every group's engine at the last version",
            lambda: asyncio.run(_served_versions(endpoint)) == wanted,
            timeout=120,
            running=[serving],
        )
    finally:
        serving.send_signal(signal.SIGINT)
        output, _ = serving.communicate(timeout=120)
    assert serving.returncode == 0, output
    assert "slime's rollout endpoint is http://127.0.0.1:" in output and "slime: stopped" in output


async def _drive(slime: SlimeStandIn, endpoint: dict) -> dict[int, set[int]]:
    """Publish each version (delta: xor and overwrite; full every fifth) and ask it exactly from several
    sessions; version -> the versions the answers said."""
    rng = np.random.default_rng(7)
    headers = {"Authorization": f"Bearer {endpoint['api_key']}"}
    answered: dict[int, set[int]] = {}
    async with httpx.AsyncClient(timeout=60) as client:
        for version in range(1, VERSIONS + 1):
            kind = "full" if version % 5 == 0 else "delta"
            encoding = "overwrite" if version % 2 else "xor"
            slime.publish(slime.perturbed(rng), kind, encoding=encoding, checksum_format="xxh3-128")
            for session in range(SESSIONS):
                output = await slime_post(
                    client,
                    endpoint["router"] + "/generate",
                    rollout_payload(version),
                    max_retries=240,
                    retry_sleep=0.25,
                    headers={**headers, "X-SMG-Routing-Key": f"episode-{version}-{session}"},
                )
                meta = rollout_meta(output)
                answered.setdefault(version, set()).add(int(meta["weight_version"]))
    return answered


async def _served_versions(endpoint: dict) -> dict[str, int]:
    headers = {"Authorization": f"Bearer {endpoint['api_key']}"}
    async with httpx.AsyncClient(timeout=10, headers=headers) as client:
        return {
            group: int((await client.get(url + "/model_info")).json()["weight_version"])
            for group, url in endpoint["servers"].items()
        }
