"""Hypothesis strategies for fuzzing request bodies, shared by the dialect tests.

Imported by the test modules as `json_strategies` (pytest puts this directory on sys.path).
"""

from __future__ import annotations

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
