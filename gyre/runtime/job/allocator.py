"""A CPU rank's allocator gives freed memory back to the system (docs/training.md, "The memory plan").

A rank on a CPU allocates every tensor with glibc's `malloc`. As glibc comes, a freed block above its mmap threshold
raises that threshold to the block's size (up to 32 MiB), so from the second step on a training step's activations
(megabytes each) come from the heap, whose freed blocks stay resident and, fragmented, do not fit the next ones: a
rank's peak then grows past what it holds at any moment, by an amount the memory plan cannot tell (measured in
`benchmarks/memory_plan.py`). `return_freed_memory()` fixes both thresholds with `mallopt`: blocks from
`MMAP_THRESHOLD` up are mmapped and unmapped at `free`, and the heap's top is trimmed past `TRIM_THRESHOLD`; a rank's
peak is then what it holds, as the plan counts it. Smaller blocks (most of the tiny models' tensors) are served as
before.

`open_job` (`gyre.runtime.job.spmd`) calls it first on every rank whose `trainer.device` is a CPU, before any model
is built; a rank on a GPU keeps glibc's defaults (its tensors are in CUDA's allocator). It sets this process only
(`mallopt`: nothing inherited, no environment read). Where the C library is not glibc: a warning, nothing set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "return_freed_memory"]

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 20  # bytes: blocks from here up are mmapped, so unmapped when freed
TRIM_THRESHOLD = 128 << 10  # bytes: glibc's own default, fixed (a raised mmap threshold also raised it)


def return_freed_memory() -> bool:
    """Set this process's glibc to give freed blocks back (module docstring); False, with a warning, where the C
    library is not glibc or refuses."""
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.warning("%s has no mallopt (not glibc): freed memory stays with the allocator", name)
        return False
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        log.warning("glibc's mallopt refused the thresholds: freed memory stays with the allocator")
        return False
    return True
