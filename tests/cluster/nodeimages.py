"""Images for the dev cluster's real node, built here with buildah (no Docker daemon, no registry).

- `pause` (the pod sandbox) and `helper` (local-path-provisioner's helper pods: busybox) are made
  from scratch: a static C program and Debian's static busybox;
- `base-cpu`: a debootstrap'd Debian (DEBIAN_SUITE) with Python and Debian's CPU build of torch, the
  base of the three rlfleet images on this machine (`pip install torch` from PyPI on Linux brings the
  CUDA libraries, several GB);
- `operator`, `sampler`, `trainer`: images/Dockerfile.* built for real (`buildah bud`, the same files
  `docker build` takes), their base images passed as build arguments, tagged as the RLJob's defaults with
  a `-cpu` suffix (CPU_TAGS).

Every image is kept as an OCI archive in ~/.cache/rlfleet/images, keyed by a digest of its inputs
(the Dockerfile, the package sources, the base's digest), so a second `images` is instant; `load`
imports the archives into the node's containerd. Builds reach the package registries only: Debian's
mirror is the one this machine's apt uses, and builds trust the CA bundle this machine trusts.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_USER_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
CACHE = Path(os.environ.get("RLFLEET_IMAGE_CACHE") or _USER_CACHE / "rlfleet" / "images")
BUILDAH_ROOT = CACHE / "buildah"
DEBIAN_SUITE = "trixie"  # Python 3.13 (megatron-core needs >= 3.12) and python3-torch (CPU) 2.6
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "python3-torch", "ca-certificates")
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
VERSION = "0.1.0"  # = pyproject's version = the RLJob's default image tags
REGISTRY = "ghcr.io/rlfleet"
CPU_TAGS = {name: f"{REGISTRY}/{name}:{VERSION}-cpu" for name in ("operator", "sampler", "trainer")}
PAUSE_IMAGE = "rlfleet.local/pause:1"
HELPER_IMAGE = "rlfleet.local/helper:1"
BASE_IMAGE = "rlfleet.local/base-cpu:1"
# The triton release PyPI's torch of the same minor version pins: `import megatron.core` needs triton, and
# torch's inductor imports it too, so it must be the one torch was built against.
TRITON_FOR_TORCH = {"2.6": "3.2.0"}
VENV = "/opt/venv"
TORCHRUN = f"""#!{VENV}/bin/python3
import sys

from torch.distributed.run import main

sys.exit(main())
"""
# Debian's torch is built without libuv, but torchrun's c10d rendezvous creates its TCPStore with the
# default use_libuv=True, which that build refuses ("use_libuv was requested but PyTorch was build without
# libuv support"; USE_LIBUV=0 does not reach that call), and so does each rank's env:// store under
# torchrun (torch/distributed/rendezvous.py `_create_c10d_store`: the agent-store client is made with the
# default). A .pth hook in the venv makes TCPStore default to use_libuv=False once torch.distributed is
# imported (nothing is imported before that): in torch.distributed and in its rendezvous module, which
# bound the original class while torch.distributed was being imported.
TCPSTORE_WITHOUT_LIBUV = '''"""The dev cluster's CPU base (tests/cluster/nodeimages.py): TCPStore without libuv, which Debian's
torch lacks; loaded by rlfleet-tcpstore-without-libuv.pth, it acts when torch.distributed is imported."""
import importlib.abc
import importlib.util
import sys


class _TCPStoreWithoutLibuv(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.distributed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)

            class TCPStore(module.TCPStore):
                def __init__(self, *args, **kwargs):
                    kwargs.setdefault("use_libuv", False)
                    super().__init__(*args, **kwargs)

            module.TCPStore = TCPStore
            sys.modules["torch.distributed.rendezvous"].TCPStore = TCPStore

        spec.loader.exec_module = exec_then_patch
        return spec


sys.meta_path.insert(0, _TCPStoreWithoutLibuv())
'''  # the CPU base's Python (first on PATH), over Debian's with its site-packages
SOURCES = ("pyproject.toml", "README.md", "rlfleet", "operator", "router", "sampler", "trainer")

PAUSE_C = r"""
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void reap(int s) { (void)s; while (waitpid(-1, 0, WNOHANG) > 0) {} }
static void quit(int s) { (void)s; _exit(0); }
int main(void) {
  signal(SIGINT, quit); signal(SIGTERM, quit); signal(SIGCHLD, reap);
  for (;;) pause();
}
"""


class ImageError(RuntimeError):
    pass


def _run(cmd: list[str], *, log: Path | None = None) -> str:
    """Run a build step; its output goes to `log` (long builds) and the tail into the error."""
    result = subprocess.run(cmd, capture_output=True, text=True)
    if log is not None:
        with open(log, "a") as out:
            out.write(f"$ {' '.join(cmd)}\n{result.stdout}{result.stderr}\n")
    if result.returncode != 0:
        raise ImageError(
            f"{' '.join(cmd[:6])} ... failed ({result.returncode}):\n{(result.stdout + result.stderr)[-3000:]}"
        )
    return result.stdout.strip()


def buildah(*args: str, log: Path | None = None) -> str:
    """buildah on the project's own storage (overlay, under CACHE): the machine's default is untouched."""
    return _run(
        [
            "buildah",
            "--root",
            str(BUILDAH_ROOT / "root"),
            "--runroot",
            str(BUILDAH_ROOT / "run"),
            "--storage-driver",
            "overlay",
            *args,
        ],
        log=log,
    )


def debian_mirror() -> str:
    """The Debian archive this machine's apt uses (deb822 `URIs:` or a one-line `deb` entry)."""
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for file in files:
        if not file.is_file() or file.name.endswith(".disabled-by-farm"):
            continue
        text = file.read_text(errors="replace")
        for uri in re.findall(r"^URIs:\s*(\S+)", text, re.MULTILINE) + re.findall(
            r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)", text, re.MULTILINE
        ):
            if uri.rstrip("/").endswith("/debian"):
                return uri
    raise ImageError(
        "no Debian archive in /etc/apt/sources.list(.d): the base image needs one for debootstrap"
    )


