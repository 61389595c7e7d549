"""The chart against a real control plane (tests/cluster): server-side dry-run, install, RBAC as the
chart's ServiceAccount (not admin), the operator reconciling examples/rljob.yaml with exactly the
granted permissions (every API call recorded by a proxy), and GitOps idempotence."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.control_plane import role_grants
from support.moto import start_moto
from support.ports import free_port
from support.processes import stop
from support.stub_views import stub_views
from support.waits import wait_for

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rlfleet"
EXAMPLE = REPO / "examples" / "rljob.yaml"


def helm_template(
    helm, release: str, namespace: str, values: dict[str, Any], tmp: Path, crds: bool = False
) -> str:
    path = tmp / f"values-{release}.yaml"
    path.write_text(yaml.safe_dump(values))
    args = [
        "template",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--kube-version",
        "v1.36.3",
        "--values",
        str(path),
    ]
    return helm(*args, *(["--include-crds"] if crds else []))


def apply_crds(kube) -> None:
    kube.kubectl(
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=rlfleet-ship-tests",
        "-f",
        str(CHART / "crds"),
    )
    for crd in (
        "rljobs.rlfleet.dev",
        "samplergroups.rlfleet.dev",
        "weightchannels.rlfleet.dev",
        "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev",
    ):
        kube.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


# --- dry-run and install ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["cluster", "namespaced"])
def test_rendered_chart_passes_server_side_dry_run(
    kube, helm, namespace: str, tmp_path: Path, mode: str
) -> None:
    apply_crds(kube)
    release = unique("dry")
    values: dict[str, Any] = {
        "operator": {"peering": {"enabled": True, "name": release}},
        "metrics": {"serviceMonitor": {"enabled": False}},
        "grafana": {"dashboard": {"enabled": True}},
    }
    if mode == "namespaced":
        values["operator"]["watchNamespaces"] = [namespace]
    rendered = helm_template(helm, release, namespace, values, tmp_path)
    result = kube.kubectl(
        "apply", "--dry-run=server", "--server-side", "-n", namespace, "-f", "-", input=rendered
    )
    applied = [line for line in result.stdout.splitlines() if "(server dry run)" in line]
    assert len(applied) == len([d for d in yaml.safe_load_all(rendered) if d]), result.stdout
    # nothing was created
    assert (
        kube.kubectl("get", "deployment", release + "-rlfleet", "-n", namespace, check=False).returncode != 0
    )


def test_helm_install_brings_up_the_operator_objects(kube, helm, namespace: str, tmp_path: Path) -> None:
    """kwok marks the operator pods Running/Ready (no container runs here): this proves the objects
    the chart creates are accepted, schedulable and wired (RBAC binding, mounts), not the process."""
    release = unique("inst")
    values = {
        "operator": {"peering": {"enabled": True, "name": release}},
        "grafana": {"dashboard": {"enabled": True}},
    }
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    env = kube.env()
    helm(
        "install",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--values",
        str(path),
        "--wait",
        "--timeout",
        "120s",
        env=env,
    )
    try:
        fullname = f"{release}-rlfleet"
        deployment = kube.get_json("deployment", fullname, "-n", namespace)
        assert deployment["status"]["availableReplicas"] == 2
        pods = kube.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/component=operator")["items"]
        assert len(pods) == 2 and {p["spec"]["nodeName"] for p in pods}  # scheduled
        assert len({p["spec"]["nodeName"] for p in pods}) == 2  # spread over nodes (soft anti-affinity)
        assert all(p["spec"]["serviceAccountName"] == fullname for p in pods)
        kube.kubectl("get", "clusterrole", fullname)
        binding = kube.get_json("clusterrolebinding", fullname)
        assert binding["subjects"][0] == {"kind": "ServiceAccount", "name": fullname, "namespace": namespace}
        kube.kubectl("get", "clusterkopfpeering", release)
        kube.kubectl("get", "configmap", f"{fullname}-catalog", "-n", namespace)
        kube.kubectl("get", "configmap", f"{fullname}-dashboard", "-n", namespace)
        kube.kubectl("get", "validatingwebhookconfiguration", f"{fullname}-{namespace}")
        # the ServiceAccount can do what the operator needs (real authorizer)
        assert can_i(
            kube, f"system:serviceaccount:{namespace}:{fullname}", "patch", "samplergroups.rlfleet.dev/status"
        )
    finally:
        helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "60s", env=env)
    assert kube.kubectl("get", "clusterrole", f"{release}-rlfleet", check=False).returncode != 0


def can_i(kube, user: str, verb: str, resource: str, namespace: str | None = None) -> bool:
    args = ["auth", "can-i", verb, resource, "--as", user]
    args += ["-n", namespace] if namespace else ["--all-namespaces"]
    result = kube.kubectl(*args, check=False)
    return result.stdout.strip() == "yes"


# --- RBAC as the ServiceAccount ---------------------------------------------------------------------


def test_namespace_mode_grants_nothing_outside_the_watched_namespace(
    kube, helm, namespace: str, tmp_path: Path
) -> None:
    release = unique("nsm")
    rendered = helm_template(
        helm,
        release,
        namespace,
        {"operator": {"watchNamespaces": [namespace], "peering": {"enabled": True, "name": release}}},
        tmp_path,
    )
    apply_crds(kube)
    kube.kubectl("apply", "--server-side", "-n", namespace, "-f", "-", input=rendered)
    try:
        user = f"system:serviceaccount:{namespace}:{release}-rlfleet"
        assert can_i(kube, user, "watch", "rljobs.rlfleet.dev", namespace)
        assert can_i(kube, user, "create", "deployments.apps", namespace)
        assert can_i(kube, user, "patch", "kopfpeerings.kopf.dev", namespace)
        assert not can_i(kube, user, "list", "rljobs.rlfleet.dev")  # cluster-wide
        assert not can_i(kube, user, "list", "rljobs.rlfleet.dev", "default")
        assert not can_i(kube, user, "list", "customresourcedefinitions.apiextensions.k8s.io")
        assert not can_i(kube, user, "get", "secrets", "default")
        assert not can_i(kube, user, "list", "secrets", namespace)  # read by name only, never listed
        # the webhook's one cluster-scoped grant: its own configuration, by name, and nothing else there
        configuration = f"validatingwebhookconfigurations/{release}-rlfleet-{namespace}"
        assert can_i(kube, user, "patch", configuration) and can_i(kube, user, "get", configuration)
        assert not can_i(kube, user, "patch", "validatingwebhookconfigurations/another")
        assert not can_i(kube, user, "list", "validatingwebhookconfigurations")
        assert not can_i(kube, user, "delete", configuration)
        assert not can_i(kube, user, "patch", "mutatingwebhookconfigurations/" + configuration.split("/")[1])
    finally:
        delete_cluster_scoped(kube, [d for d in yaml.safe_load_all(rendered) if d])


class ApiRecorder:
    """A plain-HTTP reverse proxy on 127.0.0.1 in front of the kube-apiserver that adds the
    ServiceAccount's bearer token and records (verb, group, resource, status) of every request."""

    def __init__(self, server: str, ca_pem: bytes, token: str) -> None:
        self.server, self.token = server.rstrip("/"), token
        self.ssl = ssl.create_default_context(cadata=ca_pem.decode())
        self.calls: list[tuple[str, str, str, int]] = []
        self.denials: list[str] = []
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ApiRecorder:
        self._thread.start()
        assert self._started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    @staticmethod
    def classify(method: str, path: str, query: dict[str, str]) -> tuple[str, str, str] | None:
        m = re.match(r"^/(?:api/(?P<v>v1)|apis/(?P<g>[^/]+)/(?P<gv>[^/]+))(?P<rest>/.*)?$", path)
        if not m or not m.group("rest"):
            return None  # discovery
        group = m.group("g") or ""
        parts = [p for p in m.group("rest").split("/") if p]
        if parts[:1] == ["watch"]:
            parts, query = parts[1:], {**query, "watch": "true"}
        if len(parts) >= 2 and parts[0] == "namespaces" and len(parts) != 2:
            parts = parts[2:]
        elif parts[:1] == ["namespaces"] and len(parts) == 2:
            parts = ["namespaces", parts[1]]
        resource = parts[0]
        named = len(parts) >= 2
        if len(parts) >= 3:
            resource += "/" + parts[2]
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method)
        if method == "GET":
            verb = "watch" if query.get("watch") in ("true", "1") else ("get" if named else "list")
        elif method == "DELETE":
            verb = "delete" if named else "deletecollection"
        return verb or method.lower(), group, resource

    def _run(self) -> None:
        from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()

        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            headers = {
                k: v
                for k, v in request.headers.items()
                if k.lower() not in ("host", "authorization", "content-length")
            }
            headers["Authorization"] = f"Bearer {self.token}"
            async with session.request(
                request.method,
                self.server + request.path_qs,
                data=body or None,
                headers=headers,
                ssl=self.ssl,
            ) as upstream:
                kind = self.classify(request.method, request.path, dict(request.query))
                if kind and upstream.status == 403:
                    # RBAC denials say "cannot <verb> resource"; writes into a terminating namespace
                    # (an earlier test's) are 403 too, but are no permission problem
                    payload = await upstream.read()
                    if upstream.headers.get("Content-Encoding") == "gzip":
                        import gzip

                        text = gzip.decompress(payload)
                    else:
                        text = payload
                    if b"being terminated" in text:
                        kind = None
                    else:
                        self.denials.append(text.decode(errors="replace"))
                    response = web.Response(status=upstream.status, body=payload)
                    for key in ("Content-Type", "Content-Encoding"):
                        if key in upstream.headers:
                            response.headers[key] = upstream.headers[key]
                    if kind:
                        self.calls.append((*kind, upstream.status))
                    return response
                if kind:
                    self.calls.append((*kind, upstream.status))
                    if kind[0] == "patch" and upstream.status == 201:  # a server-side apply that created
                        self.calls.append(("create", kind[1], kind[2], upstream.status))
                response = web.StreamResponse(status=upstream.status)
                for key, value in upstream.headers.items():
                    # bytes are forwarded as received (auto_decompress=False): keep Content-Encoding
                    if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                        response.headers[key] = value
                await response.prepare(request)
                try:
                    async for chunk in upstream.content.iter_any():
                        await response.write(chunk)
                    await response.write_eof()
                except (ConnectionError, asyncio.CancelledError):
                    pass  # the operator closed a watch (shutdown, reconnect): nothing to forward
                return response

        async def main() -> None:
            nonlocal session
            session = ClientSession(
                connector=TCPConnector(limit=100), timeout=ClientTimeout(total=None), auto_decompress=False
            )
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", handle)
            runner = web.AppRunner(app, handle_signals=False)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self._started.set()
            await self._stop.wait()
            await runner.cleanup()
            await session.close()

        session: Any = None
        self._loop.run_until_complete(main())


