"""Child processes of the tests: the `rlfleet` CLI as the pods run it, tied to the test's life and stopped
at teardown, so nothing outlives a test session."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# the console script installed beside this interpreter (what the images' entrypoints run)
RLFLEET = str(Path(sys.executable).with_name("rlfleet"))


def die_with_parent() -> None:
    """A `preexec_fn`: runs in the child before exec, which gets SIGKILL when the process that started it
    dies (a killed test run leaves no server behind)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def stop(procs: Iterable[subprocess.Popen], grace: float = 20.0) -> None:
    """SIGTERM every process still running, then wait for each (SIGKILL after `grace` seconds): a
    graceful stop as a pod's, all at once, bounded."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_operator(
    kube: Any, namespace: str, log: Path, *flags: str, env: Mapping[str, str] | None = None
) -> subprocess.Popen:
    """`rlfleet operator run --namespace <namespace> --kubeconfig <the control plane's> <flags>` as a
    subprocess in its own process group, its stderr (the log) in `log`; `env` added to the control plane's."""
    with log.open("w") as stderr:  # the child holds its own copy
        return subprocess.Popen(
            [
                RLFLEET,
                "operator",
                "run",
                "--namespace",
                namespace,
                "--kubeconfig",
                str(kube.kubeconfig),
                *flags,
            ],
            env={**kube.env(), **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )


def start_trainer(
    config: Path, router_url: str, cwd: Path, metrics_port: int = 0, stdout: int | None = subprocess.DEVNULL
) -> subprocess.Popen:
    """`rlfleet trainer run --config <config>` against the router at `router_url`, at INFO, its stderr piped
    (text), in its own session: killing its process group kills the trainer and what it started, as a node
    loss would."""
    return subprocess.Popen(
        [
            RLFLEET,
            "trainer",
            "run",
            "--config",
            str(config),
            "--router-url",
            router_url,
            "--metrics-port",
            str(metrics_port),
        ],
        cwd=cwd,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RLFLEET_LOG_LEVEL": "INFO"},
        start_new_session=True,
    )
