"""The operator says why it is paused (operator/logs.py): kopf's own pause code runs here (its watch-stream
block and its peering decision), with the logging `rlfleet operator run` configures."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from datetime import UTC, datetime

import kopf
import pytest
from kopf._cogs.aiokits import aiotoggles
from kopf._cogs.clients import watching
from kopf._cogs.structs import bodies, references
from kopf._core.engines import peering

from rlfleet.operator.logs import PEERING_LOGGER, QUIET_LOGGERS, WATCHING_LOGGER, configure_logging

RLJOBS = references.Resource("rlfleet.dev", "v1alpha1", "rljobs")
SAMPLERGROUPS = references.Resource("rlfleet.dev", "v1alpha1", "samplergroups")
CLUSTER_PEERING = references.Resource("kopf.dev", "v1", "clusterkopfpeerings", namespaced=False)


@pytest.fixture
def operator_logging(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """configure_logging(verbose=False), undone afterwards (levels and filters are process-wide)."""
    names = (*QUIET_LOGGERS, PEERING_LOGGER, WATCHING_LOGGER)
    levels = {name: logging.getLogger(name).level for name in names}
    filters = list(logging.getLogger(WATCHING_LOGGER).filters)
    configure_logging(verbose=False)
    caplog.set_level(logging.INFO)  # the root level of `rlfleet operator run`
    yield caplog
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    logging.getLogger(WATCHING_LOGGER).filters[:] = filters


def _kopf_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("kopf")]


async def test_a_missing_peering_crd_is_one_warning_that_says_what_to_do(operator_logging) -> None:
    paused = aiotoggles.ToggleSet(any)
    missing = await paused.make_toggle(True, name="peering CRD is missing")  # kopf's orchestrator's toggle

    async def watch(resource: references.Resource) -> None:
        async with watching.streaming_block(resource=resource, namespace=None, operator_paused=paused):
            pass

    tasks = [asyncio.create_task(watch(r)) for r in (RLJOBS, SAMPLERGROUPS)]
    for _ in range(10):
        await asyncio.sleep(0)
    assert not any(t.done() for t in tasks)  # kopf holds every watch-stream
    (paused_line,) = _kopf_records(operator_logging)  # one line for both streams
    assert paused_line.levelno == logging.WARNING
    message = paused_line.getMessage()
    assert "peering CRD is missing" in message
    assert "kopf.dev_peerings.yaml" in message and "restart the operator" in message

    await missing.turn_to(False)
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
    lines = _kopf_records(operator_logging)
    assert [(r.levelno, r.getMessage()) for r in lines[1:]] == [
        (logging.INFO, "rlfleet operator resumed: every watch-stream runs again")
    ]


async def test_the_watch_streams_other_debug_lines_stay_hidden(operator_logging) -> None:
    logging.getLogger(WATCHING_LOGGER).debug("Starting the watch-stream for rljobs cluster-wide.")
    assert _kopf_records(operator_logging) == []


async def test_pausing_for_a_peer_of_higher_priority_is_logged_at_info(operator_logging) -> None:
    settings = kopf.OperatorSettings()
    settings.peering.name, settings.peering.priority = "rlfleet", 10
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S")
    event = bodies.RawEvent(
        type="MODIFIED",
        object={
            "metadata": {"name": "rlfleet"},
            "status": {"old-pod": {"priority": 99, "lifetime": 60, "lastseen": now}},  # an unclean restart's
        },
    )
    conflicts = aiotoggles.Toggle(False)
    pressure = asyncio.Event()
    pressure.set()  # kopf waits for the peer's deadline or new events: wake it at once
    await peering.process_peering_event(
        raw_event=event,
        namespace=None,
        resource=CLUSTER_PEERING,
        identity=peering.Identity("me"),
        settings=settings,
        autoclean=False,
        stream_pressure=pressure,
        conflicts_found=conflicts,
    )
    assert conflicts.is_on()
    (line,) = _kopf_records(operator_logging)
    assert line.levelno == logging.INFO and line.name == PEERING_LOGGER
    assert "Pausing operations in favour of" in line.getMessage() and "old-pod" in line.getMessage()