def webhook_by_url(configuration: dict[str, Any], port: int) -> dict[str, Any]:
    """The chart's ValidatingWebhookConfiguration with each webhook's Service reference replaced by the
    URL of an operator run out of the cluster on this machine: the test control plane has no pod network
    and no Service proxy, the rest (rules, paths, selectors, policy) is the chart's."""
    out = copy.deepcopy(configuration)
    for webhook in out["webhooks"]:
        path = webhook["clientConfig"].pop("service")["path"]
        webhook["clientConfig"]["url"] = f"https://127.0.0.1:{port}{path}"
    return out


@contextmanager
def chart_objects_without_the_deployment(
    kube, helm, tmp: Path, operator_values: dict[str, Any], values: dict[str, Any] | None = None
) -> Iterator[dict[str, Any]]:
    """Apply everything the chart renders except the operator Deployment (its pods would be kwok's fakes),
    the webhook configuration addressed to 127.0.0.1 (webhook_by_url); yield what an out-of-cluster
    operator needs to run exactly like the Deployment's container."""
    release = unique("op")
    namespace = release + "-system"
    kube.kubectl("create", "namespace", namespace)
    apply_crds(kube)
    health, metrics, webhook = free_port(), free_port(), free_port()
    values = {
        **(values or {}),
        "webhook": {**(values or {}).get("webhook", {}), "port": webhook},
        "operator": {
            "peering": {"enabled": True, "name": release},
            "healthPort": health,
            "metricsPort": metrics,
            "logLevel": "debug",
            **operator_values,
        },
    }
    objs = [d for d in yaml.safe_load_all(helm_template(helm, release, namespace, values, tmp)) if d]
    deployment = next(o for o in objs if o["kind"] == "Deployment")
    rest = [
        webhook_by_url(o, webhook) if o["kind"] == "ValidatingWebhookConfiguration" else o
        for o in objs
        if o["kind"] != "Deployment"
    ]
    kube.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(rest))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    token = kube.kubectl("create", "token", sa, "-n", namespace, "--duration=2h").stdout.strip()
    admin = yaml.safe_load(Path(kube.kubeconfig).read_text())
    # The mounted catalog ConfigMap, as the pod would see it.
    catalog_cm = next(
        o for o in rest if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-catalog")
    )
    env = {e["name"]: e.get("value") for e in container["env"]}
    catalog_file = tmp / Path(env["RLFLEET_CATALOG"]).name
    catalog_file.write_text(catalog_cm["data"][catalog_file.name])
    try:
        yield {
            "release": release,
            "namespace": namespace,
            "container": container,
            "token": token,
            "pod": deployment["spec"]["template"]["spec"],
            "ca_data": admin["clusters"][0]["cluster"]["certificate-authority-data"],
            "catalog_file": catalog_file,
            "objects": rest,
            "health": health,
            "metrics": metrics,
            "webhook": webhook,
            "tmp": tmp,
        }
    finally:
        kube.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        delete_cluster_scoped(kube, rest)


