"""The tools' result: one JSON object printed, and written to ``--out`` when given."""

from __future__ import annotations

import json
from typing import Any


def emit(res: dict[str, Any], out: str | None, indent: int | None = 1) -> None:
    """Print ``res`` as JSON (``indent`` None: one line) and write it to ``out`` (if any)."""
    print(json.dumps(res, indent=indent))
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
