"""The pure half of the validating webhook: the rejection message for a manifest under the catalog in
effect, the webhook's settings names, and a self-signed certificate for it.

No kopf handlers live here, so importing this module registers nothing (the handlers are in
`rlfleet.operator.webhook`, imported only by `rlfleet operator run --webhook-port`)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rlfleet.api import RLJob, SamplerGroup, format_validation_error
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
