"""Sandbox pods: the `pods` backend of `Sandbox` (RLJob rollout.sandbox.backend: pods).

Each sandbox is one pod (rlfleet/sandbox/podspec.py builds it) in the trainer's namespace; every
command, file read and write, the snapshot copied in at acquire (a tar on the exec's stdin) and the
diff go through the API server's exec (pods/exec, a websocket): nothing is shared with the trainer's
file system. `close()` deletes the pod. `PodSandboxes` is the factory the environment calls; made at
the trainer's start, before its first episode, it deletes every sandbox pod its trainer pod's previous
run left (a killed trainer process never closed them).

Client: kubernetes_asyncio (the operator's client; its WsApiClient speaks the exec websocket on the
aiohttp the trainer already has) on one event loop in a thread of its own. The environment calls the
`Sandbox` methods synchronously from worker threads (the rollout driver's asyncio.to_thread), so every
call is a coroutine submitted to that loop: any number of concurrent exec streams share one loop and one
connection pool, and no thread blocks on a socket of its own.
"""

from __future__ import annotations

import asyncio
import atexit
import io
import json
import os
import secrets
import tarfile
import threading
import time
from collections.abc import Coroutine, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

from rlfleet.sandbox import ExecSandbox, SandboxLimits, SandboxUnavailable
from rlfleet.sandbox.local import MAX_OUTPUT_BYTES, checked_relative
from rlfleet.sandbox.podspec import (
    CONTAINER,
    KILL_ARGV,
    WORKDIR,
    SandboxPodConfig,
    build_sandbox_pod,
    exec_argv,
    own_pod,
    owner_selector,
    sandbox_pod_name,
    warm_pool_target,
)

T = TypeVar("T")
STDIN, STDOUT, STDERR, STATUS = 0, 1, 2, 3  # the exec websocket's channels (v4.channel.k8s.io)
START_TIMEOUT_S = 300.0
# a container that will not start: reported at once, not after the start timeout
START_FAILURES = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)


class SandboxPodError(RuntimeError):
    """An exec the API server or the runtime refused (not a command's own failure)."""


