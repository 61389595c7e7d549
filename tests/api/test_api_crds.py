"""The committed CRDs are exactly what the models generate, and they are structural and complete."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlfleet.api import crdgen
from rlfleet.api.schema import walk
from rlfleet.catalog import catalog_from_mapping, load_catalog

REPO = Path(__file__).resolve().parents[2]
CRDS = REPO / "crds"


def crd(kind: str) -> dict:
    return next(c for c in crdgen.generate().values() if c["spec"]["names"]["kind"] == kind)


def schema(kind: str) -> dict:
    return crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_committed_crds_match_the_models() -> None:
    stale = crdgen.stale_files(CRDS)
    assert stale == [], f"crds/ is stale: {stale}; run `rlfleet crds`"
    assert sorted(p.name for p in CRDS.glob("*.yaml")) == sorted(crdgen.generate())


def test_cli_check_and_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert crdgen.cli(["--out", str(tmp_path), "--check"]) == 1
    assert "stale or missing" in capsys.readouterr().err
    assert crdgen.cli(["--out", str(tmp_path)]) == 0
    assert crdgen.cli(["--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "rlfleet.dev_rljobs.yaml").write_text("tampered\n")
    assert crdgen.cli(["--out", str(tmp_path), "--check"]) == 1
    assert crdgen.cli(["--out", str(tmp_path), "--catalog", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["RLJob", "SamplerGroup", "WeightChannel"])
def test_schema_is_structural_and_documented(kind: str) -> None:
    undocumented, untyped = [], []
    for path, node in walk(schema(kind)):
        if "type" not in node:
            untyped.append(path)
        documented = path in ("", ".metadata") or path.endswith("[]") or path.endswith("{}")
        if not documented and not node.get("description"):
            undocumented.append(path)
        assert "$ref" not in node and "anyOf" not in node and "allOf" not in node, path
        assert node.get("additionalProperties") is not False, path
    assert untyped == [] and undocumented == []


def test_names_subresources_and_columns() -> None:
    names = {c["spec"]["names"]["kind"]: c["spec"]["names"] for c in crdgen.generate().values()}
    assert {k: n["shortNames"] for k, n in names.items()} == {
        "RLJob": ["rlj"],
        "SamplerGroup": ["sg"],
        "WeightChannel": ["wc"],
    }
    assert all(n["categories"] == ["rlfleet"] for n in names.values())
    sg = crd("SamplerGroup")["spec"]["versions"][0]
    assert sg["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    visible = [c["name"] for c in sg["additionalPrinterColumns"] if not c.get("priority")]
    # the cockpit: what a group does and why, without -o wide (share as a percentage)
    assert visible == [
        "Accelerator",
        "Weights",
        "Phase",
        "Ready",
        "Tok/s",
        "Share%",
        "Version",
        "Lag",
        "KL",
        "OOR",
        "Usable",
        "Reason",
        "Age",
    ]
    rlj = crd("RLJob")["spec"]["versions"][0]
    visible = [c["name"] for c in rlj["additionalPrinterColumns"] if not c.get("priority")]
    assert visible == ["Phase", "Groups", "Trainer", "Step", "Version", "Reward", "KL", "Reason", "Age"]
    # -o wide: the economics (docs/economics.md, "Where the figures show")
    wide = {c["name"]: c["jsonPath"] for c in rlj["additionalPrinterColumns"] if c.get("priority") == 1}
    assert (wide["$/1M"], wide["Saving%"], wide["Baseline"]) == (
        ".status.costPer1MTokens",
        ".status.savingPercent",
        ".status.baselineSource",
    )
    wide = {c["name"]: c["jsonPath"] for c in sg["additionalPrinterColumns"] if c.get("priority") == 1}
    assert (wide["$/h"], wide["$/1M"]) == (".status.costPerHour", ".status.costPer1MTokens")
    wc = crd("WeightChannel")["spec"]["versions"][0]
    visible = {c["name"]: c["jsonPath"] for c in wc["additionalPrinterColumns"] if not c.get("priority")}
    # the latest version's stored bytes over its complete views (deltas: a few %, anchors: 100)
    assert list(visible) == ["Store", "Latest", "Stored%", "Phase", "Age"]
    assert visible["Stored%"] == ".status.storedPercent"
    for c in crdgen.generate().values():
        version = c["spec"]["versions"][0]
        assert version["subresources"]["status"] == {}
        props = version["schema"]["openAPIV3Schema"]["properties"]
        for column in version["additionalPrinterColumns"]:
            # every column points at a field that exists in the schema
            parts = column["jsonPath"].lstrip(".").split(".")
            node = {"properties": {**props, "metadata": {"properties": {"creationTimestamp": {}}}}}
            for part in parts:
                assert part in node.get("properties", {}), column
                node = node["properties"][part]


def test_defaults_bounds_and_cel_rules_are_in_the_schema() -> None:
    spec = schema("RLJob")["properties"]["spec"]["properties"]
    rollout = spec["rollout"]
    assert rollout["default"]["promptsPerStep"] == 128 and rollout["default"]["topP"] == 1.0
    assert rollout["properties"]["promptsPerStep"]["default"] == 128
    assert (
        rollout["properties"]["temperature"]["minimum"] == 0
        and rollout["properties"]["temperature"]["exclusiveMinimum"] is True
    )
    assert any("topK" in r["rule"] for r in rollout["x-kubernetes-validations"])
    assert spec["correction"]["x-kubernetes-validations"][0]["rule"] == "self.misLow < self.misHigh"
    assert spec["staleness"]["properties"]["maxSteps"]["nullable"] is True
    groups = spec["samplerGroups"]
    assert "exists_one" in groups["x-kubernetes-validations"][0]["rule"] and groups["maxItems"] == 32
    item = groups["items"]
    assert item["properties"]["replicas"]["minimum"] == 0
    assert item["properties"]["accelerator"]["enum"] == [
        "a100",
        "b200",
        "b300",
        "cpu",
        "h100",
        "h200",
        "rtx-pro-6000",
    ]
    rules = {r["rule"] for r in item["x-kubernetes-validations"]}
    assert "self.accelerator != 'h100' || self.weightFormat in ['bf16', 'fp8', 'mxfp4']" in rules
    assert "self.accelerator != 'a100' || self.weightFormat in ['bf16', 'fp8']" in rules
    # classes that run every format and KV dtype need no rule
    assert not any("'b200'" in r for r in rules)
    sg_rules = {r["rule"] for r in schema("SamplerGroup")["properties"]["spec"]["x-kubernetes-validations"]}
    assert rules <= sg_rules
    assert schema("RLJob")["x-kubernetes-validations"][0]["rule"].startswith("size(self.metadata.name)")
    status = schema("SamplerGroup")["properties"]["status"]["properties"]
    assert status["conditions"]["x-kubernetes-list-type"] == "map"
    assert status["shareHistory"]["maxItems"] == 5


def test_catalog_override_extends_the_enum_and_rules() -> None:
    base = load_catalog(None)
    l40s = base.get("h100").model_dump(by_alias=True)
    l40s.update(
        name="l40s",
        displayName="NVIDIA L40S",
        productLabels=["NVIDIA-L40S"],
        gkeAccelerators=[],
        computeCapability="8.9",
        weightFormats={"bf16": {}, "fp8": {"flags": ["--quantization", "fp8"]}},
        unsupported={},
    )
    cat = catalog_from_mapping({"classes": {"l40s": l40s}})
    generated = crdgen.generate(cat)
    item = generated["rlfleet.dev_rljobs.yaml"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"][
        "properties"
    ]["spec"]["properties"]["samplerGroups"]["items"]
    assert "l40s" in item["properties"]["accelerator"]["enum"]
    assert "self.accelerator != 'l40s' || self.weightFormat in ['bf16', 'fp8']" in {
        r["rule"] for r in item["x-kubernetes-validations"]
    }


def test_rendered_yaml_is_stable_and_parseable() -> None:
    for c in crdgen.generate().values():
        text = crdgen.render(c)
        assert text == crdgen.render(c)
        assert yaml.safe_load(text) == c


def test_api_reference_page_is_generated_from_the_models() -> None:
    docs = REPO / "docs" / "api.md"
    assert docs.read_text() == crdgen.render_docs(), (
        "docs/api.md is stale; run `rlfleet crds --docs docs/api.md`"
    )
    text = docs.read_text()
    for field in (
        "`spec.samplerGroups[].weightFormat`",
        "`status.shareHistory[].from`",
        "`spec.local.model.hiddenSize`",
    ):
        assert field in text
    assert "group names must be unique" in text and "| `rtx-pro-6000` |" in text


def test_crds_cli_writes_every_output_and_check_names_the_stale_copy(tmp_path, capsys) -> None:
    from rlfleet.api.crdgen import cli

    first, second = tmp_path / "crds", tmp_path / "chart-crds"
    assert cli(["--out", str(first), "--out", str(second)]) == 0
    names = sorted(p.name for p in first.iterdir())
    assert names and names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_text() == (second / name).read_text()
    assert cli(["--check", "--out", str(first), "--out", str(second)]) == 0
    (second / names[0]).write_text("tampered\n")
    capsys.readouterr()
    assert cli(["--check", "--out", str(first), "--out", str(second)]) == 1
    err = capsys.readouterr().err
    assert f"{second}/{names[0]}" in err and str(first) not in err.replace(str(second), "")
