"""Directories standing for a version's published views, for the tests of what the channel, the operator and
the sidecars do with versions (not with weights): each holds one config.json naming its view."""

from __future__ import annotations

import json
from pathlib import Path


def stub_views(root: Path, views: tuple[str, ...] = ("bf16", "fp8")) -> dict[str, Path]:
    """`root`/<view>/config.json ({"view": <view>}) for each of `views`: the view -> its directory, as
    WeightChannel.publish takes them."""
    out = {}
    for view in views:
        directory = root / view
        directory.mkdir(parents=True)
        (directory / "config.json").write_text(json.dumps({"view": view}))
        out[view] = directory
    return out
