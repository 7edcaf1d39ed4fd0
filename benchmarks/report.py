"""Shared tail of every benchmark: describe the machine, print one JSON object, optionally save it."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "system": platform.system(),
    }


def emit(result: dict[str, Any], out: Path | None = None) -> None:
    """Add the machine description, write `out` (indented) when given, print one JSON line last."""
    result = {**result, "machine": machine()}
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
