"""The precision autopilot's reading of one group at one interval (operator/autopilot.py), as its tests
and the trainer's invalid-token test build it."""

from __future__ import annotations

from typing import Any

from rlfleet.operator.autopilot import AutopilotReading


def autopilot_reading(**fields: Any) -> AutopilotReading:
    """Group b200-nvfp4 (the b200 class, nvfp4 weights, KV cache auto), not quarantined, at KL 0 and no
    out-of-range tokens against budgets of 0.01 and 0.2; `fields` replace any of these or set the rest."""
    defaults: dict[str, Any] = {
        "name": "b200-nvfp4",
        "accelerator": "b200",
        "weight_format": "nvfp4",
        "kv_cache_dtype": "auto",
        "kl": 0.0,
        "oor_fraction": 0.0,
        "max_kl": 0.01,
        "max_oor_fraction": 0.2,
        "quarantined": False,
    }
    return AutopilotReading(**(defaults | fields))