# --------------------------------------------------------------------------------------------------
# Inputs -> digest -> cached OCI archive.
# --------------------------------------------------------------------------------------------------


def _digest(parts: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def _source_bytes(paths: Iterable[str]) -> Iterable[bytes]:
    """Every file of the build context that matters (sorted; caches and bytecode skipped)."""
    for rel in paths:
        path = REPO / rel
        files = (
            [path]
            if path.is_file()
            else sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
            )
        )
        for file in files:
            yield str(file.relative_to(REPO)).encode()
            yield file.read_bytes()


@dataclass(frozen=True)
class Built:
    name: str
    ref: str  # the tag inside the archive (what pods name)
    archive: Path
    seconds: float  # 0.0: from the cache


def _cached(
    name: str, ref: str, digest: str, make: Callable[[Path], None], log: Callable[[str], None]
) -> Built:
    """The archive of `ref` for these inputs: from the cache, else built by `make(workdir)` (which must
    leave `ref` in buildah's storage) and pushed to an OCI archive. buildah 1.28 still gzips the layers
    despite --disable-compression (measured: 1.24 GB base -> 401 MiB archive), so the node's import
    decompresses them (45-110 s per image here)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    archive = CACHE / f"{name}-{digest}.tar"
    if archive.is_file():
        return Built(name, ref, archive, 0.0)
    for stale in CACHE.glob(f"{name}-*.tar"):
        stale.unlink()
    log(f"building image {ref} ...")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"rlfleet-image-{name}-") as tmp:
        make(Path(tmp))
        partial = archive.with_suffix(".partial")
        partial.unlink(missing_ok=True)
        buildah("push", "--disable-compression", ref, f"oci-archive:{partial}:{ref}")
        partial.rename(archive)
    buildah("rmi", "--prune")  # the previous build of `ref`, untagged now: GBs a rebuild, kept by nobody
    seconds = time.monotonic() - started
    log(f"built {ref} in {seconds:.0f}s ({archive.stat().st_size / 2**20:.0f} MiB)")
    return Built(name, ref, archive, seconds)


def _from_scratch(
    ref: str,
    files: dict[str, Path],
    entrypoint: list[str],
    user: str | None = None,
    links: dict[str, str] | None = None,
) -> None:
    container = buildah("from", "scratch")
    try:
        for dest, source in files.items():
            buildah("copy", "--chmod", "0755", container, str(source), dest)
        if links:
            mount = Path(buildah("mount", container))
            for link, target in links.items():
                (mount / link.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
                (mount / link.lstrip("/")).symlink_to(target)
            buildah("umount", container)
        config = ["config", "--entrypoint", repr(entrypoint).replace("'", '"')]
        if user:
            config += ["--user", user]
        buildah(*config, container)
        buildah("commit", "--quiet", container, ref)
    finally:
        buildah("rm", container)


def pause_image(log: Callable[[str], None] = print) -> Built:
    def make(tmp: Path) -> None:
        (tmp / "pause.c").write_text(PAUSE_C)
        _run(["gcc", "-static", "-O2", "-s", "-o", str(tmp / "pause"), str(tmp / "pause.c")])
        _from_scratch(PAUSE_IMAGE, {"/pause": tmp / "pause"}, ["/pause"], user="65535:65535")

    return _cached("pause", PAUSE_IMAGE, _digest([PAUSE_C.encode()]), make, log)


def helper_image(log: Callable[[str], None] = print) -> Built:
    """Debian's static busybox as /bin/sh & co.: local-path-provisioner's helper pods run `sh -c` with
    mkdir, chmod and rm on the node's storage directory."""
    busybox = Path("/bin/busybox")
    applets = ("sh", "mkdir", "rm", "chmod", "ls", "cat", "echo", "sleep", "test")

    def make(tmp: Path) -> None:
        _from_scratch(
            HELPER_IMAGE,
            {"/bin/busybox": busybox},
            ["/bin/sh"],
            links={f"/bin/{a}": "busybox" for a in applets},
        )

    return _cached(
        "helper", HELPER_IMAGE, _digest([busybox.read_bytes(), " ".join(applets).encode()]), make, log
    )


