"""Placement fields every rlfleet pod role shares: trainer, each sampler group, router (docs/scheduling.md).

The models mirror the Kubernetes core/v1 types they become (NodeSelector, Toleration, Affinity,
ResourceRequirements), typed so that `kubectl apply` and `rlfleet run --local` refuse bad input before
the operator builds a pod. The operator MERGES them with what it owns: the catalog's accelerator node
affinity is ANDed with the user's required node terms (never replaced), the GPU toleration is always
there, the nvidia.com/gpu request stays the spec's GPU count, and the operator's selector labels stay its own.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from rlfleet.api.common import DNS_SUBDOMAIN_PATTERN, ApiModel, cel_list, cel_rules
from rlfleet.api.podfields import POD_FIELDS_RULES, PodTemplateFields, Quantity

GPU_RESOURCE_NAME = "nvidia.com/gpu"  # rlfleet.catalog.GPU_RESOURCE (a test keeps them equal)

# Kueue's keys (https://kueue.sigs.k8s.io/docs/tasks/run/plain_pods/): the user names the LocalQueue with
# the queue label; the operator makes the trainer replicas ONE pod group (label + total-count annotation).
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_POD_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_POD_GROUP_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
KUEUE_POD_GROUP_SERVING_ANNOTATION = "kueue.x-k8s.io/pod-group-serving"

# Labels the operator puts on pods and selects them by (operator/naming.py; a test keeps them covered):
# a user label with one of these keys would move pods in or out of the operator's selectors.
OPERATOR_LABEL_PREFIX = "rlfleet.dev/"
OPERATOR_LABEL_KEYS: tuple[str, ...] = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/managed-by",
    KUEUE_POD_GROUP_LABEL,
)
OPERATOR_ANNOTATION_PREFIXES: tuple[str, ...] = ("rlfleet.dev/", "prometheus.io/")
OPERATOR_ANNOTATION_KEYS: tuple[str, ...] = (
    KUEUE_POD_GROUP_COUNT_ANNOTATION,
    KUEUE_POD_GROUP_SERVING_ANNOTATION,
)

# Kubernetes label syntax (apimachinery validation.IsQualifiedName / IsValidLabelValue).
QUALIFIED_NAME_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"

GPU_OVERRIDE_RULE = (
    f"(!has(self.requests) || !('{GPU_RESOURCE_NAME}' in self.requests)) && "
    f"(!has(self.limits) || !('{GPU_RESOURCE_NAME}' in self.limits))"
)
GPU_OVERRIDE_MESSAGE = (
    f"resources must not set {GPU_RESOURCE_NAME}: the operator requests exactly the spec's GPU count "
    "(trainer.gpusPerReplica, a group's tensorParallel; the router none); change that field instead"
)
POD_LABELS_RULE = (
    f"self.all(k, !k.startsWith('{OPERATOR_LABEL_PREFIX}') && !(k in {cel_list(OPERATOR_LABEL_KEYS)}))"
)
POD_LABELS_MESSAGE = (
    f"podLabels must not set the operator's own labels ({OPERATOR_LABEL_PREFIX}*, "
    f"{', '.join(OPERATOR_LABEL_KEYS)}): it selects and groups its pods by them"
)
POD_ANNOTATIONS_RULE = (
    f"self.all(k, !{cel_list(OPERATOR_ANNOTATION_PREFIXES)}.exists(p, k.startsWith(p)) && "
    f"!(k in {cel_list(OPERATOR_ANNOTATION_KEYS)}))"
)
POD_ANNOTATIONS_MESSAGE = (
    f"podAnnotations must not set the operator's own annotations ({', '.join(p + '*' for p in OPERATOR_ANNOTATION_PREFIXES)}, "
    f"{', '.join(OPERATOR_ANNOTATION_KEYS)}): it writes them (metrics scraping, the trainer's Kueue pod group)"
)
EMPTY_TERM_RULE = (
    "self.nodeSelectorTerms.all(t, (has(t.matchExpressions) && size(t.matchExpressions) > 0) || "
    "(has(t.matchFields) && size(t.matchFields) > 0))"
)
EMPTY_TERM_MESSAGE = (
    "nodeSelectorTerms: every term needs matchExpressions or matchFields (Kubernetes matches no node with "
    "an empty term)"
)
# the key half of bad_label_keys, for the API server: a nodeSelector key that is no label key never
# matches a node, and Kubernetes refuses it only when the operator creates the pods (after apply)
_CEL_QUALIFIED_NAME = QUALIFIED_NAME_PATTERN.replace("\\", "\\\\")  # a CEL string literal escapes backslashes
LABEL_KEYS_RULE = f"self.all(k, size(k) <= 317 && k.matches('{_CEL_QUALIFIED_NAME}'))"
_QUALIFIED_NAME_WORDS = (
    "[prefix/]name, the name at most 63 alphanumerics, '-', '_' or '.' (starting and ending alphanumeric), "
    "the prefix a DNS subdomain"
)
LABEL_KEYS_MESSAGE = f"nodeSelector keys must be Kubernetes label keys: {_QUALIFIED_NAME_WORDS}"
# the same rule for the pod labels and annotations (Kubernetes refuses a bad key only when the operator
# creates the pods, after apply)
POD_LABEL_KEYS_MESSAGE = f"podLabels keys must be Kubernetes label keys: {_QUALIFIED_NAME_WORDS}"
POD_ANNOTATION_KEYS_MESSAGE = (
    f"podAnnotations keys must be Kubernetes qualified names: {_QUALIFIED_NAME_WORDS}"
)
TOLERATION_RULE = "self.operator != 'Exists' || !has(self.value) || self.value == ''"
TOLERATION_MESSAGE = "toleration: operator Exists takes no value"

LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]
LabelKey = Annotated[str, Field(min_length=1, max_length=317, pattern=QUALIFIED_NAME_PATTERN)]
ShortString = Annotated[str, Field(max_length=317)]


def compact(value: Any) -> Any:
    """Wire form without empty lists and maps (Kubernetes drops them, so they would show up as drift)."""
    if isinstance(value, dict):
        out = {k: compact(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if v not in ({}, [], None)}
    if isinstance(value, list):
        return [compact(v) for v in value]
    return value


def bad_label_keys(keys: list[str] | set[str]) -> list[str]:
    """Keys that are not Kubernetes qualified names (prefix <= 253, name <= 63)."""
    bad = []
    for k in keys:
        prefix, _, name = k.rpartition("/")
        if not re.fullmatch(QUALIFIED_NAME_PATTERN, k) or len(prefix) > 253 or len(name) > 63:
            bad.append(k)
    return sorted(bad)


class Toleration(ApiModel):
    """A pod toleration (core/v1 Toleration), added to the operator's nvidia.com/gpu toleration."""

    model_config = cel_rules({"rule": TOLERATION_RULE, "message": TOLERATION_MESSAGE})

    key: str | None = Field(default=None, max_length=317, pattern=QUALIFIED_NAME_PATTERN)
    """Taint key (none with operator Exists: tolerate every taint)."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """Exists (any value) or Equal (the value below)."""
    value: str | None = Field(default=None, max_length=63)
    """Taint value for operator Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to tolerate (none: every effect)."""
    toleration_seconds: int | None = Field(default=None, ge=0)
    """NoExecute only: how long the pod stays bound after the taint appears."""

    @model_validator(mode="after")
    def _check(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError(TOLERATION_MESSAGE)
        return self


class NodeSelectorRequirement(ApiModel):
    """One node label requirement (core/v1 NodeSelectorRequirement)."""

    key: str = Field(min_length=1, max_length=317)
    """Node label key."""
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    """How the label's value is compared with values."""
    values: list[ShortString] = Field(default_factory=list, max_length=64)
    """Values for In/NotIn (one integer for Gt/Lt; none for Exists/DoesNotExist)."""


