"""Run a function on N local processes joined by a gloo process group on 127.0.0.1 (tests and benchmarks).

`run_local(target, world_size, kwargs=..., timeout_s=..., env=...)` starts `world_size` processes, each of which calls
`torch.distributed.init_process_group("gloo")` through a file store in the call's temporary directory (no TCP port
to choose: one chosen free could be taken by another process before rank 0 binds it), runs `target(rank, world_size,
**kwargs)`, destroys the group, writes the JSON-able return value to a file and leaves without interpreter
finalization (see `_rank_main`). The parent returns the values by rank. Every wait is bounded: past `timeout_s`,
or as soon as one rank fails, the remaining processes are killed by PID and a `LocalRunError` carries each failed
rank's output tail.

A target that needs a TCPStore of its own (what the program's control plane and claim queue run on) gets one from
`shared_store()`: rank 0 hosts it on a port the kernel picks when it binds, and the port reaches the other ranks
through the group.

The ranks fork from multiprocessing's forkserver, which imports torch, gyre.trainer (its megatron patch) and
megatron-core once, the first time this process runs anything on it (`PRELOAD`): a rank started as
`python -m ...` paid those imports itself, ~2 CPU s for torch and ~5 more for megatron, on every rank of every
call (docs/testing.md). A rank is a clean process nonetheless: nothing of the caller is inherited but its
environment (passed at each call, so a variable set since the forkserver started counts) and the
`PRELOAD` modules, none of which holds state a rank uses. Two environment variables read when the interpreter or
torch starts are applied in the rank: `PYTHONWARNINGS` (warning filters) and `OMP_NUM_THREADS`
(`torch.set_num_threads`).

`target` is `"package.module:function"` or `"/path/to/file.py:function"` (a test module need not be importable;
the file's directory goes on `sys.path`, as when it runs as a script).
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import importlib.util
import json
import multiprocessing
import os
import random
import socket
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
POLL_S = 0.05


class LocalRunError(RuntimeError):
    """A rank failed or the run exceeded its time limit; the message carries the failing ranks' stderr."""


