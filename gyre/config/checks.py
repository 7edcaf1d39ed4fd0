"""One way to reject a bad config value: a ValueError naming the field, the value and what is allowed."""

from __future__ import annotations

import math
from typing import Any


class ConfigError(ValueError):
    """A config value a user can fix; the message names the field, the value and what is allowed."""


def require(ok: bool, field: str, value: Any, allowed: str) -> None:
    """Raise ConfigError unless `ok`; a non-finite float is never allowed (an infinite duration hangs a run)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{field}={value!r} is not allowed: expected a finite number, {allowed}")
    if not ok:
        raise ConfigError(f"{field}={value!r} is not allowed: expected {allowed}")
