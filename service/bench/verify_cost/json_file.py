"""Reading the JSON files the verify-cost bench takes (a model's config.json, a cost profile) with an
error that names the file and what it was meant to be."""

from __future__ import annotations

import json
from pathlib import Path


def read_json_object(path: Path, what: str, error: type[Exception]) -> dict:
    """The JSON object in `path`; `error` (naming `what` the file is) when it cannot be read or is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise error(f"{what} {path} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise error(f"{what} {path}: not one JSON object")
    return data