def free_port(host: str = HOST) -> int:
    """A TCP port free on `host` now, for a process started later to listen on (torchrun's MASTER_PORT).

    Another process may still take it before it is used, so it is drawn below the kernel's ephemeral range: the
    ports the kernel hands to `bind(0)` and to every outgoing connection (gloo opens many) come from that range,
    and a port picked there by `bind(0)` was taken again within seconds on a busy test machine (EADDRINUSE)."""
    low, _ = _ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12_000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    """Linux's `ip_local_port_range` (32768-60999 unless changed); the same default where it cannot be read."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def resolve(target: str) -> Callable[..., Any]:
    """The function named by `module:function` or `path.py:function`."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"target: got {target!r}, expected 'package.module:function' or '/path/file.py:function'")
    if where.endswith(".py"):
        directory = str(Path(where).resolve().parent)
        if directory not in sys.path:
            sys.path.insert(0, directory)  # as when the file runs as a script (its sibling modules import)
        spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        if spec is None or spec.loader is None:
            raise ValueError(f"target: cannot load {where}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


# In this order: gyre.trainer installs the patch megatron needs. torch._dynamo: what a torch optimizer's first
# construction imports (torch._compile's disable wrapper), 2-5 CPU s a rank paid at its first step otherwise.
PRELOAD = ["torch", "torch._dynamo", "gyre.trainer", "megatron.core"]


def run_local(
    target: str,
    world_size: int,
    *,
    kwargs: Mapping[str, Any] | None = None,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Return values of `target(rank, world_size, **kwargs)` on ranks 0..world_size-1 (see the module docstring)."""
    context = multiprocessing.get_context("forkserver")
    multiprocessing.set_forkserver_preload(PRELOAD)  # used when the forkserver starts (once per calling process)
    with tempfile.TemporaryDirectory(prefix="gyre-dist-") as tmp:
        workdir = Path(tmp)
        rank_env = {**os.environ, **(env or {})}
        processes = []
        for rank in range(world_size):
            process = context.Process(
                target=_rank_main,
                args=(target, rank, world_size, json.dumps(dict(kwargs or {})), str(workdir), timeout_s),
                kwargs={"env": rank_env},
                name=f"gyre-local-rank{rank}",
            )
            process.start()
            processes.append(process)
        try:
            failed = _wait(processes, timeout_s)
        finally:
            for process in processes:
                if process.exitcode is None:
                    process.kill()  # by PID: only the processes this call started
                process.join()
        if failed is not None:
            tails = []
            for rank, process in enumerate(processes):
                if process.exitcode != 0:
                    tails.append(f"--- rank {rank} (exit {process.exitcode}):\n{_output_tail(workdir, rank)}")
            raise LocalRunError(f"{target} on {world_size} ranks: {failed}\n" + "\n".join(tails))
        return [json.loads((workdir / f"result{rank}.json").read_text()) for rank in range(world_size)]


def _output_tail(workdir: Path, rank: int) -> str:
    try:
        return (workdir / f"output{rank}.txt").read_text(errors="replace")[-3000:]
    except FileNotFoundError:  # killed (another rank failed first) before it opened its output
        return "(no output: the rank stopped before it began)"


def shared_store(timeout_s: float = 60.0) -> tuple[Any, int]:
    """In a rank of `run_local` (its group initialized): `(store, port)`, a TCPStore on 127.0.0.1 that rank 0 hosts
    on a port the kernel picked as it bound (`store` is rank 0's server, another rank's client) and its port, for
    more clients. Every rank must call it (it broadcasts the port)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    world_size = dist.get_world_size()
    server = None
    if dist.get_rank() == 0:
        server = dist.TCPStore(HOST, 0, world_size, True, timeout=timeout, wait_for_workers=False)
    port = [server.port if server is not None else None]
    dist.broadcast_object_list(port, src=0)
    store = server if server is not None else dist.TCPStore(HOST, port[0], world_size, False, timeout=timeout)
    return store, port[0]


def _wait(processes: list, timeout_s: float) -> str | None:
    """None when every process exited 0; otherwise why the run failed (the caller kills the rest)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [process.exitcode for process in processes]
        bad = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if bad:
            return f"ranks {bad} failed"
        if all(code == 0 for code in codes):
            return None
        time.sleep(POLL_S)
    return f"timed out after {timeout_s:.0f} s"


def _rank_main(
    target: str, rank: int, world_size: int, kwargs: str, workdir: str, timeout_s: float, *, env: dict
) -> None:
    """One rank, in a process forked from the forkserver: its output to `output<rank>.txt`, the caller's
    environment, the group, the target, the result to `result<rank>.json`, then `os._exit` (never finalization)."""
    output = os.open(Path(workdir, f"output{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(output, 1)
    os.dup2(output, 2)
    code = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        _apply_startup_variables(env)
        faulthandler.enable()  # an abort in C++ (gloo, torch) still shows the Python stack in the output tail

        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"file://{Path(workdir, 'group-store')}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=float(timeout_s)),
        )
        try:
            result = resolve(target)(rank, world_size, **json.loads(kwargs))
        finally:
            dist.destroy_process_group()
        Path(workdir, f"result{rank}.json").write_text(json.dumps(result))
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        # Skip interpreter finalization: groups that megatron's parallel_state still references keep their gloo
        # worker threads, and one that releases a finished collective's Python-owned tensors while the interpreter
        # finalizes cannot take the GIL and aborts the process (std::terminate; seen about once in 12 runs of the
        # PP tests).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _apply_startup_variables(env: Mapping[str, str]) -> None:
    """What the interpreter and torch read from the environment when they start, which a forked rank did not."""
    entries = [entry for entry in env.get("PYTHONWARNINGS", "").split(",") if entry.strip()]
    if entries:
        warnings._processoptions(entries)  # how the interpreter applies -W and PYTHONWARNINGS at its start
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
