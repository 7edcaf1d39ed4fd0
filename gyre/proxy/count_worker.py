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

One process, started with the server in the background (~0.4 s: it imports the dialects, not torch), a call at a
time over its stdin and stdout (a frame: two little-endian uint32 lengths, a JSON header, the body; the answer: one JSON
line). A worker that dies is started again by the next call; the call it died on is answered in process, as
before this worker existed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import sys
from dataclasses import dataclass
from typing import Any

import orjson

from gyre.proxy.conversation import ApiError
from gyre.proxy.dialects import DIALECTS
from gyre.proxy.dialects.fields import decode_body
from gyre.proxy.template import floor_chars
from gyre.proxy.token_estimate import TextSample, request_texts, sample_texts

log = logging.getLogger(__name__)

OFFLOAD_MIN_BYTES = 2 << 20  # smaller bodies are decoded in process: ~2.5 ms of the loop at most
_FRAME = struct.Struct("<II")


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


def digest(raw: bytes, dialect_name: str, headers: dict, query: dict, max_depth: int) -> CountDigest:
    """`raw` decoded, checked and parsed as the server does in process (the same `ApiError`s), then digested."""
    dialect = next(dialect for dialect in DIALECTS if dialect.name == dialect_name)
    request = dialect.parse_count_tokens(decode_body(raw, max_depth), headers, query)
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
        return {"error": [error.kind, error.message]}
    return {
        "digest": {
            "model": found.model,
            "signals": found.signals,
            "floor_chars": found.floor_chars,
            "text_chars": found.text_chars,
            "sample": found.sample.as_json(),
        }
    }


def main() -> None:
    """The worker: frames in on stdin, one JSON line out per frame, until stdin closes."""
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    while True:
        lengths = source.read(_FRAME.size)
        if len(lengths) < _FRAME.size:
            return
        header_bytes, body_bytes = _FRAME.unpack(lengths)
        header = orjson.loads(source.read(header_bytes))
        raw = source.read(body_bytes)
        try:
            reply = _answer(raw, header)
        except Exception as error:  # a bug, not the client's: the server answers in process and logs this
            reply = {"failed": f"{type(error).__name__}: {error}"}
        sink.write(orjson.dumps(reply) + b"\n")
        sink.flush()


class WorkerFailed(RuntimeError):
    """The worker died or failed on a body: the server answers that call in process."""


class CountWorker:
    """The server's side: one worker process, started when first needed, one call at a time."""

    def __init__(self) -> None:
        self._process: asyncio.subprocess.Process | None = None
        self._prewarming: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    async def digest(self, raw: bytes, dialect_name: str, headers: dict, query: dict, max_depth: int) -> CountDigest:
        """The body's digest, `ApiError` for a body the client must fix, `WorkerFailed` otherwise."""
        header = orjson.dumps({"dialect": dialect_name, "headers": headers, "query": query, "max_depth": max_depth})
        async with self._lock:
            try:
                process = await self._started()
            except OSError as error:
                raise WorkerFailed(f"the count worker did not start: {error}") from None
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
                await self._lost(f"the count worker's pipe broke: {error}")
                raise WorkerFailed(str(error)) from None
            if not line.endswith(b"\n"):
                await self._lost("the count worker exited mid-call")
                raise WorkerFailed("the count worker exited mid-call")
        reply = orjson.loads(line)
        if "error" in reply:
            kind, message = reply["error"]
            raise ApiError(kind, message)
        if "failed" in reply:
            raise WorkerFailed(reply["failed"])
        found = reply["digest"]
        return CountDigest(
            model=found["model"],
            signals=found["signals"],
            floor_chars=found["floor_chars"],
            text_chars=found["text_chars"],
            sample=TextSample.from_json(found["sample"]),
        )

    @property
    def pid(self) -> int | None:
        """The running worker's process id (None when none runs)."""
        process = self._process
        return process.pid if process is not None and process.returncode is None else None

    def prewarm(self) -> None:
        """Start the worker now, in the background (from the running loop), so the first huge body does not wait
        for it and its start-up does not compete with the calls beside that body (~0.2 s of CPU)."""
        self._prewarming = asyncio.get_running_loop().create_task(self._prewarm())

    async def _prewarm(self) -> None:
        async with self._lock:
            try:
                await self._started()
            except OSError as error:
                log.warning("the count_tokens worker did not start (%s): huge bodies are counted in process", error)

    async def _started(self) -> asyncio.subprocess.Process:
        if self._process is not None and self._process.returncode is None:
            return self._process
        self._process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gyre.proxy.count_worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=1 << 24,  # an answer line holds the sample: tens of KB
        )
        log.info(
            "count_tokens worker started (pid %d) for bodies too big to decode on the event loop", self._process.pid
        )
        return self._process

    async def _lost(self, why: str) -> None:
        log.warning("%s; the call is answered in process and the next one starts a new worker", why)
        await self.stop()

    def _kill(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()

    async def stop(self) -> None:
        if self._prewarming is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._prewarming
            self._prewarming = None
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
