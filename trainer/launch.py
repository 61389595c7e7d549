"""`rlfleet trainer launch <torchrun's arguments>`: the trainer pod's command. It is torchrun (PyTorch's
own `torch.distributed.run`, run in this process, with every torchrun option) except for one thing: when
a rank fails, the process exits with THAT rank's exit code, where torchrun exits 1 for any failed rank.

Why: `rlfleet trainer run` exits with one code per failure class (trainer/failures.py: 3 a full store,
4 a refused version, ...). Under plain torchrun a pod's container always ended with code 1, so the
RLJob's `CrashLoopBackOff (..., code N ...)` reason and `kubectl get pod` could not tell a full store
from a crash (docs/operations.md "Exit codes of the trainer").

The code is torchrun's root cause: the failure with the earliest timestamp (`ChildFailedError.
get_first_failure`, the rank torchrun's own summary names first); ranks torchrun stopped because of it
come later. A rank killed by signal N exits 128 + N, as a shell reports it. Anything else torchrun
raises (its rendezvous timing out, the agent itself signalled) propagates unchanged, as under torchrun.
"""

from __future__ import annotations

import sys


def exit_code_of(rank_exit_code: int) -> int:
    """The container's exit code for a failed rank's: its own code (1-255), 128 + N for a rank killed by
    signal N (torch reports it as -N), 1 for anything else (a failure torch recorded without a code)."""
    if 0 < rank_exit_code < 256:
        return rank_exit_code
    if -128 < rank_exit_code < 0:
        return 128 - rank_exit_code
    return 1


def cli(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except ChildFailedError as failed:
        # torchrun prints this summary (the failed ranks, their codes, the root cause) as the traceback
        # of its exit; printed here, without the traceback, since this process exits with a code instead.
        print(failed.format_msg(), file=sys.stderr)
        _rank, first = failed.get_first_failure()
        return exit_code_of(first.exitcode)
    return 0
