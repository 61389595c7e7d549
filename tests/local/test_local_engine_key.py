"""Local mode closes its engine API with a key, as a cluster does (issue 32, the engine API;
docs/local.md, "The engine API"): during a real `rlfleet run --local`, any other local process that
calls an engine's /update_weights_from_disk or the router's /generate on 127.0.0.1 without the run's key,
or with a wrong one, gets 401; the key lives only in the fleet host's environment (not on a command
line, not in a file of the run directory, not in the run's output), and the run completes, its engines
loading the trainer's later versions through the sync loops, which present it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import httpx
import pytest
from test_local_run import fleet_hosts, small_manifest, started_until_step  # the local tests' one copy

# Long enough that the calls below (about 20, each well under a second) find the fleet serving: the CI-like
# run at d414a73 trained 4 steps in 2 s and had stopped its engines before the last call.
STEPS = 40


def host_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if item)


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def serving_urls(log: Path) -> tuple[str, dict[str, str]]:
    """The router's and the servers' URLs, as the fleet host logs them once it serves."""
    found = re.search(
        r"serving: router (\S+), servers (\{[^}]*\}) \(closed with the run's key\)", log.read_text()
    )
    assert found is not None, log.read_text()[-3000:]
    return found.group(1), ast.literal_eval(found.group(2))


@pytest.mark.slow
def test_a_local_run_refuses_engine_and_router_calls_without_its_key(tmp_path: Path) -> None:
    manifest = small_manifest(tmp_path)
    out = tmp_path / "run"
    with started_until_step(tmp_path, manifest, out, STEPS) as run:
        hosts = fleet_hosts(out / "fleet.json")
        assert len(hosts) == 1, "".join(run.lines)
        key = host_environ(hosts[0]).get("RLFLEET_API_KEY", "")
        assert len(key) == 43, "the host has no key of secrets.token_urlsafe(32)"  # 32 bytes, base64url
        assert key not in cmdline(hosts[0]) and key not in cmdline(run.proc.pid)
        router, servers = serving_urls(out / "fleet.log")
        assert sorted(servers) == ["b200-nvfp4", "h100-bf16"]

        generate = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
        update = {"model_path": str(out / "channel" / "v0" / "bf16"), "weight_version": "1000000"}
        for auth in (
            {},
            {"Authorization": "Bearer not-the-key"},
            {"Authorization": key},
        ):  # none, wrong, no scheme
            answer = httpx.post(router + "/generate", json=generate, headers=auth, timeout=30)
            assert answer.status_code == 401, (auth, answer.text)
            for url in servers.values():
                answer = httpx.post(url + "/update_weights_from_disk", json=update, headers=auth, timeout=30)
                assert answer.status_code == 401, (url, auth, answer.text)
                assert (
                    httpx.post(url + "/generate", json=generate, headers=auth, timeout=30).status_code == 401
                )
        # the key opens them: the router generates, and an engine answers its model info
        with_key = {"Authorization": f"Bearer {key}"}
        answer = httpx.post(router + "/generate", json=generate, headers=with_key, timeout=30)
        assert answer.status_code == 200, answer.text
        info = httpx.get(servers["h100-bf16"] + "/model_info", headers=with_key, timeout=30)
        assert info.status_code == 200, info.text
        output = run.finish(timeout=600)
    assert run.proc.returncode == 0, output[-3000:]
    assert f"step {STEPS}/{STEPS} " in output and key not in output
    assert fleet_hosts(out / "fleet.json") == []
    # every engine loaded the trainer's later versions, which only its sync loop (presenting the key) loads,
    # and the refused load changed nothing: no engine ever served the foreign version
    fleet_log = (out / "fleet.log").read_text()
    for view in ("bf16", "nvfp4"):
        assert re.search(rf"\(view {view}\) -> version [1-9]", fleet_log), fleet_log[-3000:]
    assert "-> version 1000000" not in fleet_log
    written = [p for p in out.rglob("*") if p.is_file()]
    assert written and not [p for p in written if key.encode() in p.read_bytes()]
