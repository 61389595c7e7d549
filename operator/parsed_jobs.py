"""Each RLJob parsed once per generation: the pydantic parse (`RLJob.from_manifest`) of a job the
reconcile, every status refresh and every rebalance tick read.

The API server bumps `metadata.generation` on every change of an RLJob's spec (the CRD has a status
subresource, so status writes do not), and of the parsed job the operator reads only its spec and name:
a (uid, generation) pair names one parse. The memo holds one entry per job name, the parse of the
newest (uid, generation) seen (a new generation replaces it, so it stays as small as the set of jobs),
and the job's DELETED event drops it (`forget`, next to the rebalancer's, in rljob_pipeline.rljob_event).
A body without uid or generation (never from the API server) is parsed every time.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from rlfleet.api import RLJob, format_validation_error
from rlfleet.catalog import CatalogError

# (namespace, name) -> (uid, generation, the parsed job or why it is invalid)
_PARSED: dict[tuple[str, str], tuple[str, int, RLJob | str]] = {}


def parse(body: Mapping[str, Any]) -> RLJob | str:
    """The RLJob of a manifest, or the one-line reason it is invalid ("invalid RLJob: ...")."""
    meta = body.get("metadata") or {}
    uid, generation = meta.get("uid"), meta.get("generation")
    if not uid or not isinstance(generation, int):
        return _parse(body)
    key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
    cached = _PARSED.get(key)
    if cached is not None and cached[:2] == (uid, generation):
        return cached[2]
    parsed = _parse(body)
    _PARSED[key] = (uid, generation, parsed)
    return parsed


def forget(namespace: str, name: str) -> None:
    """Drop the parse of a deleted RLJob."""
    _PARSED.pop((namespace, name), None)


def _parse(body: Mapping[str, Any]) -> RLJob | str:
    try:
        # a deep copy: the memo outlives the body, whose dicts a model's untyped fields would share
        return RLJob.from_manifest(copy.deepcopy(dict(body)))
    except ValidationError as exc:
        return "invalid RLJob: " + format_validation_error(exc).strip().replace("\n", ";")
    except (CatalogError, ValueError) as exc:
        return f"invalid RLJob: {exc}"
