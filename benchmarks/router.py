"""Router overhead: added latency (p50, p99) and requests/s per core, against a direct connection.

    .venv/bin/python benchmarks/router.py [--requests 3000] [--duration 6] [--concurrency 64]
        [--smg /path/to/smg | --install-smg] [--loops uvloop,asyncio] [--no-pin]

Setup (2 cores): the router under test runs alone on CPU 0 (taskset); a fast upstream (a minimal
asyncio HTTP/1.1 server answering an SGLang-shaped /generate JSON, 8 listening ports = 4 groups x 2
replicas) and this load generator share CPU 1. Latency: one keep-alive connection, sequential
requests, each with its own session id; added = router percentile - direct percentile. Throughput:
`--concurrency` connections for `--duration` seconds; "req/s per core" = answered requests / CPU
seconds the router process consumed (from /proc), so it holds even when the load generator, not the
router, is the bottleneck. Everything is compared in the same run; the machine is shared, so read
ratios, not absolutes. Also: reading/annotating a 1 MB response on its bytes vs json decode+encode.

    .venv/bin/python benchmarks/router.py --bounds [--big-posts 4] [--big-mb 200] [--legit-posts 200]
        [--slow-connections 2000]

Bounds (issue 32; docs/router.md, "Bounds"): the same router process started twice per scenario, once
with the bounds as they were before (`maxBodyBytes` 256 MiB, no body budget, aiohttp's 3,630 s
keep-alive as the only header deadline) and once with the defaults, in the same run: peak RSS (VmHWM)
and RSS after, for `--big-posts` concurrent posts of `--big-mb` MB, for `--legit-posts` concurrent
posts of the largest legitimate body (maxBodyBytes) to an upstream that answers after 1 s, and the
router's open file descriptors `headerTimeoutSeconds` + 2 s after `--slow-connections` connections
each sent half a request header, under an open-file limit of `--fd-limit` (1,024), and whether a normal
request is answered then.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

N_PORTS = 8
SMG_VENV = "/tmp/smgvenv"
PROMPT = list(range(1000, 1512))  # 512 prompt tokens
OUTPUT_TOKENS = 64


def response_body(n_tokens: int = OUTPUT_TOKENS, top: int = 0) -> bytes:
    """An SGLang /generate response with logprobs (and `top` top-logprobs per position)."""
    logprobs = [[-0.5 - i * 1e-3, 1000 + i, None] for i in range(n_tokens)]
    meta = {
        "id": "0123456789abcdef",
        "finish_reason": {"type": "length", "length": n_tokens},
        "prompt_tokens": len(PROMPT),
        "weight_version": "12",
        "completion_tokens": n_tokens,
        "cached_tokens": 0,
        "output_token_logprobs": logprobs,
    }
    if top:
        meta["output_top_logprobs"] = [
            [[-1.0 - j * 1e-2, 2000 + j, None] for j in range(top)] for _ in range(n_tokens)
        ]
    return json.dumps(
        {"text": "x" * n_tokens, "output_ids": list(range(n_tokens)), "meta_info": meta}
    ).encode()


# --- the fast upstream (its own process) -------------------------------------------------------


class _UpstreamProtocol(asyncio.Protocol):
    generate = b""
    delay = 0.0  # seconds before each answer (--upstream-delay)
    model_info = json.dumps({"model_path": "bench", "weight_version": "12", "is_generation": True}).encode()

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = bytes(self.buffer[:head_end]).decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buffer) < head_end + 4 + length:
                return
            del self.buffer[: head_end + 4 + length]
            method, path = head.split(" ", 2)[:2]
            if method == "POST":
                body = self.generate
            elif path in ("/model_info", "/get_model_info", "/get_server_info", "/server_info", "/v1/models"):
                body = self.model_info
            else:
                body = b"{}"
            answer = (
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            if self.delay:
                asyncio.get_running_loop().call_later(self.delay, self._answer, answer)
            else:
                self.transport.write(answer)

    def _answer(self, answer: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(answer)


async def _serve_upstream(port_file: str, delay: float = 0.0) -> None:
    _UpstreamProtocol.generate = response_body()
    _UpstreamProtocol.delay = delay
    loop = asyncio.get_running_loop()
    servers = [
        await loop.create_server(_UpstreamProtocol, "127.0.0.1", 0, backlog=1024) for _ in range(N_PORTS)
    ]
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    Path(port_file).write_text(json.dumps(ports))
    await asyncio.Event().wait()


# --- process helpers -----------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its threads (smg is multi-threaded), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_port(port: int, timeout: float = 60.0) -> None:
    import socket

    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listening on {port}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PIN = True


class Proc:
    def __init__(
        self, argv: list[str], cpu: int, env: dict[str, str] | None = None, stderr: int = subprocess.PIPE
    ) -> None:
        self.process = subprocess.Popen(
            (["taskset", "-c", str(cpu)] if PIN else []) + argv,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env={**os.environ, **(env or {})},
        )

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# --- load ---------------------------------------------------------------------------------------


async def latency_run(url: str, n: int, header: str, client: str = "aiohttp") -> list[float]:
    import aiohttp

    body = json.dumps(
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": OUTPUT_TOKENS, "temperature": 1.0}}
    ).encode()
    out: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
        for i in range(n + 200):  # 200 warm-up requests
            t0 = time.perf_counter()
            async with http.post(
                url + "/generate",
                data=body,
                headers={"Content-Type": "application/json", header: f"s{i % 500}"},
            ) as r:
                await r.read()
                assert r.status == 200, r.status
            if i >= 200:
                out.append(time.perf_counter() - t0)
    return out


async def throughput_run(
    url: str, seconds: float, concurrency: int, header: str, pid: int | None
) -> tuple[float, float | None]:
    import aiohttp

    body = json.dumps({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": OUTPUT_TOKENS}}).encode()
    done = 0
    errors = 0
    stop = False

    async def worker(http, index: int) -> None:
        nonlocal done, errors
        i = 0
        while not stop:
            i += 1
            async with http.post(
                url + "/generate",
                data=body,
                headers={"Content-Type": "application/json", header: f"w{index}-{i % 50}"},
            ) as r:
                await r.read()
                if r.status == 200:
                    done += 1
                else:
                    errors += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        tasks = [asyncio.create_task(worker(http, i)) for i in range(concurrency)]
        await asyncio.sleep(1.0)  # warm-up
        done, errors = 0, 0
        cpu0 = _cpu_seconds(pid) if pid else None
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        count, elapsed = done, time.perf_counter() - t0
        cpu1 = _cpu_seconds(pid) if pid else None
        stop = True
        await asyncio.gather(*tasks, return_exceptions=True)
    if errors:
        print(f"  ({errors} non-200 answers)")
    per_core = count / (cpu1 - cpu0) if pid and cpu1 > cpu0 else None
    return count / elapsed, per_core


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def library_overhead(url: str, n: int) -> tuple[float, float]:
    """p50 of Router.route() minus p50 of the same request sent directly, in one process: the routing
    library's own added latency (hashing, replica choice, metrics, meta scan + annotation)."""
    import aiohttp

    from rlfleet.router.config import GroupConfig, RouterConfig
    from rlfleet.router.core import Router

    body = json.dumps({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": OUTPUT_TOKENS}}).encode()
    headers = {"Content-Type": "application/json"}
    router = Router(RouterConfig(groups=[GroupConfig(name=f"g{i}", replicas=[url]) for i in range(4)]))
    await router.start(health_checks=False)
    direct: list[float] = []
    routed: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
        for i in range(n + 200):
            t0 = time.perf_counter()
            async with http.post(url + "/generate", data=body, headers=headers) as r:
                await r.read()
            t1 = time.perf_counter()
            result = await router.route("/generate", body, f"s{i % 500}", None, headers)
            t2 = time.perf_counter()
            assert result.status == 200
            if i >= 200:
                direct.append(t1 - t0)
                routed.append(t2 - t1)
    await router.close()
    return pct(routed, 0.5) - pct(direct, 0.5), pct(routed, 0.99) - pct(direct, 0.99)


def meta_microbench() -> None:
    from rlfleet.router import meta

    body = response_body(n_tokens=1024, top=20)
    fields = meta.annotation({"rlfleet_group": "h100-fp8", "rlfleet_replica": "http://10.0.0.7:30000"})
    n = 20
    t0 = time.perf_counter()
    for _ in range(n):
        scan = meta.scan(body)
        meta.annotate(body, scan.insert_at, fields)
    bytes_ms = (time.perf_counter() - t0) / n * 1e3
    t0 = time.perf_counter()
    for _ in range(n):
        decoded = json.loads(body)
        decoded["meta_info"].update({"rlfleet_group": "h100-fp8", "rlfleet_replica": "x"})
        json.dumps(decoded).encode()
    json_ms = (time.perf_counter() - t0) / n * 1e3
    print(
        f"\nresponse of {len(body) / 1e6:.2f} MB (1024 tokens, 20 top logprobs): read+annotate on bytes "
        f"{bytes_ms:.2f} ms vs json decode+encode {json_ms:.2f} ms ({json_ms / bytes_ms:.0f}x)"
    )


def _start_routers(
    loops: list[str], urls: list[str], procs: list[Proc]
) -> list[tuple[str, str, str, int | None]]:
    """One rlfleet router per event loop over the upstreams, two per group (added to `procs`)."""
    targets: list[tuple[str, str, str, int | None]] = []
    for loop in loops:
        port = _free_port()
        argv = [
            sys.executable,
            "-m",
            "rlfleet.cli",
            "router",
            "serve",
            "--port",
            str(port),
            "--loop",
            loop or "auto",
        ]
        for g in range(N_PORTS // 2):
            argv += ["--group", f"g{g}={urls[2 * g]},{urls[2 * g + 1]}"]
        proc = Proc(argv, cpu=0)
        procs.append(proc)
        _wait_port(port)
        name = f"rlfleet router ({loop or 'auto'})"
        targets.append((name, f"http://127.0.0.1:{port}", "X-Session-Id", proc.process.pid))
    return targets


def _start_smg(smg: str | None, urls: list[str], procs: list[Proc]) -> list[tuple[str, str, str, int | None]]:
    """SGLang's Rust router over the same upstreams when its binary is there (added to `procs`)."""
    if smg and os.path.exists(smg):
        port = _free_port()
        argv = [
            smg,
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *urls,
            "--policy",
            "consistent_hashing",
            "--log-level",
            "error",
            "--disable-health-check",
            "--prometheus-port",
            str(_free_port()),
        ]
        proc = Proc(argv, cpu=0)
        procs.append(proc)
        try:
            _wait_port(port)
            time.sleep(2.0)  # smg registers workers asynchronously after binding
            return [
                (
                    "smg (SGLang router, Rust)",
                    f"http://127.0.0.1:{port}",
                    "X-SMG-Routing-Key",
                    proc.process.pid,
                )
            ]
        except RuntimeError:
            print(
                f"smg did not start: {proc.process.stderr.read(2000) if proc.process.poll() is not None else ''}"
            )
    else:
        print("smg not found: pass --smg /path/to/smg (pip install smg into a separate venv)")
    return []


# --- bounds (issue 32) ---------------------------------------------------------------------------

MIB = 1024 * 1024
# The router's bounds before issue 32, in its config's terms: a 256 MiB body limit, no budget, and
# aiohttp's keep-alive timer (3,630 s) as the only deadline on a request's headers.
BEFORE_BOUNDS = {
    "maxBodyBytes": 256 * MIB,
    "bodyBudgetBytes": 1 << 50,
    "headerTimeoutSeconds": 3630.0,
    "bodyTimeoutSeconds": 3630.0,
    "maxClientConnections": 1 << 20,
}


def _start_configured_router(
    bounds: dict, urls: list[str], procs: list[Proc], fd_limit: int | None = None
) -> tuple[str, Proc]:
    """A router process with `bounds` in its config (and at most `fd_limit` open files: prlimit)."""
    port = _free_port()
    path = Path(tempfile.mkdtemp()) / "router.json"
    path.write_text(json.dumps({"port": port, "groups": [{"name": "g", "replicas": urls}], **bounds}))
    limit = ["prlimit", f"--nofile={fd_limit}:{fd_limit}"] if fd_limit else []
    argv = [*limit, sys.executable, "-m", "rlfleet.cli", "router", "serve", "--config", str(path)]
    proc = Proc(argv, cpu=0, stderr=subprocess.DEVNULL)  # out of fds it logs every failed accept
    procs.append(proc)
    _wait_port(port)
    return f"http://127.0.0.1:{port}", proc


def _memory_mib(pid: int) -> tuple[float, float]:
    """Peak RSS (VmHWM) and RSS now of a process, MiB."""
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return int(status["VmHWM"].split()[0]) / 1024, int(status["VmRSS"].split()[0]) / 1024


async def _post_all(url: str, n: int, body: bytes) -> dict[str, int]:
    """`n` posts of `body` at once: how many got each status (or client error)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:

        async def one() -> str:
            try:
                async with http.post(
                    url + "/generate", data=body, headers={"Content-Type": "application/json"}
                ) as r:
                    await r.read()
                    return str(r.status)
            except aiohttp.ClientError as exc:
                return type(exc).__name__

        answers = await asyncio.gather(*(one() for _ in range(n)))
    return {answer: answers.count(answer) for answer in sorted(set(answers))}


async def _slow_connections(url: str, n: int, wait_s: float, pid: int) -> tuple[int, int, str]:
    """`n` connections each send half a request header: the router's open fds with them connected and
    `wait_s` later, and the status of a normal request then."""
    import aiohttp

    port = int(url.rsplit(":", 1)[1])
    writers = []
    for _ in range(n):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /generate HTTP/1.1\r\nHost: router\r\n")
        writers.append(writer)
    await asyncio.sleep(1.0)
    connected = len(os.listdir(f"/proc/{pid}/fd"))
    await asyncio.sleep(wait_s)
    later = len(os.listdir(f"/proc/{pid}/fd"))
    body = json.dumps({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}).encode()
    try:
        timeout = aiohttp.ClientTimeout(total=10)
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            http.post(url + "/generate", data=body) as r,
        ):
            normal = str(r.status)
    except (aiohttp.ClientError, TimeoutError) as exc:
        normal = (
            f"{type(exc).__name__} (none in 10 s)" if isinstance(exc, TimeoutError) else type(exc).__name__
        )
    for writer in writers:
        writer.close()
    return connected, later, normal


def _json_body(size: int) -> bytes:
    """A /generate body of about `size` bytes (a long input_ids list)."""
    return b'{"input_ids": [' + b"7," * max(0, (size - 40) // 2) + b'7], "sampling_params": {}}'


def bounds_benchmark(args: argparse.Namespace, procs: list[Proc], tmp: str) -> None:
    from rlfleet.router.config import RouterConfig

    defaults = RouterConfig()
    port_file = os.path.join(tmp, "slow-ports.json")
    procs.append(
        Proc([sys.executable, __file__, "--serve-upstream", port_file, "--upstream-delay", "1.0"], cpu=1)
    )
    while not os.path.exists(port_file) or not Path(port_file).read_text():
        time.sleep(0.05)
    urls = [f"http://127.0.0.1:{p}" for p in json.loads(Path(port_file).read_text())[:2]]
    scenarios = [
        (
            f"{args.big_posts} x {args.big_mb} MB posts",
            lambda url, proc: asyncio.run(
                _post_all(url, args.big_posts, _json_body(args.big_mb * 1000 * 1000))
            ),
        ),
        (
            f"{args.legit_posts} x {defaults.max_body_bytes / MIB:.0f} MiB (largest legit) posts, upstream 1 s",
            lambda url, proc: asyncio.run(
                _post_all(url, args.legit_posts, _json_body(defaults.max_body_bytes - 64))
            ),
        ),
    ]
    print(f"\n{'scenario':52} {'bounds':8} {'peak MiB':>9} {'after MiB':>10}  answers")
    for name, run in scenarios:
        peaks = {}
        for label, bounds in (("before", BEFORE_BOUNDS), ("now", {})):
            url, proc = _start_configured_router(bounds, urls, procs)
            answers = run(url, proc)
            time.sleep(1.0)
            peak, after = _memory_mib(proc.process.pid)
            peaks[label] = peak
            print(f"{name:52} {label:8} {peak:9.0f} {after:10.0f}  {answers}")
            proc.stop()
        print(f"{'':52} {'ratio':8} {peaks['now'] / peaks['before']:9.2f}")
    wait_s = defaults.header_timeout_seconds + 2.0
    print(
        f"\n{args.slow_connections} slow connections (half a header each), router fd limit {args.fd_limit}: "
        f"router fds connected / {wait_s:.0f} s later"
    )
    for label, bounds in (("before", BEFORE_BOUNDS), ("now", {})):
        url, proc = _start_configured_router(bounds, urls, procs, args.fd_limit)
        connected, later, normal = asyncio.run(
            _slow_connections(url, args.slow_connections, wait_s, proc.process.pid)
        )
        print(f"  {label:8} {connected:6} / {later:6} fds; a normal request then: {normal}")
        proc.stop()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--loops", default="uvloop,asyncio", help="the router's event loops to measure")
    parser.add_argument("--smg", default=shutil.which("smg") or SMG_VENV + "/bin/smg")
    parser.add_argument(
        "--install-smg",
        action="store_true",
        help=f"pip install smg into {SMG_VENV} first (kept out of .venv)",
    )
    parser.add_argument("--no-pin", action="store_true", help="let the scheduler place every process")
    parser.add_argument("--serve-upstream", help=argparse.SUPPRESS)
    parser.add_argument("--upstream-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--bounds", action="store_true", help="measure the bounds against clients instead")
    parser.add_argument("--big-posts", type=int, default=4)
    parser.add_argument("--big-mb", type=int, default=200)
    parser.add_argument("--legit-posts", type=int, default=200)
    parser.add_argument("--slow-connections", type=int, default=2000)
    parser.add_argument(
        "--fd-limit", type=int, default=1024, help="the router's open-file limit (slow connections)"
    )
    args = parser.parse_args()
    global PIN
    PIN = not args.no_pin
    if args.serve_upstream:
        asyncio.run(_serve_upstream(args.serve_upstream, args.upstream_delay))
        return 0
    if args.bounds:
        bounds_tmp = tempfile.mkdtemp()
        bounds_procs: list[Proc] = []
        try:
            bounds_benchmark(args, bounds_procs, bounds_tmp)
        finally:
            for proc in reversed(bounds_procs):
                proc.stop()
            shutil.rmtree(bounds_tmp, ignore_errors=True)
        return 0

    if args.install_smg and not os.path.exists(args.smg):
        # smg brings grpcio + protobuf 7 with it: a venv of its own keeps the project's env untouched.
        subprocess.run([sys.executable, "-m", "venv", SMG_VENV], check=True)
        subprocess.run([SMG_VENV + "/bin/pip", "install", "-q", "smg>=1.13,<2"], check=True)
        args.smg = SMG_VENV + "/bin/smg"
    tmp = tempfile.mkdtemp()
    port_file = os.path.join(tmp, "ports.json")
    procs: list[Proc] = []
    try:
        procs.append(Proc([sys.executable, __file__, "--serve-upstream", port_file], cpu=1))
        while not os.path.exists(port_file) or not Path(port_file).read_text():
            time.sleep(0.05)
        ports = json.loads(Path(port_file).read_text())
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        if PIN:
            os.sched_setaffinity(0, {1})  # the load generator shares CPU 1 with the upstream

        targets: list[tuple[str, str, str, int | None]] = [
            ("direct (no router)", urls[0], "X-Session-Id", None)
        ]
        targets += _start_routers(args.loops.split(","), urls, procs)
        targets += _start_smg(args.smg, urls, procs)

        results = {}
        for name, url, header, pid in targets:
            lat = asyncio.run(latency_run(url, args.requests, header))
            rps, per_core = asyncio.run(throughput_run(url, args.duration, args.concurrency, header, pid))
            results[name] = (pct(lat, 0.5), pct(lat, 0.99), statistics.mean(lat), rps, per_core)
        base50, base99, _, base_rps, _ = results["direct (no router)"]
        print(
            f"\n{'target':34} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8} {'req/s':>8} {'req/s/core':>11} {'vs direct':>9}"
        )
        for name, (p50, p99, _mean, rps, per_core) in results.items():
            print(
                f"{name:34} {p50 * 1e3:8.3f} {p99 * 1e3:8.3f} {(p50 - base50) * 1e3:8.3f} {(p99 - base99) * 1e3:8.3f} "
                f"{rps:8.0f} {per_core if per_core else float('nan'):11.0f} {rps / base_rps:9.2f}"
            )
        lib50, lib99 = asyncio.run(library_overhead(urls[0], args.requests))
        print(
            f"\nrouting library in-process (Router.route vs direct, same client): +p50 {lib50 * 1e3:.3f} ms, "
            f"+p99 {lib99 * 1e3:.3f} ms"
        )
        meta_microbench()
        print(f"load average during the run: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    finally:
        for proc in reversed(procs):
            proc.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
