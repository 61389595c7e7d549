"""Validating admission webhook for the rules that depend on the LIVE accelerator catalog.

The CRD's OpenAPI + CEL rules are generated from the built-in catalog. When the operator runs with an
override (`RLFLEET_CATALOG`: another price, an extra class, a class that loses a format), this webhook
re-validates RLJobs and SamplerGroups with the same pydantic models against the catalog the operator
actually uses, so `kubectl apply` is rejected with the same clear message instead of the job failing
later. Enabled by `rlfleet operator run --webhook-port P` (this module is only imported then).

TLS: `--webhook-cert/--webhook-key` (e.g. from cert-manager); otherwise a self-signed certificate is
generated for `--webhook-host` (needs `cryptography`). `--webhook-managed` lets kopf create and keep
the ValidatingWebhookConfiguration `rlfleet.dev` (the chart can ship its own instead).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import tempfile
from pathlib import Path
from typing import Any

import kopf
from pydantic import ValidationError

from rlfleet.api import RLJob, SamplerGroup, format_validation_error
from rlfleet.api.common import GROUP, VERSION
from rlfleet.catalog import CatalogError

WEBHOOK_ENV = {
    "port": "RLFLEET_WEBHOOK_PORT",
    "addr": "RLFLEET_WEBHOOK_ADDR",
    "host": "RLFLEET_WEBHOOK_HOST",
    "cert": "RLFLEET_WEBHOOK_CERT",
    "key": "RLFLEET_WEBHOOK_KEY",
    "managed": "RLFLEET_WEBHOOK_MANAGED",
}


def admission_message(kind: str, manifest: dict[str, Any]) -> str | None:
    """None if the object is valid against the runtime catalog, else the rejection message."""
    try:
        if kind == "RLJob":
            RLJob.from_manifest(manifest)
        else:
            SamplerGroup.from_manifest(manifest)
    except ValidationError as exc:
        return f"{kind} rejected by rlfleet (catalog in effect): " + "; ".join(
            line.strip() for line in format_validation_error(exc).splitlines()
        )
    except (CatalogError, ValueError) as exc:
        return f"{kind} rejected by rlfleet (catalog in effect): {exc}"
    return None


def _manifest(body: kopf.Body) -> dict[str, Any]:
    return {k: body[k] for k in body if k != "status"}


@kopf.on.validate(GROUP, VERSION, "rljobs", id="validate-rljob", operation="CREATE")
@kopf.on.validate(GROUP, VERSION, "rljobs", id="validate-rljob-update", operation="UPDATE")
def validate_rljob(body: kopf.Body, **_: Any) -> None:
    message = admission_message("RLJob", _manifest(body))
    if message:
        raise kopf.AdmissionError(message, code=422)


@kopf.on.validate(GROUP, VERSION, "samplergroups", id="validate-samplergroup", operation="CREATE")
@kopf.on.validate(GROUP, VERSION, "samplergroups", id="validate-samplergroup-update", operation="UPDATE")
def validate_samplergroup(body: kopf.Body, **_: Any) -> None:
    message = admission_message("SamplerGroup", _manifest(body))
    if message:
        raise kopf.AdmissionError(message, code=422)


def self_signed(host: str, directory: Path) -> tuple[Path, Path, bytes]:
    """(certfile, keyfile, CA PEM) of a self-signed certificate valid for `host` (IP or DNS name)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    try:
        san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        san = x509.DNSName(host)
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.SubjectAlternativeName([san]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    certfile, keyfile = directory / "webhook.crt", directory / "webhook.key"
    certfile.write_bytes(pem)
    keyfile.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    keyfile.chmod(0o600)
    return certfile, keyfile, pem


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
