"""Validating admission webhook: the rules CEL cannot see (docs/install.md "Admission webhook").

The CRD's OpenAPI + CEL rules are generated from the built-in catalog. When the operator runs with an
override (`RLFLEET_CATALOG`: another price, an extra class, a class that loses a format), this webhook
re-validates RLJobs and SamplerGroups with the same pydantic models against the catalog the operator
actually uses, so `kubectl apply` is rejected with the same clear message instead of the job failing
later. It also refuses an RLJob whose child names would collide with another job's in the namespace
(CEL sees one object; `admission.collision_message` compares the namespace's RLJobs and SamplerGroups,
listed from the API: every replica answers, and a standby replica's kopf indexes are empty), and one
whose weight store overlaps another RLJob's (`admission.shared_store_message`: the namespace's jobs for a
filesystem store, every namespace's for an S3 bucket, whose name is global).
An UPDATE that leaves the spec as it was (kopf's own annotations, a finalizer, labels) is not judged,
as the API server ratchets CEL rules: an object the catalog has since turned invalid can still be
deleted.

Enabled by `rlfleet operator run --webhook-port P` (this module is only imported then). TLS, one of:
- `--webhook-cert/--webhook-key`: files (cert-manager's Secret, mounted; re-read when they change);
- `--webhook-cert-secret S --webhook-configuration C`: the operator keeps a CA and serving certificate in
  Secret S of its namespace (`rlfleet.operator.certs` decides; `CertKeeper` applies) and writes the CA
  into the caBundle of ValidatingWebhookConfiguration C (the chart's, without cert-manager);
- neither: a self-signed certificate for `--webhook-host`, new at every start (by hand, with
  `--webhook-managed`, which lets kopf create and keep the configuration `rlfleet.dev`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import kopf

from rlfleet.api.common import API_VERSION, GROUP, VERSION
from rlfleet.operator import certs, kube
from rlfleet.operator.admission import WEBHOOK_ENV, admission_message, collision_message, shared_store_message

log = logging.getLogger("rlfleet.operator.webhook")

FIRST_SYNC_RETRY_SECONDS = 10.0
# what an API call can fail with besides the API's own answer: the connection, a timeout
API_FAILURES = (kube.KubeError, aiohttp.ClientError, asyncio.TimeoutError, OSError)


def _manifest(body: kopf.Body) -> dict[str, Any]:
    return {k: body[k] for k in body if k != "status"}


def _spec_unchanged(operation: str | None, old: kopf.Body | None, body: kopf.Body) -> bool:
    return operation == "UPDATE" and old is not None and old.get("spec") == body.get("spec")


async def _namespace_collision(manifest: dict[str, Any], namespace: str | None) -> str | None:
    """collision_message over the namespace's RLJobs and SamplerGroups as the API has them now. Unknown
    (not logged in yet, the API failing): None, as with failurePolicy Ignore; the RLJob pipeline
    refuses the colliding job anyway (Failed, InvalidSpec)."""
    if not namespace or not kube.connected():
        return None
    api = kube.api()
    try:
        jobs, groups = await asyncio.gather(
            api.list(API_VERSION, "RLJob", namespace), api.list(API_VERSION, "SamplerGroup", namespace)
        )
    except API_FAILURES as exc:
        log.warning(
            "webhook: could not list RLJobs and SamplerGroups of %s (%s): collisions not checked",
            namespace,
            exc,
        )
        return None
    return collision_message(manifest, jobs, groups)


async def _jobs_sharing_the_store(manifest: dict[str, Any], namespace: str | None) -> str | None:
    """shared_store_message over the RLJobs the store could be shared with, as the API has them now: the
    namespace's (a filesystem store) or every namespace's (S3: a bucket is global; an operator limited to
    watchNamespaces may not list cluster-wide, and then checks its namespace only, saying so). Unknown
    (the API failing): None, as with failurePolicy Ignore; the trainers' writer lease refuses the second
    trainer at start anyway (docs/weights.md, "One writer per channel")."""
    if not namespace or not kube.connected():
        return None
    s3 = (manifest.get("spec", {}).get("weightChannel", {}).get("store", {}) or {}).get("type") == "s3"
    api = kube.api()
    try:
        try:
            jobs = await api.list(API_VERSION, "RLJob", None if s3 else namespace)
        except kube.KubeError as exc:
            if not (s3 and exc.status == 403):
                raise
            log.warning(
                "webhook: RLJobs cannot be listed cluster-wide (RBAC of watchNamespaces): the S3 "
                "store of %s/%s is checked against namespace %s only",
                namespace,
                manifest.get("metadata", {}).get("name"),
                namespace,
            )
            jobs = await api.list(API_VERSION, "RLJob", namespace)
    except API_FAILURES as exc:
        log.warning("webhook: could not list RLJobs (%s): shared weight stores not checked", exc)
        return None
    return shared_store_message(manifest, namespace, jobs)


@kopf.on.validate(GROUP, VERSION, "rljobs", id="validate-rljob", operation="CREATE")
@kopf.on.validate(GROUP, VERSION, "rljobs", id="validate-rljob-update", operation="UPDATE")
async def validate_rljob(
    body: kopf.Body,
    old: kopf.Body | None = None,
    operation: str | None = None,
    namespace: str | None = None,
    **_: Any,
) -> None:
    if _spec_unchanged(operation, old, body):
        return
    manifest = _manifest(body)
    message = admission_message("RLJob", manifest)
    namespace = namespace or manifest.get("metadata", {}).get("namespace")
    if message is None:
        message = await _namespace_collision(manifest, namespace)
    if message is None:
        message = await _jobs_sharing_the_store(manifest, namespace)
    if message:
        raise kopf.AdmissionError(message, code=422)


@kopf.on.validate(GROUP, VERSION, "samplergroups", id="validate-samplergroup", operation="CREATE")
@kopf.on.validate(GROUP, VERSION, "samplergroups", id="validate-samplergroup-update", operation="UPDATE")
def validate_samplergroup(
    body: kopf.Body, old: kopf.Body | None = None, operation: str | None = None, **_: Any
) -> None:
    if _spec_unchanged(operation, old, body):
        return
    message = admission_message("SamplerGroup", _manifest(body))
    if message:
        raise kopf.AdmissionError(message, code=422)


# --- the operator's own certificate (Secret mode) -------------------------------------------------------


class CertError(Exception):
    """The webhook's certificate cannot be kept (a missing configuration, a Secret that keeps changing)."""


