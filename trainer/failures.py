"""Runtime failures an operator can act on (issue 32 item 8): each is ONE line naming the store, the path
and the fix, and its own exit code. The cluster trainer (trainer/entrypoint.py: stderr and the pod's
termination message, which the RLJob's CrashLoopBackOff reason quotes) and local mode
(rlfleet/local/main.py) both describe a failure through `describe_failure`; docs/local.md and
docs/operations.md list the codes.

To add a class (a new exception a store or the publisher raises): one row in `FAILURES`, with a code not
taken yet. The first row whose exception the error (or an error it was raised from) is an instance of
wins, so a subclass's row goes before its base class's.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from rlfleet.channel import ChannelError, LeaseHeldError, LeaseLostError, VersionConflictError
from rlfleet.store.errors import StoreUnavailableError
from rlfleet.trainer.publish.checkpoint import CheckpointError
from rlfleet.trainer.rollout.driver import RolloutStallError

EXIT_BAD_INPUT = 2  # the run cannot start as configured (manifest, model, prompts): before any failure below


@dataclass(frozen=True)
class FailureContext:
    """Where the run keeps things, for the line (each entrypoint fills it at the failure)."""

    store: str  # the weight channel's store URI
    checkpoints: str  # where checkpoints go
    router: str  # the router's URL
    rollout_logs: str  # where to look when no rollout comes (the sampler pods, local mode's fleet.log)
    own_store: str  # how to give this run a store of its own (spec.weightChannel.store, local --out)
    continue_with: str  # what continues the run once fixed (a pod restart, local mode's resume command)
    detail: str = ""  # what the rollout driver knows about the router (its outage), if anything


@dataclass(frozen=True)
class FailureClass:
    name: str
    code: int
    exception: type[BaseException] | tuple[type[BaseException], ...]
    what: str  # a format string over FailureContext's fields, `error` (the exception's message) and `path`
    fix: str
    errnos: frozenset[int] = frozenset()  # for OSError rows: only these errno values


FAILURES: tuple[FailureClass, ...] = (
    FailureClass(
        "store-full", 3, OSError,
        "the weight store {store} is full ({error}{path})",
        "free space on its volume or grow it; nothing partial is named (bytes are written before the "
        "pointer moves), so {continue_with}",
        errnos=frozenset({errno.ENOSPC, errno.EDQUOT}),
    ),
    FailureClass(
        "version-conflict", 4, VersionConflictError,
        "the weight channel {store} refused this trainer's publish: {error}",
        "another trainer publishes to this channel: stop it, or give this run {own_store}; then {continue_with}",
    ),
    FailureClass(
        "another-writer", 9, (LeaseHeldError, LeaseLostError),
        "the weight channel {store} has another writer: {error}",
        "one trainer writes a channel: stop the other one (or let its lease expire), or give this run "
        "{own_store}; then {continue_with}",
    ),
    FailureClass(
        "store-unreachable", 5, StoreUnavailableError,
        "the weight store {store} is unreachable: {error}",
        "mount its volume, or check the S3 endpoint, bucket and credentials; then {continue_with}",
    ),
    FailureClass(
        "checkpoint-unloadable", 6, CheckpointError,
        "cannot resume from the checkpoints in {checkpoints}: {error}",
        "put back a good checkpoint there (`latest` names each kept one with its digest), or start over with "
        "a fresh channel and no checkpoints",
    ),
    FailureClass(
        "rollouts-stalled", 7, RolloutStallError,
        "{error} from the router {router}{detail}",
        "check the router and the sampler groups ({rollout_logs}); then {continue_with}",
    ),
    # last: every other channel error (its subclasses above win, as does a row of an error raised from one)
    FailureClass(
        "channel-unreadable", 10, ChannelError,
        "the weight channel {store} cannot be used: {error}",
        "a record in it is damaged (restore it, or delete a damaged pointer.json: the next publish writes it "
        "again) or the store kept refusing its compare-and-swap (an S3 store without conditional writes "
        "frees a writer's claim it could not delete after 600 s); then {continue_with}",
    ),
)  # fmt: skip


def failure_class(exc: BaseException) -> tuple[FailureClass, BaseException] | None:
    """The first row of FAILURES that `exc`, or an error it was raised from, matches; with that error."""
    chain: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__
    for row in FAILURES:
        for error in chain:
            if isinstance(error, row.exception) and (
                not row.errnos or (isinstance(error, OSError) and error.errno in row.errnos)
            ):
                return row, error
    return None


def describe_failure(exc: BaseException, ctx: FailureContext) -> tuple[int, str] | None:
    """(exit code, the one line) for a failure of FAILURES; None for any other error (a bug: traceback)."""
    found = failure_class(exc)
    if found is None:
        return None
    row, error = found
    if isinstance(error, OSError) and row.errnos:
        message = error.strerror or str(error)
        path = f": {error.filename}" if error.filename else ""
    else:
        message, path = str(error), ""
    fields = {
        **ctx.__dict__,
        "error": message,
        "path": path,
        "detail": f" ({ctx.detail})" if ctx.detail else "",
    }
    line = f"{row.what.format(**fields)}. Fix: {row.fix.format(**fields)}"
    return row.code, " ".join(line.split())  # one line, whatever the messages held
