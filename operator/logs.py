"""How `rlfleet operator run` logs: INFO, kopf's per-handler lines quiet, and WHY the operator is paused
always said (docs/operations.md, "The operator is paused").

kopf pauses every watch when a peer of higher priority is alive (HA standby, or the old pod of an unclean
restart until its lifetime runs out), when peers of the same priority meet, or when the peering is named
(`--peering`) but its CRD is missing. It says so under loggers the default level hides:
- `kopf._core.engines.peering` logs "Pausing operations in favour of ..." at INFO, under `kopf._core`,
  which the operator quiets to WARNING (one INFO line per handler call is most of its CPU under load);
- `kopf._cogs.clients.watching` logs "Pausing the watch-stream for R (blockers: B)" at DEBUG only: a
  missing peering CRD left no other trace.
`configure_logging` keeps the peering logger at INFO and puts `PauseReasons` on the watch-stream logger:
the pause and resume lines come out once per set of blockers (not once per watched resource), a pause at
WARNING when it cannot end by itself, the rest of that logger's DEBUG lines only with --verbose.
"""

from __future__ import annotations

import logging
import re

QUIET_LOGGERS = ("kopf.objects", "kopf.activities", "kopf._core")
PEERING_LOGGER = "kopf._core.engines.peering"
WATCHING_LOGGER = "kopf._cogs.clients.watching"
# the name kopf gives the toggle that pauses everything while a mandatory peering has no CRD
PEERING_CRD_MISSING = "peering CRD is missing"
_PAUSE = re.compile(
    r"^(Pausing|Resuming) the watch-stream for .*?(?: \((?:blockers|resolved): (?P<names>.*)\))?\.$"
)


class PauseReasons(logging.Filter):
    """On kopf's watch-stream logger: its DEBUG pause line becomes one line per set of blockers (INFO, or
    WARNING with what to do for a missing peering CRD: the operator does not scan for CRDs, so only a
    restart after installing it ends that pause); its resume line one INFO line; every other DEBUG line
    of that logger passes only when `verbose`."""

    def __init__(self, verbose: bool = False) -> None:
        super().__init__()
        self.verbose = verbose
        self._paused: frozenset[str] | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.DEBUG:
            return True
        found = _PAUSE.match(record.getMessage())
        if found is None:
            return self.verbose
        names = frozenset(name.strip() for name in (found.group("names") or "").split(",") if name.strip())
        if found.group(1) == "Resuming":
            if self._paused is None:
                return self.verbose
            self._paused = None
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = "rlfleet operator resumed: every watch-stream runs again", ()
            return True
        if names == self._paused:
            return self.verbose
        self._paused = names
        blockers = ", ".join(sorted(names))
        record.msg, record.args = f"rlfleet operator paused, no object is handled (blockers: {blockers})", ()
        record.levelno, record.levelname = logging.INFO, "INFO"
        if PEERING_CRD_MISSING in names:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg += (
                ": the peering is named (--peering) but kopf's peering CRDs are not installed. Install them "
                "(charts/rlfleet/crds/kopf.dev_peerings.yaml; the Argo CD example syncs them with the other "
                "CRDs) and restart the operator: it does not scan for CRDs added later"
            )
        else:
            record.msg += (
                ": kopf's peering holds the operator until it sees no live peer of higher or the same priority "
                f"(at start-up until the first read of the peering; the {PEERING_LOGGER} lines name the peers)"
            )
        return True


def configure_logging(verbose: bool) -> PauseReasons:
    """The operator's logging: everything at DEBUG with `verbose`; else INFO with kopf's per-object lines
    at WARNING, kopf's peering decisions at INFO and the pause reasons through `PauseReasons`."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if not verbose:
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
        logging.getLogger(PEERING_LOGGER).setLevel(logging.INFO)
    watching = logging.getLogger(WATCHING_LOGGER)
    watching.setLevel(logging.DEBUG)  # the pause line is a DEBUG record: it must be created to be raised
    for old in [f for f in watching.filters if isinstance(f, PauseReasons)]:
        watching.removeFilter(old)
    reasons = PauseReasons(verbose)
    watching.addFilter(reasons)
    return reasons
