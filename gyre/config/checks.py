"""One way to reject a bad config value: a ValueError naming the field, the value and what is allowed."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value a user can fix; the message names the field, the value and what is allowed."""


def require(ok: bool, field: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{field}={value!r} is not allowed: expected {allowed}")
