"""`rlfleet fleet plan FILE` as a real subprocess: the example's plan as JSON, exit 2 with one line for
an infeasible demand and for bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.fleet_plan_cli import run_fleet_plan

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "fleet-plan.yaml"


def test_example_plan_prints_json_with_replicas_shares_costs_and_binding() -> None:
    result = run_fleet_plan(EXAMPLE)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    spec = yaml.safe_load(EXAMPLE.read_text())
    assert set(plan["groups"]) == {g["name"] for g in spec["groups"]}
    shares = [g["share"] for g in plan["groups"].values()]
    assert sum(shares) == pytest.approx(1.0, abs=1e-5)
    assert plan["fleet"]["usableTokensPerSecond"] >= spec["demand"]["usableTokensPerSecond"]
    assert plan["fleet"]["oorFraction"] <= spec["budgets"]["maxOorFraction"]
    assert plan["fleet"]["kl"] <= spec["budgets"]["maxKl"]
    for g in spec["groups"]:  # the change bound from the current replicas
        assert abs(plan["groups"][g["name"]]["replicas"] - g["replicas"]) <= spec["maxStepReplicas"]
    # b200 at bf16 from the example's own b200-bf16 group: $5.99/h over 6000 x 0.998 usable tok/s
    assert plan["reference"]["costPer1MUsableTokens"] == pytest.approx(
        5.99 / 3600 / (6000 * 0.998) * 1e6, rel=1e-5
    )
    assert 0 < plan["reference"]["saving"] < 1
    assert {"constraint", "group", "message"} <= set(plan["binding"][0])


def test_infeasible_demand_exits_2_with_one_line(tmp_path: Path) -> None:
    spec: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    spec["demand"]["usableTokensPerSecond"] = 10**7
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(spec))  # JSON input as well as YAML
    result = run_fleet_plan(path)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "no plan meets the budgets: demand 1e+07 usable tokens/s" in lines[0]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s["groups"][0].pop("maxReplicas"), "groups.0.maxReplicas: Field required"),
        (lambda s: s["groups"][1].update(accelerator="tpu"), "unknown accelerator 'tpu'"),
        (
            lambda s: s["budgets"].update(maxOorFraction=2),
            "budgets.maxOorFraction: Input should be less than or equal to 1",
        ),
        (lambda s: s.update(extra=1), "extra: Extra inputs are not permitted"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path: Path, edit: Any, message: str) -> None:
    spec = yaml.safe_load(EXAMPLE.read_text())
    edit(spec)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = run_fleet_plan(path)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_unreadable_and_non_mapping_files_exit_2(tmp_path: Path) -> None:
    missing = run_fleet_plan(tmp_path / "nope.yaml")
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n")
    result = run_fleet_plan(listed)
    assert result.returncode == 2 and "expected a mapping" in result.stderr