class NodeSelectorTerm(ApiModel):
    """A node selector term: every requirement must hold (core/v1 NodeSelectorTerm)."""

    match_expressions: list[NodeSelectorRequirement] = Field(default_factory=list, max_length=32)
    """Requirements on node labels."""
    match_fields: list[NodeSelectorRequirement] = Field(default_factory=list, max_length=32)
    """Requirements on node fields (metadata.name)."""


class NodeSelector(ApiModel):
    """Required node terms (ORed), each ANDed with the catalog's accelerator terms."""

    model_config = cel_rules(
        {"rule": EMPTY_TERM_RULE, "message": EMPTY_TERM_MESSAGE, "fieldPath": ".nodeSelectorTerms"}
    )

    node_selector_terms: list[NodeSelectorTerm] = Field(min_length=1, max_length=16)
    """Terms; a node fits when it matches one of them AND the accelerator class."""

    @model_validator(mode="after")
    def _check_terms(self) -> NodeSelector:
        if any(not (t.match_expressions or t.match_fields) for t in self.node_selector_terms):
            raise ValueError(EMPTY_TERM_MESSAGE)
        return self


class PreferredSchedulingTerm(ApiModel):
    """A weighted preference for nodes (core/v1 PreferredSchedulingTerm)."""

    weight: int = Field(ge=1, le=100)
    """Weight 1..100 added to the node's score when it matches."""
    preference: NodeSelectorTerm
    """The node term."""


