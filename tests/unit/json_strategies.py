"""Hypothesis strategies for fuzzing request bodies, shared by the dialect tests.

Imported by the test modules as `json_strategies` (pytest puts this directory on sys.path).
"""

from __future__ import annotations

import copy

from hypothesis import strategies as st

# Any JSON value: what a foreign or broken client could send.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def all_paths(value, prefix=()) -> list[tuple]:
    """Every path (tuple of keys and indexes) into a JSON value, the empty path first."""
    paths = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            paths += all_paths(child, (*prefix, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            paths += all_paths(child, (*prefix, i))
    return paths


DELETE = object()  # `mutate`'s value that removes the field


def mutate(body: dict, path: list, value) -> dict:
    """A deep copy of `body` with the field at `path` set to `value` (or removed: `DELETE`)."""
    body = copy.deepcopy(body)
    target = body
    for key in path[:-1]:
        target = target[key]
    if value is DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return body
