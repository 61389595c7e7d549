"""The webhook's certificate decisions (operator/certs.py): what a new Secret holds, when the serving
certificate and the CA are renewed (30 days before their end), that a good Secret is left alone and that
a serving renewal keeps the caBundle. Certificates are read back with `cryptography` and checked against
the documented lifetimes, computed here from the clock the test gives."""

from __future__ import annotations

import base64
import datetime
import socket
import ssl
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from rlfleet.operator import certs

T0 = datetime.datetime(2026, 3, 1, 12, 0, 0, tzinfo=datetime.UTC)
DAY = datetime.timedelta(days=1)
SECOND = datetime.timedelta(seconds=1)
HOST = "rlfleet-webhook.rlfleet-system.svc"


def pems(data: dict[str, str], key: str) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(base64.b64decode(data[key]))


def serving(data: dict[str, str]) -> x509.Certificate:
    (cert,) = pems(data, "tls.crt")
    return cert


def sans(cert: x509.Certificate) -> list[str]:
    return [str(n.value) for n in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value]


def test_a_new_secret_holds_a_ca_and_a_serving_certificate_it_signed() -> None:
    plan = certs.plan_secret(None, [HOST], T0)
    assert plan is not None and plan.reason == "no Secret yet"
    assert sorted(plan.data) == ["ca.crt", "ca.key", "tls.crt", "tls.key"]
    (ca,) = pems(plan.data, "ca.crt")
    cert = serving(plan.data)
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert sans(cert) == [HOST]
    assert ca.not_valid_before_utc == cert.not_valid_before_utc == T0 - datetime.timedelta(minutes=5)
    assert ca.not_valid_after_utc == T0 + 3650 * DAY
    assert cert.not_valid_after_utc == T0 + 365 * DAY
    # the keys are the certificates' own
    key = serialization.load_pem_private_key(base64.b64decode(plan.data["tls.key"]), password=None)
    ca_key = serialization.load_pem_private_key(base64.b64decode(plan.data["ca.key"]), password=None)
    der = serialization.PublicFormat.SubjectPublicKeyInfo
    assert key.public_key().public_bytes(serialization.Encoding.DER, der) == cert.public_key().public_bytes(
        serialization.Encoding.DER, der
    )
    assert ca_key.public_key().public_bytes(serialization.Encoding.DER, der) == ca.public_key().public_bytes(
        serialization.Encoding.DER, der
    )


def test_a_good_secret_is_not_rewritten_until_30_days_before_the_serving_certificate_ends() -> None:
    data = certs.plan_secret(None, [HOST], T0).data
    assert certs.plan_secret(data, [HOST], T0) is None
    # the serving certificate ends at T0 + 365 d: renewed once less than 30 days are left
    assert certs.plan_secret(data, [HOST], T0 + 335 * DAY) is None
    renewed = certs.plan_secret(data, [HOST], T0 + 335 * DAY + SECOND)
    assert renewed is not None
    assert renewed.reason == f"the serving certificate expires at {(T0 + 365 * DAY).isoformat()}"
    # the CA and so the caBundle are untouched: replicas serving the old certificate stay trusted
    assert renewed.data["ca.crt"] == data["ca.crt"] and renewed.data["ca.key"] == data["ca.key"]
    assert renewed.data["tls.crt"] != data["tls.crt"] and renewed.data["tls.key"] != data["tls.key"]
    (ca,) = pems(data, "ca.crt")
    serving(renewed.data).verify_directly_issued_by(ca)
    assert serving(renewed.data).not_valid_after_utc == T0 + 335 * DAY + SECOND + 365 * DAY
    assert certs.plan_secret(renewed.data, [HOST], T0 + 335 * DAY + SECOND) is None


