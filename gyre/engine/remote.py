"""`RemoteEngine`: the `Engine` protocol over HTTP, the client of `gyre.engine.endpoint` (what the proxy holds).

A remote engine behaves like a local one, with three differences that follow from the network:
- `abort`, `stop_accepting`, `resume_accepting` and `release_export` return at once (they are synchronous in the
  protocol) and send their call in the background, in order; every async method first waits for those calls,
  so `stop_accepting(); await drain()` reaches the server in that order. `abort` returns True for a request this
  client has in flight (it names the submission, so the abort holds even if it overtakes the request on the
  wire) and otherwise forwards the abort and returns False.
- `load()` is the last snapshot this client saw: refreshed by every async method, adjusted locally by
  `stop_accepting`/`resume_accepting`, and by `await refresh_load()`.
- A connection failure raises `EngineUnreachable` (an `EngineUnavailableError`: the endpoint is gone, or its
  connection broke, route elsewhere): refused or reset connections, a body cut short (also a stream that breaks off
  mid-line or before its final chunk). An endpoint that answers with an error status raises that error instead.
- Weights (`update_weights`, `load_bucket`) are sent as the frame's head and then slices of the flat buffer's own
  memory (`SEND_SLICE_BYTES` each, written as the connection drains), so one bucket sent to several engines at once
  is not copied per engine (at most a slice per connection is).
- A call whose prompt extends the last prompt this client sent for the same execution (the usual agent turn) sends
  only the new ids (`wire.PromptBase`); the endpoint splices them onto the prompt it kept, or answers 409 and the
  call is sent whole. At a 700K-token history that is a few KB instead of 2.8 MB per call.

Create with `await RemoteEngine.connect(url, secret=...)` (the endpoint's secret, sent as `Authorization: Bearer` on
every request; an endpoint that refuses it raises `gyre.engine.errors.EngineAuthError` from `connect`); `await
close()` when done. Must be used from one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence

import aiohttp

from gyre.engine import wire
from gyre.engine.errors import EngineUnreachable
from gyre.engine.protocol import (
    EngineLoad,
    EngineUnavailableError,
    GenerateRequest,
    GenerateResult,
    KVExport,
    TokenChunk,
    starts_with,
)
from gyre.models.flat_weights import FlatWeights

log = logging.getLogger(__name__)

# Executions whose last prompt is kept, so the next call sends only what it adds (least recently used dropped).
MAX_REMEMBERED_PROMPTS = 4096
MAX_REMEMBERED_PROMPT_BYTES = 1 << 30  # 4 bytes per id: 1 GiB holds ~380 histories of 700K tokens
# A weights frame goes out in slices of this size: the socket takes each as the connection drains (aiohttp waits),
# where one write of the whole buffer would copy what the socket did not take at once into the transport's buffer.
SEND_SLICE_BYTES = 1 << 20


class RemoteEngine:
    """An engine served by `gyre.engine.endpoint.EngineServer` at `url`; implements `gyre.engine.protocol.Engine`."""

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        load: EngineLoad,
        *,
        owns_session: bool,
        secret: str | None = None,
    ):
        self.url = url.rstrip("/")
        self._session = session
        self._headers = _auth_headers(secret)  # on every request (a shared session may serve other endpoints)
        self._owns_session = owns_session
        self._load = load
        self._in_flight: dict[str, str] = {}  # request id -> submission id
        self._pinned: set[str] = set()
        self._sent = wire.PromptStore(MAX_REMEMBERED_PROMPT_BYTES, MAX_REMEMBERED_PROMPTS)  # last prompt sent
        self._background: asyncio.Task | None = None  # the last queued fire-and-forget call

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        session: aiohttp.ClientSession | None = None,
        connect_timeout_s: float = 10.0,
        secret: str | None = None,
    ) -> RemoteEngine:
        """Reach the endpoint (its load snapshot) or raise `EngineUnreachable`; `EngineAuthError` when it requires a
        secret and `secret` is not it."""
        owns = session is None
        if session is None:
            # No total timeout: a generate may run for minutes; connecting is bounded.
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
            session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        try:
            load = wire.load_from_wire(await _get_json(session, url.rstrip("/") + "/load", _auth_headers(secret)))
        except BaseException:
            if owns:
                await session.close()
            raise
        return cls(url, session, load, owns_session=owns, secret=secret)

    async def close(self) -> None:
        await self._settle()
        if self._owns_session:
            await self._session.close()

    # ----------------------------------------------------------------- requests

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        await self._settle()
        submission = self._register(request)
        try:
            for base in self._bases(request):
                body = wire.generate_to_frame(request, stream=False, submission_id=submission, base=base)
                try:
                    result = wire.result_from_wire(await self._post_json("/generate", None, data=body))
                except wire.PromptBaseUnknown:
                    continue  # the endpoint no longer holds the base: the whole prompt next
                self._sent_prompt(request)
                return result
            raise AssertionError("unreachable: the last attempt sends the whole prompt")
        finally:
            self._in_flight.pop(request.request_id, None)

    def _bases(self, request: GenerateRequest) -> list[wire.PromptBase | None]:
        """What to send: only the ids after this execution's last prompt when the new one extends it, then (if
        the endpoint does not hold that base any more) everything."""
        last = self._sent.latest(request.execution_id)
        if last is None:
            return [None]
        request_id, ids = last
        n = len(ids)
        if len(request.input_ids) <= n or not starts_with(request.input_ids, ids):
            return [None]
        return [wire.PromptBase(request_id=request_id, length=n), None]

    def _sent_prompt(self, request: GenerateRequest) -> None:
        self._sent.remember(request)

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        await self._settle()
        submission = self._register(request)
        finished = broken = False
        try:
            for base in self._bases(request):
                body = wire.generate_to_frame(request, stream=True, submission_id=submission, base=base)
                async with self._request("POST", "/generate", data=body) as response:
                    try:
                        await _raise_for_error(response)
                    except wire.PromptBaseUnknown:
                        continue  # the endpoint no longer holds the base: the whole prompt next
                    self._sent_prompt(request)
                    async for line in response.content:
                        if not line.endswith(b"\n"):  # the last bytes before the connection went: not a chunk
                            raise EngineUnreachable(f"{self.url}: {request.request_id!r}'s stream broke off mid-line")
                        if not line.strip():
                            continue
                        chunk = wire.chunk_from_wire(wire.loads(line))
                        finished = chunk.finish_reason is not None
                        yield chunk
                        if finished:
                            return
                break
            raise EngineUnreachable(f"{self.url}: {request.request_id!r}'s stream ended without a final chunk")
        except EngineUnreachable:
            broken = True  # the endpoint's side of the request ended with its connection: no abort to send
            raise
        finally:
            self._in_flight.pop(request.request_id, None)
            if not finished and not broken:  # closed early: the server sees the connection go and aborts; say so too
                self._send_later("/abort", {"request_id": request.request_id, "submission_id": submission})

    def _register(self, request: GenerateRequest) -> str:
        if not self._load.accepting:
            raise EngineUnavailableError(f"{self.url}: the engine stopped accepting requests")
        if request.request_id in self._in_flight:
            raise ValueError(f"request_id={request.request_id!r} is already in flight: request ids must be unique")
        submission = uuid.uuid4().hex
        self._in_flight[request.request_id] = submission
        return submission

    def abort(self, request_id: str) -> bool:
        submission = self._in_flight.get(request_id)
        self._pinned.discard(request_id)
        self._send_later("/abort", {"request_id": request_id, "submission_id": submission})
        return submission is not None

    # ----------------------------------------------------------------- accepting / drain / memory

    def stop_accepting(self) -> None:
        self._load = dataclasses.replace(self._load, accepting=False)
        self._send_later("/stop_accepting", {})

    def resume_accepting(self) -> None:
        self._load = dataclasses.replace(self._load, accepting=not self._load.memory_released)
        self._send_later("/resume_accepting", {})

    async def drain(self, *, abort_after_s: float | None = None) -> None:
        self._load = dataclasses.replace(self._load, accepting=False)
        await self._call("/drain", {"abort_after_s": abort_after_s})

    async def release_memory(self, *, weights: bool = True, kv: bool = True) -> None:
        await self._call("/release_memory", {"weights": weights, "kv": kv})

    async def resume_memory(self, *, weights: bool = True, kv: bool = True) -> None:
        await self._call("/resume_memory", {"weights": weights, "kv": kv})

    async def update_weights(self, weights: Mapping | FlatWeights, *, version: int) -> None:
        await self._settle()
        await self._post_json("/update_weights", None, data=_sliced(wire.weights_frame_parts(weights, version=version)))
        await self.refresh_load()

    async def begin_update(self, *, version: int) -> None:
        await self._call("/update_begin", {"version": version})

    async def load_bucket(self, bucket: Mapping | FlatWeights) -> None:
        await self._settle()
        await self._post_json("/update_bucket", None, data=_sliced(wire.weights_frame_parts(bucket, version=None)))

    async def end_update(self, *, version: int) -> None:
        await self._call("/update_end", {"version": version})

    async def abort_update(self) -> None:
        await self._call("/update_abort", {})

    async def init_weights_group(
        self, *, address: str, port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        """The engine joins a weight group with rank 0 (SGLang's engines: `gyre.engine.sglang_engine`); an engine
        without one raises NotImplementedError."""
        body = {
            "address": address,
            "port": port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        await self._call("/init_weights_group", body)

    async def update_weights_from_group(
        self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, version: int
    ) -> None:
        """The engine loads `version` from rank 0's broadcasts over its weight group (which rank 0 sends meanwhile)."""
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name, "version": version}
        await self._call("/update_weights_from_group", body)
        await self.refresh_load()

    async def load_bucket_from_group(
        self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str
    ) -> None:
        """In the open weight-update session, the engine loads one bucket from rank 0's broadcasts over its weight
        group (which rank 0 sends meanwhile); an engine without a weight group raises NotImplementedError."""
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name}
        await self._call("/update_bucket_from_group", body)

    # ----------------------------------------------------------------- KV migration

    async def export_kv(self, request_id: str) -> KVExport:
        await self._settle()
        async with self._request("POST", "/export_kv", data=wire.dumps({"request_id": request_id})) as response:
            await _raise_for_error(response)
            export = wire.kv_export_from_frame(await response.read())
        self._pinned.add(request_id)
        return export

    async def import_kv(self, export: KVExport) -> None:
        await self._settle()
        await self._post_json("/import_kv", None, data=wire.kv_export_to_frame(export))
        await self.refresh_load()

    def release_export(self, request_id: str) -> bool:
        pinned = request_id in self._pinned
        self._pinned.discard(request_id)
        self._send_later("/release_export", {"request_id": request_id})
        return pinned

    # ----------------------------------------------------------------- load

    def load(self) -> EngineLoad:
        return self._load

    async def refresh_load(self) -> EngineLoad:
        """The endpoint's load, read after every queued control call (`stop_accepting`, `resume_accepting`) reached
        it: a read racing ahead of them would put back the state they changed."""
        await self._settle()
        self._load = wire.load_from_wire(
            await _get_json(self._session, self.url + "/load", self._headers, owner=self.url)
        )
        return self._load

    # ----------------------------------------------------------------- plumbing

    async def _call(self, path: str, body: dict) -> None:
        await self._settle()
        await self._post_json(path, body)
        await self.refresh_load()

    async def _post_json(self, path: str, body, *, data: bytes | AsyncIterator[memoryview] | None = None):
        payload = data if data is not None else wire.dumps(body)
        async with self._request("POST", path, data=payload) as response:
            await _raise_for_error(response)
            return wire.loads(await response.read())

    @contextlib.asynccontextmanager
    async def _request(self, method: str, path: str, **kwargs):
        try:
            async with self._session.request(method, self.url + path, headers=self._headers, **kwargs) as response:
                yield response
        except _CONNECTION_ERRORS as error:
            raise EngineUnreachable(f"{self.url}: {error}") from error

    def _send_later(self, path: str, body: dict) -> None:
        """Queue a call behind the ones already queued; failures are logged (the endpoint may be gone)."""
        previous = self._background

        async def send():
            if previous is not None:
                await asyncio.wait([previous])  # its outcome is its own (logged); order is what matters
            try:
                await self._post_json(path, body)
            except Exception as error:
                log.warning("engine %s: %s failed: %s", self.url, path, error)

        self._background = asyncio.get_running_loop().create_task(send())

    async def _settle(self) -> None:
        """Wait until every queued fire-and-forget call has reached the server."""
        if self._background is not None:
            await asyncio.wait([self._background])  # a cancelled caller still raises CancelledError


# What aiohttp raises when the endpoint is not there or its connection breaks: refused, reset or closed connections
# and connect timeouts (`ClientConnectionError`), and a body cut short mid-transfer (`ClientPayloadError`: a reset
# in the middle of a streamed answer).
_CONNECTION_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)


async def _raise_for_error(response: aiohttp.ClientResponse) -> None:
    if response.status >= 400:
        raise wire.error_from_wire(response.status, await response.read())


async def _sliced(parts: Sequence[bytes | memoryview]) -> AsyncIterator[memoryview]:
    """A body sent as `parts` one after another, in views of at most `SEND_SLICE_BYTES` (no copy of a part)."""
    for part in parts:
        view = memoryview(part).cast("B")
        for start in range(0, view.nbytes, SEND_SLICE_BYTES):
            yield view[start : start + SEND_SLICE_BYTES]


def _auth_headers(secret: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"} if secret else {}


async def _get_json(session: aiohttp.ClientSession, url: str, headers: dict[str, str], *, owner: str | None = None):
    try:
        async with session.get(url, headers=headers) as response:
            await _raise_for_error(response)
            return wire.loads(await response.read())
    except _CONNECTION_ERRORS as error:
        raise EngineUnreachable(f"{owner or url}: {error}") from error
