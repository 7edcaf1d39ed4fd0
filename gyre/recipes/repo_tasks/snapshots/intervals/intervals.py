"""Integer intervals."""


def merge(intervals):
    """Merge overlapping or touching [start, end] intervals; the result sorted by start."""
    raise NotImplementedError


def length(interval):
    start, end = interval
    return end - start
