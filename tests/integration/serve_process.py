"""Start `python -m gyre.serve` as a subprocess for tests, read what it prints, stop it by PID.

Imported by the integration tests as `serve_process` (pytest puts this directory on sys.path). Every wait is
bounded: stdout is read on a thread into a queue, so a server that hangs without printing cannot block a test.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


@dataclass
class Served:
    process: subprocess.Popen
    run_dir: Path
    anthropic_url: str = ""
    openai_url: str = ""
    admin_key: str = ""
    keys: dict[str, str] = field(default_factory=dict)  # execution -> key

    @property
    def records(self) -> Path:
        return self.run_dir / "records"

    def stderr_tail(self, chars: int = 3000) -> str:
        path = self.run_dir / "stderr.txt"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                return self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait(timeout=timeout_s)


def pump_lines(stream) -> queue.Queue:
    """The lines of a child's `stream`, read on a daemon thread into a queue (None once it ends): a bounded
    `get(timeout=...)` then never blocks on a child that hangs without printing."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def start_serve(run_dir: Path, *overrides: str, timeout_s: float = START_TIMEOUT_S) -> Served:
    """Run gyre.serve with `overrides` and wait (bounded) for its `ready` line; stderr goes to run_dir/stderr.txt."""
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "gyre.serve", f"hydra.run.dir={run_dir}", *overrides]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    with (run_dir / "stderr.txt").open("w") as stderr:  # a file, not a pipe: nobody has to drain it
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
        )
    served = Served(process=process, run_dir=run_dir)
    lines = pump_lines(process.stdout)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"gyre.serve not ready within {timeout_s} s: {served.stderr_tail()}") from None
            if line is None:
                raise RuntimeError(f"gyre.serve exited before it was ready: {served.stderr_tail()}")
            if line == "ready":
                return served
            name, _, value = line.partition(": ")
            if name == "anthropic":
                served.anthropic_url = value
            elif name == "openai":
                served.openai_url = value
            elif name == "admin key":
                served.admin_key = value
            elif name == "key":
                key, _, execution = value.partition(" execution=")
                served.keys[execution] = key
    except BaseException:
        served.stop()
        raise
