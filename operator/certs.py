"""The validating webhook's TLS certificates: what to issue and when (pure: no I/O, no clock).

Without cert-manager the operator keeps a CA and a serving certificate signed by it in one Secret of its
namespace (`kubernetes.io/tls`: `tls.crt`, `tls.key`, `ca.crt`, plus the CA's key `ca.key`, which signs
the next serving certificate). Every replica serves with that Secret's certificate and writes its
`ca.crt` into the ValidatingWebhookConfiguration's caBundle, so HA replicas never disagree
(docs/install.md "Admission webhook"). The thin apply code is `rlfleet.operator.webhook.CertKeeper`.

Lifetimes: the CA 10 years, the serving certificate 1 year (never past its CA). Each is renewed when it
has less than RENEW_BEFORE left. A new serving certificate leaves `ca.crt` (the caBundle) unchanged; a
new CA is put first in `ca.crt` and the old one stays in it until it expires, so a replica still serving
the old certificate is trusted until it reads the Secret again.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_VALIDITY = datetime.timedelta(days=3650)
SERVING_VALIDITY = datetime.timedelta(days=365)
RENEW_BEFORE = datetime.timedelta(days=30)
CLOCK_SKEW = datetime.timedelta(minutes=5)  # notBefore lies this far back: API servers with a slower clock

SECRET_TYPE = "kubernetes.io/tls"
CA_CERT, CA_KEY, TLS_CERT, TLS_KEY = "ca.crt", "ca.key", "tls.crt", "tls.key"
SECRET_KEYS = (CA_CERT, CA_KEY, TLS_CERT, TLS_KEY)
CA_NAME = "rlfleet webhook CA"

WEBHOOK_API_VERSION = "admissionregistration.k8s.io/v1"
WEBHOOK_KIND = "ValidatingWebhookConfiguration"


# --- building blocks ----------------------------------------------------------------------------------


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def new_ca(now: datetime.datetime) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) of a new CA valid from `now` (less CLOCK_SKEW) for CA_VALIDITY."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _cert_pem(cert), _key_pem(key)


def issue_serving(
    ca_pem: bytes, ca_key_pem: bytes, hosts: Sequence[str], now: datetime.datetime
) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) of a serving certificate for `hosts` (DNS names or IPs; the first is
    the CommonName) signed by the CA, valid for SERVING_VALIDITY but never past the CA."""
    ca = x509.load_pem_x509_certificate(ca_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the webhook CA's key is not an ECDSA key")
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(min(now + SERVING_VALIDITY, ca.not_valid_after_utc))
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return _cert_pem(cert), _key_pem(key)


def self_signed(host: str, directory: Path) -> tuple[Path, Path, bytes]:
    """(certfile, keyfile, CA PEM): a new CA and a serving certificate for `host` (IP or DNS name), in
    files: the webhook's TLS when it runs by hand without a Secret or files of its own."""
    now = datetime.datetime.now(datetime.UTC)
    ca_pem, ca_key_pem = new_ca(now)
    cert_pem, key_pem = issue_serving(ca_pem, ca_key_pem, [host], now)
    certfile, keyfile = directory / "webhook.crt", directory / "webhook.key"
    certfile.write_bytes(cert_pem)
    keyfile.write_bytes(key_pem)
    keyfile.chmod(0o600)
    return certfile, keyfile, ca_pem


# --- the Secret ---------------------------------------------------------------------------------------


def _b64(pem: bytes) -> str:
    return base64.b64encode(pem).decode()


def pem_of(data: Mapping[str, str], key: str) -> bytes:
    """One entry of a Secret's `data` (base64) as PEM bytes."""
    return base64.b64decode(data[key])


@dataclass(frozen=True)
class _Held:
    """What a Secret holds, parsed: the CA bundle (signing CA first), the CA key, the serving pair."""

    bundle: list[x509.Certificate]
    ca_key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _public_bytes(key: Any) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _parse(data: Mapping[str, str]) -> _Held | str:
    """The Secret's content, or why it is unusable."""
    missing = [k for k in SECRET_KEYS if not data.get(k)]
    if missing:
        return f"it lacks {', '.join(missing)}"
    try:
        bundle = x509.load_pem_x509_certificates(pem_of(data, CA_CERT))
        ca_key = serialization.load_pem_private_key(pem_of(data, CA_KEY), password=None)
        cert = x509.load_pem_x509_certificate(pem_of(data, TLS_CERT))
        key = serialization.load_pem_private_key(pem_of(data, TLS_KEY), password=None)
    except ValueError as exc:
        return f"it does not parse ({exc})"
    if not (isinstance(ca_key, ec.EllipticCurvePrivateKey) and isinstance(key, ec.EllipticCurvePrivateKey)):
        return "its keys are not ECDSA keys"
    if _public_bytes(bundle[0].public_key()) != _public_bytes(ca_key.public_key()):
        return f"{CA_KEY} is not the key of the first CA in {CA_CERT}"
    return _Held(bundle, ca_key, cert, key)


def _hosts_of(cert: x509.Certificate) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(name.value) for name in san]


