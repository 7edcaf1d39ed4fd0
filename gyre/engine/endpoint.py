"""The engine endpoint: a cell leader serves its engine over HTTP to the proxy (and separate-pool engines alike).

aiohttp, the same stack as the proxy (docs/proxy.md: ~0.5 ms CPU per request, tens of microseconds per relayed
chunk). Every route maps to one `Engine` method; the wire format is `gyre.engine.wire`; the client is
`gyre.engine.remote.RemoteEngine`.

| route | method | body -> reply |
|---|---|---|
| `GET /health` | - | `{"ok": true}` |
| `GET /load` | `load` | EngineLoad |
| `POST /generate` | `generate(_stream)` | frame or `{"request", "stream", "submission_id"?}` -> result/NDJSON chunks |
| `POST /abort` | `abort` | `{"request_id", "submission_id"?}` -> `{"aborted": bool}` |
| `POST /stop_accepting`, `/resume_accepting` | same | `{}` |
| `POST /drain` | `drain` | `{"abort_after_s": float?}` |
| `POST /release_memory`, `/resume_memory` | same | `{"weights": bool, "kv": bool}` |
| `POST /update_weights` | `update_weights` | weights frame (flat buffer, manifest, version) |
| `POST /update_begin` | `begin_update` | `{"version"}` |
| `POST /update_bucket` | `load_bucket` | weights frame without a version (one bucket) |
| `POST /update_end` | `end_update` | `{"version"}` |
| `POST /update_abort` | `abort_update` | `{}` |
| `POST /export_kv` | `export_kv` | `{"request_id"}` -> KV frame |
| `POST /import_kv` | `import_kv` | KV frame |
| `POST /release_export` | `release_export` | `{"request_id"}` -> `{"released": bool}` |
| `POST /init_weights_group` | same | `{"address", "port", "rank_offset", "world_size", "group_name", "backend"}` |
| `POST /update_weights_from_group` | same | `{"names", "dtypes", "shapes", "group_name", "version"}` |
| `POST /update_bucket_from_group` | `load_bucket_from_group` | `{"names", "dtypes", "shapes", "group_name"}` |

The last three are SGLang's publication by broadcast (`gyre.engine.sglang_engine`); an engine without them (the
native one) answers 501. A weights frame's body is read into one buffer per request, which its tensors view (no
second copy: `gyre.engine.wire.decode_frame`).

With a `secret` (the job's, `gyre.runtime.job.spmd.Job.secret`), every route but `GET /health` requires
`Authorization: Bearer <secret>`: without that header (or with another scheme) the answer is 401 `unauthorized`,
with another token 403 `forbidden`, both `{"error": {"type", "message"}}` before the body is read. `/health` stays
open: it says only that the server is up, which a TCP connect says too, and a liveness probe needs no key. Without
a secret (the default: library uses, tests, `python -m gyre.engine serve`) every route is open.

Errors come back in the engine's own terms (400 bad input, 404 unknown request, 409 busy, 503 unavailable,
501 not implemented; see `gyre.engine.wire.error_status`) and never stop the server. A client that disconnects
cancels its handler, which aborts the request (the protocol's "cancelling the awaiting task aborts it").

An abort can overtake its own request on the wire (two connections). A client that names the submission in both
calls (`submission_id`) gets it applied anyway: an abort for a submission not seen yet is remembered, and that
submission ends at once with `finish_reason="abort"` and no tokens when it arrives.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from aiohttp import web

from gyre import eventloop
from gyre.engine import wire
from gyre.engine.protocol import Engine, GenerateRequest, GenerateResult, GenerateTimings, TokenChunk

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 36  # weight publications of large models travel in one body
_TOMBSTONES = 4096  # aborts remembered for submissions that have not arrived yet
OPEN_PATHS = frozenset({"/health"})  # served without the secret (module docstring)


def _json(payload, status: int = 200) -> web.Response:
    return web.Response(body=wire.dumps(payload), status=status, content_type="application/json")


def _error(error: BaseException) -> web.Response:
    status, body = wire.error_status(error)
    if status == 500:
        log.exception("engine endpoint: unexpected error", exc_info=error)
    return _json(body, status)


def bearer_token(authorization: str) -> str | None:
    """The token of an `Authorization: Bearer <token>` header's value; None for none, another scheme, no token."""
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _secret_middleware(secret: str):
    """Refuses every request but `OPEN_PATHS` whose bearer token is not `secret`: 401 without one, 403 for another."""
    expected = secret.encode()

    @web.middleware
    async def require_secret(http: web.Request, handler):
        if http.path in OPEN_PATHS:
            return await handler(http)
        token = bearer_token(http.headers.get("Authorization", ""))
        if token is None:
            message = "this endpoint requires the job's secret: Authorization: Bearer <secret>"
            return _json({"error": {"type": "unauthorized", "message": message}}, 401)
        # bytes (not str): compare_digest refuses non-ASCII str, and a header may carry anything
        if not secrets.compare_digest(token.encode("utf-8", "replace"), expected):
            return _json({"error": {"type": "forbidden", "message": "the bearer token is not the job's secret"}}, 403)
        return await handler(http)

    return require_secret


