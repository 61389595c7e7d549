"""Where a model's base checkpoint comes from: ONE resolver for `spec.model.path` (docs/architecture.md,
"Model sources"), used by the trainer and by anything on the sampler side that needs the base model.

`resolve_model_source(path)` returns a local directory holding the checkpoint:
- a local or PVC directory: used in place; it must hold `config.json` (a Hugging Face checkpoint) or
  `rlfleet_view.json` (one of our own weight views);
- `s3://bucket/prefix[?endpoint=URL&region=R]`: every object under the prefix is downloaded with the
  weight channel's S3 store (`rlfleet.store`) into the cache and verified against the prefix's
  `SHA256SUMS` (the `sha256sum` format; `rlfleet model tiny-qwen3` writes one) before use. A prefix
  without `SHA256SUMS` is refused: weights are verified by checksum before use;
- a Hugging Face id (`org/name`, optionally `revision`): fetched once with huggingface_hub's
  `snapshot_download` into the Hugging Face cache (`HF_HOME`; on rlfleet pods `/tmp/huggingface`,
  the writable emptyDir of the non-root uid 10001); the hub verifies the files it downloads.
- `builtin:tiny-qwen3[?seed=N]`: the project's tiny Qwen3 (rlfleet/tiny_qwen3.py, what `rlfleet model
  tiny-qwen3` writes: seeded, built locally, no download) built once into the cache; for trying the
  operator without a model anywhere (examples/rljob-cpu.yaml).
Anything else (another URI scheme, a missing directory, a directory that is not a checkpoint) is a
`ModelSourceError` with a one-line message.

No torch here (core module); boto3 and huggingface_hub are imported only for those sources.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

if TYPE_CHECKING:
    from rlfleet.store import Store

CHECKSUMS_FILE = "SHA256SUMS"
HF_CONFIG = "config.json"
VIEW_CONFIG = "rlfleet_view.json"  # rlfleet.numerics.views.VIEW_CONFIG_FILE (core must not import torch)
HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
"""A Hugging Face repo id: `name` or `org/name` (letters, digits, `._-`)."""

SnapshotDownload = Callable[..., str]


class ModelSourceError(ValueError):
    """`spec.model.path` cannot be resolved to a checkpoint directory (one-line message)."""


def default_cache_dir() -> Path:
    """`RLFLEET_MODEL_CACHE`, else `$HF_HOME/rlfleet-models`, else `~/.cache/rlfleet/models`."""
    if os.environ.get("RLFLEET_MODEL_CACHE"):
        return Path(os.environ["RLFLEET_MODEL_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "rlfleet-models"
    return Path.home() / ".cache" / "rlfleet" / "models"


def check_checkpoint_dir(directory: Path, source: str) -> Path:
    """`directory` if it is a checkpoint (config.json or an rlfleet view), else a clear error."""
    if not directory.is_dir():
        raise ModelSourceError(f"model source {source}: {directory} is not a directory")
    if not (directory / HF_CONFIG).is_file() and not (directory / VIEW_CONFIG).is_file():
        raise ModelSourceError(
            f"model source {source}: {directory} has no {HF_CONFIG} (not a Hugging Face checkpoint) "
            f"and no {VIEW_CONFIG} (not an rlfleet weight view)"
        )
    return directory


def is_hf_checkpoint(directory: str | Path) -> bool:
    """True when the resolved directory is a Hugging Face checkpoint (it has config.json)."""
    return (Path(directory) / HF_CONFIG).is_file()


def read_safetensors_dir(directory: str | Path) -> dict[str, Any]:
    """Every tensor of a Hugging Face checkpoint directory's `*.safetensors` files, HF-named, in their
    stored dtype (shards of an index included: they are the directory's safetensors files)."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ModelSourceError(f"model {directory}: no *.safetensors files")
    tensors: dict[str, Any] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def parse_checksums(text: str, source: str) -> dict[str, str]:
    """`sha256sum` output (`<hex>  <name>`, `*` for binary mode) -> {relative name: hex}."""
    sums: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split(maxsplit=1)
        if len(parts) != 2 or not re.fullmatch(r"[0-9a-f]{64}", parts[0]):
            raise ModelSourceError(
                f"model source {source}: {CHECKSUMS_FILE} line {number} is not '<sha256>  <file>'"
            )
        name = parts[1].strip().lstrip("*").removeprefix("./")
        if name.startswith("/") or ".." in Path(name).parts:
            raise ModelSourceError(
                f"model source {source}: {CHECKSUMS_FILE} names {name!r} outside the prefix"
            )
        sums[name] = parts[0]
    return sums


def write_checksums(directory: Path) -> Path:
    """Write `SHA256SUMS` for every file under `directory` (what an s3:// model source must carry)."""
    from rlfleet.store import hash_file

    lines = [
        f"{hash_file(p, 'sha256').hexdigest}  {p.relative_to(directory).as_posix()}"
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != CHECKSUMS_FILE
    ]
    path = directory / CHECKSUMS_FILE
    path.write_text("\n".join(lines) + "\n")
    return path


def spec_digest(spec: Any) -> str:
    """16 hex digits naming a dataclass `spec` in a cache (sha256 of its fields as sorted JSON)."""
    import hashlib
    import json
    from dataclasses import asdict

    return hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:16]