def base_image(log: Callable[[str], None] = print) -> Built:
    mirror = debian_mirror()

    def make(tmp: Path) -> None:
        rootfs = tmp / "rootfs"
        _run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                DEBIAN_SUITE,
                str(rootfs),
                mirror,
            ],
            log=tmp / "debootstrap.log",
        )
        # pip must keep Debian's CPU torch: a requirement it does not satisfy fails the build instead of
        # pulling PyPI's CUDA build (several GB)
        [torch_info] = (rootfs / "usr/lib/python3/dist-packages").glob("torch-*.egg-info")
        torch_version = torch_info.name.removeprefix("torch-").removesuffix(".egg-info")
        (rootfs / "etc/rlfleet").mkdir(parents=True, exist_ok=True)
        minor = ".".join(torch_version.split(".")[:2])
        if minor not in TRITON_FOR_TORCH:
            raise ImageError(
                f"Debian's torch {torch_version}: add the triton release its PyPI twin pins to TRITON_FOR_TORCH"
            )
        (rootfs / "etc/rlfleet/pip-constraints.txt").write_text(
            f"torch=={torch_version}\ntriton=={TRITON_FOR_TORCH[minor]}\n"
        )
        # The images' Python is a venv over Debian's: pip installs into it and never has to remove a
        # Debian-installed package (it cannot: no RECORD files), while Debian's torch stays visible.
        _run(["chroot", str(rootfs), "python3", "-m", "venv", "--system-site-packages", VENV])
        # Debian's /usr/bin/torchrun runs the system Python, which cannot see what pip installs into the venv
        # (rlfleet): the venv gets its own.
        torchrun = rootfs / VENV.lstrip("/") / "bin" / "torchrun"
        torchrun.write_text(TORCHRUN)
        torchrun.chmod(0o755)
        [site_packages] = (rootfs / VENV.lstrip("/") / "lib").glob("python3*/site-packages")
        (site_packages / "rlfleet_tcpstore_without_libuv.py").write_text(TCPSTORE_WITHOUT_LIBUV)
        (site_packages / "rlfleet-tcpstore-without-libuv.pth").write_text(
            "import rlfleet_tcpstore_without_libuv\n"
        )
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (rootfs / junk).glob("*"):
                if path.is_file():
                    path.unlink()
        container = buildah("from", "scratch")
        try:
            mount = buildah("mount", container)
            # tar keeps owners, modes and links as debootstrap made them (buildah copy would chown to root)
            _run(["sh", "-c", f"tar -C {rootfs} -cf - . | tar -C {mount} -xpf -"])
            buildah("umount", container)
            buildah(
                "config",
                "--env",
                f"PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--env",
                f"VIRTUAL_ENV={VENV}",
                "--env",
                "LANG=C.UTF-8",
                # torch's env:// rendezvous (init_process_group in each rank) reads it; the c10d store
                # of torchrun's agent does not (TCPSTORE_WITHOUT_LIBUV)
                "--env",
                "USE_LIBUV=0",
                "--env",
                "PIP_CONSTRAINT=/etc/rlfleet/pip-constraints.txt",
                "--cmd",
                "/bin/bash",
                container,
            )
            buildah("commit", "--quiet", container, BASE_IMAGE)
        finally:
            buildah("rm", container)

    recipe = [
        DEBIAN_SUITE,
        " ".join(BASE_PACKAGES),
        VENV,
        "venv --system-site-packages",
        "PIP_CONSTRAINT torch",
        repr(sorted(TRITON_FOR_TORCH.items())),
        TORCHRUN,
        TCPSTORE_WITHOUT_LIBUV,
        "USE_LIBUV=0",
    ]
    return _cached("base-cpu", BASE_IMAGE, _digest(r.encode() for r in recipe), make, log)