def _aborted_on_arrival(request: GenerateRequest, policy_version: int) -> GenerateResult:
    """The result of a submission whose abort arrived first: no tokens, nothing computed."""
    zero = GenerateTimings(queued_s=0.0, first_token_s=0.0, total_s=0.0)
    return GenerateResult(
        request_id=request.request_id,
        output_ids=(),
        output_logprobs=(),
        finish_reason="abort",
        policy_version=policy_version,
        last_policy_version=policy_version,
        prompt_tokens=len(request.input_ids),
        cached_tokens=0,
        timings=zero,
    )


class EngineServer:
    """Serves one engine on `host:port` from the event loop the engine runs on (port 0 picks a free one); with a
    `secret`, only to callers that send it (module docstring)."""

    def __init__(
        self,
        engine: Engine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        secret: str | None = None,
    ):
        if secret is not None and (not isinstance(secret, str) or not secret.strip()):
            raise ValueError("EngineServer secret='': expected None (every route open) or a non-empty string")
        self.engine = engine
        self.host = host
        self.port = port
        self._active: dict[str, str] = {}  # submission id -> request id, while its generate runs
        self._pending_abort: set[str] = set()  # aborts that reached an active submission before the engine did
        self._tombstones: OrderedDict[str, None] = OrderedDict()  # aborts of submissions not seen yet
        self._prompts = wire.PromptStore()  # each execution's latest prompt, which frames may extend
        self._runner: web.AppRunner | None = None
        middlewares = [] if secret is None else [_secret_middleware(secret)]
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
        self.app.add_routes(
            [
                web.get("/health", self._health),
                web.get("/load", self._load),
                web.post("/generate", self._generate),
                web.post("/abort", self._abort),
                web.post("/stop_accepting", self._simple(lambda body: self.engine.stop_accepting())),
                web.post("/resume_accepting", self._simple(lambda body: self.engine.resume_accepting())),
                web.post(
                    "/drain", self._simple(lambda body: self.engine.drain(abort_after_s=body.get("abort_after_s")))
                ),
                web.post("/release_memory", self._simple(lambda body: self.engine.release_memory(**_memory(body)))),
                web.post("/resume_memory", self._simple(lambda body: self.engine.resume_memory(**_memory(body)))),
                web.post("/update_weights", self._update_weights),
                web.post("/update_begin", self._simple(lambda body: self.engine.begin_update(**_version(body)))),
                web.post("/update_bucket", self._load_bucket),
                web.post("/update_end", self._simple(lambda body: self.engine.end_update(**_version(body)))),
                web.post("/update_abort", self._simple(lambda body: self.engine.abort_update())),
                web.post("/export_kv", self._export_kv),
                web.post("/import_kv", self._import_kv),
                web.post("/release_export", self._release_export),
                web.post("/init_weights_group", self._simple(lambda body: self._optional("init_weights_group", body))),
                web.post(
                    "/update_weights_from_group",
                    self._simple(lambda body: self._optional("update_weights_from_group", body)),
                ),
                web.post(
                    "/update_bucket_from_group",
                    self._simple(lambda body: self._optional("load_bucket_from_group", body)),
                ),
            ]
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> str:
        """Bind and serve; returns the base URL."""
        # handler_cancellation: a client that goes away cancels its generate, which aborts the request.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the bound port when 0 was asked for
        log.info("engine endpoint serving at %s", self.url)
        return self.url

    async def kill(self) -> None:
        """Die as a crashed process's endpoint does (fault tests): stop listening, so a new connection is refused,
        and reset every open connection, so a stream in flight breaks off mid-way with no final chunk. The engine is
        left as it is (its requests are aborted as their handlers see the client gone); `stop` still cleans up."""
        if self._runner is None:
            return
        for site in list(self._runner.sites):
            await site.stop()
        for handler in self._runner.server.connections:
            if handler.transport is not None:
                handler.transport.abort()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------------ routes

    async def _health(self, _: web.Request) -> web.Response:
        return _json({"ok": True})

    async def _load(self, _: web.Request) -> web.Response:
        return _json(wire.load_to_wire(self.engine.load()))

    async def _generate(self, http: web.Request) -> web.StreamResponse:
        try:
            raw = await http.read()
            if wire.is_frame(raw):  # what RemoteEngine sends: prompt ids as raw int32, maybe extending a base
                request, stream, submission = wire.generate_from_frame(raw, resolve_base=self._prompts.resolve)
            else:  # JSON, e.g. by hand: {"request": {"input_ids": [...], ...}, "stream": false}
                body = wire.loads(raw)
                request = wire.request_from_wire(body.get("request"))
                stream = bool(body.get("stream", False))
                submission = body.get("submission_id")
        except wire.PromptBaseUnknown as error:
            return _error(error)
        except (ValueError, AttributeError, TypeError) as error:
            return _error(error if isinstance(error, ValueError) else wire.WireError(str(error)))
        self._prompts.remember(request)  # a later call of this execution may send only what it adds
        if submission is not None and submission in self._tombstones:
            del self._tombstones[submission]
            result = _aborted_on_arrival(request, self.engine.load().policy_version)
            if not stream:
                return _json(wire.result_to_wire(result))
            return await self._stream_aborted_on_arrival(http, result)
        if submission is not None:
            self._active[submission] = request.request_id
        try:
            if stream:
                return await self._generate_stream(http, request, submission)
            task = asyncio.ensure_future(self.engine.generate(request))
            await asyncio.sleep(0)  # the engine registers the request in the task's first step
            self._apply_pending_abort(submission, request)
            try:
                result = await asyncio.shield(task)
            except asyncio.CancelledError:
                task.cancel()  # the client went away: cancelling the engine's generate aborts the request
                raise
            return _json(wire.result_to_wire(result))
        except Exception as error:
            return _error(error)
        finally:
            if submission is not None:
                self._active.pop(submission, None)
                self._pending_abort.discard(submission)

    async def _generate_stream(self, http: web.Request, request: GenerateRequest, submission: str | None):
        chunks = self.engine.generate_stream(request)
        try:
            first = await chunks.__anext__()  # errors in the request surface here, before the stream starts
        except StopAsyncIteration:
            return _error(RuntimeError("the engine's stream ended without a final chunk"))
        except Exception as error:
            await chunks.aclose()
            return _error(error)
        self._apply_pending_abort(submission, request)
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        try:
            await response.prepare(http)
            await response.write(wire.dumps(wire.chunk_to_wire(first)) + b"\n")
            async for chunk in chunks:  # to exhaustion: a stream left open at its final chunk counts as closed early
                await response.write(wire.dumps(wire.chunk_to_wire(chunk)) + b"\n")
            await response.write_eof()
        except ConnectionResetError:  # the client hung up: not an endpoint error (aiohttp ends the connection)
            log.info("engine endpoint: the client of request %s went away; it is aborted", request.request_id)
        finally:
            await chunks.aclose()  # closing early (client gone) aborts the request
        return response

    async def _stream_aborted_on_arrival(self, http: web.Request, result: GenerateResult) -> web.StreamResponse:
        chunk = TokenChunk(
            request_id=result.request_id,
            index=0,
            token_ids=(),
            logprobs=(),
            policy_version=result.policy_version,
            finish_reason="abort",
            timings=result.timings,
            cached_tokens=0,
        )
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(http)
        await response.write(wire.dumps(wire.chunk_to_wire(chunk)) + b"\n")
        await response.write_eof()
        return response

    def _apply_pending_abort(self, submission: str | None, request: GenerateRequest) -> None:
        if submission is not None and submission in self._pending_abort:
            self._pending_abort.discard(submission)
            self.engine.abort(request.request_id)

    async def _abort(self, http: web.Request) -> web.Response:
        try:
            body = wire.loads(await http.read())
            request_id, submission = body["request_id"], body.get("submission_id")
        except (ValueError, KeyError, TypeError) as error:
            return _error(wire.WireError(f"abort needs a request_id: {error}"))
        aborted = self.engine.abort(request_id)
        if submission is not None and not aborted:
            if submission in self._active:
                self._pending_abort.add(submission)  # its generate is about to register it
                aborted = True
            else:
                self._tombstones[submission] = None
                while len(self._tombstones) > _TOMBSTONES:
                    self._tombstones.popitem(last=False)
        return _json({"aborted": aborted})

    def _simple(self, call: Callable[[dict], Awaitable | None]):
        """A route for a method that takes a few JSON keyword arguments and returns nothing."""

        async def handler(http: web.Request) -> web.Response:
            try:
                raw = await http.read()
                body = wire.loads(raw) if raw else {}
                if not isinstance(body, dict):
                    raise wire.WireError("the body must be a JSON object")
                outcome = call(body)
                if asyncio.iscoroutine(outcome):
                    await outcome
            except Exception as error:
                return _error(error)
            return _json({"ok": True})

        return handler

    def _optional(self, method: str, body: dict):
        """`engine.<method>(**body)` for a method not every engine has (NotImplementedError: 501 without it)."""
        call = getattr(self.engine, method, None)
        if call is None:
            raise NotImplementedError(f"{type(self.engine).__name__} has no {method} (SGLang's engines have)")
        return call(**body)

    async def _update_weights(self, http: web.Request) -> web.Response:
        try:
            flat, version = wire.weights_from_frame(await self._read_frame(http))
            await self.engine.update_weights(flat, version=version)
        except Exception as error:
            return _error(error)
        return _json({"ok": True})

    async def _load_bucket(self, http: web.Request) -> web.Response:
        try:
            await self.engine.load_bucket(wire.bucket_from_frame(await self._read_frame(http)))
        except Exception as error:
            return _error(error)
        return _json({"ok": True})

    async def _read_frame(self, http: web.Request) -> bytearray:
        """The body as one writable buffer, which the frame's tensors then view (`http.read()` would hold it twice:
        its bytearray and the bytes it returns). Longer than `max_body_bytes`: a `WireError` (400)."""
        limit = http.client_max_size
        body = bytearray()
        async for chunk in http.content.iter_any():
            body += chunk
            if limit and len(body) > limit:
                raise wire.WireError(f"the body is longer than this endpoint's limit of {limit} bytes (max_body_bytes)")
        return body

    async def _export_kv(self, http: web.Request) -> web.Response:
        try:
            export = await self.engine.export_kv(wire.loads(await http.read())["request_id"])
        except Exception as error:
            return _error(error)
        return web.Response(body=wire.kv_export_to_frame(export), content_type="application/octet-stream")

    async def _import_kv(self, http: web.Request) -> web.Response:
        try:
            await self.engine.import_kv(wire.kv_export_from_frame(await http.read()))
        except Exception as error:
            return _error(error)
        return _json({"ok": True})

    async def _release_export(self, http: web.Request) -> web.Response:
        try:
            released = self.engine.release_export(wire.loads(await http.read())["request_id"])
        except Exception as error:
            return _error(error)
        return _json({"released": released})


def _version(body: dict) -> dict:
    extra = sorted(set(body) - {"version"})
    if extra or "version" not in body:
        raise wire.WireError(f"the body must be {{'version': int}}, got fields {sorted(body)}")
    return {"version": body["version"]}


def _memory(body: dict) -> dict:
    extra = sorted(set(body) - {"weights", "kv"})
    if extra:
        raise wire.WireError(f"unknown fields {extra}: expected weights and kv")
    return {"weights": bool(body.get("weights", True)), "kv": bool(body.get("kv", True))}


class ServerThread:
    """An engine and its endpoint on their own event loop in a daemon thread (a cell leader's layout; tests).

    `engine_factory` runs on that loop, so the engine's asyncio state belongs to it. `call(fn)` runs
    `fn(engine)` (a coroutine function or a plain one) on the loop and returns its result. `secret`: the
    `EngineServer`'s.
    """

    def __init__(
        self,
        engine_factory: Callable[[], Engine],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: str | None = None,
    ):
        self._factory = engine_factory
        self._host, self._port, self._secret = host, port, secret
        self._thread = eventloop.LoopThread("gyre-engine-endpoint")
        self.engine: Engine | None = None
        self.server: EngineServer | None = None

    def start(self, timeout_s: float = 30.0) -> str:
        self._thread.start(self._setup, what="the engine endpoint", timeout_s=timeout_s)
        return self.server.url

    def _setup(self):
        self.engine = self._factory()
        self.server = EngineServer(self.engine, host=self._host, port=self._port, secret=self._secret)
        return self.server.start()

    def call(self, fn: Callable, timeout_s: float = 30.0):
        async def run():
            outcome = fn(self.engine)
            return await outcome if asyncio.iscoroutine(outcome) else outcome

        return self._thread.call(run(), timeout_s)

    async def call_async(self, fn: Callable, timeout_s: float = 30.0):
        """`call` awaited from another event loop (a test's, the proxy's), which goes on meanwhile."""
        return await asyncio.to_thread(self.call, fn, timeout_s)

    def kill(self, timeout_s: float = 30.0) -> None:
        """`EngineServer.kill` on the endpoint's loop: it dies as a crashed process's would (fault tests)."""
        self._thread.call(self.server.kill(), timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        if not self._thread.alive:
            return

        async def shutdown():
            await self.server.stop()
            close = getattr(self.engine, "close", None)
            if close is not None:
                await close()

        try:
            self._thread.call(shutdown(), timeout_s)
        except Exception:  # stopping goes on (the loop, the thread); what failed is reported, not swallowed
            log.exception("engine endpoint %s: shutdown failed", self.server.url)
        self._thread.stop(timeout_s)