def delete_cluster_scoped(kube, objs: list[dict[str, Any]]) -> None:
    """Delete what a rendered chart has outside namespaces (a namespace's deletion takes the rest)."""
    for obj in objs:
        if obj["kind"] in (
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterKopfPeering",
            "ValidatingWebhookConfiguration",
        ):
            kube.kubectl("delete", obj["kind"].lower(), obj["metadata"]["name"], "--wait=false", check=False)


def write_kubeconfig(path: Path, server: str, namespace: str, token: str, ca_data: str | None = None) -> Path:
    cluster: dict[str, Any] = {"server": server}
    if ca_data:
        cluster["certificate-authority-data"] = ca_data
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "sa",
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": "sa", "user": {"token": token}}],
                "contexts": [
                    {"name": "sa", "context": {"cluster": "c", "user": "sa", "namespace": namespace}}
                ],
            }
        )
    )
    return path


@contextmanager
def running_operator(
    chart: dict[str, Any],
    kubeconfig: Path,
    pod_name: str,
    ports: tuple[int, int] | None = None,
    env_from_pod: dict[str, str] | None = None,
    webhook_port: int | None = None,
) -> Iterator[tuple[subprocess.Popen, Path]]:
    """`rlfleet` with the chart container's own args (liveness, metrics and webhook bound to 127.0.0.1:
    tests never listen beyond the loopback; the webhook's certificate names 127.0.0.1, the address
    webhook_by_url gives the API server, instead of the Service's DNS name) and the pod's env
    (POD_ID/POD_NAME/POD_NAMESPACE from the downward API; `env_from_pod`: the container's other env
    resolved as the kubelet would, e.g. secretKeyRefs). `webhook_port`: another port than the chart's.
    Yields the process and its log; the process is stopped (support.processes.stop) when the block ends."""
    health, metrics = ports or (chart["health"], chart["metrics"])
    args = [a.replace("0.0.0.0", "127.0.0.1") for a in chart["container"]["args"]] + [
        "--metrics-address=127.0.0.1"
    ]
    args = [re.sub(r":\d+/healthz$", f":{health}/healthz", a) for a in args]
    args = [f"--metrics-port={metrics}" if a.startswith("--metrics-port=") else a for a in args]
    args = ["--webhook-host=127.0.0.1" if a.startswith("--webhook-host=") else a for a in args]
    if webhook_port is not None:
        args = [f"--webhook-port={webhook_port}" if a.startswith("--webhook-port=") else a for a in args]
    env = dict(os.environ)
    if env_from_pod is not None:  # nothing of this machine's AWS setup leaks in: only what the pod gets
        env = {k: v for k, v in env.items() if not k.startswith("AWS_")} | env_from_pod
    # the mounted catalog and the downward API, as this machine has them
    env |= {
        "KUBECONFIG": str(kubeconfig),
        "RLFLEET_CATALOG": str(chart["catalog_file"]),
        "POD_ID": pod_name,
        "POD_NAME": pod_name,
        "POD_NAMESPACE": chart["namespace"],
    }
    env.pop("KUBERNETES_SERVICE_HOST", None)
    log_path = chart["tmp"] / f"{pod_name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "rlfleet"), *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc, log_path
    finally:
        stop([proc])