def test_the_ca_is_renewed_30_days_before_its_end_and_the_old_one_stays_trusted_while_valid() -> None:
    data = certs.plan_secret(None, [HOST], T0).data
    (old_ca,) = pems(data, "ca.crt")
    # 9 years on, the serving certificates issued by this CA end with it (never past their CA)
    late = T0 + 3650 * DAY - 100 * DAY
    reissued = certs.plan_secret(data, [HOST], late)
    assert reissued is not None and serving(reissued.data).not_valid_after_utc == T0 + 3650 * DAY
    assert certs.plan_secret(reissued.data, [HOST], T0 + 3620 * DAY) is None
    # with less than 30 days left on the CA: a new CA, first in the bundle, and the old one after it
    renewal = T0 + 3620 * DAY + SECOND
    rotated = certs.plan_secret(reissued.data, [HOST], renewal)
    assert rotated is not None and rotated.reason == f"the CA expires at {(T0 + 3650 * DAY).isoformat()}"
    new_ca, kept = pems(rotated.data, "ca.crt")
    assert kept == old_ca and new_ca != old_ca
    assert new_ca.not_valid_after_utc == renewal + 3650 * DAY
    serving(rotated.data).verify_directly_issued_by(new_ca)
    # once the old CA has expired, the next renewal drops it from the bundle
    after = renewal + 335 * DAY + SECOND
    again = certs.plan_secret(rotated.data, [HOST], after)
    assert again is not None and pems(again.data, "ca.crt") == [new_ca, old_ca]  # a serving renewal keeps it
    final = certs.plan_secret({**again.data, "ca.key": base64.b64encode(b"garbage").decode()}, [HOST], after)
    assert final is not None and len(pems(final.data, "ca.crt")) == 1  # unusable: all new, nothing kept


def test_a_changed_host_or_an_unusable_secret_gets_new_certificates() -> None:
    data = certs.plan_secret(None, [HOST], T0).data
    moved = certs.plan_secret(data, ["other.ns.svc"], T0 + DAY)
    assert moved is not None and moved.reason == f"the serving certificate names {HOST}, not other.ns.svc"
    assert moved.data["ca.crt"] == data["ca.crt"] and sans(serving(moved.data)) == ["other.ns.svc"]
    ip = certs.plan_secret(data, ["127.0.0.1"], T0)
    assert ip is not None and sans(serving(ip.data)) == ["127.0.0.1"]
    assert certs.plan_secret(ip.data, ["127.0.0.1"], T0) is None
    partial = {k: v for k, v in data.items() if k != "tls.key"}
    lacking = certs.plan_secret(partial, [HOST], T0)
    assert lacking is not None and lacking.reason == "the Secret was unusable: it lacks tls.key"
    assert lacking.data["ca.crt"] != data["ca.crt"]
    # a serving certificate of another CA (e.g. copied from another release) is re-issued from this one
    other = certs.plan_secret(None, [HOST], T0).data
    mixed = {**data, "tls.crt": other["tls.crt"], "tls.key": other["tls.key"]}
    fixed = certs.plan_secret(mixed, [HOST], T0)
    assert fixed is not None and fixed.reason == "the serving certificate is not signed by the CA"
    assert fixed.data["ca.crt"] == data["ca.crt"]


def test_ca_bundle_patch_sets_every_webhook_and_only_when_it_differs() -> None:
    bundle = certs.plan_secret(None, [HOST], T0).data["ca.crt"]
    configuration = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "rlfleet", "uid": "u1"},
        "webhooks": [
            {"name": "rljobs.rlfleet.dev", "clientConfig": {"service": {"name": "s"}}},
            {
                "name": "samplergroups.rlfleet.dev",
                "clientConfig": {"service": {"name": "s"}, "caBundle": bundle},
            },
        ],
    }
    assert certs.ca_bundle_patch(configuration, bundle) == {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "rlfleet"},
        "webhooks": [
            {"name": "rljobs.rlfleet.dev", "clientConfig": {"caBundle": bundle}},
            {"name": "samplergroups.rlfleet.dev", "clientConfig": {"caBundle": bundle}},
        ],
    }
    configuration["webhooks"][0]["clientConfig"]["caBundle"] = bundle
    assert certs.ca_bundle_patch(configuration, bundle) is None