def build_once(target: Path, build: Callable[[Path], object]) -> Path:
    """`target` once it holds a complete checkpoint (its SHA256SUMS), else `build(tmp)` into a temporary
    sibling, checksummed and renamed into place: a half-written build is never used, and a builder
    that loses the race to another keeps theirs."""
    import tempfile

    if (target / CHECKSUMS_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        write_checksums(tmp)
        os.replace(tmp, target)
    except OSError:
        if not (target / CHECKSUMS_FILE).is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _intact(directory: Path, sums: dict[str, str]) -> bool:
    from rlfleet.store import hash_file

    return all(
        (directory / n).is_file() and hash_file(directory / n, "sha256").hexdigest == h
        for n, h in sums.items()
    )


def _download_s3(uri: str, cache_dir: Path, **s3_options: Any) -> Path:
    from rlfleet.store import open_store

    parsed = urlparse(uri)
    dest = cache_dir / "s3" / parsed.netloc / (parsed.path.strip("/") or "_root")
    store = open_store(uri, **s3_options)
    try:
        sums_text, sums = _read_checksums(store, uri)
        keys = set(store.list())
        missing = sorted(set(sums) - keys)
        if missing:
            raise ModelSourceError(
                f"model source {uri}: {CHECKSUMS_FILE} names files not in the prefix: {missing[:3]}"
            )
        if _intact(dest, sums):
            return dest  # already downloaded and still intact
        # A private staging directory per process: torchrun's ranks on one pod resolve the same source
        # at once; the first complete, verified copy is renamed into place, the others are dropped.
        staging = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex}"
        try:
            _download_verified(store, uri, sums, staging)
            (staging / CHECKSUMS_FILE).write_text(sums_text)
            _move_into_place(staging, dest, sums)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return dest
    finally:
        store.close()


def _read_checksums(store: Store, uri: str) -> tuple[str, dict[str, str]]:
    """The prefix's SHA256SUMS, as text and as name -> sha256; a missing or unreadable one is an error."""
    from rlfleet.store import KeyNotFoundError, StoreError

    try:
        sums_text = store.get(CHECKSUMS_FILE).decode()
        return sums_text, parse_checksums(sums_text, uri)
    except KeyNotFoundError:
        raise ModelSourceError(
            f"model source {uri}: no {CHECKSUMS_FILE} under the prefix (write one with "
            f"`sha256sum` over the checkpoint's files; weights are verified before use)"
        ) from None
    except StoreError as e:
        raise ModelSourceError(f"model source {uri}: {e}") from e