@pytest.fixture(scope="module")
def operator_as_serviceaccount(kube, helm, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """The chart's objects (not its Deployment), and `rlfleet` run OUT of the cluster with the chart's own
    operator arguments, authenticated as the chart's ServiceAccount (a token from `kubectl create token`)
    through the recording proxy."""
    tmp = tmp_path_factory.mktemp("operator-sa")
    with chart_objects_without_the_deployment(kube, helm, tmp, {"replicas": 1}) as chart:
        ca_pem = base64.b64decode(chart["ca_data"])
        with ApiRecorder(kube.server, ca_pem, chart["token"]) as proxy:
            kubeconfig = write_kubeconfig(
                tmp / "sa.kubeconfig", f"http://127.0.0.1:{proxy.port}", chart["namespace"], "via-proxy"
            )
            with running_operator(chart, kubeconfig, f"{chart['release']}-pod") as (proc, log_path):
                yield {
                    "namespace": chart["namespace"],
                    "proxy": proxy,
                    "proc": proc,
                    "log": log_path,
                    "health": chart["health"],
                    "metrics": chart["metrics"],
                    "release": chart["release"],
                    "roles": operator_roles(chart["objects"]),
                }


def operator_roles(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chart's (Cluster)Roles bound to a ServiceAccount (the operator's): not the sandbox role, which the
    operator only binds to a job's trainer (`bind`, rollout.sandbox.backend pods) and never holds."""
    bound = {
        (b["roleRef"]["kind"], b["roleRef"]["name"])
        for b in objects
        if b["kind"] in ("ClusterRoleBinding", "RoleBinding")
        and any(subject["kind"] == "ServiceAccount" for subject in b.get("subjects") or [])
    }
    return [
        o
        for o in objects
        if o["kind"] in ("ClusterRole", "Role") and (o["kind"], o["metadata"]["name"]) in bound
    ]


def remove_the_last_group(kube, name: str, namespace: str, groups: int, what: str) -> None:
    """A JSON patch removes the last of the RLJob's `groups` sampler groups; wait (60 s, `what`) for the
    operator to have deleted its SamplerGroup."""
    remove = [{"op": "remove", "path": f"/spec/samplerGroups/{groups - 1}"}]
    kube.kubectl("patch", "rljob", name, "-n", namespace, "--type=json", "-p", json.dumps(remove))
    wait_for(what, lambda: len(kube.get_json("samplergroups", "-n", namespace)["items"]) == groups - 1, 60)


def rljob_reconciled(kube, name: str, namespace: str) -> bool:
    """The RLJob's status is the operator's for its current generation."""
    job = kube.get_json("rljob", name, "-n", namespace)
    return job.get("status", {}).get("observedGeneration") == job["metadata"]["generation"]


def test_operator_as_serviceaccount_reconciles_the_example(kube, operator_as_serviceaccount) -> None:
    ctx = operator_as_serviceaccount
    ns = f"{ctx['release']}-jobs"
    kube.kubectl("create", "namespace", ns)
    try:
        kube.kubectl("apply", "--server-side", "-n", ns, "-f", str(EXAMPLE))
        job = yaml.safe_load(EXAMPLE.read_text())
        name = job["metadata"]["name"]
        groups = [g["name"] for g in job["spec"]["samplerGroups"]]

        def children() -> bool:
            sgs = kube.get_json("samplergroups", "-n", ns)["items"]
            return len(sgs) == len(groups) and bool(kube.get_json("weightchannels", "-n", ns)["items"])

        try:
            wait_for("SamplerGroups and WeightChannel", children, timeout=90)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n" + "\n".join(ctx["log"].read_text().splitlines()[-40:])) from None
        sgs = {s["metadata"]["name"] for s in kube.get_json("samplergroups", "-n", ns)["items"]}
        assert sgs == {f"{name}-{g}" for g in groups}
        wait_for(
            "sampler Deployments",
            lambda: len(kube.get_json("deployments", "-n", ns)["items"]) >= len(groups),
            90,
        )
        wait_for("trainer StatefulSet", lambda: kube.get_json("statefulsets", "-n", ns)["items"], 60)
        wait_for(
            "RLJob status for the current generation",
            lambda: rljob_reconciled(kube, name, ns),
            90,
        )
        # the rebalancer's timer ran with the chart's grant (it writes the shares into SamplerGroup status)
        wait_for(
            "the rebalancer's shares",
            lambda: all(
                "share" in (sg.get("status") or {})
                for sg in kube.get_json("samplergroups", "-n", ns)["items"]
            ),
            90,
        )
        # a group removed from the spec: the operator deletes its SamplerGroup (the one delete it does)
        remove_the_last_group(kube, name, ns, len(groups), "removed group deleted")
        assert ctx["proc"].poll() is None, ctx["log"].read_text()[-3000:]
        # the chart's liveness probe and metrics port answer (what the Deployment and ServiceMonitor use)
        with urllib.request.urlopen(f"http://127.0.0.1:{ctx['health']}/healthz", timeout=10) as response:
            assert response.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{ctx['metrics']}/metrics", timeout=10) as response:
            assert "rlfleet_operator_reconciles_total" in response.read().decode()

        log = ctx["log"].read_text()
        problems = [
            line
            for line in log.splitlines()
            if re.search(r"cannot \w+ resource", line) or "Not enough permissions" in line
        ]
        assert not problems, "\n".join(problems)[:3000]
        assert not ctx["proxy"].denials, ctx["proxy"].denials[:5]
        calls = ctx["proxy"].calls
        denied = {(v, g, r) for v, g, r, status in calls if status == 403}
        assert not denied, f"operator was denied {sorted(denied)}"
        used = {(v, g, r) for v, g, r, _ in calls}
        # the operator's ClusterRole, and the webhook's grants (its Secret, its configuration's caBundle)
        allowed = {(v, g, r) for role in ctx["roles"] for g, r, v in role_grants(role)}
        print("operator API calls (verb, group, resource):", *sorted(used), sep="\n  ")
        # enough: nothing it did was outside the grant; no more: every granted verb was used
        assert used <= allowed, sorted(used - allowed)
        # granted for a code path this scenario does not take (see charts/rlfleet/templates/rbac.yaml)
        rare = {
            ("get", "rlfleet.dev", "weightchannels"),
            ("patch", "", "secrets"),  # the webhook Secret's renewal (a new Secret is created)
            # opt-in paths the example does not take: the fleet-mix optimizer's replicas
            # (spec.router.optimize, tests/router/test_router_fleet_plan_cluster.py) and a job whose
            # sandboxes are pods (rollout.sandbox, tests/operator/test_operator_sandboxes.py)
            ("patch", "rlfleet.dev", "samplergroups/scale"),
            ("create", "", "serviceaccounts"),
            ("patch", "", "serviceaccounts"),
            ("create", "rbac.authorization.k8s.io", "rolebindings"),
            ("patch", "rbac.authorization.k8s.io", "rolebindings"),
            ("bind", "rbac.authorization.k8s.io", "clusterroles"),
        }
        assert allowed - rare <= used, f"granted but never used: {sorted(allowed - rare - used)}"
    finally:
        kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)


# --- GitOps --------------------------------------------------------------------------------------------


def _with_managed_fields(kube, *args: str) -> Any:
    return json.loads(kube.kubectl("get", *args, "-o", "json", "--show-managed-fields").stdout)


def _applied_by(obj: dict[str, Any], manager: str) -> list[dict[str, Any]]:
    return [
        m
        for m in obj["metadata"].get("managedFields", [])
        if m["manager"] == manager and m["operation"] == "Apply"
    ]