class NodeAffinity(ApiModel):
    """Node affinity, merged with the catalog's: required terms are ANDed with the accelerator class."""

    required_during_scheduling_ignored_during_execution: NodeSelector | None = None
    """Hard node requirements, on top of the accelerator class (which the operator always requires)."""
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] = Field(
        default_factory=list, max_length=16
    )
    """Soft node preferences."""


class LabelSelectorRequirement(ApiModel):
    """One pod label requirement (metav1 LabelSelectorRequirement)."""

    key: str = Field(min_length=1, max_length=317)
    """Pod label key."""
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    """How the label's value is compared with values."""
    values: list[ShortString] = Field(default_factory=list, max_length=64)
    """Values for In/NotIn."""


class LabelSelector(ApiModel):
    """A pod label selector (metav1 LabelSelector)."""

    match_labels: dict[str, LabelValue] = Field(default_factory=dict, max_length=32)
    """Labels the pods must carry."""
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list, max_length=32)
    """Requirements on pod labels."""


class PodAffinityTerm(ApiModel):
    """Pods matching labelSelector in the same topology domain (core/v1 PodAffinityTerm)."""

    label_selector: LabelSelector | None = None
    """Which pods (e.g. rlfleet.dev/job: <job>, rlfleet.dev/group: <group>)."""
    topology_key: str = Field(min_length=1, max_length=317)
    """Node label naming the domain, e.g. kubernetes.io/hostname or topology.kubernetes.io/zone."""
    namespaces: list[Annotated[str, Field(max_length=63)]] = Field(default_factory=list, max_length=16)
    """Namespaces of the pods (none: the pod's own)."""
    match_label_keys: list[ShortString] = Field(default_factory=list, max_length=16)
    """Label keys whose values are taken from the incoming pod and ANDed into labelSelector."""


class WeightedPodAffinityTerm(ApiModel):
    """A weighted pod (anti-)affinity preference."""

    weight: int = Field(ge=1, le=100)
    """Weight 1..100."""
    pod_affinity_term: PodAffinityTerm
    """The term."""


class PodAffinity(ApiModel):
    """Pod affinity or anti-affinity (core/v1 PodAffinity / PodAntiAffinity)."""

    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] = Field(
        default_factory=list, max_length=16
    )
    """Hard terms."""
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] = Field(
        default_factory=list, max_length=16
    )
    """Soft terms."""


class Affinity(ApiModel):
    """Scheduling affinity of the pods (core/v1 Affinity), merged with what the operator requires."""

    node_affinity: NodeAffinity | None = None
    """Node affinity; the catalog's accelerator terms are always required as well."""
    pod_affinity: PodAffinity | None = None
    """Co-locate with other pods (e.g. pack a group's samplers onto few nodes)."""
    pod_anti_affinity: PodAffinity | None = None
    """Keep away from other pods (the trainer's replicas always keep one per node)."""


