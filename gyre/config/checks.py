"""The one way a config rejects a bad value: a `ConfigError` (a ValueError) naming the field, the value and what
is allowed, always in the shape `{field}={value!r} is not allowed: expected {allowed}`.

`require(ok, field, value, allowed)` is the general check (cross-field rules, choices with a reason). The typed
helpers below cover the common field kinds so every config checks them the same way:
- `require_int`: an int within bounds; a bool is never an integer (True would pass `isinstance(x, int)`).
- `require_number`: an int or float within bounds; never a bool, never NaN or an infinity.
- `require_duration`: a number of seconds > 0 (or >= 0 with `allow_zero`), finite: an infinite budget hangs a run.
- `require_bool`: exactly True or False (1 and "yes" are refused: a typo should not flip a switch).
- `require_choice`: one of a fixed set of names.
A field name may be qualified (`packing.min_fill`, `WarmStartConfig.lr`): the message shows it as given.
Stdlib only.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any


class ConfigError(ValueError):
    """A config value a user can fix; the message names the field, the value and what is allowed."""


def require(ok: bool, field: str, value: Any, allowed: str) -> None:
    """Raise ConfigError unless `ok`; a non-finite float is never allowed (an infinite duration hangs a run)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{field}={value!r} is not allowed: expected a finite number, {allowed}")
    if not ok:
        raise ConfigError(f"{field}={value!r} is not allowed: expected {allowed}")


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or float that is not a bool (finite or not: `require` refuses the non-finite ones)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def require_int(
    field: str, value: Any, *, ge: int | None = None, le: int | None = None, gt: int | None = None, note: str = ""
) -> None:
    """`value` is an int (not a bool) with `ge <= value <= le` / `value > gt` where given.

    The allowed text reads "an integer >= 1", "an integer in [0, 65535]", with " ({note})" appended if given."""
    ok = is_int(value) and _within(value, ge=ge, le=le, gt=gt)
    require(ok, field, value, _describe("an integer", ge=ge, le=le, gt=gt, note=note))


def require_number(
    field: str,
    value: Any,
    *,
    ge: float | None = None,
    le: float | None = None,
    gt: float | None = None,
    lt: float | None = None,
    note: str = "",
) -> None:
    """`value` is a finite int or float (not a bool) within the given bounds ("a number in (0, 1]")."""
    ok = is_number(value) and math.isfinite(value) and _within(value, ge=ge, le=le, gt=gt, lt=lt)
    require(ok, field, value, _describe("a number", ge=ge, le=le, gt=gt, lt=lt, note=note))


def require_duration(field: str, value: Any, *, allow_zero: bool = False, note: str = "") -> None:
    """`value` is a finite number of seconds, > 0 ("a positive number of seconds"), or >= 0 with `allow_zero`."""
    ok = is_number(value) and math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    allowed = "a number of seconds >= 0" if allow_zero else "a positive number of seconds"
    require(ok, field, value, f"{allowed} ({note})" if note else allowed)


def require_bool(field: str, value: Any) -> None:
    """`value` is True or False, nothing else."""
    require(isinstance(value, bool), field, value, "a bool")


def require_choice(field: str, value: Any, choices: Collection[str], *, note: str = "") -> None:
    """`value` is one of `choices` ("one of float32, bfloat16, float16")."""
    allowed = f"one of {', '.join(choices)}"
    require(isinstance(value, str) and value in choices, field, value, f"{allowed} ({note})" if note else allowed)


def _within(
    value: float, *, ge: float | None = None, le: float | None = None, gt: float | None = None, lt: float | None = None
) -> bool:
    return (
        (ge is None or value >= ge)
        and (le is None or value <= le)
        and (gt is None or value > gt)
        and (lt is None or value < lt)
    )


def _describe(
    kind: str,
    *,
    ge: float | None = None,
    le: float | None = None,
    gt: float | None = None,
    lt: float | None = None,
    note: str = "",
) -> str:
    low = f"[{_bound(ge)}" if ge is not None else f"({_bound(gt)}" if gt is not None else None
    high = f"{_bound(le)}]" if le is not None else f"{_bound(lt)})" if lt is not None else None
    if low is not None and high is not None:
        text = f"{kind} in {low}, {high}"
    elif low is not None:
        text = f"{kind} {'>=' if ge is not None else '>'} {low[1:]}"
    elif high is not None:
        text = f"{kind} {'<=' if le is not None else '<'} {high[:-1]}"
    else:
        text = kind
    return f"{text} ({note})" if note else text


def _bound(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"