@dataclass
class CertKeeper:
    """Keeps the webhook Secret (`certs.plan_secret`), the serving files kopf's server reads, and the
    configuration's caBundle in step; every replica runs one. A write names the resourceVersion it read,
    so of two replicas renewing at once one wins and the other reads the winner's Secret."""

    secret: str
    namespace: str
    configuration: str
    hosts: list[str]
    interval: float  # seconds between checks
    directory: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rlfleet-webhook-")))

    @property
    def certfile(self) -> Path:
        return self.directory / certs.TLS_CERT

    @property
    def keyfile(self) -> Path:
        return self.directory / certs.TLS_KEY

    async def sync(self) -> None:
        """Observe the configuration and the Secret, renew the Secret if due, write the files, set the
        caBundle. Raises CertError or kube.KubeError."""
        api = kube.api()
        configuration = await api.get(certs.WEBHOOK_API_VERSION, certs.WEBHOOK_KIND, None, self.configuration)
        if configuration is None:
            raise CertError(
                f"ValidatingWebhookConfiguration {self.configuration} not found (the chart creates it)"
            )
        data = await self._secret_data(api, configuration)
        self._write_files(data)
        patch = certs.ca_bundle_patch(configuration, data[certs.CA_CERT])
        if patch is not None:
            await api.apply(patch)
            log.info(
                "webhook: caBundle of ValidatingWebhookConfiguration %s set from Secret %s/%s",
                self.configuration,
                self.namespace,
                self.secret,
            )

    async def _secret_data(self, api: kube.KubeApi, configuration: Mapping[str, Any]) -> dict[str, str]:
        for _ in range(3):
            live = await api.get("v1", "Secret", self.namespace, self.secret)
            data = (live or {}).get("data")
            plan = certs.plan_secret(data, self.hosts, datetime.datetime.now(datetime.UTC))
            if plan is None:
                return dict(data or {})
            version = live["metadata"]["resourceVersion"] if live else None
            body = certs.secret_body(self.secret, self.namespace, plan.data, configuration, version)
            if await self._write(api, body, create=live is None):
                log.info("webhook: Secret %s/%s renewed: %s", self.namespace, self.secret, plan.reason)
                return plan.data
            # another replica wrote it between our read and our write: read theirs
        raise CertError(f"Secret {self.namespace}/{self.secret} kept changing under the operator")

    @staticmethod
    async def _write(api: kube.KubeApi, body: dict[str, Any], create: bool) -> bool:
        if create:
            return await api.create(body) is not None
        try:
            await api.apply(body)
        except kube.KubeError as exc:
            if exc.status == 409:  # not the resourceVersion we read
                return False
            raise
        return True

    def _write_files(self, data: Mapping[str, str]) -> None:
        """The serving pair as kopf's server reads it; rewritten only on change (SecretCertServer re-reads
        the files every 5 s and restarts its listener with the new certificate when they differ)."""
        for path, key in ((self.keyfile, certs.TLS_KEY), (self.certfile, certs.TLS_CERT)):
            pem = certs.pem_of(data, key)
            if not path.exists() or path.read_bytes() != pem:
                path.write_bytes(pem)
                path.chmod(0o600)

    async def first_sync(self) -> None:
        """Sync until it succeeds (the server cannot listen without a certificate), saying why not."""
        while True:
            try:
                await self.sync()
                return
            except (CertError, *API_FAILURES) as exc:
                log.error(
                    "webhook: no certificate yet (retrying in %.0f s): %s", FIRST_SYNC_RETRY_SECONDS, exc
                )
                await asyncio.sleep(FIRST_SYNC_RETRY_SECONDS)

    async def keep(self) -> None:
        """Check every `interval` seconds: renewal near expiry, another replica's renewal, a caBundle reset."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.sync()
            except (CertError, *API_FAILURES) as exc:
                log.error("webhook: certificate check failed (next in %.0f s): %s", self.interval, exc)


class SecretCertServer(kopf.WebhookServer):
    """kopf's webhook server, serving the certificate a CertKeeper keeps: it starts once the first sync
    wrote the files, and the keeper checks on while it serves."""

    def __init__(self, keeper: CertKeeper, **kwargs: Any) -> None:
        # the files are local (written by the keeper): re-read them often, a renewal serves within seconds
        super().__init__(certfile=keeper.certfile, pkeyfile=keeper.keyfile, file_check_interval=5.0, **kwargs)
        self.keeper = keeper

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        while not kube.connected():  # kopf logs in after the startup handlers
            await asyncio.sleep(0.1)
        await self.keeper.first_sync()
        keeping = asyncio.create_task(self.keeper.keep())
        try:
            async for client_config in super().__call__(fn):
                yield client_config
        finally:
            keeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeping


@kopf.on.startup()
def configure_webhook(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Start kopf's webhook server when RLFLEET_WEBHOOK_PORT is set (by `--webhook-port`)."""
    env = {key: os.environ.get(name) or "" for key, name in WEBHOOK_ENV.items()}
    if not env["port"]:
        return
    addr, port, host = env["addr"] or "0.0.0.0", int(env["port"]), env["host"] or "127.0.0.1"
    if env["secret"]:
        keeper = CertKeeper(
            secret=env["secret"],
            namespace=env["secret_namespace"],
            configuration=env["configuration"],
            hosts=[host],
            interval=float(env["check_interval"] or 60),
        )
        settings.admission.server = SecretCertServer(keeper, addr=addr, port=port, host=host)
    else:
        if env["cert"] and env["key"]:
            certfile, keyfile, cadata = Path(env["cert"]), Path(env["key"]), Path(env["cert"]).read_bytes()
        else:
            certfile, keyfile, cadata = certs.self_signed(
                host, Path(tempfile.mkdtemp(prefix="rlfleet-webhook-"))
            )
        settings.admission.server = kopf.WebhookServer(
            addr=addr, port=port, host=host, certfile=certfile, pkeyfile=keyfile, cadata=cadata
        )
    if env["managed"]:
        settings.admission.managed = GROUP
