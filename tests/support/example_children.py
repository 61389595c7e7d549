"""What the operator's real builders (operator/builders.py) make for examples/rljob.yaml, in namespace rl
with the built-in catalog: the RLJob's children and each SamplerGroup's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rljob.yaml"


def example_children() -> list[dict[str, Any]]:
    """Every object, the SamplerGroups' Deployments and the rest after the job's own."""
    from rlfleet.api import RLJob, SamplerGroup, StoreSpec
    from rlfleet.catalog import get_catalog
    from rlfleet.operator import builders

    job = RLJob.from_manifest(yaml.safe_load(EXAMPLE.read_text()))
    catalog = get_catalog()
    objs = builders.build_job_children(job, "rl", None, catalog)
    store = StoreSpec.model_validate(job.spec.weight_channel.store.model_dump())
    for sg in [o for o in objs if o["kind"] == "SamplerGroup"]:
        objs += builders.build_samplergroup_children(
            SamplerGroup.from_manifest(sg), "rl", None, catalog, store
        )
    return objs


def example_workloads() -> list[dict[str, Any]]:
    """The Deployments and StatefulSets among them."""
    return [o for o in example_children() if o["kind"] in ("Deployment", "StatefulSet")]
