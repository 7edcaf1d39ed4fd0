"""Run a function on N local processes joined by a gloo process group on 127.0.0.1 (tests and benchmarks).

`run_local(target, world_size, kwargs=..., timeout_s=...)` starts `world_size` subprocesses of
`python -m gyre.distributed.local`, each of which calls `torch.distributed.init_process_group("gloo")` on a free port of
127.0.0.1, runs `target(rank, world_size, **kwargs)`, destroys the group, writes the JSON-able return value to a
file and leaves without interpreter finalization (see `_child`). The parent returns the values by rank. Every wait
is bounded: past `timeout_s`, or as soon as one rank fails, the remaining processes are killed by PID and a
`LocalRunError` carries each failed rank's stderr tail.

`target` is `"package.module:function"` or `"/path/to/file.py:function"` (a test module need not be importable;
the file's directory goes on `sys.path`, as when it runs as a script).
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
POLL_S = 0.05


class LocalRunError(RuntimeError):
    """A rank failed or the run exceeded its time limit; the message carries the failing ranks' stderr."""


def free_port(host: str = HOST) -> int:
    """A TCP port free on `host` now (another process may still take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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


def run_local(
    target: str,
    world_size: int,
    *,
    kwargs: Mapping[str, Any] | None = None,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Return values of `target(rank, world_size, **kwargs)` on ranks 0..world_size-1 (see the module docstring)."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gyre-dist-") as tmp:
        workdir = Path(tmp)
        processes = []
        child_env = {**os.environ, **(env or {})}
        for rank in range(world_size):
            command = [
                sys.executable,
                "-m",
                "gyre.distributed.local",
                target,
                str(rank),
                str(world_size),
                str(port),
                json.dumps(dict(kwargs or {})),
                str(workdir / f"result{rank}.json"),
                str(timeout_s),
            ]
            stderr = open(workdir / f"stderr{rank}.txt", "wb")  # noqa: SIM115 (closed below)
            process = subprocess.Popen(command, stdout=stderr, stderr=subprocess.STDOUT, env=child_env)
            processes.append((process, stderr))
        try:
            failed = _wait(processes, timeout_s)
        finally:
            for process, stream in processes:
                if process.poll() is None:
                    process.kill()  # by PID: only the processes this call started
                process.wait()
                stream.close()
        if failed is not None:
            tails = []
            for rank in range(world_size):
                code = processes[rank][0].returncode
                if code != 0:
                    text = (workdir / f"stderr{rank}.txt").read_text(errors="replace")[-3000:]
                    tails.append(f"--- rank {rank} (exit {code}):\n{text}")
            raise LocalRunError(f"{target} on {world_size} ranks: {failed}\n" + "\n".join(tails))
        return [json.loads((workdir / f"result{rank}.json").read_text()) for rank in range(world_size)]


def _wait(processes: list, timeout_s: float) -> str | None:
    """None when every process exited 0; otherwise why the run failed (the caller kills the rest)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [process.poll() for process, _ in processes]
        bad = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if bad:
            return f"ranks {bad} failed"
        if all(code == 0 for code in codes):
            return None
        time.sleep(POLL_S)
    return f"timed out after {timeout_s:.0f} s"


def _child(argv: list[str]) -> None:
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # an abort in C++ (gloo, torch) still shows the Python stack in the stderr tail

    target, rank, world_size, port, kwargs, out, timeout_s = argv
    rank, world_size = int(rank), int(world_size)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{HOST}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=float(timeout_s)),
    )
    try:
        result = resolve(target)(rank, world_size, **json.loads(kwargs))
    finally:
        dist.destroy_process_group()
    Path(out).write_text(json.dumps(result))
    # Skip interpreter finalization: groups that megatron's parallel_state still references keep their gloo worker
    # threads, and one that releases a finished collective's Python-owned tensors while the interpreter finalizes
    # cannot take the GIL and aborts the process (std::terminate; seen about once in 12 runs of the PP tests).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _child(sys.argv[1:])