def test_secret_body_is_owned_by_the_configuration_and_guards_the_version_it_read() -> None:
    owner = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "rlfleet", "uid": "u1"},
    }
    body = certs.secret_body("rlfleet-webhook-cert", "ops", {"ca.crt": "x"}, owner, "42")
    assert body["type"] == "kubernetes.io/tls" and body["data"] == {"ca.crt": "x"}
    assert body["metadata"]["resourceVersion"] == "42" and body["metadata"]["namespace"] == "ops"
    assert body["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "name": "rlfleet",
            "uid": "u1",
        }
    ]
    assert "resourceVersion" not in certs.secret_body("s", "ops", {}, owner)["metadata"]


def handshake(cert_pem: bytes, key_pem: bytes, bundle_pem: bytes, tmp_path: Path) -> bytes:
    """A TLS server on 127.0.0.1 with this pair; a client that trusts `bundle_pem` (as the API server
    trusts caBundle) and checks the host name connects and reads. Raises ssl errors as the client sees them."""
    (tmp_path / "tls.crt").write_bytes(cert_pem)
    (tmp_path / "tls.key").write_bytes(key_pem)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    client_ctx = ssl.create_default_context(cadata=bundle_pem.decode())
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)

        def serve() -> None:
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(b"ok")
            except (ssl.SSLError, OSError):
                pass  # the client refused the certificate

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            with socket.create_connection(listener.getsockname(), timeout=10) as raw:
                with client_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                    return tls.recv(2)
        finally:
            thread.join(10)


def test_after_a_ca_renewal_the_bundle_trusts_both_the_old_and_the_new_serving_certificate(
    tmp_path: Path,
) -> None:
    """Why caBundle never flaps: a replica that has not re-read the Secret yet still serves the serving
    certificate of the old CA, and the API server (trusting the new bundle) still accepts it. Real TLS
    handshakes, so the certificates are made around the real clock: a CA 20 days from its end."""
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    old = certs.plan_secret(None, ["127.0.0.1"], now - 3630 * DAY).data
    old_cert, old_key = certs.issue_serving(
        certs.pem_of(old, "ca.crt"), certs.pem_of(old, "ca.key"), ["127.0.0.1"], now - DAY
    )
    old = {
        **old,
        "tls.crt": base64.b64encode(old_cert).decode(),
        "tls.key": base64.b64encode(old_key).decode(),
    }
    assert handshake(old_cert, old_key, certs.pem_of(old, "ca.crt"), tmp_path) == b"ok"
    rotated = certs.plan_secret(old, ["127.0.0.1"], now)
    assert rotated is not None and rotated.reason.startswith("the CA expires at")
    bundle = certs.pem_of(rotated.data, "ca.crt")
    assert (
        handshake(
            certs.pem_of(rotated.data, "tls.crt"), certs.pem_of(rotated.data, "tls.key"), bundle, tmp_path
        )
        == b"ok"
    )
    assert handshake(old_cert, old_key, bundle, tmp_path) == b"ok"  # the replica not yet switched
    # a client trusting only the old CA refuses the new certificate (the bundle matters), and the
    # serving certificate is refused for a host it does not name
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(
            certs.pem_of(rotated.data, "tls.crt"),
            certs.pem_of(rotated.data, "tls.key"),
            certs.pem_of(old, "ca.crt"),
            tmp_path,
        )
    named = certs.plan_secret(None, ["rlfleet-webhook.ops.svc"], now).data
    with pytest.raises(ssl.SSLCertVerificationError, match="127.0.0.1"):
        handshake(
            certs.pem_of(named, "tls.crt"),
            certs.pem_of(named, "tls.key"),
            certs.pem_of(named, "ca.crt"),
            tmp_path,
        )
