"""Router configuration (the file `rlfleet router serve --config` reads) and admin API bodies.

camelCase in YAML/JSON (like the CRDs), snake_case in Python. Unknown keys are errors, so a typo in
a ConfigMap fails at start with a clear message instead of being ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from rlfleet.retries import ROUTER_MAX_ATTEMPTS


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


def normalise_url(url: str) -> str:
    """`http://host:port` without a trailing slash; rejects anything that is not http(s)://host."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"replica url must look like http://host:port, got {url!r}")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


class GroupConfig(_Model):
    """One sampler group: a routing share (any non-negative weight; normalised) and its replicas: each
    URL is one replica, or, when its host is a name (http), one replica per address the name resolves to,
    looked up again every resolveIntervalSeconds (router/membership.py)."""

    name: str = Field(min_length=1, max_length=63)
    share: float = Field(default=1.0, ge=0.0)
    replicas: list[str] = Field(default_factory=list)
    quarantined: bool = False

    @field_validator("replicas")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        urls = [normalise_url(u) for u in value]
        if len(set(urls)) != len(urls):
            raise ValueError("replica urls must be unique")
        return urls


# The largest legitimate request body (docs/router.md, "Bounds"): a prompt of the whole context as
# JSON (token ids are at most 8 bytes each with their separator; text, JSON-escaped, stays under 32 bytes
# a token), plus 1 MiB for sampling parameters and the rest of the body.
BODY_BYTES_PER_CONTEXT_TOKEN = 32
BODY_OVERHEAD_BYTES = 1024 * 1024
# The context length assumed when the job does not state one (model.maxSeqLen unset): 128k tokens.
DEFAULT_CONTEXT_TOKENS = 131072


def max_body_bytes_for(context_tokens: int) -> int:
    """The router's body limit for a model whose context (prompt + generation) is `context_tokens`."""
    return BODY_OVERHEAD_BYTES + BODY_BYTES_PER_CONTEXT_TOKEN * context_tokens


