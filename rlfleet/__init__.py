"""rlfleet: asynchronous LLM RL on a heterogeneous, mixed-precision GPU fleet.

The core package (`rlfleet`, `rlfleet.api`, `rlfleet.records`, `rlfleet.catalog`) imports nothing of
the product packages; `rlfleet.operator`, `rlfleet.sampler`, `rlfleet.trainer` and `rlfleet.router`
are mapped from the top-level folders of the same name (see pyproject.toml); `rlfleet.local` is local
mode (`rlfleet run --local`). The research experiments are not part of this package
(`rlfleet_experiments`, experiments/README.md).
"""

__version__ = "0.1.0"
