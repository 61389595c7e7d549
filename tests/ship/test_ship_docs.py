"""User docs stay true to the code: links resolve, every page is reachable from the index, commands are
real CLI commands, tables match the chart (alerts, RBAC, values) they describe."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
# The pages this area owns (other areas' pages are checked by their owners' tests).
PAGES = [
    DOCS / f"{n}.md" for n in ("index", "quickstart", "install", "operations", "gitops", "architecture")
] + [REPO / "images" / "README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    for target in LINK.findall(re.sub(r"`[^`]*`", "", text)):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.name}: broken link {target}"
        if anchor and resolved.suffix == ".md":
            anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", resolved.read_text(), re.MULTILINE)}
            assert anchor in anchors, f"{page.name}: no heading #{anchor} in {resolved.name}"


def test_index_links_every_page() -> None:
    linked = {t.partition("#")[0] for t in LINK.findall((DOCS / "index.md").read_text())}
    missing = {p.name for p in DOCS.glob("*.md")} - linked - {"index.md"}
    assert not missing, f"docs/index.md does not link {sorted(missing)}"
    for needed in ("quickstart.md", "install.md", "operations.md", "gitops.md", "architecture.md"):
        assert (DOCS / needed).is_file()


def test_docs_only_show_real_rlfleet_commands() -> None:
    from rlfleet.cli import COMMANDS, plugin_commands

    commands = COMMANDS | plugin_commands()  # `rlfleet ablate`: the experiments' command, installed in .venv
    seen = 0
    for page in PAGES:
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", page.read_text(), re.DOTALL):
            pattern = r"^\s*(?:\.venv/bin/|scripts/)?rlfleet ((?:[a-z][a-z0-9-]* ?){1,2})"
            for words in re.findall(pattern, block, re.MULTILINE):
                parts = tuple(words.split())
                assert any(parts[: len(w)] == w for w in commands), (
                    f"{page.name}: `rlfleet {words}` is no command"
                )
                seen += 1
    assert seen >= 3  # the pages do show commands (run, ablate, crds)


def test_operations_alert_table_matches_the_chart(render) -> None:
    objs = render({"metrics": {"prometheusRule": {"enabled": True}}})
    (rule,) = [o for o in objs if o["kind"] == "PrometheusRule"]
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    documented = set(re.findall(r"^\| (RLFleet\w+) \|", (DOCS / "operations.md").read_text(), re.MULTILINE))
    assert documented == alerts
    # the anchors the alert descriptions point to exist
    text = (DOCS / "operations.md").read_text()
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}
    for r in (r for g in rule["spec"]["groups"] for r in g["rules"]):
        for anchor in re.findall(r"operations\.md#([\w-]+)", r["annotations"]["description"]):
            assert anchor in anchors, anchor


def _rbac_rows() -> set[tuple[str, str, str]]:
    text = (DOCS / "install.md").read_text()
    section = text[text.index("## RBAC") : text.index("## High availability")]
    rows = set()
    for group, resources, verbs in re.findall(r"^\| ([^|]+) \| ([^|]+) \| ([^|]+) \|", section, re.MULTILINE):
        group = group.strip().split(" ")[0].strip('"')
        if group in ("API", "---"):
            continue
        for resource in re.findall(r"[a-z]+(?:/[a-z]+)?", resources.split("(")[0]):
            for verb in verbs.split():
                rows.add(("" if group == "" else group, resource, verb))
    return rows


def test_install_rbac_table_matches_the_chart(render) -> None:
    """Every grant of the default chart (the operator's ClusterRole, the webhook's Role and
    ClusterRole, and the two sandbox roles it binds trainers to) is a row of the table, and every row a grant."""
    roles = [o for o in render() if o["kind"] in ("ClusterRole", "Role")]
    assert len(roles) == 5
    granted = {
        (g, r, v)
        for role in roles
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert _rbac_rows() == granted


def _keys(values: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for key, value in values.items():
        out.add(prefix + key)
        if isinstance(value, dict):
            out |= _keys(value, prefix + key + ".")
    return out


def test_install_values_table_names_real_values() -> None:
    keys = _keys(yaml.safe_load((REPO / "charts" / "rlfleet" / "values.yaml").read_text()))
    text = (DOCS / "install.md").read_text()
    section = text[text.index("## Values") : text.index("## Uninstall")]
    for cell in re.findall(r"^\| `([^|]+)` \|", section, re.MULTILINE):
        first, *rest = [c.strip(" `") for c in cell.split("/")]
        if first.endswith(".*"):
            first = first[:-2]
        assert first in keys, first
        base = first.rsplit(".", 1)[0]
        for other in rest:
            assert f"{base}.{other}" in keys or other in keys, other
