"""An engine endpoint in a process of its own whose calls are held in flight: what a test SIGKILLs mid-call.

Imported by the integration tests as `held_engine_process` (pytest puts this directory on sys.path); run as a
script it is the process. `python held_engine_process.py AFTER_TOKENS LOGPROB` serves a `ScriptedEngine` (the
stand-in, `counting_reply`, every token's log-prob LOGPROB) on the real endpoint (`EngineServer`, 127.0.0.1, a free
port), as `python -m gyre.engine serve` serves its native engine, with `hold(after_tokens=AFTER_TOKENS)`: every
call streams its first AFTER_TOKENS tokens and then stays in flight until its abort or the process's death. It
prints `engine endpoint: <url>` once it accepts connections and `held` once a call waits at the hold, so a test
that kills it there knows the call is in flight, however slow the machine (docs/testing.md, "Deterministic
in-flight tests"). SIGTERM or SIGINT end it (exit 0). It imports the stdlib, aiohttp and gyre's engine protocol,
endpoint and stand-in (no torch): it starts in well under a second. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import signal
import subprocess
import sys
from pathlib import Path

from serve_process import pump_lines

START_TIMEOUT_S = 60.0


def counting_reply(request):
    """Token i of a call is `(len(context) + i) % 40 + 5`: a call continued anywhere goes on the same sequence."""
    return ((len(request.input_ids) + i) % 40 + 5 for i in itertools.count())


class HeldEngineProcess:
    """The process (`start`), its URL, and a bounded wait for its `held` line."""

    def __init__(self, after_tokens: int, logprob: float):
        env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__)), str(after_tokens), repr(logprob)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self._lines = pump_lines(self.process.stdout)
        try:
            self.url = self._line("engine endpoint: ", START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise

    def _line(self, prefix: str, timeout_s: float) -> str:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"the engine process did not print {prefix!r} within {timeout_s} s") from None
        assert line is not None, f"the engine process exited (code {self.process.poll()}) before {prefix!r}"
        assert line.startswith(prefix), f"the engine process printed {line!r}, expected {prefix!r}"
        return line[len(prefix) :].strip()

    def until_held(self, timeout_s: float = 60.0) -> None:
        """Return once a call waits at the hold (the process said `held`)."""
        self._line("held", timeout_s)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)


async def _serve(after_tokens: int, logprob: float) -> None:
    from gyre.engine.endpoint import EngineServer
    from gyre.engine.scripted import ScriptedEngine

    engine = ScriptedEngine(counting_reply, logprob=logprob)
    engine.hold(after_tokens=after_tokens)
    server = EngineServer(engine)
    print(f"engine endpoint: {await server.start()}", flush=True)
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    held = asyncio.ensure_future(engine.until_held(1))
    held.add_done_callback(lambda future: future.cancelled() or print("held", flush=True))
    await stop.wait()
    held.cancel()
    await server.stop()


if __name__ == "__main__":
    asyncio.run(_serve(int(sys.argv[1]), float(sys.argv[2])))