DOCKERFILE_BASE_ARGS = {  # the build argument naming each Dockerfile's base image, and extra CPU args
    "operator": {"PYTHON_IMAGE": BASE_IMAGE},
    "sampler": {"SGLANG_IMAGE": BASE_IMAGE, "SAMPLER_ENGINE": "reference"},
    "trainer": {"PYTORCH_IMAGE": BASE_IMAGE},
}


def rlfleet_image(name: str, base: Built, log: Callable[[str], None] = print) -> Built:
    """images/Dockerfile.<name> built by buildah on the CPU base, with the host's CA bundle mounted
    into RUN steps (pip trusts what this machine trusts)."""
    dockerfile = REPO / "images" / f"Dockerfile.{name}"
    ref = CPU_TAGS[name]
    build_args = DOCKERFILE_BASE_ARGS[name]
    digest = _digest(
        [
            base.archive.name.encode(),
            repr(sorted(build_args.items())).encode(),
            dockerfile.read_bytes(),
            *_source_bytes(SOURCES),
        ]
    )

    def make(tmp: Path) -> None:
        context = tmp / "context"  # what the .dockerignore lets through: the package sources
        context.mkdir()
        for rel in SOURCES:
            source = REPO / rel
            if source.is_dir():
                shutil.copytree(source, context / rel, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(source, context / rel)
        args = [
            "bud",
            "--isolation",
            "chroot",
            "--network",
            "host",
            "--layers=false",
            "-f",
            str(dockerfile),
            "-t",
            ref,
        ]
        for key, value in build_args.items():
            args += ["--build-arg", f"{key}={value}"]
        if HOST_CA_BUNDLE.is_file():
            args += ["--volume", f"{HOST_CA_BUNDLE}:/etc/ssl/certs/ca-certificates.crt:ro"]
        buildah(*args, str(context), log=CACHE / f"{name}.build.log")

    return _cached(name, ref, digest, make, log)


SANDBOX_IMAGE = "rlfleet.local/sandbox:1"
SANDBOX_PACKAGES = ("git",)  # over the CPU base's Python: what a SWE sandbox needs (sh, git, python3)


def sandbox_image(log: Callable[[str], None] = print) -> Built:
    """The sandbox pods' image (rlfleet/sandbox/pods.py, RLJob rollout.sandbox.image): the CPU base plus
    Debian's git, as uid 10001's (the pods set the uid; nothing else of the base changes)."""
    base = base_image(log)

    def make(tmp: Path) -> None:
        if buildah("images", "-q", BASE_IMAGE, log=None) == "":
            buildah("tag", buildah("pull", "-q", f"oci-archive:{base.archive}"), BASE_IMAGE)
        container = buildah("from", BASE_IMAGE)
        try:
            volume = (
                ["--volume", f"{HOST_CA_BUNDLE}:/etc/ssl/certs/ca-certificates.crt:ro"]
                if HOST_CA_BUNDLE.is_file()
                else []
            )
            buildah(
                "run",
                "--isolation",
                "chroot",
                "--network",
                "host",
                *volume,
                container,
                "--",
                "sh",
                "-c",
                "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "
                f"{' '.join(SANDBOX_PACKAGES)} && rm -rf /var/lib/apt/lists/*",
                log=tmp / "sandbox.log",
            )
            buildah("config", "--user", "10001:10001", "--workingdir", "/work", "--cmd", "/bin/sh", container)
            buildah("commit", "--quiet", container, SANDBOX_IMAGE)
        finally:
            buildah("rm", container)

    return _cached(
        "sandbox",
        SANDBOX_IMAGE,
        _digest([base.archive.name.encode(), " ".join(SANDBOX_PACKAGES).encode()]),
        make,
        log,
    )


def build_all(
    names: Iterable[str] = ("operator", "sampler", "trainer"), log: Callable[[str], None] = print
) -> list[Built]:
    """Every image the dev cluster loads: pause, helper, the CPU base (needed by the others but not
    loaded) and the named rlfleet images."""
    built = [pause_image(log), helper_image(log)]
    names = list(names)
    if names:
        base = base_image(log)
        if base.seconds == 0.0 and buildah("images", "-q", BASE_IMAGE, log=None) == "":
            # the archive was cached but buildah's storage is new: the Dockerfiles build FROM the tag
            buildah("tag", buildah("pull", "-q", f"oci-archive:{base.archive}"), BASE_IMAGE)
        built += [rlfleet_image(name, base, log) for name in names]
    return built
