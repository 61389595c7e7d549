"""Reading a YAML file a user hands a command (an RLJob, a catalog, a fleet-plan request; JSON is YAML):
one way to read it and one pair of one-line reasons when that fails, which each loader prefixes with
what the file was for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def read_yaml(path: Path, *, all_documents: bool = False) -> Any:
    """The data of the YAML file `path` (`all_documents`: the list of its documents, empty ones left out).
    ValueError "cannot read: <reason>" or "not valid YAML: <the parser's message on one line>"."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read: {exc.strerror or exc}") from None
    try:
        if all_documents:
            return [doc for doc in yaml.safe_load_all(text) if doc is not None]
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"not valid YAML: {' '.join(str(exc).split())}") from None
