"""Router admin tokens derived from an operator key, so nothing has to read Secrets back; engine API keys.

With `RLFLEET_OPERATOR_KEY` (or a file named by `RLFLEET_OPERATOR_KEY_FILE`; the Helm chart mounts one
from a Secret), the token of a job is HMAC-SHA256(key, job uid): the operator writes it once into the
job's `<job>-router-admin` Secret (mounted by the router pods) and the rebalancer recomputes it, so
the operator needs `create` on Secrets but never `get`. Without a key the token is random and the
rebalancer has to read the Secret.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

KEY_ENV = "RLFLEET_OPERATOR_KEY"
KEY_FILE_ENV = "RLFLEET_OPERATOR_KEY_FILE"


def operator_key() -> bytes | None:
    """The operator key from the environment (value, or file), or None."""
    value = os.environ.get(KEY_ENV)
    if value:
        return value.encode()
    path = os.environ.get(KEY_FILE_ENV)
    if path and Path(path).is_file():
        data = Path(path).read_bytes().strip()
        return data or None
    return None


def derive_token(job_uid: str, key: bytes) -> str:
    """HMAC-SHA256(key, "router-admin:" + uid), hex."""
    return hmac.new(key, f"router-admin:{job_uid}".encode(), hashlib.sha256).hexdigest()


def admin_token_for(job_uid: str) -> str | None:
    """The derived token of a job, or None when no operator key is configured."""
    key = operator_key()
    return derive_token(job_uid, key) if key else None


def new_admin_token(job_uid: str) -> str:
    """Token to store in a new router Secret: derived when a key is configured, else random."""
    return admin_token_for(job_uid) or secrets.token_urlsafe(32)


def new_api_key() -> str:
    """A job's engine API key (its `<job>-api-key` Secret, created once and never rotated by a reconcile).
    Random, not derived: the operator never presents it (it reads only the engines' open /metrics), so it
    never needs to know it again. URL-safe characters only: it is expanded into the engines' argv
    (`--api-key $(RLFLEET_API_KEY)`, also inside the launch script's single quotes)."""
    return secrets.token_urlsafe(32)
