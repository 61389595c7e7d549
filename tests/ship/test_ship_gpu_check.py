"""scripts/gpu-check, the one prepared run of the checks that need a GPU (docs/testing.md, "The GPU
check"): its CPU dry run (`--cpu`, the same checks and code paths at small sizes) runs here so the script
cannot rot before the next GPU machine, and every check must be able to fail (`--fault`: a deliberately
wrong input) and make the run exit non-zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu-check"
CHECKS = [
    "torch_step/qwen3", "torch_step/qwen3_moe", "attention/varlen_bf16", "routing/replay_bf16", "fsdp2/fused_adamw",
    "objective/memory_16k", "objective/memory_64k", "megatron_step", "views/fp8", "views/nvfp4",
]  # fmt: skip

pytestmark = pytest.mark.slow


def _run(*args: str, python: str = sys.executable) -> tuple[int, list[dict[str, Any]], str]:
    env = {**os.environ, "PYTHON": python}
    result = subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=900, env=env, cwd=REPO
    )
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    return result.returncode, lines, result.stderr


@pytest.fixture(scope="module")
def dry_run() -> tuple[int, list[dict[str, Any]], str]:
    return _run("--cpu")


def test_the_dry_run_prints_one_line_per_check_and_holds(
    dry_run: tuple[int, list[dict[str, Any]], str],
) -> None:
    rc, lines, stderr = dry_run
    checks, summary = lines[:-1], lines[-1]
    assert [c["check"] for c in checks] == CHECKS, stderr[-2000:]
    by_name = {c["check"]: c for c in checks}
    for name, line in by_name.items():
        if name == "megatron_step" and line["status"] == "skipped":
            # the test tier's interpreter (3.11) has no megatron-core: the check names what it lacks
            assert (
                "megatron-core is not importable" in line["reason"]
                and "gpu-check-wheels.txt" in line["reason"]
            )
            continue
        assert line["status"] == "ok", line
        assert line["device"] == "cpu" and line["tolerance"], line
    assert rc == 0, stderr[-2000:]
    skipped = sum(c["status"] == "skipped" for c in checks)
    assert summary["summary"] == {"ok": len(CHECKS) - skipped, "failed": 0, "skipped": skipped}
    assert summary["failed"] == [] and summary["device"] == "cpu"


def test_the_dry_run_measures_what_each_check_claims(dry_run: tuple[int, list[dict[str, Any]], str]) -> None:
    by_name = {c["check"]: c for c in dry_run[1][:-1]}
    attention = by_name["attention/varlen_bf16"]["measured"]
    assert attention["other_sequences_unchanged"] is True and attention["sequences"] == 3
    routing = by_name["routing/replay_bf16"]["measured"]
    assert routing["routed_as_replayed"] and routing["router_grad_nonzero"] and routing["layers"] == 2
    fsdp2 = by_name["fsdp2/fused_adamw"]["measured"]
    assert fsdp2["fused"] and fsdp2["dtensor"] and fsdp2["adam_update_err_over_slack"] <= 1.0
    for name in ("objective/memory_16k", "objective/memory_64k"):
        memory = by_name[name]["measured"]
        assert memory["vocab"] == 8192 and memory["measure"] == "VmHWM"
        assert memory["fused_gib"] * 2 <= memory["materialized_gib"], memory
    assert (
        by_name["objective/memory_64k"]["measured"]["tokens"]
        == 4 * by_name["objective/memory_16k"]["measured"]["tokens"]
    )
    for view in ("views/fp8", "views/nvfp4"):
        # the tiny Qwen3's 2 layers x (q, k, v, o, gate, up, down) projections
        assert by_name[view]["measured"]["quantized_weights"] == 14
        assert by_name[view]["measured"]["err_over_bound"] <= 1.0


def test_every_check_fails_on_a_wrong_input_and_the_run_exits_non_zero() -> None:
    rc, lines, stderr = _run("--cpu", "--fault", "all")
    checks, summary = lines[:-1], lines[-1]
    assert [c["check"] for c in checks] == CHECKS, stderr[-2000:]
    ran = [c for c in checks if c["status"] != "skipped"]
    assert len(ran) >= len(CHECKS) - 1
    for line in ran:
        assert line["status"] == "failed" and line["reason"] and not line["reason"].startswith("error:"), line
    assert rc == 1
    assert summary["failed"] == [c["check"] for c in ran]


def test_one_faulted_check_fails_the_run_alone() -> None:
    rc, lines, _ = _run("--cpu", "--only", "attention/varlen_bf16,views/fp8", "--fault", "views/fp8")
    assert [(c["check"], c["status"]) for c in lines[:-1]] == [
        ("attention/varlen_bf16", "ok"),
        ("views/fp8", "failed"),
    ]
    assert "rounding bound" in lines[1]["reason"]
    assert rc == 1 and lines[-1]["failed"] == ["views/fp8"]


def test_an_unknown_check_is_one_line_and_exit_2() -> None:
    result = subprocess.run(
        [str(SCRIPT), "--cpu", "--only", "attention"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
        timeout=120,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"gpu-check: unknown check 'attention'; known: {', '.join(CHECKS)}"
    ]


def _megatron_python() -> str | None:
    """An interpreter with megatron-core and rlfleet's core dependencies: RLFLEET_MEGATRON_PYTHON, or the
    megatron CPU tier's .venv312 (scripts/bootstrap)."""
    for python in filter(
        None, [os.environ.get("RLFLEET_MEGATRON_PYTHON"), str(REPO / ".venv312" / "bin" / "python")]
    ):
        probe = subprocess.run(
            [python, "-c", "import megatron.core, pydantic, blake3, transformers"], capture_output=True
        )
        if Path(python).exists() and probe.returncode == 0:
            return python
    return None


