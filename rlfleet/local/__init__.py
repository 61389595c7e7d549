"""Local mode: `rlfleet run RLJOB.yaml --local` on one machine (`main`), the fleet host it starts as a
subprocess (`fleet`: reference sampler servers, the router, a weight-sync loop per group) and the run's
report (`report`); `emulated`: the in-process fleet (the reference engine without HTTP, an in-memory
version sink) that the trainer loop tests and the experiments run on. It trains through the cluster
trainer's own composition root (rlfleet.trainer.run); nothing in rlfleet.trainer imports it (an
import-linter contract in pyproject.toml)."""