class _BoundedOutput:
    """A command's output as the local sandbox keeps it: beyond MAX_OUTPUT_BYTES, the first and last half."""

    def __init__(self) -> None:
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = MAX_OUTPUT_BYTES // 2 - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        if len(self.tail) > MAX_OUTPUT_BYTES:
            del self.tail[: len(self.tail) - MAX_OUTPUT_BYTES // 2]

    def text(self) -> str:
        if self.total <= MAX_OUTPUT_BYTES:
            data = bytes(self.head + self.tail)
        else:
            tail = bytes(self.tail[-(MAX_OUTPUT_BYTES // 2) :])
            data = (
                bytes(self.head)
                + f"\n[... {self.total - MAX_OUTPUT_BYTES} bytes omitted ...]\n".encode()
                + tail
            )
        return data.decode("utf-8", errors="replace")


def exit_code(status: Mapping[str, Any]) -> int:
    """The command's exit code from the exec's status channel (a metav1.Status)."""
    if status.get("status") == "Success":
        return 0
    for cause in (status.get("details") or {}).get("causes") or []:
        if cause.get("reason") == "ExitCode":
            return int(cause["message"])
    raise SandboxPodError(f"exec failed: {status.get('message') or json.dumps(status)[:500]}")


class PodSandboxes:
    """The factory of sandbox pods for one trainer: `(files, limits) -> PodSandbox` (SweEnv's `sandbox`)."""

    def __init__(
        self,
        config: SandboxPodConfig,
        kubeconfig: str | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        """`kubeconfig`: None in a pod (its ServiceAccount token), else a kubeconfig file (tests)."""
        self.config = config
        self.start_timeout_s = start_timeout_s
        # the warm pool, touched only on the loop: idle running pods (name, started at), how many are
        # starting, and the sandboxes open now (what sizes the pool)
        self._idle: list[tuple[str, float]] = []
        self._warming = 0
        self._open = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sandbox-pods", daemon=True)
        self._thread.start()
        try:
            self._call(self._connect(kubeconfig))
            self.removed_leftovers = self._call(self._delete_owned())
        except BaseException:
            self.shutdown()
            raise
        atexit.register(
            self.shutdown
        )  # the trainer's exit deletes the pool's idle pods (a kill: the next run does)

    @classmethod
    def from_environment(cls, spec: Any, job: str, environ: Mapping[str, str] | None = None) -> PodSandboxes:
        """In the trainer pod: the RLJob's rollout.sandbox (`spec`, rlfleet.api.SandboxSpec) and the pod's
        own identity from the downward API."""
        pod = own_pod("pods", os.environ if environ is None else environ)
        # the sandbox spec's fields a pod takes under the same names
        same = ("image", "runtime_class_name", "cpu", "memory", "work_dir_size", "max_seconds", "warm_pool")
        config = SandboxPodConfig(
            **{name: getattr(spec, name) for name in same},
            namespace=pod.namespace,
            job=job,
            owner_pod=pod.name,
            owner_uid=pod.uid,
            node_selector=dict(spec.node_selector),
        )
        return cls(config)

    # --- the loop thread ---------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout)

    async def _connect(self, kubeconfig: str | None) -> None:
        from kubernetes_asyncio import client, config
        from kubernetes_asyncio.stream import WsApiClient

        api_configuration = client.Configuration()
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(
                client_configuration=api_configuration
            )  # the token is re-read as it rotates
        else:
            await config.load_kube_config(config_file=kubeconfig, client_configuration=api_configuration)
        self._api = client.ApiClient(api_configuration)
        self._ws = WsApiClient(api_configuration)
        # Any: the generated stubs want V1Pod bodies and a str command; the API takes plain dicts and
        # WsApiClient a list (one `command` query parameter per argument), and returns the websocket
        self.core: Any = client.CoreV1Api(self._api)
        self._exec_api: Any = client.CoreV1Api(self._ws)

    def shutdown(self) -> None:
        """Close the clients and stop the loop (the sandboxes themselves are closed one by one)."""
        if not self._loop.is_running():
            return
        atexit.unregister(self.shutdown)

        async def close() -> None:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if hasattr(self, "core"):  # the warm pool's idle pods: nobody will take them now
                await asyncio.gather(
                    *(self._delete_pod(name) for name, _ in self._idle), return_exceptions=True
                )
            self._idle.clear()
            for c in (getattr(self, "_api", None), getattr(self, "_ws", None)):
                if c is not None:
                    await c.close()

        try:
            self._call(close(), timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    # --- pods ------------------------------------------------------------------------------------------

    async def _delete_owned(self) -> list[str]:
        """Every sandbox pod of this trainer pod (a previous run's, after a restart): deleted now."""
        pods = await self.core.list_namespaced_pod(
            self.config.namespace, label_selector=owner_selector(self.config.owner_pod)
        )
        names = [p.metadata.name for p in pods.items]
        await asyncio.gather(*(self._delete_pod(name) for name in names))
        return names

    async def _delete_pod(self, name: str) -> None:
        from kubernetes_asyncio.client.rest import ApiException

        try:
            await self.core.delete_namespaced_pod(name, self.config.namespace, grace_period_seconds=0)
        except ApiException as exc:
            if exc.status != 404:
                raise

    async def _start_pod(self, name: str) -> None:
        await self.core.create_namespaced_pod(self.config.namespace, build_sandbox_pod(self.config, name))
        deadline = time.monotonic() + self.start_timeout_s
        why = "not scheduled yet"
        while time.monotonic() < deadline:
            pod = await self.core.read_namespaced_pod(name, self.config.namespace)
            phase = pod.status.phase
            for status in pod.status.container_statuses or []:
                waiting = status.state.waiting if status.state else None
                if waiting is not None:
                    why = f"{waiting.reason}: {waiting.message or ''}".strip()
                    if waiting.reason in START_FAILURES:
                        raise SandboxUnavailable(f"sandbox pod {name} cannot start ({why})")
                if status.state and status.state.running and phase == "Running":
                    return
            if phase in ("Failed", "Succeeded"):
                raise SandboxUnavailable(
                    f"sandbox pod {name} ended at its start ({phase}: {pod.status.message or ''})"
                )
            for cond in pod.status.conditions or []:
                if cond.type == "PodScheduled" and cond.status == "False":
                    why = f"unschedulable: {cond.message}"
            await asyncio.sleep(0.25)
        raise SandboxUnavailable(f"sandbox pod {name} did not start in {self.start_timeout_s:g} s ({why})")

    # --- the warm pool ----------------------------------------------------------------------------------

    async def _acquire(self) -> tuple[str, bool]:
        """A running pod for a new sandbox: an idle one of the pool (True), else one started now."""
        self._open += 1
        try:
            now = time.monotonic()
            while self._idle:
                name, started = self._idle.pop()
                if now - started < self.config.max_seconds / 2:  # well before its activeDeadlineSeconds
                    return name, True
                self._spawn(self._delete_pod(name))
            name = sandbox_pod_name(self.config.owner_pod, secrets.token_hex(4))
            try:
                await self._start_pod(name)
            except BaseException:
                await self._delete_pod(name)
                raise
            return name, False
        except BaseException:
            self._open -= 1
            raise
        finally:
            self._resize()

    async def _release(self, name: str) -> None:
        self._open -= 1
        self._resize()
        await self._delete_pod(name)

    def _resize(self) -> None:
        """Start or delete idle pods toward warm_pool_target (on the loop, never waiting)."""
        target = warm_pool_target(self._open, self.config.warm_pool)
        for _ in range(target - len(self._idle) - self._warming):
            self._warming += 1
            self._spawn(self._warm_one())
        while len(self._idle) > target:
            name, _ = self._idle.pop(0)
            self._spawn(self._delete_pod(name))

    async def _warm_one(self) -> None:
        name = sandbox_pod_name(self.config.owner_pod, secrets.token_hex(4))
        try:
            await self._start_pod(name)
        except Exception:  # noqa: BLE001 - a pool pod that cannot start is no sandbox's failure: gone, not retried
            await self._delete_pod(name)
            return
        finally:
            self._warming -= 1
        self._idle.append((name, time.monotonic()))
        self._resize()  # the target may have fallen meanwhile

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def pool(self) -> tuple[list[str], int, int]:
        """(idle pod names, pods starting for the pool, open sandboxes), as the loop sees them now."""

        async def read() -> tuple[list[str], int, int]:
            return [name for name, _ in self._idle], self._warming, self._open

        return self._call(read())

    async def _exec(
        self, name: str, argv: list[str], stdin: bytes, timeout_s: float
    ) -> tuple[int, str, bool]:
        """(exit code, output, timed out) of `argv` in the sandbox pod; on its timeout, every process of
        the container but pid 1 is killed by a second exec."""
        output = _BoundedOutput()
        status: dict[str, Any] = {}

        async def stream() -> None:
            ws_ctx = await self._exec_api.connect_get_namespaced_pod_exec(
                name,
                self.config.namespace,
                container=CONTAINER,
                command=argv,
                stdin=bool(stdin),
                stdout=True,
                stderr=True,
                tty=False,
                _preload_content=False,
            )
            async with ws_ctx as ws:
                for start in range(0, len(stdin), 1 << 20):
                    await ws.send_bytes(bytes([STDIN]) + stdin[start : start + (1 << 20)])
                async for msg in ws:
                    data = msg.data if isinstance(msg.data, bytes) else str(msg.data).encode()
                    if not data:
                        continue
                    if data[0] in (STDOUT, STDERR):
                        output.add(data[1:])
                    elif data[0] == STATUS and len(data) > 1:
                        status.update(json.loads(data[1:]))

        try:
            await asyncio.wait_for(stream(), timeout_s)
        except TimeoutError:
            await self._exec(name, KILL_ARGV, b"", 60)
            return -9, output.text(), True
        if not status:
            raise SandboxPodError(f"exec in sandbox pod {name} ended without a status (the pod is gone?)")
        return exit_code(status), output.text(), False

    # --- the factory -----------------------------------------------------------------------------------

    def __call__(self, files: Mapping[str, str], limits: SandboxLimits) -> PodSandbox:
        return PodSandbox(self, files, limits)


class PodSandbox(ExecSandbox):
    """One sandbox pod: the snapshot in /work (a git commit), every call an exec."""

    def __init__(
        self, pods: PodSandboxes, files: Mapping[str, str], limits: SandboxLimits | None = None
    ) -> None:
        self.pods = pods
        self.limits = limits or SandboxLimits()
        self.seconds = 0.0
        t0 = time.monotonic()
        self.name, self.warm = pods._call(pods._acquire())  # warm: an idle pod of the pool
        self.start_seconds = time.monotonic() - t0
        self.closed = False
        self.unpack_snapshot(_tar(files), WORKDIR, f"sandbox pod {self.name}")

    def _run_command(self, argv: list[str], timeout: float, stdin: bytes) -> tuple[int, str, bool]:
        return self.pods._call(
            self.pods._exec(self.name, exec_argv(argv, len(stdin), self.limits), stdin, timeout)
        )

    def _release(self) -> None:
        """Delete the pod; its processes die with it."""
        self.pods._call(self.pods._release(self.name))


def _tar(files: Mapping[str, str]) -> bytes:
    """The snapshot as an uncompressed tar (paths checked like the local sandbox's)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, content in files.items():
            data = content.encode()
            info = tarfile.TarInfo(checked_relative(path))
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
