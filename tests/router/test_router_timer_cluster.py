"""Against the real control plane: the operator's rebalance timer updates SamplerGroup status columns
(Tok/s, Share), the share history, Events, and the RLJob's blended cost per 1M tokens.

Sampler pods are kwok fakes (no process behind their IPs), so throughput comes from the
`spec.router.prometheusUrl` path, served by a small real Prometheus-API HTTP server on 127.0.0.1
(tests/support/fake_prometheus.py) that reports 3000 tok/s for the b200 group and 1000 tok/s for the a100
group.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator

import pytest
import yaml
from support import waits
from support.control_plane import events, operator_in_process, rljob
from support.fake_prometheus import fake_prometheus

# these tests wait on rebalance intervals: longer timeout, coarser polling than the default
wait_for = functools.partial(waits.wait_for, timeout=120.0, interval=1.0)

JOB = "rebal"
TPS = {f"{JOB}-b200-nvfp4": 3000.0, f"{JOB}-a100-bf16": 1000.0}

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture
def prometheus() -> Iterator[tuple[str, list[str]]]:
    with fake_prometheus(lambda samplergroup: TPS.get(samplergroup, 0.0)) as served:
        yield served


def manifest(prometheus_url: str) -> dict:
    # no b200 group at bf16: the reference fleet's throughput is given
    return rljob(
        JOB,
        router={
            "policy": "throughput",
            "rebalanceIntervalSeconds": 5,
            "prometheusUrl": prometheus_url,
            "reference": {"tokensPerGpuSecond": 2500},
        },
    )


def test_timer_writes_samplergroup_status_columns_history_events_and_job_cost(
    kube, crds, namespace: str, prometheus: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, queries = prometheus

    def sg(name: str) -> dict:
        return json.loads(
            kube.kubectl("get", "samplergroup", f"{JOB}-{name}", "-n", namespace, "-o", "json").stdout
        )

    with operator_in_process(kube, namespace, monkeypatch):
        kube.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest(url)))

        def converged() -> dict | None:
            fast, slow = sg("b200-nvfp4")["status"], sg("a100-bf16")["status"]
            if fast.get("share", 0) >= 0.74 and len(fast.get("shareHistory", [])) >= 2:
                return {"fast": fast, "slow": slow}
            return None

        status = wait_for("shares to reach the throughput ratio", converged, timeout=150)
        fast, slow = status["fast"], status["slow"]
        assert fast["tokensPerSecond"] == 3000.0 and slow["tokensPerSecond"] == 1000.0
        assert fast["share"] == pytest.approx(0.745, abs=0.006)  # 0.02 floor + 0.96 * 0.75
        assert slow["share"] == pytest.approx(1 - fast["share"], abs=1e-3)
        assert fast["tokenShare"] == 0.75 and fast["quarantined"] is False
        assert fast["costPer1MTokens"] > 0 and slow["costPer1MTokens"] > 0
        # Bounded change per interval once the group is up (before its pods were ready it had 0).
        moves = [
            h
            for h in fast["shareHistory"]
            if h["from"] > 0 and h["reason"].startswith("throughput 3000 tok/s")
        ]
        assert len(moves) >= 2 and all(0 < h["to"] - h["from"] <= 0.1 + 1e-3 for h in moves), fast[
            "shareHistory"
        ]
        # The operator's own fields survive next to the rebalancer's (separate field managers).
        assert fast.get("phase") and fast.get("ready")

        table = kube.kubectl("get", "samplergroups", "-n", namespace).stdout
        header, *rows = table.strip().splitlines()
        assert "TOK/S" in header and "SHARE" in header
        row = next(r for r in rows if r.startswith(f"{JOB}-b200-nvfp4"))
        assert "3000" in row.split() and row.split()[6].startswith("74"), table  # SHARE% column

        job = json.loads(kube.kubectl("get", "rljob", JOB, "-n", namespace, "-o", "json").stdout)
        # The fleet: one b200 GPU ($5.99/h, the catalog's) and one a100 ($1.79) over 4000 usable tok/s (no
        # trainer: no token counted out of range); the reference: b200 at bf16, 2500 tok/s per GPU.
        fleet, reference = 7.78 / 3600 / 4000 * 1e6, 5.99 / 3600 / 2500 * 1e6
        assert job["status"]["costPer1MTokens"] == pytest.approx(round(fleet, 4), abs=1e-9)  # 0.5403
        assert job["status"]["baselineCostPer1MTokens"] == pytest.approx(
            round(reference, 4), abs=1e-9
        )  # 0.6656
        assert job["status"]["savingPercent"] == pytest.approx(
            round(100 * (1 - fleet / reference), 2), abs=1e-9
        )
        wide = kube.kubectl("get", "rljob", JOB, "-n", namespace, "-o", "wide").stdout
        header, row = wide.strip().splitlines()
        assert "SAVING%" in header and "18.82" in row.split(), wide
        assert events(kube, namespace, "ShareChanged")

        # Quarantine by annotation: the group drops to share 0 at the next interval.
        kube.kubectl(
            "annotate", "samplergroup", f"{JOB}-a100-bf16", "-n", namespace, "rlfleet.dev/quarantined=true"
        )
        wait_for(
            "quarantine",
            lambda: (
                sg("a100-bf16")["status"].get("quarantined") is True
                and sg("a100-bf16")["status"]["share"] == 0.0
            ),
            timeout=60,
        )
        assert sg("b200-nvfp4")["status"]["share"] == 1.0
        kube.kubectl("delete", "rljob", JOB, "-n", namespace, "--wait=false")
    assert queries and all('sglang:realtime_tokens_total{mode="decode",' in q for q in queries)