class RouterConfig(_Model):
    host: str = "127.0.0.1"
    port: int = Field(default=30000, ge=0, le=65535)
    groups: list[GroupConfig] = Field(default_factory=list)
    # Readiness from a generation probe: GET healthPath (SGLang's /health_generate runs a one-token
    # generation; /health only says the HTTP server is up) + /model_info for the served weight version.
    health_path: str = Field(default="/health_generate", pattern=r"^/\S*$")
    health_interval_seconds: float = Field(default=2.0, gt=0.0)
    # How often the replica URLs' host names are looked up again (a headless Service: its ready pods).
    resolve_interval_seconds: float = Field(default=2.0, gt=0.0)
    # Below SGLang's own limit (SGLANG_HEALTH_CHECK_TIMEOUT, 20 s) so that a hung engine reads as a
    # probe that timed out (hung), not as its 503 (also its answer while draining on shutdown).
    health_timeout_seconds: float = Field(default=5.0, gt=0.0)
    failure_threshold: int = Field(default=2, ge=1)
    # Probes without an answer for this long: the replica is hung and its requests in flight move. Longer
    # than a weight load blocks SGLang's scheduler (update_weights_from_disk; the pod's readinessProbe
    # allows 45 s), shorter than the sampler client's 120 s read timeout.
    hung_after_seconds: float = Field(default=60.0, ge=0.0)
    connect_timeout_seconds: float = Field(default=2.0, gt=0.0)
    # An upstream attempt without an answer this long gets its replica's generation probed: a replica
    # found hung (hungAfterSeconds) is ejected and its requests move; any other keeps them (a long
    # generation is not a failure, and moving it would run it twice). None: only the periodic probe.
    request_timeout_seconds: float | None = Field(default=30.0, gt=0.0)
    max_connections_per_replica: int = Field(default=256, ge=1)
    # Upstream posts per request across replicas and groups (each replica once) before answering 503:
    # the router's part of the one retry policy of a turn (rlfleet/retries.py).
    max_attempts: int = Field(default=ROUTER_MAX_ATTEMPTS, ge=1)
    # Inside a group, keep a session on its own replica (prefix cache) unless that replica has more
    # than `loadSlack` requests in flight above the least loaded one.
    load_slack: int = Field(default=2, ge=0)
    retry_after_seconds: int = Field(default=1, ge=0)
    # Bounds against the router's clients (docs/router.md, "Bounds"): the largest body (413 above it),
    # the bytes of all bodies being read or routed at once (a request over the budget waits up to
    # bodyWaitSeconds, then 503 + Retry-After), the time a connection has to send a request's headers
    # (from its start or its previous response; also the idle keep-alive limit) and its body (408),
    # and the client connections held at once (None: half the process's file descriptor limit), in all
    # and from one client address (None: half of that; router/bounds.py).
    max_body_bytes: int = Field(default=max_body_bytes_for(DEFAULT_CONTEXT_TOKENS), ge=1024)
    body_budget_bytes: int = Field(default=256 * 1024 * 1024, ge=1024)
    body_wait_seconds: float = Field(default=10.0, ge=0.0)
    header_timeout_seconds: float = Field(default=10.0, gt=0.0)
    body_timeout_seconds: float = Field(default=30.0, gt=0.0)
    max_client_connections: int | None = Field(default=None, ge=1)
    max_client_connections_per_source: int | None = Field(default=None, ge=1)
    # Admin API bearer token: read from this file (a mounted Secret) or else this env variable.
    admin_token_file: str | None = None
    admin_token_env: str = "RLFLEET_ROUTER_ADMIN_TOKEN"
    # Data-plane key (optional): when set, /generate & co. need `Authorization: Bearer <key>` and the
    # router sends the same key to the replicas (SGLang / the reference sampler with --api-key).
    # Without one the data plane is open (keep the Service cluster-internal) and a client's
    # Authorization header is passed through to the replicas.
    api_key_file: str | None = None
    api_key_env: str | None = None
    # Annotate JSON responses: meta_info gets rlfleet_group / rlfleet_replica fields.
    annotate_body: bool = True

    @model_validator(mode="after")
    def _body_fits_budget(self) -> RouterConfig:
        if self.body_budget_bytes < self.max_body_bytes:
            raise ValueError(
                f"bodyBudgetBytes ({self.body_budget_bytes}) must be >= maxBodyBytes ({self.max_body_bytes}): "
                "a body of the largest size must fit the budget"
            )
        return self

    @model_validator(mode="after")
    def _unique_groups(self) -> RouterConfig:
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"group names must be unique, got {names}")
        return self


def load_config(path: str | Path) -> RouterConfig:
    """Read a YAML or JSON config file. Raises ValueError with a one-line reason on bad input."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read router config {str(file)!r}: {exc.strerror}") from None
    try:
        data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"router config {str(file)!r} is not valid YAML/JSON: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"router config {str(file)!r} must be a mapping")
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"invalid router config {str(file)!r}: {format_validation_error(exc)}") from None


def format_validation_error(exc: ValidationError) -> str:
    """pydantic errors as one line: `groups.0.share: Input should be >= 0; ...`."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


# --- admin API bodies -------------------------------------------------------------------------


class SharesUpdate(_Model):
    """PUT /admin/shares: new weights per group (normalised by the router). Unknown groups are errors."""

    shares: dict[str, float]
    reason: str | None = None

    @field_validator("shares")
    @classmethod
    def _non_negative(cls, value: dict[str, float]) -> dict[str, float]:
        for name, share in value.items():
            if not share >= 0.0 or share == float("inf"):
                raise ValueError(f"share of {name!r} must be a finite number >= 0, got {share}")
        return value


class GroupUpdate(_Model):
    """PUT /admin/groups/{name}: quarantine a group of the config, or lift its quarantine. Its replicas are
    not the admin API's: they follow its configured URLs (router/membership.py)."""

    quarantined: bool
