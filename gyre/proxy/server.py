"""The proxy's HTTP server: the three API dialects in, routed engine calls, TITO records out.

aiohttp (server), the same library as the engine endpoint and its client: docs/proxy.md's probes found an aiohttp
server with one shared aiohttp client cheapest on these machines (~0.5 ms CPU per request, 20-30 us per relayed
chunk), where FastAPI cost 1.5-2x and httpx as the upstream client collapsed at 64+ concurrent streams.

One call, in order: read the body (size cap -> 413, time limit -> 408), authenticate the execution key (401),
parse the dialect (4xx in its own shape), check the model name (404), build the prompt with TITO reuse
(`gyre.proxy.render`; a big build on a worker thread, a prompt past the context limit refused as soon as its token
floor or count shows it: 400 "prompt is too long"), run the call through the routing table with transparent
retry (`gyre.proxy.routing`; a streamed call still without a first token after `proxy.stream_keepalive_s` has its
stream started and kept alive meanwhile: docs/proxy.md, "Long prefills"), turn output ids into the dialect's
structures as they come (`gyre.proxy.output`), record the call once into the execution's tree and file
(`gyre.proxy.sessions`), and remember our exact output for the payload cache. A client error is answered and
nothing is recorded; an engine failure after the stream started ends the stream with the dialect's error event.

Admin routes (for `gyre.serve` and the runtime; they need the admin key as a Bearer token or `x-api-key`: without a
key 401 `authentication_error`, with another key 403 `permission_error`):
`POST /gyre/executions` `{"execution"?}` -> `{"execution", "key"}`; `POST /gyre/executions/{execution}/close`;
`GET /gyre/stats` -> `ProxyServer.stats()`, the counters of the calls served (`gyre.proxy.stats`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from gyre.config.proxy import ProxyConfig
from gyre.engine.errors import RemoteEngineError
from gyre.engine.protocol import GenerateRequest, SamplingParams, call_seed
from gyre.proxy import body_reuse
from gyre.proxy.conversation import ApiError, AssistantOutput, ChatRequest, Usage
from gyre.proxy.count_worker import CountWorker, WorkerFailed, offload_bytes
from gyre.proxy.dialects import DIALECTS, Dialect
from gyre.proxy.dialects.fields import decode_body, json_type
from gyre.proxy.dialects.protocol import StreamWriter
from gyre.proxy.heap import HeapFreezer
from gyre.proxy.in_flight import InFlight
from gyre.proxy.output import OutputDecoder, prompt_opens_thinking
from gyre.proxy.render import PromptTooLong
from gyre.proxy.routing import NoEngineError, RoutedFinish, RoutedTokens, RoutingTable, generate_routed
from gyre.proxy.sessions import (
    ExecutionIdConflict,
    ExecutionSession,
    RecordError,
    SessionRegistry,
    key_from_headers,
    thread_key,
)
from gyre.proxy.stats import ProxyStats, RouteCounters
from gyre.proxy.token_estimate import estimate_from_sample, estimate_tokens, request_texts
from gyre.traj.record import CallMeta, CallRouting
from gyre.traj.roles import Role

ROLE_LABELS = tuple(role.value for role in Role)

log = logging.getLogger(__name__)

# Deepest nesting of objects and arrays a request body may have. Everything a call carries is echoed or stored one or
# two levels deeper (a response's metadata, a record line's role signals) and orjson serializes at most 255 levels;
# real harness bodies nest about a dozen (tool schemas included). Checked before anything is parsed or recorded.
MAX_BODY_DEPTH = 128


# A build that renders and encodes this many new characters runs on a worker thread, so the event loop goes on serving
# every other execution meanwhile (the template encodes with the GIL released; the tiny tokenizer at ~1 MB/s: ~30 ms).
OFF_THE_LOOP_CHARS = 32 * 1024

# A body this large that cannot reuse its thread's previous one is scanned for its messages' offsets on a worker
# thread (gyre.proxy.body_reuse.fresh: ~12 ms at 1.4 MB, Python), so the event loop's other calls interleave; and
# a body that adds this much to the previous one is decoded whole (C) rather than scanned on the loop.
OFF_THE_LOOP_BODY_BYTES = 256 * 1024

# count_tokens counts exactly a prompt of at most this many characters per token of the context limit: every
# prompt the model can take in text of natural density (3-5 characters a token; code and CJK fewer). Beyond it, or
# past the limit, it answers an estimate, marked in this header (docs/proxy.md, "Counting tokens").
EXACT_COUNT_CHARS_PER_TOKEN = 8
TOKEN_COUNT_HEADER = "gyre-token-count"


async def _off_the_loop_if_big(
    builder, request: ChatRequest, *, max_tokens: int | None = None, enable_thinking: bool | None = None
):
    """`builder.build(request)`, on a worker thread when it has much new text to encode (which releases the GIL)."""
    if builder.pending_chars(request) < OFF_THE_LOOP_CHARS:
        return builder.build(request, max_tokens=max_tokens, enable_thinking=enable_thinking)
    return await asyncio.to_thread(builder.build, request, max_tokens=max_tokens, enable_thinking=enable_thinking)


def _too_long(at_least: int, max_tokens: int) -> ApiError:
    """The 400 of a prompt known to pass the limit before it was wholly counted (docs/proxy.md, "One call")."""
    return ApiError(
        "prompt_too_long",
        f"prompt is too long: {at_least} tokens > {max_tokens} maximum (at least {at_least}: counting stopped once "
        "the prompt passed the limit)",
    )


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class ProxyServer:
    """Serves `DIALECTS` for the executions of `registry`, sending calls to the engines of `table`.

    The server holds each dialect by the `Dialect` protocol (`gyre.proxy.dialects.protocol`) and has no per-dialect
    branch: a dialect's routes, shapes and signals are its own."""

    def __init__(
        self,
        config: ProxyConfig,
        *,
        template: Any,  # gyre.proxy.render.ChatTemplate
        registry: SessionRegistry,
        table: RoutingTable,
        context_limit: int,
        admin_key: str | None = None,
    ):
        flags = {"enabled": (True,), "disabled": (False,), "client": (True, False)}.get(config.thinking, ())
        for problem in filter(None, (template.thinking_switch_problem(flag) for flag in flags)):
            raise ValueError(f"proxy.thinking={config.thinking}: {problem}")
        self.config = config
        self.template = template
        self.registry = registry
        self.table = table
        self.context_limit = config.context_limit or context_limit
        self.admin_key = admin_key or ("gyre-admin-" + secrets.token_urlsafe(24))
        self.port = config.port
        self._runner: web.AppRunner | None = None
        self.heap = HeapFreezer(config.gc_freeze_every, config.gc_full_every_s)
        self.count_worker = CountWorker()  # huge count_tokens bodies, decoded off the loop (docs/proxy.md)
        self.counters = ProxyStats()
        self.in_flight = InFlight()  # the calls being served now (progress lines read it on this loop)
        self.stopping = False
        self.app = web.Application(client_max_size=config.max_body_bytes)
        routes = [
            web.get("/", self._root),  # aiohttp answers HEAD / with the same handler
            web.get("/v1/models", self._models),
        ]
        for dialect in DIALECTS:
            counters = self.counters.route(dialect.path, dialect.name)
            routes.append(web.post(dialect.path, self._dialect_handler(dialect, counters)))
            if dialect.count_tokens_path is not None:
                counters = self.counters.route(dialect.count_tokens_path, dialect.name)
                routes.append(web.post(dialect.count_tokens_path, self._count_tokens_handler(dialect, counters)))
        routes += [
            web.post("/gyre/executions", self._issue),
            web.post("/gyre/executions/{execution}/close", self._close),
            web.get("/gyre/stats", self._stats),
        ]
        self.app.add_routes(routes)

    @property
    def url(self) -> str:
        """The root URL (Anthropic clients' base URL: their SDKs append `/v1/messages`)."""
        return f"http://{self.config.host}:{self.port}"

    @property
    def openai_url(self) -> str:
        """The base URL OpenAI clients use (`/v1`: their SDKs append `/chat/completions`, `/responses`)."""
        return self.url + "/v1"

    def stats(self) -> dict[str, Any]:
        """The counters of the calls served so far, JSON-able (`gyre.proxy.stats`, docs/proxy.md "Counters").
        Read on the proxy's event loop: the handlers update the counters there."""
        return self.counters.snapshot(self.registry.calls_recorded(), self.table.lost_engines)

    async def start(self) -> str:
        # handler_cancellation: a harness that hangs up cancels its call, which aborts it on the engine.
        # shutdown_timeout: at stop, calls still running after the grace are cancelled (their handlers abort the
        # engine call and record what was sampled) and idle or slow connections are closed; aiohttp's default
        # waited 60 s for one slow client.
        # keepalive_timeout: aiohttp closes a connection whose next request head is not complete this long after
        # it opened or answered, so it bounds both idle keep-alive connections and a client trickling headers.
        # lingering_time: after an answer that left the body unread (413, 408), the rest is read and dropped this
        # long so the client sees the answer rather than a reset (aiohttp's default is 10 s).
        self._runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=self.config.shutdown_grace_s,
            keepalive_timeout=self.config.request_head_timeout_s,
            lingering_time=2.0,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.heap.start()
        self.count_worker.prewarm()
        log.info("proxy serving at %s", self.url)
        return self.url

    async def stop(self) -> None:
        self.stopping = True
        await self.heap.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.count_worker.stop()  # after the calls in flight, which may be using it

    # ------------------------------------------------------------------ small routes

    async def _root(self, http: web.Request) -> web.Response:
        return web.Response(status=200) if http.method == "HEAD" else _json({"ok": True, "service": "gyre proxy"})

    async def _models(self, http: web.Request) -> web.Response:
        headers = _headers(http)
        dialect = next(dialect for dialect in DIALECTS if dialect.lists_models_for(headers))
        return _json(dialect.models_body(self.config.model_names, int(time.time())))

    async def _issue(self, http: web.Request) -> web.Response:
        if (refusal := self.admin_refusal(http)) is not None:
            return refusal
        try:
            raw = await self._read_body(http)
            body = orjson.loads(raw) if raw else {}
            if not isinstance(body, dict):
                raise ValueError(f'the body must be a JSON object ({{"execution"?: str}}), got {json_type(body)}')
            session = self.registry.issue(body.get("execution"))
        except ApiError as error:  # the body is too large or too slow
            return _json({"error": {"type": f"{error.kind}_error", "message": error.message}}, error.status)
        except ExecutionIdConflict as error:
            return _json({"error": {"type": "conflict_error", "message": str(error)}}, 409)
        except (orjson.JSONDecodeError, ValueError) as error:
            return _json({"error": {"type": "invalid_request_error", "message": str(error)}}, 400)
        return _json({"execution": session.execution, "key": session.key})

    async def _close(self, http: web.Request) -> web.Response:
        if (refusal := self.admin_refusal(http)) is not None:
            return refusal
        execution = http.match_info["execution"]
        if self.registry.by_execution(execution) is None:
            return _json({"error": {"type": "not_found_error", "message": f"no open execution {execution!r}"}}, 404)
        in_flight = self.registry.close(execution)
        return _json({"closed": execution, "calls_in_flight": in_flight})

    async def _stats(self, http: web.Request) -> web.Response:
        if (refusal := self.admin_refusal(http)) is not None:
            return refusal
        return _json(self.stats())

    def admin_refusal(self, http: web.Request) -> web.Response | None:
        """None for the admin key; else the answer: 401 without a key, 403 with another one (an execution's key
        among them), the engine endpoint's rule (docs/endpoint.md)."""
        key = key_from_headers({k.lower(): v for k, v in http.headers.items()})
        if key is None:
            return _json({"error": {"type": "authentication_error", "message": "admin key required"}}, 401)
        # bytes (not str): compare_digest refuses non-ASCII str, and a header may carry anything
        if not secrets.compare_digest(key.encode("utf-8", "replace"), self.admin_key.encode()):
            return _json({"error": {"type": "permission_error", "message": "this key is not the admin key"}}, 403)
        return None

    # ------------------------------------------------------------------ the dialect routes

    def _dialect_handler(self, dialect: Dialect, counters: RouteCounters):
        async def handler(http: web.Request) -> web.StreamResponse:
            return await _counted(counters, self._serve_call(http, dialect, counters))

        return handler

    def _count_tokens_handler(self, dialect: Dialect, counters: RouteCounters):
        async def handler(http: web.Request) -> web.Response:
            return await _counted(counters, self._count_tokens(http, dialect, counters))

        return handler

    async def _serve_call(self, http: web.Request, dialect: Dialect, counters: RouteCounters) -> web.StreamResponse:
        try:
            session, request = await self._admit(http, dialect)
            prompt = await self._build_prompt(session, request)
            params = self._sampling(request, prompt.num_tokens, self._call_seed(session.execution, prompt.input_ids))
            if session.closing:  # closed while its body was read or its prompt built (every close sets it)
                raise ApiError("authentication", "invalid x-api-key: its execution was closed")
        except ApiError as error:
            counters.ended_with(error)
            return self.error_response(dialect, error)
        counters.admitted += 1
        call = _Call(self, dialect, session, request, prompt, params)
        self.in_flight.add(call.response_id, execution=session.execution, prompt_tokens=prompt.num_tokens, now=call.t0)
        session.begin_call()  # an admin close waits for this call to end (docs/proxy.md, routes)
        try:
            if request.stream:
                return await call.stream(http)
            return await call.complete()
        except _HANG_UPS:
            call.log_hang_up()
            raise
        finally:
            session.end_call()
            self.in_flight.remove(call.response_id)

    async def _count_tokens(self, http: web.Request, dialect: Dialect, counters: RouteCounters) -> web.Response:
        """The exact count of a prompt the model can take; beyond the context limit an estimate from a bounded
        sample of its text, so no body a client chooses costs more than a prompt at the limit does
        (`gyre.proxy.token_estimate`; docs/proxy.md, "Counting tokens")."""
        try:
            session = self._authenticate(http)
            raw = await self._read_body(http)
            limit = self.context_limit
            if len(raw) >= offload_bytes(limit, EXACT_COUNT_CHARS_PER_TOKEN):
                answer = await self._count_offloaded(raw, dialect, http)
                if answer is not None:
                    counters.answered += 1
                    return answer
            body = self._decode_json(raw)
            request = dialect.parse_count_tokens(body, _headers(http), dict(http.query))
            self._check_model(request.model)
            _check_stated_role(request.signals)
            texts = request_texts(request)
            floor = self.template.prompt_floor(request.turns)
            if not self._countable(floor, sum(map(len, texts))):
                count, exact = await asyncio.to_thread(self._estimate_beyond, texts, floor), False
            else:
                builder = session.make_builder(session.payload)  # a throwaway builder: no cache churn, no lock
                thinking = self.config.enable_thinking(request.thinking)
                try:
                    prompt = await _off_the_loop_if_big(builder, request, max_tokens=limit, enable_thinking=thinking)
                    count, exact = prompt.num_tokens, True
                except PromptTooLong as error:
                    count, exact = await asyncio.to_thread(self._estimate_beyond, texts, error.at_least), False
        except ApiError as error:
            counters.ended_with(error)
            return self.error_response(dialect, error)
        counters.answered += 1
        answer = _json(dialect.count_tokens_body(count))
        answer.headers[TOKEN_COUNT_HEADER] = "exact" if exact else "estimate"
        return answer

    async def _count_offloaded(self, raw: bytes, dialect: Dialect, http: web.Request) -> web.Response | None:
        """The estimate of a huge body, decoded and parsed by the count worker (`gyre.proxy.count_worker`); None
        to count it in process: the model can take its prompt, or the worker failed."""
        try:
            found = await self.count_worker.digest(raw, dialect.name, _headers(http), dict(http.query), MAX_BODY_DEPTH)
        except WorkerFailed as error:
            log.warning("count_tokens: the worker failed on a %d-byte body (%s); counted in process", len(raw), error)
            return None
        self._check_model(found.model)
        _check_stated_role(found.signals)
        floor = self.template.floor_of_chars(found.floor_chars)
        if self._countable(floor, found.text_chars):
            return None
        estimate = await asyncio.to_thread(estimate_from_sample, found.sample, self.template.encode_many)
        answer = _json(dialect.count_tokens_body(max(floor, estimate)))
        answer.headers[TOKEN_COUNT_HEADER] = "estimate"
        return answer

    def _countable(self, floor: int, text_chars: int) -> bool:
        """Whether count_tokens counts a prompt exactly: its floor within the context limit and its text at most
        `EXACT_COUNT_CHARS_PER_TOKEN` characters per token of it; else it answers an estimate."""
        limit = self.context_limit
        return floor <= limit and text_chars <= EXACT_COUNT_CHARS_PER_TOKEN * limit

    def _estimate_beyond(self, texts: list[str], at_least: int) -> int:
        """A count for a prompt past the context limit (or too long to count): the sampled estimate, never below
        what is known of it."""
        return max(at_least, estimate_tokens(texts, self.template.encode_many))

    async def _admit(self, http: web.Request, dialect: Dialect) -> tuple[ExecutionSession, ChatRequest]:
        session = self._authenticate(http)
        headers = _headers(http)
        # Only the bytes the thread's previous body did not have are decoded (gyre.proxy.body_reuse), and with an
        # incremental dialect only the messages it did not have are parsed (gyre.proxy.dialects.incremental).
        cache = session.parse_cache(f"{dialect.name}:{thread_key(headers)}")
        raw = await self._read_body(http)
        previous = cache.body
        reused = body_reuse.reuse(raw, previous, MAX_BODY_DEPTH, OFF_THE_LOOP_BODY_BYTES) if previous else None
        if reused is not None:
            body, layout = reused
        else:
            body = self._decode_json(raw)
            field = dialect.history_field
            if len(raw) >= OFF_THE_LOOP_BODY_BYTES:  # the scan is Python: off the loop, the others go on
                layout = await asyncio.to_thread(body_reuse.fresh, raw, body, field)
            else:
                layout = body_reuse.fresh(raw, body, field)
        request = dialect.parse_request(body, headers, dict(http.query), cache=cache if dialect.incremental else None)
        self._check_model(request.model)
        _check_stated_role(request.signals)
        cache.body = layout  # only once admitted: a refused body is never the base of the next
        return session, request

    async def _build_prompt(self, session: ExecutionSession, request: ChatRequest):
        """The call's prompt from its thread's builder, one build of a thread at a time; a prompt that must pass
        the context limit is refused as soon as that is known (before tokenizing it, where its floor shows it)."""
        thread = thread_key(request.signals)
        max_tokens = self.context_limit - self.config.min_output_tokens
        builder = session.builder(thread)
        # The turns new to the builder are a subset of the prompt's: their floor is a floor of the prompt, whatever
        # the builder's state when it builds. O(new turns), nothing rendered or encoded.
        floor = self.template.prompt_floor(builder.pending_turns(request))
        if floor > max_tokens:
            raise _too_long(floor, max_tokens)
        async with session.build_lock(thread):
            try:
                thinking = self.config.enable_thinking(request.thinking)
                return await _off_the_loop_if_big(builder, request, max_tokens=max_tokens, enable_thinking=thinking)
            except PromptTooLong as error:
                raise _too_long(error.at_least, max_tokens) from None

    def _authenticate(self, http: web.Request) -> ExecutionSession:
        session = self.registry.by_key(key_from_headers(_headers(http)))
        if session is None:
            raise ApiError("authentication", "invalid x-api-key: no execution has this key")
        return session

    async def _read_body(self, http: web.Request) -> bytes:
        """The whole body, within `proxy.max_body_bytes` (else 413) and `proxy.body_timeout_s` (else 408)."""
        timeout_s = self.config.body_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                return await http.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(
                "request_too_large", f"request body exceeds the limit of {self.config.max_body_bytes} bytes"
            ) from None
        except TimeoutError:
            raise ApiError(
                "request_timeout", f"the request body did not arrive within {timeout_s:g} s (proxy.body_timeout_s)"
            ) from None

    async def _read_json(self, http: web.Request) -> Any:
        return self._decode_json(await self._read_body(http))

    def _decode_json(self, raw: bytes) -> Any:
        return decode_body(raw, MAX_BODY_DEPTH)

    def _check_model(self, model: str) -> None:
        if model not in self.config.model_names:
            raise ApiError("not_found", f"model: {model!r} is not served here; available: {self.config.model_names}")

    def _call_seed(self, execution: str, input_ids) -> int | None:
        run_seed = self.config.sampling.seed
        return None if run_seed is None else call_seed(run_seed, execution, input_ids)

    def _sampling(self, request: ChatRequest, prompt_tokens: int, seed: int | None = None) -> SamplingParams:
        room = self.context_limit - prompt_tokens
        if room < self.config.min_output_tokens:
            raise ApiError(
                "prompt_too_long",
                f"prompt is too long: {prompt_tokens} tokens > {self.context_limit - self.config.min_output_tokens} "
                "maximum",
            )
        sampling = self.config.sampling
        budget = min(room, sampling.max_new_tokens, request.max_tokens or sampling.max_new_tokens)
        temperature, top_p, top_k = sampling.temperature, sampling.top_p, sampling.top_k
        if sampling.honor_client:
            temperature = request.temperature if request.temperature is not None else temperature
            top_p = request.top_p if request.top_p is not None else top_p
            top_k = request.top_k if request.top_k is not None else top_k
        try:
            return SamplingParams(
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                max_new_tokens=budget,
                stop_token_ids=self.template.end_of_turn_ids,
                seed=seed,
            )
        except ValueError as error:
            raise ApiError("invalid_request", str(error)) from None

    def error_response(self, dialect: Dialect, error: ApiError) -> web.Response:
        return _json(dialect.error_body(error), error.status)


