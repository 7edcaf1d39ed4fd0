"""Huge count_tokens bodies decoded in a worker process, so they never hold up the serving event loop.

A body sent to `count_tokens` can be any size up to `proxy.max_body_bytes`. Decoding a 10 MB one (orjson, ~13 ms)
and parsing its dialect (2-6 ms) is one block of the event loop that every other execution's calls wait behind:
measured, +63 ms on a small call beside it (docs/proxy.md, "Counting tokens"). A prompt that big is past the context
limit, so its answer is an estimate from a bounded sample of its text (`gyre.proxy.token_estimate`). The server
hands a body of at least `offload_bytes(limit)` to this worker instead: it decodes, checks and parses the body
there (the same code and the same 400s as in process) and sends back a digest of a few dozen KB, the request's
model and role signals, its prompt floor's characters, its text's length and the sample to encode; the server
encodes the sample (the GIL released) and answers. A body the digest shows the model could take (at most
`EXACT_COUNT_CHARS_PER_TOKEN` characters per token of the limit, its floor within the limit) is counted exactly in
process, as any smaller body is.

One process, started with the server in the background (`python -m gyre.proxy.count_worker`: ~0.25 s, ~0.33 s of
CPU; it imports the dialects, not torch), a call at a time over its stdin and stdout (a frame: the header's and the
body's lengths, a JSON header naming the call, the body; the answer: one JSON line naming the call). What the worker
cannot answer is counted in process, as before this worker existed: a worker that would not start, died, or
answered something else (it is then stopped, and not started again for `RESTART_PAUSE_S`), a call after the
server's stop. A call the client hangs up on kills the worker, so its answer is never read by the next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gyre.proxy.conversation import ApiError
from gyre.proxy.dialects import DIALECTS_BY_NAME
from gyre.proxy.dialects.fields import decode_body
from gyre.proxy.template import floor_chars
from gyre.proxy.token_estimate import TextSample, request_texts, sample_texts

log = logging.getLogger(__name__)

OFFLOAD_MIN_BYTES = 2 << 20  # smaller bodies are decoded in process: ~2.5 ms of the loop at most
RESTART_PAUSE_S = 10.0  # after a worker that would not start or died: count in process this long, then try again
_FRAME = struct.Struct("<IQ")  # the header's length, the body's


def offload_bytes(context_limit: int, exact_chars_per_token: int) -> int:
    """The smallest body the server hands to the worker: 2 MiB, or more where a body that size may still hold a
    prompt the model can take (whose exact count needs the whole request in process)."""
    return max(OFFLOAD_MIN_BYTES, exact_chars_per_token * context_limit)


@dataclass(frozen=True)
class CountDigest:
    """What the server needs of a count_tokens request to answer it without its body."""

    model: str
    signals: dict[str, Any]
    floor_chars: int  # `gyre.proxy.template.floor_chars` of its turns
    text_chars: int  # all its text (`request_texts`)
    sample: TextSample

    def as_json(self) -> dict:
        return {
            "model": self.model,
            "signals": self.signals,
            "floor_chars": self.floor_chars,
            "text_chars": self.text_chars,
            "sample": self.sample.as_json(),
        }

    @classmethod
    def from_json(cls, data: dict) -> CountDigest:
        return cls(
            model=str(data["model"]),
            signals=dict(data["signals"]),
            floor_chars=int(data["floor_chars"]),
            text_chars=int(data["text_chars"]),
            sample=TextSample.from_json(data["sample"]),
        )


def digest(raw: bytes, dialect_name: str, headers: dict, query: dict, max_depth: int) -> CountDigest:
    """`raw` decoded, checked and parsed as the server does in process (the same `ApiError`s), then digested."""
    request = DIALECTS_BY_NAME[dialect_name].parse_count_tokens(decode_body(raw, max_depth), headers, query)
    texts = request_texts(request)
    return CountDigest(
        model=request.model,
        signals=dict(request.signals),
        floor_chars=floor_chars(request.turns),
        text_chars=sum(map(len, texts)),
        sample=sample_texts(texts),
    )


def _answer(raw: bytes, header: dict) -> dict:
    try:
        found = digest(raw, header["dialect"], header["headers"], header["query"], header["max_depth"])
    except ApiError as error:
        return {"call": header["call"], "error": [error.kind, error.message, error.param]}
    return {"call": header["call"], "digest": found.as_json()}


def main() -> None:
    """The worker: frames in on stdin, one JSON line out per frame, until stdin closes. Frames go out on a copy of
    the original stdout, and `sys.stdout` is pointed at stderr, so nothing printed can pass for an answer.
    Headers and answers are the standard library's JSON, which carries a header's lone surrogates (aiohttp's
    decoding of bytes that are not UTF-8) both ways."""
    source = sys.stdin.buffer
    sink = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr
    while True:
        lengths = source.read(_FRAME.size)
        if len(lengths) < _FRAME.size:
            return
        header_bytes, body_bytes = _FRAME.unpack(lengths)
        header = json.loads(source.read(header_bytes))
        raw = source.read(body_bytes)
        try:
            reply = _answer(raw, header)
        except Exception as error:  # a bug, not the client's: the server counts in process and logs this
            reply = {"call": header.get("call"), "failed": f"{type(error).__name__}: {error}"}
        sink.write(json.dumps(reply).encode() + b"\n")
        sink.flush()


class WorkerFailed(RuntimeError):
    """The worker could not answer (it would not start, died, or said something that is not an answer): the
    server counts that call in process."""


class CountWorker:
    """The server's side: one worker process, started with the server, one call at a time."""

    def __init__(self, command: Sequence[str] = (sys.executable, "-m", "gyre.proxy.count_worker")) -> None:
        self.command = tuple(command)  # another only in tests (a worker that misbehaves)
        self._process: asyncio.subprocess.Process | None = None
        self._prewarming: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._calls = 0
        self._closed = False
        self._paused_until = 0.0  # monotonic; no start before it (RESTART_PAUSE_S)

    @property
    def pid(self) -> int | None:
        """The running worker's process id (None when none runs)."""
        process = self._process
        return process.pid if process is not None and process.returncode is None else None

    def prewarm(self) -> None:
        """Start the worker now, in the background (from the running loop), so the first huge body does not wait
        for it and its start-up does not compete with the calls beside that body (~0.33 s of CPU)."""
        self._prewarming = asyncio.get_running_loop().create_task(self._prewarm())

    async def _prewarm(self) -> None:
        async with self._lock:
            with contextlib.suppress(WorkerFailed):  # logged; huge bodies are counted in process meanwhile
                await self._started()

    async def digest(self, raw: bytes, dialect_name: str, headers: dict, query: dict, max_depth: int) -> CountDigest:
        """The body's digest, `ApiError` for a body the client must fix, `WorkerFailed` otherwise."""
        async with self._lock:
            process = await self._started()
            self._calls += 1
            call = self._calls
            header = json.dumps(
                {"call": call, "dialect": dialect_name, "headers": headers, "query": query, "max_depth": max_depth}
            ).encode()
            try:
                assert process.stdin is not None and process.stdout is not None
                process.stdin.write(_FRAME.pack(len(header), len(raw)))
                process.stdin.write(header)
                process.stdin.write(raw)
                await process.stdin.drain()
                line = await process.stdout.readline()
            except asyncio.CancelledError:  # the client hung up: the answer would be read by the next call
                self._kill()
                raise
            except (ConnectionError, OSError, ValueError) as error:  # ValueError: an answer line over the limit
                raise await self._lost(f"the count worker's pipe broke: {error!r}") from None
            try:
                reply = json.loads(line)
                if reply["call"] != call:
                    raise ValueError(f"the answer to call {reply['call']!r}, not {call}")
                if "error" in reply:
                    kind, message, param = reply["error"]
                    refusal: Exception = ApiError(kind, message, param=param)
                elif "failed" in reply:
                    refusal = WorkerFailed(f"the count worker failed: {reply['failed']}")
                else:
                    return CountDigest.from_json(reply["digest"])
            except (ValueError, KeyError, TypeError) as error:  # not an answer (an empty line: the worker exited)
                raise await self._lost(f"the count worker's answer is not one ({error}): {line[:200]!r}") from None
        raise refusal

    async def _started(self) -> asyncio.subprocess.Process:
        if self._process is not None and self._process.returncode is None:
            return self._process
        if self._closed:
            raise WorkerFailed("the server is stopping")
        if time.monotonic() < self._paused_until:
            raise WorkerFailed("the count worker is paused after a failure")
        try:
            self._process = await asyncio.create_subprocess_exec(
                *self.command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                limit=1 << 24,  # an answer line holds the sample: tens of KB
            )
        except OSError as error:
            raise await self._lost(f"the count worker did not start: {error}") from None
        log.info("count_tokens worker started (pid %d): bodies too big to decode on the loop", self._process.pid)
        return self._process

    async def _lost(self, why: str) -> WorkerFailed:
        """Stop the worker after a failure and pause restarts; the error to raise."""
        log.warning("%s; huge count_tokens bodies are counted in process for %g s", why, RESTART_PAUSE_S)
        self._paused_until = time.monotonic() + RESTART_PAUSE_S
        await self._stop_process()
        return WorkerFailed(why)

    def _kill(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()

    async def stop(self) -> None:
        """Stop the worker for good: a call after this is counted in process."""
        self._closed = True
        if self._prewarming is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._prewarming
            self._prewarming = None
        await self._stop_process()

    async def _stop_process(self) -> None:
        process, self._process = self._process, None
        if process is None or process.returncode is not None:
            return
        if process.stdin is not None:
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), 5.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()


if __name__ == "__main__":
    main()