def _assert_diff_clean(kube, namespace: str, manager: str) -> None:
    """`kubectl diff --server-side` of the examples finds nothing to change.

    `kubectl diff` reads the live objects, then dry-runs the apply: a status write (an operator
    reconciling the namespace) landing in between shows up as a status-only difference. So: diff once
    the RLJobs' resourceVersions have held still for 3 s, and allow a status write to race it twice."""

    def settled() -> bool:
        def versions() -> list[str]:
            return [
                j["metadata"]["resourceVersion"] for j in kube.get_json("rljobs", "-n", namespace)["items"]
            ]

        first = versions()
        time.sleep(3)
        return versions() == first

    wait_for("RLJob status to settle", settled, timeout=90, interval=0)
    diffs = []
    for _ in range(3):
        diff = kube.kubectl(
            "diff",
            "--server-side",
            f"--field-manager={manager}",
            "-n",
            namespace,
            "-f",
            str(EXAMPLE),
            check=False,
        )
        if diff.returncode == 0:
            return
        diffs.append(diff.stdout[-3000:] + diff.stderr[-1000:])
    raise AssertionError("\n".join(diffs))


def test_server_side_apply_of_the_examples_twice_changes_nothing(kube, namespace: str) -> None:
    """A no-op apply changes neither the spec, nor the generation, nor the applier's managed-fields entry
    (its timestamp only moves when an apply changes something), whatever else writes status meanwhile."""
    apply_crds(kube)
    manager = "gitops-smoke"
    apply = ("apply", "--server-side", f"--field-manager={manager}", "-n", namespace, "-f", str(EXAMPLE))
    first = kube.kubectl(*apply)
    assert "serverside-applied" in first.stdout
    before = _with_managed_fields(kube, "rljobs", "-n", namespace)["items"]
    time.sleep(1.1)  # managedFields times have 1 s resolution
    kube.kubectl(*apply)
    after = _with_managed_fields(kube, "rljobs", "-n", namespace)["items"]
    assert len(before) == len(after) == len(list(yaml.safe_load_all(EXAMPLE.read_text())))
    for old, new in zip(before, after, strict=True):
        assert new["metadata"]["generation"] == old["metadata"]["generation"]
        assert new["spec"] == old["spec"]
        assert _applied_by(new, manager) == _applied_by(old, manager) != []
    _assert_diff_clean(kube, namespace, manager)


def test_diff_stays_clean_after_the_operator_reconciled(kube, operator_as_serviceaccount) -> None:
    ctx = operator_as_serviceaccount
    ns = f"{ctx['release']}-gitops"
    kube.kubectl("create", "namespace", ns)
    try:
        kube.kubectl("apply", "--server-side", "--field-manager=gitops-smoke", "-n", ns, "-f", str(EXAMPLE))
        name = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
        before = kube.get_json("rljob", name, "-n", ns)
        wait_for(
            "reconciled",
            lambda: rljob_reconciled(kube, name, ns),
            90,
        )
        wait_for("children", lambda: kube.get_json("samplergroups", "-n", ns)["items"], 60)
        _assert_diff_clean(kube, ns, "gitops-smoke")
        job = _with_managed_fields(kube, "rljob", name, "-n", ns)
        # the operator reconciled without touching the spec Git owns
        assert (
            job["spec"] == before["spec"]
            and job["metadata"]["generation"] == before["metadata"]["generation"]
        )
        assert job["status"]["observedGeneration"] == job["metadata"]["generation"]
        spec_writers = {
            m["manager"]
            for m in job["metadata"]["managedFields"]
            if not m.get("subresource") and "f:spec" in m.get("fieldsV1", {})
        }
        assert spec_writers == {"gitops-smoke"}, spec_writers
    finally:
        kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)


# --- HA: two replicas, one peering ----------------------------------------------------------------------


def test_two_replicas_elect_one_active_operator_and_fail_over(kube, helm, tmp_path: Path) -> None:
    """Two operators with the chart's peering arguments (namespace mode: a KopfPeering in the watched
    namespace): distinct auto priorities, only the higher one works; when it stops, the standby resumes
    and reconciles."""
    from rlfleet.operator.main import auto_priority

    jobs = unique("ha")
    kube.kubectl("create", "namespace", jobs)
    try:
        with chart_objects_without_the_deployment(
            kube, helm, tmp_path, {"replicas": 2, "watchNamespaces": [jobs]}
        ) as chart:
            kubeconfig = write_kubeconfig(
                tmp_path / "sa.kubeconfig", kube.server, chart["namespace"], chart["token"], chart["ca_data"]
            )
            names = [f"{chart['release']}-rlfleet-5c8d7-{suffix}" for suffix in ("abcde", "vwxyz")]
            names.sort(key=auto_priority)  # [standby, active]
            assert auto_priority(names[0]) != auto_priority(names[1])

            def peers() -> dict[str, Any]:
                obj = kube.get_json("kopfpeering", chart["release"], "-n", jobs)
                return {k: v for k, v in (obj.get("status") or {}).items() if v}

            # the active replica first, then a standby joins (as in a rollout); simultaneous starts are
            # left to kopf
            with running_operator(chart, kubeconfig, names[1], (free_port(), free_port())) as (
                active,
                active_log,
            ):
                wait_for("the first replica in the KopfPeering", lambda: names[1] in peers(), timeout=60)
                with running_operator(chart, kubeconfig, names[0], (free_port(), free_port())) as (
                    standby,
                    standby_log,
                ):
                    wait_for(
                        "both replicas in the KopfPeering", lambda: set(peers()) == set(names), timeout=60
                    )
                    assert {peers()[n]["priority"] for n in names} == {auto_priority(n) for n in names}
                    # kopf starts paused until it has seen the peers: the active replica resumes, the standby
                    # (a live peer of higher priority exists) never does
                    wait_for(
                        "the higher-priority replica to resume",
                        lambda: "Resuming operations" in active_log.read_text(),
                        timeout=60,
                    )
                    kube.kubectl("apply", "--server-side", "-n", jobs, "-f", str(EXAMPLE))
                    job = yaml.safe_load(EXAMPLE.read_text())
                    groups = job["spec"]["samplerGroups"]
                    wait_for(
                        "children by the active replica",
                        lambda: len(kube.get_json("samplergroups", "-n", jobs)["items"]) == len(groups),
                        timeout=90,
                    )
                    wait_for(
                        "the active replica's handler to finish",
                        lambda: "Handler 'reconcile_rljob' succeeded" in active_log.read_text(),
                        timeout=30,
                    )
                    assert "Handler 'reconcile_rljob'" not in standby_log.read_text()
                    assert "Resuming operations" not in standby_log.read_text()

                    stop([active])  # a clean stop removes its keep-alive from the peering
                    wait_for(
                        "the standby to resume",
                        lambda: "Resuming operations" in standby_log.read_text(),
                        timeout=60,
                    )
                    remove_the_last_group(
                        kube,
                        job["metadata"]["name"],
                        jobs,
                        len(groups),
                        "the former standby to reconcile the change",
                    )
                    # the spec change's handler: kopf names it reconcile_rljob/spec (the update handler,
                    # field spec); reconcile_rljob is its resume handler, which kopf may or may not run at the
                    # takeover (it ran in most runs, not in one CI run where the update handler did the work)
                    wait_for(
                        "the former standby's handler to finish",
                        lambda: re.search(
                            r"Handler 'reconcile_rljob(/spec)?' succeeded", standby_log.read_text()
                        ),
                        timeout=30,
                    )
                    assert standby.poll() is None
    finally:
        kube.kubectl("delete", "namespace", jobs, "--wait=false", check=False)


