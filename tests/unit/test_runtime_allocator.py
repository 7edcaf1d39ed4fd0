"""A CPU rank's allocator (`gyre.runtime.job.allocator`, called by `open_job`): a freed block of a few MiB goes back to
the system, where glibc as it comes keeps it resident once its threshold has risen past it. Each case runs in a
fresh interpreter (the setting is the process's)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# Allocate 8 MiB, touch and free it twice (the first free raises glibc's own threshold past 8 MiB, so the second
# block comes from the heap as it comes), then report how much resident memory the second free gave back.
PROBE = textwrap.dedent(
    """
    import ctypes, json, re
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def rss():
        status = open("/proc/self/status").read()
        return int(re.search(r"VmRSS:\\s+(\\d+) kB", status).group(1)) * 1024

    size = 8 << 20
    for _ in range(2):
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        held = rss()
        libc.free(block)
    print(json.dumps({"returned": held - rss()}))
    """
)
OPEN_JOB = textwrap.dedent(
    """
    from gyre.config import TrainConfig
    from gyre.config.cluster import ClusterConfig
    from gyre.runtime.job.plan import plan_layout
    from gyre.runtime.job.spmd import open_job

    cfg = TrainConfig(cluster=ClusterConfig(num_cells=1, cell_size=1, cell_capacity=16))
    open_job(cfg, plan_layout(cfg, 1))
    """
)


def returned_bytes(setup: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", setup + PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])["returned"]


def test_a_cpu_rank_gives_a_freed_block_back_where_glibc_as_it_comes_keeps_it():
    assert returned_bytes("") < 2 << 20  # glibc's own thresholds: the second block stays resident
    assert returned_bytes(OPEN_JOB) >= 7 << 20  # a CPU trainer's rank: unmapped at free
    setting = "from gyre.runtime.job.allocator import return_freed_memory\nassert return_freed_memory()\n"
    assert returned_bytes(setting) >= 7 << 20