class _Call:
    """One admitted model call: run it across engines, translate its output, record it once."""

    def __init__(self, server: ProxyServer, dialect: Dialect, session: ExecutionSession, request, prompt, params):
        self.server, self.dialect, self.session = server, dialect, session
        self.counters = server.counters.routes[dialect.path]
        self.request, self.prompt, self.params = request, prompt, params
        self.response_id = _new_id(dialect.response_prefix)
        self.created = int(time.time())
        self.t0 = time.monotonic()
        self.first_token_at: float | None = None
        config = server.config
        self.decoder = OutputDecoder(
            server.template.tokenizer,
            skip_ids=server.template.end_of_turn_ids,
            new_call_id=lambda: _new_id(dialect.call_prefix),
            tool_call_parser=config.tool_call_parser,
            reasoning_parser=config.reasoning_parser,
            tools=request.tools,  # qwen3_coder types parameter values by their schema
            starts_in_thinking=prompt_opens_thinking(
                config.reasoning_parser,
                server.template.generation_prompt
                + server.template.generation_suffix(config.enable_thinking(request.thinking)),
            ),
        )
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.engine = ""
        self.finish: RoutedFinish | None = None
        self.recorded = False
        self.routed_start = 0  # routed_experts_start of the engine request

    def _engine_request(self) -> GenerateRequest:
        routed = self.server.config.record_routed_experts
        if routed:  # from the first position the tree has no routing for (the previous output's last token, mostly)
            self.routed_start = self.session.routed_prefix_len(
                self.prompt.segments, thread=thread_key(self.request.signals)
            )
        return GenerateRequest(
            request_id=self.response_id,
            execution_id=self.session.execution,
            input_ids=self.prompt.input_ids,
            params=self.params,
            return_routed_experts=routed,
            routed_experts_start=self.routed_start,
        )

    def _routing(self) -> CallRouting | None:
        """The recorded call's routing: the engine's, when it covers the context and output exactly."""
        experts = self.finish.routed_experts if self.finish is not None else None
        if experts is None:
            return None
        expected = self.prompt.num_tokens + len(self.output_ids) - 1 - self.routed_start
        known = self.session.tree.routing_layers_topk
        try:
            if experts.shape[0] != expected:
                raise ValueError(f"it covers {experts.shape[0]} positions, not {expected}")
            routing = CallRouting(self.routed_start, experts)
            if known is not None and routing.layers_topk != known:
                raise ValueError(f"it has layers x top-k {routing.layers_topk}, the execution's earlier calls {known}")
        except (ValueError, TypeError) as error:  # the call is recorded all the same, its routing left out
            log.warning("call %s: the engine's routing is not recorded: %s", self.response_id, error)
            return None
        return routing

    async def _run(self):
        """Routed tokens -> output events; yields event lists, returns via `self.finish`/`self.output`."""
        routed = generate_routed(self.server.table, self._engine_request(), wait_s=self.server.config.engine_wait_s)
        async for item in routed:
            if isinstance(item, RoutedTokens):
                if self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                    self.server.in_flight.first_token(self.response_id, self.first_token_at)
                self.output_ids.extend(item.token_ids)
                self.logprobs.extend(item.logprobs)
                self.versions.append(item.policy_version)
                self.engine = item.engine
                yield self.decoder.feed(item.token_ids)
            else:
                self.finish = item
                self.counters.finished(item.attempts, item.continuation_cached_tokens, item.failed_over)
        events, self.output = self.decoder.finish(self.finish.finish_reason)
        yield events

    def log_hang_up(self) -> None:
        """Say in the log that the harness went away (or the proxy stopped) mid-call, and, before the first token,
        how long the prefill had run: a harness's own per-call timeout is what ends a long CPU prefill."""
        if self.server.stopping:
            return
        waited = time.monotonic() - self.t0
        if self.first_token_at is None:
            log.warning(
                "call %s of execution %s: the harness hung up after %.0f s without a first token (a %d-token prompt "
                "in prefill): a long prefill outlasted the harness's own timeout (streamed calls are kept alive by "
                'proxy.stream_keepalive_s, others wait as long as the harness lets them; docs/proxy.md, "Long '
                'prefills")',
                self.response_id,
                self.session.execution,
                waited,
                self.prompt.num_tokens,
            )
        else:
            log.info(
                "call %s of execution %s: the harness hung up after %.0f s (%d tokens sampled)",
                self.response_id,
                self.session.execution,
                waited,
                len(self.output_ids),
            )

    def _usage(self) -> Usage:
        cached = self.finish.cached_tokens if self.finish is not None else 0
        return Usage(input_tokens=self.prompt.num_tokens, output_tokens=len(self.output_ids), cached_tokens=cached)

    def _record(self) -> None:
        if not self.output_ids:
            return
        finish = self.finish
        meta = CallMeta(
            execution=self.session.execution,
            request_id=self.response_id,
            policy_version=self.versions[0] if self.versions else 0,
            engine=",".join(finish.engines) if finish is not None else self.engine,
            timings={"first_token_s": finish.first_token_s or 0.0, "total_s": finish.total_s} if finish else {},
            role_signals=self.dialect.role_signals(self.request),
            # cached_tokens: the prompt's KV the engine reused (its prefix cache; docs/proxy.md, "Long prefills")
            usage={"prompt_tokens": self.prompt.num_tokens, "cached_tokens": finish.cached_tokens} if finish else {},
        )
        reason = finish.finish_reason if finish is not None else "abort"
        thread = thread_key(self.request.signals)
        self.session.record(
            self.prompt.segments, self.output_ids, self.logprobs, reason, meta, thread=thread, routing=self._routing()
        )
        self.counters.recorded += 1
        self.server.heap.call_done()
        if finish is not None:
            self.session.payload.remember(self.output, self.output_ids)

    async def complete(self) -> web.Response:
        failed = None
        try:
            async for _ in self._run():
                pass
        except _CALL_ERRORS as error:
            failed = _api_error(error)
        finally:
            unrecorded = self._record_once()
        failed = unrecorded or failed  # a call that could not be recorded is never answered as a success
        if failed is not None:
            return self._error_response(failed)
        self.counters.answered += 1
        return _json(self._body(self.output))

    def _error_response(self, error: ApiError) -> web.Response:
        self.counters.ended_with(error)
        return self.server.error_response(self.dialect, error)

    def _record_once(self) -> ApiError | None:
        """Record the call if it produced tokens and is not recorded yet (also when the harness went away); the
        500 to answer with when its record could not be written (nothing of it was kept: `RecordError`)."""
        if self.recorded or not self.output_ids:
            return None
        self.recorded = True
        try:
            self._record()
        except RecordError as error:
            return ApiError("api_error", str(error))
        return None

    def _body(self, output: AssistantOutput) -> dict:
        usage, response_id = self._usage(), self.response_id
        return self.dialect.response_body(self.request, output, usage, response_id=response_id, created=self.created)

    def _writer(self) -> StreamWriter:
        return self.dialect.stream_writer(
            self.request, response_id=self.response_id, created=self.created, input_tokens=self.prompt.num_tokens
        )

    async def _start_stream(self, http: web.Request, writer: StreamWriter, batch=()) -> web.StreamResponse:
        """Send the headers and the dialect's opening events, with the first `batch` of events in the same write."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}
        )
        await response.prepare(http)
        opening = writer.start()
        await response.write(opening + b"".join(writer.event(event) for event in batch))
        return response

    async def _first_tokens(self, first: asyncio.Future, http: web.Request, writer: StreamWriter):
        """Wait for the call's first events (`first`). Past `proxy.stream_keepalive_s` without them (a long
        prefill), start the stream and send the dialect's keep-alive every as long until they come, so a harness's
        idle-connection timers see bytes (docs/proxy.md, "Long prefills"). The response if the stream started."""
        every = self.server.config.stream_keepalive_s
        if every <= 0:
            await asyncio.wait({first})
            return None
        done, _ = await asyncio.wait({first}, timeout=every)
        if done:
            return None
        response = await self._start_stream(http, writer)
        while not done:
            await response.write(writer.keepalive())
            done, _ = await asyncio.wait({first}, timeout=every)
        return response

    async def stream(self, http: web.Request) -> web.StreamResponse:
        events = self._run()
        first = asyncio.ensure_future(events.__anext__())
        writer = self._writer()
        failed: ApiError | None = None
        response = None
        try:
            response = await self._first_tokens(first, http, writer)
            if response is None:  # no byte sent yet: a call that failed at once gets a plain HTTP error
                try:
                    batch = first.result()
                except _CALL_ERRORS as error:
                    return self._error_response(_api_error(error))
                response = await self._start_stream(http, writer, batch)
            else:
                batch = first.result()  # an error now ends the started stream below
                await response.write(b"".join(writer.event(event) for event in batch))
            async for batch in events:
                data = b"".join(writer.event(event) for event in batch)
                if data:
                    await response.write(data)
            failed = self._record_once()
            if failed is not None:
                await response.write(writer.error(failed))
            else:
                await response.write(writer.finish(self.output, self._usage()))
        except _CALL_ERRORS as error:  # after the stream started: the dialect's in-stream error event
            failed = _api_error(error)
            await response.write(writer.error(failed))
        finally:
            if not first.done():  # the harness went away (or a write failed) before the first tokens
                first.cancel()
                await asyncio.wait({first})
            if not first.cancelled():
                first.exception()  # retrieved (it was answered above, or the call is going away)
            await events.aclose()  # a harness that went away: the engine call is aborted
            self._record_once()  # what was sampled is recorded (finish "abort" when the call did not end)
        await response.write_eof()
        # Counted once the stream is whole: a client that hangs up before is a hang-up (`_counted`), not both.
        if failed is not None:
            self.counters.ended_with(failed)
        else:
            self.counters.answered += 1
        return response


# How a client's hang-up reaches a handler: aiohttp cancels it (`handler_cancellation`), or a write to the closed
# connection raises (aiohttp's `ClientConnectionResetError` is a `ConnectionResetError`). Also a call cancelled
# when the proxy stops.
_HANG_UPS = (asyncio.CancelledError, ConnectionResetError)


async def _counted(counters: RouteCounters, serve) -> web.StreamResponse:
    """Await `serve` (one request of the route) and count a hang-up or an error the proxy did not expect: the
    answers themselves are counted where they are made (`gyre.proxy.stats`: one outcome per request)."""
    counters.requests += 1
    try:
        return await serve
    except _HANG_UPS:
        counters.hung_up += 1
        raise
    except Exception:  # aiohttp answers it with a 500; counted, then raised as before (never swallowed)
        counters.ended_unhandled()
        raise


# Errors a routed call can end with, and the API error each becomes.
_CALL_ERRORS = (NoEngineError, ValueError, RemoteEngineError)


def _api_error(error: BaseException) -> ApiError:
    if isinstance(error, NoEngineError):
        return ApiError("overloaded", str(error))
    if isinstance(error, ValueError):  # the engine refused the input (e.g. its own context limit is smaller)
        return ApiError("invalid_request", f"the engine refused the request: {error}")
    return ApiError("api_error", f"the engine failed: {error}")


def _headers(http: web.Request) -> dict[str, str]:
    return {k.lower(): v for k, v in http.headers.items()}


def _check_stated_role(signals: Mapping[str, Any]) -> None:
    """An `x-gyre-role` header (a request's signals) must name a role label (`gyre.traj.roles`): the same 400 on
    every route."""
    role = signals.get("x-gyre-role")
    if role is not None and role not in ROLE_LABELS:
        raise ApiError("invalid_request", f"header x-gyre-role: got {role!r}, expected one of {list(ROLE_LABELS)}")


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")