# --- the admission webhook with the operator's own certificate -------------------------------------------


def _job(name: str, group: str, **fields: Any) -> dict[str, Any]:
    """The example RLJob renamed, with one H100 group `group` and its own store (one trainer per weight
    channel: the webhook refuses a second job on the example's claim)."""
    job = yaml.safe_load(EXAMPLE.read_text())
    job["metadata"]["name"] = name
    job["spec"]["weightChannel"]["store"] = {
        "type": "filesystem",
        "path": f"/weights/{name}",
        "volumeClaimName": f"{name}-weights",
    }
    job["spec"]["samplerGroups"] = [
        {"name": group, "accelerator": "h100", "replicas": 1, "weightFormat": "bf16", **fields}
    ]
    return job


def _tls_serves(port: int, ca_pem: bytes) -> bool:
    """A TLS client trusting `ca_pem` (as the API server trusts caBundle) completes a handshake with
    127.0.0.1:port, host name checked."""
    context = ssl.create_default_context(cadata=ca_pem.decode())
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            with context.wrap_socket(raw, server_hostname="127.0.0.1"):
                return True
    except OSError:  # refused (not listening yet) or ssl.SSLError (not this CA's certificate yet)
        return False


def test_the_charts_webhook_keeps_its_certificate_and_refuses_colliding_jobs(
    kube, helm, tmp_path: Path
) -> None:
    """The chart's webhook without cert-manager, as its ServiceAccount (namespace mode, two replicas):
    the first operator creates the Secret (a CA and a serving certificate) and sets the caBundle of the
    chart's ValidatingWebhookConfiguration; the second replica serves the same certificate without
    rewriting anything; `kubectl apply` of the second of two RLJobs that want one SamplerGroup name is
    refused naming the first, also when only the standby answers. The live catalog's rules refuse a
    spec change while a metadata-only change passes, and before any operator ran, failurePolicy
    Ignore admitted what the webhook would refuse."""
    from cryptography import x509

    from rlfleet.operator.main import auto_priority

    jobs = unique("wh")
    kube.kubectl("create", "namespace", jobs)
    catalog = {
        "catalog": {"classes": {"h100": {"kvCacheDtypes": ["auto", "bf16"]}}}
    }  # no FP8 KV cache on H100
    try:
        with chart_objects_without_the_deployment(
            kube, helm, tmp_path, {"replicas": 2, "watchNamespaces": [jobs]}, catalog
        ) as chart:
            ns, release = chart["namespace"], chart["release"]
            configuration_name = f"{release}-rlfleet-{ns}"
            secret_name = f"{release}-rlfleet-webhook-cert"
            (rendered,) = [o for o in chart["objects"] if o["kind"] == "ValidatingWebhookConfiguration"]
            assert rendered["metadata"]["name"] == configuration_name
            assert f"--webhook-cert-secret={secret_name}" in chart["container"]["args"]
            assert kube.kubectl("get", "secret", secret_name, "-n", ns, check=False).returncode != 0
            # no operator yet: the API server cannot reach the webhook, and Ignore admits unchecked
            legacy = _job("legacy", "h100-kv8", kvCacheDtype="fp8_e4m3")
            kube.kubectl("apply", "-n", jobs, "-f", "-", input=json.dumps(legacy))

            kubeconfig = write_kubeconfig(
                tmp_path / "sa.kubeconfig", kube.server, ns, chart["token"], chart["ca_data"]
            )
            names = sorted((f"{release}-rlfleet-5c8d7-{s}" for s in ("abcde", "vwxyz")), key=auto_priority)
            with running_operator(chart, kubeconfig, names[1], (free_port(), free_port())) as (
                active,
                active_log,
            ):
                operator_logs = [active_log]

                def logs() -> str:
                    return "\n".join(p.read_text()[-3000:] for p in operator_logs)

                def configuration() -> dict[str, Any]:
                    return kube.get_json("validatingwebhookconfiguration", configuration_name)

                try:
                    secret = wait_for(
                        "the operator's webhook Secret",
                        lambda: _get_or_none(kube, "secret", secret_name, "-n", ns),
                        timeout=60,
                    )
                    bundle = secret["data"]["ca.crt"]
                    wait_for(
                        "the caBundle of every webhook",
                        lambda: all(
                            w["clientConfig"].get("caBundle") == bundle for w in configuration()["webhooks"]
                        ),
                        timeout=30,
                    )
                except AssertionError as exc:
                    raise AssertionError(f"{exc}\n{logs()}") from None
                live = configuration()
                assert secret["type"] == "kubernetes.io/tls"
                assert sorted(secret["data"]) == ["ca.crt", "ca.key", "tls.crt", "tls.key"]
                assert secret["metadata"]["ownerReferences"] == [
                    {
                        "apiVersion": "admissionregistration.k8s.io/v1",
                        "kind": "ValidatingWebhookConfiguration",
                        "name": configuration_name,
                        "uid": live["metadata"]["uid"],
                    }
                ]
                (ca,) = x509.load_pem_x509_certificates(base64.b64decode(bundle))
                serving = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
                serving.verify_directly_issued_by(ca)
                san = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
                # the --webhook-host running_operator gives
                assert [str(n.value) for n in san] == ["127.0.0.1"]
                # only the caBundle changed: the rest is the chart's (rules, paths, policy, selector)
                for got, want in zip(live["webhooks"], rendered["webhooks"], strict=True):
                    assert {**got, "clientConfig": {"url": got["clientConfig"]["url"]}} == {
                        **want,
                        "matchPolicy": got["matchPolicy"],
                        "objectSelector": got["objectSelector"],
                    }
                wait_for(
                    "the active replica's webhook",
                    lambda: _tls_serves(chart["webhook"], base64.b64decode(bundle)),
                )

                # job ab with group cd-ef and job ab-cd with group ef both want SamplerGroup ab-cd-ef
                kube.kubectl("apply", "-n", jobs, "-f", "-", input=json.dumps(_job("ab", "cd-ef")))
                wait_for(
                    "SamplerGroup ab-cd-ef of RLJob ab",
                    lambda: (
                        _get_or_none(kube, "sg", "ab-cd-ef", "-n", jobs).get("spec", {}).get("jobName")
                        == "ab"
                    ),
                )
                refused = kube.kubectl(
                    "apply", "-n", jobs, "-f", "-", input=json.dumps(_job("ab-cd", "ef")), check=False
                )
                assert refused.returncode != 0, refused.stdout
                assert (
                    "the name ab-cd-ef (Deployment and Service) is taken by SamplerGroup ab-cd-ef of RLJob ab"
                    in (refused.stderr)
                ), refused.stderr
                assert kube.kubectl("get", "rljob", "ab-cd", "-n", jobs, check=False).returncode != 0

                # the live catalog: legacy's spec may not change, its metadata may (kopf's own writes too)
                kube.kubectl("annotate", "rljob", "legacy", "-n", jobs, "example.com/owner=team-a")
                changed = kube.kubectl(
                    "patch",
                    "rljob",
                    "legacy",
                    "-n",
                    jobs,
                    "--type=json",
                    "-p",
                    json.dumps([{"op": "replace", "path": "/spec/samplerGroups/0/replicas", "value": 2}]),
                    check=False,
                )
                assert changed.returncode != 0, changed.stdout
                assert "rejected by rlfleet (catalog in effect)" in changed.stderr, changed.stderr
                assert "accelerator h100 (sm90) cannot use kvCacheDtype fp8_e4m3" in changed.stderr, (
                    changed.stderr
                )

                # a second replica (the standby: the active one has the higher priority) on a port of its own
                standby_port = free_port()
                with running_operator(
                    chart, kubeconfig, names[0], (free_port(), free_port()), webhook_port=standby_port
                ) as (standby, standby_log):
                    operator_logs.append(standby_log)
                    try:
                        wait_for(
                            "the standby's webhook, trusted by the same caBundle",
                            lambda: _tls_serves(standby_port, base64.b64decode(bundle)),
                            timeout=60,
                        )
                    except AssertionError as exc:
                        raise AssertionError(f"{exc}\n{logs()}") from None
                    again = kube.get_json("secret", secret_name, "-n", ns)
                    assert (
                        again["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]
                    )  # not rewritten
                    assert all(w["clientConfig"]["caBundle"] == bundle for w in configuration()["webhooks"])
                    # only the standby answers now: its kopf indexes are empty (peering paused its watches)
                    kube.kubectl(
                        "patch",
                        "validatingwebhookconfiguration",
                        configuration_name,
                        "--type=json",
                        "-p",
                        json.dumps(
                            [
                                {
                                    "op": "replace",
                                    "path": f"/webhooks/{i}/clientConfig/url",
                                    "value": w["clientConfig"]["url"].replace(
                                        f":{chart['webhook']}/", f":{standby_port}/"
                                    ),
                                }
                                for i, w in enumerate(live["webhooks"])
                            ]
                        ),
                    )
                    refused = kube.kubectl(
                        "apply", "-n", jobs, "-f", "-", input=json.dumps(_job("ab-cd", "ef")), check=False
                    )
                    assert refused.returncode != 0, refused.stdout
                    assert "is taken by SamplerGroup ab-cd-ef of RLJob ab" in refused.stderr, refused.stderr
                    # it was the standby all along
                    assert "Resuming operations" not in standby_log.read_text()
                    assert active.poll() is None and standby.poll() is None, logs()
    finally:
        kube.kubectl("delete", "namespace", jobs, "--wait=false", check=False)


# --- weight stores: WeightChannel status with the chart as shipped ----------------------------------------


def _pod_env(kube, namespace: str, container: dict[str, Any]) -> dict[str, str]:
    """The container's env as the kubelet resolves it: literal values and secretKeyRefs (read from the
    real Secret); downward-API fields are set by running_operator."""
    out: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            out[e["name"]] = e["value"]
        elif ref := e.get("valueFrom", {}).get("secretKeyRef"):
            secret = kube.get_json("secret", ref["name"], "-n", namespace)
            out[e["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
    return out


def _printed(kube, *args: str) -> dict[str, str]:
    """`kubectl get` of one object as {column: cell}; cells (maybe empty) lie under their headers."""
    header, row = kube.kubectl("get", *args).stdout.splitlines()[:2]
    starts = [(m.start(), m.group()) for m in re.finditer(r"\S+", header)]
    ends = [start for start, _ in starts[1:]] + [None]
    return {name: row[start:end].strip() for (start, name), end in zip(starts, ends, strict=True)}


def _get_or_none(kube, *args: str) -> dict[str, Any]:
    result = kube.kubectl("get", *args, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else {}


def test_weightchannel_versions_with_the_charts_store_access(
    kube, helm, tmp_path_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chart as shipped gives the operator read access to both store kinds: a filesystem store
    through a read-only volume at the channels' path, an S3 store through credentials from a Secret the
    user names (by reference). Published versions and a sidecar's report then appear as WeightChannel
    status (LATEST) and the SamplerGroup VERSION / LAG columns. The operator runs out of the cluster
    with the Deployment's own args and env (secretKeyRefs resolved from the real Secret, this machine's
    AWS settings removed); the PVC mount is emulated by linking the rendered mountPath to the PV's
    directory, so a path the chart does not mount does not exist for it."""
    from rlfleet.channel import SubscriberReport, WeightChannel
    from rlfleet.store import FilesystemStore, S3Store

    tmp = tmp_path_factory.mktemp("stores")
    mount_path = tmp / "mnt" / "weights"  # what the chart mounts in the operator pod
    s3_port = free_port()
    s3 = start_moto(s3_port)
    endpoint = f"http://127.0.0.1:{s3_port}"
    values = {
        "weightStores": {
            "filesystem": [
                {"name": "weights", "mountPath": str(mount_path), "claimName": "rlfleet-weights-ro"}
            ],
            "s3": {"secretName": "rlfleet-s3"},
        }
    }
    try:
        with chart_objects_without_the_deployment(kube, helm, tmp, {"replicas": 1}, values) as chart:
            ns = chart["namespace"]
            pod, container = chart["pod"], chart["container"]
            # the rendered Deployment: the PVC read-only at the path, the keys by reference only
            volume = next(v for v in pod["volumes"] if v["name"] == "store-weights")
            assert volume["persistentVolumeClaim"] == {"claimName": "rlfleet-weights-ro", "readOnly": True}
            assert {"name": "store-weights", "mountPath": str(mount_path), "readOnly": True} in container[
                "volumeMounts"
            ]
            refs = {
                e["name"]: e["valueFrom"]["secretKeyRef"]
                for e in container["env"]
                if e["name"].startswith("AWS_")
            }
            assert refs == {
                "AWS_ACCESS_KEY_ID": {"name": "rlfleet-s3", "key": "AWS_ACCESS_KEY_ID"},
                "AWS_SECRET_ACCESS_KEY": {"name": "rlfleet-s3", "key": "AWS_SECRET_ACCESS_KEY"},
            }
            kube.kubectl(
                "create",
                "secret",
                "generic",
                "rlfleet-s3",
                "-n",
                ns,
                "--from-literal=AWS_ACCESS_KEY_ID=testing",
                "--from-literal=AWS_SECRET_ACCESS_KEY=testing",
            )
            # the "PV" behind the claim, "mounted" (linked) wherever the rendered pod mounts a store volume
            pv = tmp / "pv"
            pv.mkdir()
            for mount in container["volumeMounts"]:
                if mount["name"].startswith("store-"):
                    Path(mount["mountPath"]).parent.mkdir(parents=True, exist_ok=True)
                    Path(mount["mountPath"]).symlink_to(pv)
            assert mount_path.is_dir()
            # stores, written as the trainer (publish) and a sidecar (report) do
            for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # this test's own writes
                monkeypatch.setenv(key, "testing")
            import boto3

            bucket = f"wc-{uuid.uuid4().hex[:10]}"
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
            stores = {
                "fs": FilesystemStore(pv / "fs-job", create=True),
                "s3": S3Store(bucket, "runs/s3-job", endpoint_url=endpoint, region="us-east-1"),
            }
            views = stub_views(tmp / "views")
            jobs_ns = f"{chart['release']}-jobs"
            kube.kubectl("create", "namespace", jobs_ns)
            example = yaml.safe_load(EXAMPLE.read_text())
            store_specs = {
                "fs": {"type": "filesystem", "path": str(mount_path / "fs-job")},
                "s3": {
                    "type": "s3",
                    "bucket": bucket,
                    "prefix": "runs/s3-job",
                    "endpoint": endpoint,
                    "region": "us-east-1",
                },
            }
            for store in stores.values():
                WeightChannel(store).publish(views, version=0)
            kubeconfig = write_kubeconfig(
                tmp / "sa.kubeconfig", kube.server, ns, chart["token"], chart["ca_data"]
            )
            try:
                with running_operator(
                    chart, kubeconfig, f"{chart['release']}-pod", env_from_pod=_pod_env(kube, ns, container)
                ) as (_, log_path):
                    for kind in stores:
                        job = copy.deepcopy(example)
                        job["metadata"]["name"] = f"{kind}-job"
                        job["spec"]["samplerGroups"] = [
                            {"name": "h100-fp8", "accelerator": "h100", "replicas": 1, "weightFormat": "fp8"}
                        ]
                        job["spec"]["weightChannel"]["store"] = store_specs[kind]
                        kube.kubectl("apply", "-n", jobs_ns, "-f", "-", input=json.dumps(job))
                    for kind, store in stores.items():
                        channel = WeightChannel(store)
                        channel.publish(views, version=1)
                        channel.report(
                            SubscriberReport(
                                group=f"{kind}-job-h100-fp8",
                                replica="pod-a",
                                view="fp8",
                                applied_version=0,
                                in_use=[0],
                            )
                        )

                    def versions(kind: str) -> Callable[[], Any]:
                        def check() -> Any:
                            wc = _get_or_none(kube, "wc", f"{kind}-job-weights", "-n", jobs_ns)
                            sg = _get_or_none(kube, "sg", f"{kind}-job-h100-fp8", "-n", jobs_ns)
                            ok = (
                                wc.get("status", {}).get("latestVersion") == 1
                                and sg.get("status", {}).get("versionLag") == 1
                            )
                            return (wc["status"], sg["status"]) if ok else None

                        return check

                    for kind in stores:
                        try:
                            wc, sg = wait_for(f"{kind} channel status", versions(kind), timeout=120)
                        except AssertionError as exc:
                            raise AssertionError(
                                f"{exc}\n" + "\n".join(log_path.read_text().splitlines()[-30:])
                            ) from None
                        assert wc["phase"] == "Ready" and {a["view"] for a in wc["artifacts"]} == {
                            "bf16",
                            "fp8",
                        }
                        assert sg["appliedWeightVersion"] == 0
                        sg_row = _printed(kube, "sg", f"{kind}-job-h100-fp8", "-n", jobs_ns)
                        assert (sg_row["VERSION"], sg_row["LAG"]) == ("0", "1"), sg_row
                        assert _printed(kube, "wc", f"{kind}-job-weights", "-n", jobs_ns)["LATEST"] == "1"
            finally:
                kube.kubectl("delete", "namespace", jobs_ns, "--wait=false", check=False)
    finally:
        s3.terminate()
        s3.wait(10)
