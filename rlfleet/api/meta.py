"""The part of Kubernetes ObjectMeta our code reads (everything else is kept but not typed), and the
envelope of the rlfleet.dev kinds (`KubeObject`)."""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from rlfleet.api.common import API_VERSION, ApiModel


class ObjectMeta(BaseModel):
    """metadata of an object. Unknown keys (managedFields, ...) are kept, not validated."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")

    name: str | None = None
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    resource_version: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


SpecT = TypeVar("SpecT", bound=BaseModel)
StatusT = TypeVar("StatusT", bound=BaseModel)


class KubeObject(ApiModel, Generic[SpecT, StatusT]):
    """An object of one of the rlfleet.dev kinds: the envelope every kind shares, its spec and status (a
    kind narrows `kind` to its own name)."""

    api_version: Literal["rlfleet.dev/v1alpha1"] = API_VERSION
    """API version."""
    kind: str
    """Kind."""
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    """Object metadata."""
    spec: SpecT
    """Desired state."""
    status: StatusT | None = None
    """Observed state."""
