"""Start `python -m gyre.serve` as a subprocess for tests, read what it prints, stop it by PID.

Imported by the integration tests as `serve_process` (pytest puts this directory on sys.path).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

START_TIMEOUT_S = 120.0


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

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                return self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait(timeout=timeout_s)


def start_serve(run_dir: Path, *overrides: str) -> Served:
    """Run gyre.serve with `overrides` and wait (bounded) for its `ready` line."""
    command = [sys.executable, "-m", "gyre.serve", f"hydra.run.dir={run_dir}", *overrides]
    run_dir.mkdir(parents=True, exist_ok=True)
    stderr = (run_dir / "stderr.txt").open("w")  # a file, not a pipe: nobody has to drain it
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
    stderr.close()
    served = Served(process=process, run_dir=run_dir)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                error = (run_dir / "stderr.txt").read_text()[-2000:]
                raise RuntimeError(f"gyre.serve exited before it was ready: {error}")
            name, _, value = line.strip().partition(": ")
            if line.strip() == "ready":
                return served
            if name == "anthropic":
                served.anthropic_url = value
            elif name == "openai":
                served.openai_url = value
            elif name == "admin key":
                served.admin_key = value
            elif name == "key":
                key, _, execution = value.partition(" execution=")
                served.keys[execution] = key
        raise TimeoutError(f"gyre.serve was not ready within {START_TIMEOUT_S} s")
    except BaseException:
        served.stop()
        raise