def test_the_megatron_check_runs_where_megatron_core_is_importable() -> None:
    """The megatron backend's step on CPU (fp32, gloo, the product's CPU shims) equals the torch backend's
    fp32 step; with a fault (5% weight noise) it fails the run."""
    python = _megatron_python()
    if python is None:
        pytest.skip("no interpreter with megatron-core (.venv312 or RLFLEET_MEGATRON_PYTHON)")
    rc, lines, stderr = _run("--cpu", "--only", "megatron_step", python=python)
    assert rc == 0 and lines[0]["status"] == "ok", (lines, stderr[-2000:])
    assert lines[0]["measured"]["grad_norm_rel_err"] < 1e-5  # fp32 against fp32: the same step
    rc, lines, _ = _run("--cpu", "--only", "megatron_step", "--fault", "megatron_step", python=python)
    assert (
        rc == 1 and lines[0]["status"] == "failed" and lines[0]["reason"].startswith("outside tolerance")
    ), lines


def test_without_a_gpu_the_run_says_so_in_one_line_and_exits_2() -> None:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "CUDA_VISIBLE_DEVICES": "",
    }  # no device, as on this machine
    result = subprocess.run(
        [str(SCRIPT), "--only", "attention/varlen_bf16"], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "gpu-check: no CUDA device (torch.cuda.is_available() is False); --cpu runs the dry run"
    ]


UNINSTALLED = """
import sys
# the GPU machine: rlfleet not installed (this interpreter's editable install hidden), only the checkout
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower() and "editable" not in type(f).__module__]
try:
    import rlfleet
    raise SystemExit("rlfleet is still importable")
except ImportError:
    pass
sys.path.insert(0, sys.argv[1])
import gpu_check
code = gpu_check.main(["--cpu", "--only", "attention/varlen_bf16"])
import operator
assert operator.__file__.startswith(sys.base_prefix) or "python3" in operator.__file__, operator.__file__  # the stdlib's
assert sys.modules["rlfleet.trainer"].__file__.endswith("/trainer/__init__.py")
sys.exit(code)
"""


def test_the_check_imports_the_product_from_a_checkout_where_it_is_not_installed(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", UNINSTALLED, str(REPO / "tests" / "gpu")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[0])["status"] == "ok"
