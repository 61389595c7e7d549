"""The Argo CD example installs everything the operator needs, in the right waves (docs/gitops.md).

Each Application of examples/argocd-application.yaml is rendered the way Argo CD renders it (a folder of
manifests, or `helm template` of a chart with its CRDs unless skipCrds), and every custom resource the
operator watches (its kopf handler registrations, plus the peering kopf watches with the rendered
Deployment's arguments) must be served by a CRD synced in an earlier wave than the operator, or by the
operator's own Application."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from kopf._cogs.structs import references
from kopf._core.engines import peering

from rlfleet.operator.main import parse_args

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "argocd-application.yaml"
KUBE_VERSION = "v1.36.3"
BUILTIN_GROUPS = {"", "apps"}  # served by the API server itself


def applications() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]


def wave(app: dict[str, Any]) -> int:
    return int(app["metadata"].get("annotations", {}).get("argocd.argoproj.io/sync-wave", "0"))


def render_application(app: dict[str, Any], helm: Callable[..., str], tmp: Path) -> list[dict[str, Any]]:
    """The objects Argo CD would apply for this Application (its source is a path in this repository)."""
    source = app["spec"]["source"]
    path = REPO / source["path"]
    assert path.is_dir(), f"{app['metadata']['name']}: {source['path']} is not a folder of the repository"
    if (path / "Chart.yaml").is_file():  # Argo CD's rule: a Chart.yaml makes it a Helm source
        spec = source.get("helm", {})
        values = tmp / f"{app['metadata']['name']}-values.yaml"
        values.write_text(yaml.safe_dump(spec.get("valuesObject", {})))
        args = [
            "template",
            spec.get("releaseName", app["metadata"]["name"]),
            str(path),
            "--namespace",
            app["spec"]["destination"]["namespace"],
            "--kube-version",
            KUBE_VERSION,
            "--values",
            str(values),
        ]
        if not spec.get("skipCrds"):
            args.append("--include-crds")
        text = helm(*args)
    else:
        directory = source.get("directory", {})
        files = sorted(path.rglob("*") if directory.get("recurse") else path.glob("*"))
        files = [f for f in files if f.suffix in (".yaml", ".yml", ".json") and f.is_file()]
        if directory.get("include"):
            files = [f for f in files if fnmatch.fnmatch(f.name, directory["include"])]
        text = "\n---\n".join(f.read_text() for f in files)
    return [d for d in yaml.safe_load_all(text) if d]


def watched_custom_resources(operator_args: list[str]) -> dict[str, list[references.Selector]]:
    """What the operator run with these arguments watches beyond the built-in kinds: the kopf selectors of
    its handlers, and of the peering (kopf accepts a resource matching any of its selectors)."""
    import rlfleet.operator.handlers  # noqa: F401  (registers every handler)

    registry = kopf.get_default_registry()
    handlers = [
        *registry._indexing.get_all_handlers(),
        *registry._watching.get_all_handlers(),
        *registry._spawning.get_all_handlers(),
        *registry._changing.get_all_handlers(),
    ]
    wanted = {
        str(h.selector): [h.selector]
        for h in handlers
        if h.selector is not None and h.selector.group not in BUILTIN_GROUPS
    }
    args = parse_args(operator_args)
    if not args.standalone:
        settings = kopf.OperatorSettings()
        settings.peering.standalone = False
        settings.peering.clusterwide = args.all_namespaces
        wanted["peering"] = list(peering.guess_selectors(settings=settings))
    return wanted


def served(crd: dict[str, Any]) -> list[references.Resource]:
    """The resources a CRD serves, as kopf's discovery describes them (what its selectors match)."""
    names = crd["spec"]["names"]
    return [
        references.Resource(
            group=crd["spec"]["group"],
            version=v["name"],
            plural=names["plural"],
            kind=names["kind"],
            singular=names.get("singular", ""),
            shortcuts=frozenset(names.get("shortNames", [])),
            categories=frozenset(names.get("categories", [])),
            namespaced=crd["spec"]["scope"] == "Namespaced",
            verbs=frozenset({"list", "watch", "patch", "get"}),
        )
        for v in crd["spec"]["versions"]
        if v.get("served", True)
    ]


@pytest.fixture(scope="module")
def rendered(
    helm: Callable[..., str], tmp_path_factory: pytest.TempPathFactory
) -> list[tuple[dict, list[dict]]]:
    tmp = tmp_path_factory.mktemp("argocd")
    return [(app, render_application(app, helm, tmp)) for app in applications()]


def test_every_crd_the_operator_watches_is_synced_before_the_operator(rendered) -> None:
    ((operator_app, container),) = [
        (app, c)
        for app, objs in rendered
        for o in objs
        if o["kind"] == "Deployment"
        for c in o["spec"]["template"]["spec"]["containers"]
        if c["name"] == "operator"
    ]
    assert container["args"][:2] == ["operator", "run"]
    wanted = watched_custom_resources(container["args"][2:])
    assert {s.group for selectors in wanted.values() for s in selectors} >= {"rlfleet.dev", "kopf.dev"}
    synced = [
        (app, r)
        for app, objs in rendered
        for o in objs
        if o["kind"] == "CustomResourceDefinition"
        for r in served(o)
    ]
    for what, selectors in wanted.items():
        apps = [app for app, r in synced if any(s.check(r) for s in selectors)]
        assert apps, f"{what}: no Application of the example syncs its CRD"
        assert any(a is operator_app or wave(a) < wave(operator_app) for a in apps), (
            f"{what}: its CRD syncs after the operator ({[a['metadata']['name'] for a in apps]})"
        )


def test_every_custom_object_of_the_example_has_its_crd_in_an_earlier_wave(rendered) -> None:
    crd_wave = {}
    for app, objs in rendered:
        for crd in (o for o in objs if o["kind"] == "CustomResourceDefinition"):
            crd_wave[(crd["spec"]["group"], crd["spec"]["names"]["kind"])] = wave(app)
    custom = [
        (app, o)
        for app, objs in rendered
        for o in objs
        if o["apiVersion"].split("/")[0] in {group for group, _ in crd_wave}
    ]
    assert {o["kind"] for _, o in custom} >= {"RLJob", "ClusterKopfPeering"}
    for app, obj in custom:
        group = obj["apiVersion"].split("/")[0]
        assert crd_wave[(group, obj["kind"])] < wave(app), f"{obj['kind']} syncs no later than its CRD"


def test_the_crd_size_gitops_md_states_is_the_rljob_crds() -> None:
    """gitops.md gives the RLJob CRD's size as JSON as the reason for server-side apply: held to the file
    within 10% (the number is a reader's scale, and it grows with the API)."""
    import json
    import re

    stated = re.search(r"the RLJob CRD is about (\d+) KB as JSON", (REPO / "docs" / "gitops.md").read_text())
    assert stated, "docs/gitops.md no longer states the RLJob CRD's size"
    crd = yaml.safe_load((REPO / "charts" / "rlfleet" / "crds" / "rlfleet.dev_rljobs.yaml").read_text())
    size = len(json.dumps(crd, separators=(",", ":")))
    assert abs(size / 1000 - int(stated.group(1))) <= 0.1 * int(stated.group(1)), size
    assert size < 262_144  # the stated cap is not the reason today: growth is
