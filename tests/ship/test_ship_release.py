"""The release pipeline (.github/workflows/release.yml): linted by actionlint (built from its Go module,
tests/cluster/go/actionlint), its images the Dockerfiles the dev cluster's node builds for real
(tests/cluster/nodeimages.py), and its version rule (the tag is pyproject's version; the chart's version
and appVersion are the images' tag) run as the workflow runs it, with the real helm."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
WORKFLOW = REPO / ".github" / "workflows" / "release.yml"
VERSION_OUTPUT = "${{ needs.version.outputs.version }}"


def _workflow() -> dict[str, Any]:
    return yaml.safe_load(WORKFLOW.read_text())


def _step(job: str, name: str) -> dict[str, Any]:
    steps = [s for s in _workflow()["jobs"][job]["steps"] if s.get("name") == name]
    assert len(steps) == 1, f"{job}: no single step named {name!r}"
    return steps[0]


def _lint(actionlint: Path, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(actionlint), "-no-color", "-oneline", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def test_actionlint_accepts_the_release_workflow(actionlint_bin: Path) -> None:
    result = _lint(actionlint_bin, WORKFLOW)
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_rejects_a_broken_copy(actionlint_bin: Path, tmp_path: Path) -> None:
    """The linter really reads the workflow: an output no job defines and a misspelt input are errors."""
    broken = WORKFLOW.read_text().replace(
        "needs.version.outputs.owner }}/${{ matrix.image }}",
        "needs.version.outputs.ownr }}/${{ matrix.image }}",
        1,
    )
    broken = broken.replace("          provenance: mode=max", "          provenance-mode: max", 1)
    (tmp_path / ".github" / "workflows").mkdir(parents=True)
    path = tmp_path / ".github" / "workflows" / "release.yml"
    path.write_text(broken)
    result = _lint(actionlint_bin, path)
    assert result.returncode == 1, result.stdout
    assert "ownr" in result.stdout and "provenance-mode" in result.stdout, result.stdout


def test_a_version_tag_triggers_it() -> None:
    workflow = _workflow()
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads the key `on` as true
    assert on == {"push": {"tags": ["v*"]}}
    assert workflow["permissions"] == {"contents": "read"}  # write only where a job pushes


def test_it_builds_the_dockerfiles_the_dev_node_builds(nodeimages: Any) -> None:
    """The three images, each from the Dockerfile (and context) that tests/cluster/nodeimages.py builds for
    the real node with buildah; the operator multi-arch, the CUDA images amd64 like their bases; provenance
    and SBOM on every push; no build argument the Dockerfile does not declare (the release takes each
    Dockerfile's own base, which the dev node overrides with its CPU base through the same arguments)."""
    job = _workflow()["jobs"]["images"]
    matrix = {m["image"]: m for m in job["strategy"]["matrix"]["include"]}
    assert sorted(matrix) == sorted(nodeimages.DOCKERFILE_BASE_ARGS)
    build = next(s for s in job["steps"] if s.get("uses", "").startswith("docker/build-push-action@"))
    options = build["with"]
    assert options["context"] == "." and options["file"] == "${{ matrix.dockerfile }}"
    assert options["push"] is True and options["provenance"] == "mode=max" and options["sbom"] is True
    assert (
        options["tags"]
        == f"ghcr.io/${{{{ needs.version.outputs.owner }}}}/${{{{ matrix.image }}}}:{VERSION_OUTPUT}"
    )
    for name, entry in matrix.items():
        dockerfile = REPO / entry["dockerfile"]
        assert entry["dockerfile"] == f"images/Dockerfile.{name}" and dockerfile.is_file()
        assert Path(f"{dockerfile}.dockerignore").is_file()  # BuildKit's context filter beside it
        declared = set(re.findall(r"^ARG\s+(\w+)", dockerfile.read_text(), re.MULTILINE))
        assert set(nodeimages.DOCKERFILE_BASE_ARGS[name]) <= declared
        assert set(_build_args(options)) <= declared
        assert entry["platforms"] == ("linux/amd64,linux/arm64" if name == "operator" else "linux/amd64")
    for source in nodeimages.SOURCES:  # the context the Dockerfiles copy from is the repository's root
        assert (REPO / source).exists()


def _build_args(options: dict[str, Any]) -> list[str]:
    return [line.split("=", 1)[0] for line in str(options.get("build-args", "")).splitlines() if line.strip()]


def _run_step(step: dict[str, Any], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """A step's `run` script as the runner runs it (bash -e), its `${{ }}` inputs given through `env`."""
    assert "${{" not in step["run"], "a run script takes its inputs from env:, never inline expressions"
    return subprocess.run(
        ["bash", "-e", "-c", step["run"]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, **env},
    )


def _version_step(tag: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    output = tmp_path / "github_output"
    output.write_text("")
    result = _run_step(
        _step("version", "Check the tag against pyproject's version"),
        {"GITHUB_REF_NAME": tag, "GITHUB_OUTPUT": str(output), "GITHUB_REPOSITORY_OWNER": "RLFleet"},
        REPO,
    )
    outputs = dict(line.split("=", 1) for line in output.read_text().splitlines())
    return result, outputs


def _project_version() -> str:
    match = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert match
    return match.group(1)


def test_the_version_is_the_tag_and_pyprojects(tmp_path: Path) -> None:
    version = _project_version()
    result, outputs = _version_step(f"v{version}", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert outputs == {"version": version, "owner": "rlfleet"}  # ghcr.io names are lower case
    outputs_declared = _workflow()["jobs"]["version"]["outputs"]
    assert outputs_declared["version"] == "${{ steps.version.outputs.version }}"


@pytest.mark.parametrize(
    ("tag", "error"),
    [
        ("v9.9.9", "but pyproject.toml says version"),
        ("vlatest", "is not v<semver>"),
        ("v1.2", "is not v<semver>"),
        ("v1.2.3;echo version=9", "is not v<semver>"),
    ],
)
def test_a_tag_that_is_not_the_projects_version_stops_the_release(
    tag: str, error: str, tmp_path: Path
) -> None:
    result, outputs = _version_step(tag, tmp_path)
    assert result.returncode == 1 and outputs == {}
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("::error::") and error in lines[0], result.stdout


def test_the_chart_is_packaged_with_the_images_tag(helm_bin: Path, tmp_path: Path) -> None:
    """The chart job's packaging step, run with the real helm: the packaged chart's version AND appVersion
    are the version output that tags the images, and the operator image it installs is that tag."""
    version = "7.8.9-rc.1"
    package = _step("chart", "Package the chart")
    push = _step("chart", "Push the chart")
    assert package["env"] == {"VERSION": VERSION_OUTPUT} and push["env"]["VERSION"] == VERSION_OUTPUT
    assert 'helm push "dist/rlfleet-$VERSION.tgz" "oci://ghcr.io/$OWNER/charts"' in push["run"]
    assert _workflow()["jobs"]["chart"]["needs"] == ["version", "images"]  # no chart for images that failed
    shutil.copytree(REPO / "charts", tmp_path / "charts")
    path = f"{helm_bin.parent}{os.pathsep}{os.environ['PATH']}"
    result = _run_step(package, {"VERSION": version, "PATH": path}, tmp_path)
    assert result.returncode == 0, result.stderr
    with tarfile.open(tmp_path / "dist" / f"rlfleet-{version}.tgz") as archive:
        member = archive.extractfile("rlfleet/Chart.yaml")
        assert member is not None
        chart = yaml.safe_load(member.read())
    assert chart["version"] == version and chart["appVersion"] == version
    rendered = subprocess.run(
        [str(helm_bin), "template", "rlfleet", str(tmp_path / "dist" / f"rlfleet-{version}.tgz")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    images = set(re.findall(r"image: \"?([^\s\"]+)", rendered))
    assert images == {f"ghcr.io/rlfleet/operator:{version}"}, images
