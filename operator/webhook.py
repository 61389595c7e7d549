"""Validating admission webhook for the rules that depend on the LIVE accelerator catalog.

The CRD's OpenAPI + CEL rules are generated from the built-in catalog. When the operator runs with an
override (`RLFLEET_CATALOG`: another price, an extra class, a class that loses a format), this webhook
re-validates RLJobs and SamplerGroups with the same pydantic models against the catalog the operator
actually uses, so `kubectl apply` is rejected with the same clear message instead of the job failing
later. Enabled by `rlfleet operator run --webhook-port P` (this module is only imported then).

TLS: `--webhook-cert/--webhook-key` (e.g. from cert-manager); otherwise a self-signed certificate is
generated for `--webhook-host` (needs `cryptography`). `--webhook-managed` lets kopf create and keep
the ValidatingWebhookConfiguration `rlfleet.dev` (the chart can ship its own instead).

It also refuses an RLJob whose child names would collide with another job's in the namespace (CEL
sees one object only; the operator's indexes see the namespace): `admission.collision_message`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import kopf

from rlfleet.api.common import GROUP, VERSION
from rlfleet.operator.admission import (
    WEBHOOK_ENV,
    admission_message,
    collision_message,
    in_namespace,
    self_signed,
)


def _manifest(body: kopf.Body) -> dict[str, Any]:
    return {k: body[k] for k in body if k != "status"}


@kopf.on.validate(GROUP, VERSION, "rljobs", id="validate-rljob", operation="CREATE")
@kopf.on.validate(GROUP, VERSION, "rljobs", id="validate-rljob-update", operation="UPDATE")
def validate_rljob(body: kopf.Body, namespace: str | None = None, **kwargs: Any) -> None:
    manifest = _manifest(body)
    message = admission_message("RLJob", manifest)
    if message is None and "rljobs_idx" in kwargs:  # the operator's indexes (handlers.py) are loaded
        ns = namespace or manifest.get("metadata", {}).get("namespace")
        message = collision_message(
            manifest, in_namespace(kwargs["rljobs_idx"], ns), in_namespace(kwargs["samplergroups_idx"], ns)
        )
    if message:
        raise kopf.AdmissionError(message, code=422)


@kopf.on.validate(GROUP, VERSION, "samplergroups", id="validate-samplergroup", operation="CREATE")
@kopf.on.validate(GROUP, VERSION, "samplergroups", id="validate-samplergroup-update", operation="UPDATE")
def validate_samplergroup(body: kopf.Body, **_: Any) -> None:
    message = admission_message("SamplerGroup", _manifest(body))
    if message:
        raise kopf.AdmissionError(message, code=422)


@kopf.on.startup()
def configure_webhook(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Start kopf's webhook server when RLFLEET_WEBHOOK_PORT is set (by `--webhook-port`)."""
    port = os.environ.get(WEBHOOK_ENV["port"])
    if not port:
        return
    addr = os.environ.get(WEBHOOK_ENV["addr"], "0.0.0.0")
    host = os.environ.get(WEBHOOK_ENV["host"], "127.0.0.1")
    certfile, keyfile = os.environ.get(WEBHOOK_ENV["cert"]), os.environ.get(WEBHOOK_ENV["key"])
    cadata: bytes | None = None
    if not (certfile and keyfile):
        directory = Path(tempfile.mkdtemp(prefix="rlfleet-webhook-"))
        cert_path, key_path, cadata = self_signed(host, directory)
        certfile, keyfile = str(cert_path), str(key_path)
    else:
        cadata = Path(certfile).read_bytes()
    settings.admission.server = kopf.WebhookServer(
        addr=addr, port=int(port), host=host, certfile=certfile, pkeyfile=keyfile, cadata=cadata
    )
    if os.environ.get(WEBHOOK_ENV["managed"]):
        settings.admission.managed = GROUP