def _download_verified(store: Store, uri: str, sums: dict[str, str], staging: Path) -> None:
    """Download every listed file into `staging`, each checked against its sha256 as it arrives."""
    for name, expected in sorted(sums.items()):
        # SHA256SUMS is sha256sum's format: sha256 computed while downloading
        digest = store.get_file(name, staging / name, algorithm="sha256")
        if digest.hexdigest != expected:
            raise ModelSourceError(
                f"model source {uri}: {name} has sha256 {digest.hexdigest[:12]}.., "
                f"{CHECKSUMS_FILE} says {expected[:12]}.. (corrupted or tampered; not used)"
            )


def _move_into_place(staging: Path, dest: Path, sums: dict[str, str]) -> None:
    """Rename the verified staging copy to `dest` unless an intact copy is already there."""
    if _intact(dest, sums):
        return
    if dest.exists() and not _intact(dest, sums):  # an old, damaged copy (rechecked just now)
        shutil.rmtree(dest, ignore_errors=True)
    try:
        staging.rename(dest)
    except OSError:  # another process renamed its verified copy first
        if not _intact(dest, sums):
            raise


BUILTIN_TINY_QWEN3 = "builtin:tiny-qwen3"


def _builtin(source: str, name: str, query: str, cache: Path) -> Path:
    """`builtin:tiny-qwen3[?seed=N]`: the tiny Qwen3 built once under `cache` (rlfleet/tiny_qwen3.py)."""
    from urllib.parse import parse_qs

    if name != "tiny-qwen3":
        raise ModelSourceError(
            f"model source {source}: unknown built-in model {name!r} (built in: tiny-qwen3)"
        )
    params = parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(params) - {"seed"})
    if unknown:
        raise ModelSourceError(f"model source {source}: unknown parameter {', '.join(unknown)} (only seed)")
    try:
        seed = int(params.get("seed", ["0"])[-1])
    except ValueError:
        raise ModelSourceError(f"model source {source}: seed must be an integer") from None
    from rlfleet.tiny_qwen3 import TinyQwen3, cached_tiny_qwen3

    return cached_tiny_qwen3(cache, TinyQwen3(seed=seed))


def resolve_model_source(
    path: str,
    *,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    snapshot_download: SnapshotDownload | None = None,
    **s3_options: Any,
) -> Path:
    """The local checkpoint directory for `spec.model.path` (see the module docstring).

    `snapshot_download`: huggingface_hub's function (the default); tests pass a named stub."""
    if not path:
        raise ModelSourceError("model source is empty")
    parsed = urlparse(path)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ModelSourceError(f"model source {path}: no bucket")
        return check_checkpoint_dir(_download_s3(path, cache, **s3_options), path)
    if parsed.scheme == "file":
        return check_checkpoint_dir(Path(parsed.path), path)
    if parsed.scheme == "builtin":
        return check_checkpoint_dir(_builtin(path, parsed.path, parsed.query, cache), path)
    if parsed.scheme:
        raise ModelSourceError(
            f"model source {path}: unknown scheme {parsed.scheme!r} (use a directory, file://, s3://, "
            f"{BUILTIN_TINY_QWEN3} or a Hugging Face id)"
        )
    local = Path(path).expanduser()
    if local.exists() or path.startswith(("/", ".", "~")) or not HF_ID.match(path):
        if not local.exists():
            raise ModelSourceError(f"model source {path}: no such directory")
        return check_checkpoint_dir(local, path)
    return check_checkpoint_dir(_hub_snapshot(path, revision, snapshot_download), path)


def _hub_snapshot(path: str, revision: str | None, snapshot_download: SnapshotDownload | None) -> Path:
    """The Hugging Face Hub snapshot of repo id `path` (downloaded unless already in the hub's cache)."""
    if snapshot_download is None:
        from huggingface_hub import snapshot_download as hub_snapshot_download

        snapshot_download = hub_snapshot_download
    try:
        # cache_dir None: the hub's own cache under HF_HOME, shared with SGLang on the same pod
        fetched = snapshot_download(repo_id=path, revision=revision)
    except Exception as e:  # the hub raises many types (offline, 404, gated): one clear line
        raise ModelSourceError(
            f"model source {path}: Hugging Face download failed: {type(e).__name__}: {e}"
        ) from e
    return Path(fetched)