def _serving_problem(held: _Held, hosts: Sequence[str], now: datetime.datetime) -> str | None:
    """Why the serving certificate must be re-issued (None: it is good for at least RENEW_BEFORE)."""
    try:
        held.cert.verify_directly_issued_by(held.bundle[0])
    except (ValueError, TypeError, InvalidSignature):
        return "the serving certificate is not signed by the CA"
    if _public_bytes(held.cert.public_key()) != _public_bytes(held.key.public_key()):
        return f"{TLS_KEY} is not the serving certificate's key"
    if sorted(_hosts_of(held.cert)) != sorted(str(_san(h).value) for h in hosts):
        return f"the serving certificate names {', '.join(_hosts_of(held.cert))}, not {', '.join(hosts)}"
    expires = held.cert.not_valid_after_utc
    if expires - now < RENEW_BEFORE:
        return f"the serving certificate expires at {expires.isoformat()}"
    return None


@dataclass(frozen=True)
class CertPlan:
    """A Secret content to write, and why."""

    reason: str
    data: dict[str, str]  # the Secret's `data`: base64 of each PEM


def _fresh(
    reason: str, hosts: Sequence[str], now: datetime.datetime, keep: Sequence[x509.Certificate] = ()
) -> CertPlan:
    """A new CA (first in the bundle, then the CAs of `keep` still valid at `now`) and its serving pair."""
    ca_pem, ca_key_pem = new_ca(now)
    cert_pem, key_pem = issue_serving(ca_pem, ca_key_pem, hosts, now)
    bundle = ca_pem + b"".join(_cert_pem(c) for c in keep if c.not_valid_after_utc > now)
    return CertPlan(
        reason,
        {CA_CERT: _b64(bundle), CA_KEY: _b64(ca_key_pem), TLS_CERT: _b64(cert_pem), TLS_KEY: _b64(key_pem)},
    )


def plan_secret(
    data: Mapping[str, str] | None, hosts: Sequence[str], now: datetime.datetime
) -> CertPlan | None:
    """The webhook Secret's next content, or None when it is good as it is (nothing is written).

    No Secret or an unusable one: a new CA and serving certificate. The CA within RENEW_BEFORE of its end:
    a new CA (the old one stays in the bundle while valid) and serving certificate. The serving
    certificate within RENEW_BEFORE of its end, for other hosts, or not from the CA: a new one from the
    same CA, the bundle unchanged."""
    if data is None:
        return _fresh("no Secret yet", hosts, now)
    held = _parse(data)
    if isinstance(held, str):
        return _fresh(f"the Secret was unusable: {held}", hosts, now)
    ca_expires = held.bundle[0].not_valid_after_utc
    if ca_expires - now < RENEW_BEFORE:
        return _fresh(f"the CA expires at {ca_expires.isoformat()}", hosts, now, keep=held.bundle)
    problem = _serving_problem(held, hosts, now)
    if problem is None:
        return None
    cert_pem, key_pem = issue_serving(_cert_pem(held.bundle[0]), pem_of(data, CA_KEY), hosts, now)
    return CertPlan(problem, {**data, TLS_CERT: _b64(cert_pem), TLS_KEY: _b64(key_pem)})


def secret_body(
    name: str,
    namespace: str,
    data: Mapping[str, str],
    owner: Mapping[str, Any],
    resource_version: str | None = None,
) -> dict[str, Any]:
    """The webhook Secret, owned by the ValidatingWebhookConfiguration it serves (deleting that, e.g.
    `helm uninstall`, garbage-collects the Secret). `resource_version`: write only over that version."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {"app.kubernetes.io/part-of": "rlfleet", "app.kubernetes.io/component": "webhook"},
        "ownerReferences": [
            {
                "apiVersion": owner["apiVersion"],
                "kind": owner["kind"],
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
            }
        ],
    }
    if resource_version:
        meta["resourceVersion"] = resource_version
    return {"apiVersion": "v1", "kind": "Secret", "type": SECRET_TYPE, "metadata": meta, "data": dict(data)}


def ca_bundle_patch(configuration: Mapping[str, Any], bundle: str) -> dict[str, Any] | None:
    """Server-side apply body that sets `bundle` (base64 PEM, as in the Secret's ca.crt) as the caBundle
    of every webhook of the configuration; None if every one already has it."""
    webhooks = configuration.get("webhooks") or []
    if all((w.get("clientConfig") or {}).get("caBundle") == bundle for w in webhooks):
        return None
    return {
        "apiVersion": WEBHOOK_API_VERSION,
        "kind": WEBHOOK_KIND,
        "metadata": {"name": configuration["metadata"]["name"]},
        "webhooks": [{"name": w["name"], "clientConfig": {"caBundle": bundle}} for w in webhooks],
    }