class ResourceRequirements(ApiModel):
    """CPU, memory and other non-GPU resources of the role's main container (merged over the defaults)."""

    model_config = cel_rules({"rule": GPU_OVERRIDE_RULE, "message": GPU_OVERRIDE_MESSAGE})

    requests: dict[str, Quantity] = Field(default_factory=dict, max_length=16)
    """Requests by resource name (quoted quantities: cpu: "16", memory: 128Gi); replace the defaults per key."""
    limits: dict[str, Quantity] = Field(default_factory=dict, max_length=16)
    """Limits by resource name; replace the defaults per key."""

    @model_validator(mode="after")
    def _check_gpu(self) -> ResourceRequirements:
        if GPU_RESOURCE_NAME in self.requests or GPU_RESOURCE_NAME in self.limits:
            raise ValueError(GPU_OVERRIDE_MESSAGE)
        return self


def _label_map(keys_message: str, *rules: tuple[str, str]) -> Any:
    """The field of a map of labels or annotations (empty by default, at most 32 entries) whose keys must be
    qualified names (CEL: `keys_message` when one is not), with the CEL `rules` ((rule, message)) besides."""
    validations: list[Any] = [
        {"rule": LABEL_KEYS_RULE, "message": keys_message},
        *({"rule": rule, "message": message} for rule, message in rules),
    ]
    return Field(
        default_factory=dict, max_length=32, json_schema_extra={"x-kubernetes-validations": validations}
    )


class PodPlacement(PodTemplateFields):
    """Scheduling fields of one pod role (base of TrainerSpec, RouterSpec and SamplerGroupTemplate), with
    its env, identity and volumes (PodTemplateFields, rlfleet/api/podfields.py)."""

    model_config = cel_rules(*POD_FIELDS_RULES)

    node_selector: dict[str, LabelValue] = _label_map(LABEL_KEYS_MESSAGE)
    """Node labels the pods require, on top of the accelerator class (e.g. a node pool or zone)."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    """Tolerations added to the operator's nvidia.com/gpu toleration (e.g. a dedicated-pool taint)."""
    affinity: Affinity | None = None
    """Node and pod (anti-)affinity, merged with the catalog's accelerator node affinity (never replacing it)."""
    priority_class_name: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """PriorityClass of the pods (it must exist in the cluster)."""
    resources: ResourceRequirements | None = None
    """CPU / memory / ephemeral-storage requests and limits of the main container (never nvidia.com/gpu)."""
    pod_labels: dict[str, LabelValue] = _label_map(
        POD_LABEL_KEYS_MESSAGE, (POD_LABELS_RULE, POD_LABELS_MESSAGE)
    )
    """Extra pod labels, e.g. kueue.x-k8s.io/queue-name: <LocalQueue> (not the operator's rlfleet.dev/* or app.kubernetes.io/* labels)."""
    pod_annotations: dict[str, Annotated[str, Field(max_length=4096)]] = _label_map(
        POD_ANNOTATION_KEYS_MESSAGE, (POD_ANNOTATIONS_RULE, POD_ANNOTATIONS_MESSAGE)
    )
    """Extra pod annotations (not the operator's rlfleet.dev/*, prometheus.io/* or Kueue pod-group keys)."""

    @model_validator(mode="after")
    def _check_placement(self) -> PodPlacement:
        bad = bad_label_keys(set(self.node_selector) | set(self.pod_labels) | set(self.pod_annotations))
        if bad:
            raise ValueError(
                f"label and annotation keys must be Kubernetes qualified names: got {', '.join(bad)}"
            )
        reserved = sorted(
            k for k in self.pod_labels if k.startswith(OPERATOR_LABEL_PREFIX) or k in OPERATOR_LABEL_KEYS
        )
        if reserved:
            raise ValueError(f"{POD_LABELS_MESSAGE} (got {', '.join(reserved)})")
        reserved = sorted(
            k
            for k in self.pod_annotations
            if k.startswith(OPERATOR_ANNOTATION_PREFIXES) or k in OPERATOR_ANNOTATION_KEYS
        )
        if reserved:
            raise ValueError(f"{POD_ANNOTATIONS_MESSAGE} (got {', '.join(reserved)})")
        return self

    def placement_wire(self) -> dict[str, Any]:
        """The placement and pod template fields that are set, in wire form (what a SamplerGroup child
        inherits)."""
        placement = set(PodPlacement.model_fields) - set(PodTemplateFields.model_fields)
        wire = compact(self.model_dump(mode="json", by_alias=True, exclude_none=True, include=placement))
        return {**wire, **self.pod_fields_wire()}
