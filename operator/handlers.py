"""The operator's kopf handlers: the module `rlfleet operator run` (and the tests' KopfRunner) loads. It holds
the operator's lifecycle (settings, login, cleanup) and imports every module whose handlers kopf registers.
Per resource ONE reconcile pipeline, KubeRay-shaped (docs/architecture.md):

    observe (kopf indexes + the rebalance tick's scrapes) -> pure compute (builders.py: children;
    decide.py: the job's decisions; status.py and one module per kind: the WHOLE status) -> apply once (one field manager per
    write kind)

- Observe (`indexes.py`): in-memory kopf indexes of the watched objects (RLJobs, SamplerGroups,
  WeightChannels, sampler Deployments, trainer StatefulSets, the operator's pods: `pods.pod_view`, and the
  kubelet's FailedMount Events by pod and the FailedCreate Events of StatefulSets: `pods.event_view`)
  replace list/get round trips; the rebalance tick (`rebalancer.rebalance_job`) adds what only a scrape
  can see (throughput, the trainer's report) and keeps it in memory.
- RLJob create/update(spec)/resume (`rljob_pipeline.py`, `reconcile_job`) -> server-side apply of every
  child (owner references, common labels), deletion of SamplerGroups no longer in the spec, then the job's
  status pipeline. A child of a live job deleted by someone else runs it again (`heal_job`).
- SamplerGroup create/update(spec)/resume (`samplergroup_pipeline.py`, `reconcile_group`) -> its
  Deployment + Service, then its status pipeline. Its Deployment deleted by someone else runs it again
  (`heal_group`).
- Status pipeline (`refresh_job_status`, `refresh_samplergroup_status`, `refresh_weightchannel_status`):
  the whole status from the indexes and the tick's memory, written by server-side apply on the status
  subresource as `STATUS_FIELD_MANAGER` (`pipelines.write_status`, the only status writer), only when it
  changed, with a Kubernetes Event on each phase (and CollapseRisk) transition. Events of children and
  pods (and a FailedMount Event on a pod) re-run it; `pipelines.py` runs one pipeline of an object at a
  time and coalesces a burst of events.
- One timer (`timer.py`), on each job's WeightChannel (kopf puts a finalizer on objects with timers;
  RLJobs must delete without the operator): it reads the channel's store, runs the rebalance tick, and
  re-runs the same pipelines. It writes nothing to the API itself.
- WeightChannel pipeline (`weightchannel_pipeline.py`, `refresh_weightchannel_status`): observe (the
  sampler pods in the pod index, then the store: `channel_read.read_channel`) -> pure compute
  (`channel.group_versions` with the age-out bound, `channel.subscribers_to_remove`,
  `channel_status.weightchannel_status`) -> apply (the reports of gone replicas removed from the store with
  `WeightChannel.remove_subscriber`, the status written). docs/weights.md, "Subscriber reports".
- Each RLJob is parsed once per generation (`parsed_jobs.parse`), by the reconcile, the status pipeline and
  the rebalance tick alike.
- Runtime state per object (locks, the timer's read times, the rebalancer's memory, the parsed RLJob) is
  dropped when it is no longer needed: see `pipelines.locked` and the DELETED branches of `rljob_event`
  and `weightchannel_event`.
The operator never writes an RLJob's spec (Argo CD owns it).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf

# Importing a module registers its kopf handlers: every module that has some.
import rlfleet.operator.indexes  # noqa: F401
import rlfleet.operator.rljob_pipeline  # noqa: F401
import rlfleet.operator.samplergroup_pipeline  # noqa: F401
import rlfleet.operator.timer  # noqa: F401
import rlfleet.operator.weightchannel_pipeline  # noqa: F401
from rlfleet.operator import kube
from rlfleet.operator import naming as n


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # kopf's bookkeeping in annotations under our prefix; status stays strictly typed by the CRD.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=n.KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=n.KOPF_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = n.FINALIZER
    # Events are posted explicitly (transitions, errors), not for every log line.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    settings.execution.max_workers = 4
    # Our kinds are fixed: no CRD scanning (saves a cluster-wide list/watch on CRDs in RBAC).
    settings.scanning.disabled = True
    # HA: how long a silent peer still counts as alive (a standby takes over after at most this).
    settings.peering.lifetime = int(os.environ.get("RLFLEET_PEERING_LIFETIME", "60"))


@kopf.on.login()
def login(settings: kopf.OperatorSettings, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """Kubeconfig when one is named ($KUBECONFIG / --kubeconfig), else the in-cluster service account."""
    if os.environ.get("KUBECONFIG"):
        info = kopf.login_with_kubeconfig(settings=settings, **kwargs)
    else:
        info = kopf.login_with_service_account(settings=settings, **kwargs) or kopf.login_with_kubeconfig(
            settings=settings, **kwargs
        )
    if info is not None:
        kube.set_connection(info)
    return info


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    await kube.close_api()
