"""`ScriptedEngine`: a scripted stand-in for a rollout engine, for tests and benchmarks of what sits above the engine
(the proxy, `gyre.serve`, harnesses, load generators). It is not a model: its tokens come from a script.

Contract
- It implements `gyre.engine.protocol.Engine` (`isinstance(engine, Engine)` holds) with the protocol's request
  lifecycle: the same input checks (`check_request`: unique in-flight ids; with `vocab_size` / `context_length`
  given, ids in the vocabulary and prompt + `max_new_tokens` within the context), at most `max_running` requests
  running and the rest queued in order, `abort` of a queued or running request, `stop_accepting` / `drain` /
  `release_memory` as documented there (`EngineUnavailableError`, `EngineBusyError`), and versions that
  `update_weights` raises between two tokens, so a request can span an update.
- Each request's output comes from `reply(request)`, an iterable of token ids (a list, or an endless generator
  such as `itertools.cycle(ids)`), read lazily while the request runs. A request ends `stop` when a token in
  `params.stop_token_ids` is emitted or the reply runs out (the script ended its turn), `length` after
  `max_new_tokens` tokens, `abort` when aborted. Every token is one chunk with log-prob `logprob`.
- Pacing stands in for decode: each token waits `token_delay_s` (0 still yields to the event loop once, a step
  boundary) and the first one `first_token_delay_s` more (prefill). Both are plain attributes a benchmark may
  change while serving. Timings are measured on the wall clock.
- Weight-update sessions as the protocol has them: from `begin_update` to `end_update` no request gets a token (each
  waits in flight before its next one), `load_bucket` outside a session raises, versions are checked, and an aborted
  session that loaded a bucket leaves the engine refusing requests (in-flight ones aborted) until a whole version
  is loaded. Without a model it reads no tensor and knows no parameter names: `end_update` checks no completeness.
- What it does not model: weights (`update_weights` records the version only and reads no tensor), a KV cache
  (`cached_tokens` is always 0; `export_kv` / `import_kv` raise `NotImplementedError`, as SGLang's adapter does),
  experts (`routed_experts` is always None, as for a dense model, whatever `return_routed_experts` asks).
- Holding, for tests whose outcome must not depend on the script ending or on timing: after `hold(after_tokens=n)`
  every request streams at most its first `n` tokens and then waits, in flight, until `release()` or its abort (it
  ends `abort` with those tokens); `await until_held(count)` returns once `count` requests wait there. A request
  that ends within its first `n` tokens (a stop id, the reply's end, `max_new_tokens`) ends as usual.
- `calls` counts the requests that started running; with `record_requests=True`, `requests` holds them in order.

Imports are the stdlib and the protocol's module (no torch, no numpy; numpy only when the vocabulary check runs),
so light processes (proxy tests, load generators) can serve it. See docs/engine.md.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from gyre.config.checks import require, require_duration, require_int, require_number
from gyre.engine.protocol import (
    AcceptingLifecycle,
    EngineBusyError,
    EngineLoad,
    EngineUnavailableError,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    GenerateTimings,
    TokenChunk,
    UpdateSession,
    WeightUpdateSessionError,
    check_request,
    partial_weights_error,
)

if TYPE_CHECKING:
    from gyre.engine.protocol import KVExport

Reply = Callable[[GenerateRequest], Iterable[int]]  # a request -> its output token ids, read lazily


def chat_reply(template: Any, respond: Callable[[GenerateRequest, str], str]) -> Reply:
    """A reply that speaks through a chat template (`gyre.proxy.render.ChatTemplate` or anything with its
    `tokenizer.decode`, `encode` and `end_of_turn_ids`): `respond(request, prompt)` gets the decoded context
    (special tokens kept) and returns the assistant's text, which is encoded with the template and ended with its
    end-of-turn token, so the proxy parses and records it like any model output (tool calls included)."""
    end_of_turn = template.end_of_turn_ids[0]  # the template's end of turn (Qwen3 also stops on <|endoftext|>)

    def reply(request: GenerateRequest) -> list[int]:
        prompt = template.tokenizer.decode(list(request.input_ids), skip_special_tokens=False)
        return [*template.encode(respond(request, prompt)), end_of_turn]

    return reply


class _Flight:
    """One request from submission to its end: queued until `admitted` is set, then running."""

    def __init__(self, request: GenerateRequest):
        self.request = request
        self.submitted = time.monotonic()
        self.admitted = asyncio.Event()
        self.running = False
        self.aborted = False
        self.wake = asyncio.Event()  # a held request goes on: set by release() and abort()


class ScriptedEngine(AcceptingLifecycle):
    """A scripted stand-in engine (see the module docstring): answers each request with `reply(request)`."""

    def __init__(
        self,
        reply: Reply,
        *,
        logprob: float = -1.0,
        token_delay_s: float = 0.0,
        first_token_delay_s: float = 0.0,
        max_running: int = 64,
        kv_tokens: int = 1 << 20,
        vocab_size: int | None = None,
        context_length: int | None = None,
        policy_version: int = 0,
        record_requests: bool = False,
    ):
        require(callable(reply), "reply", reply, "a callable: request -> iterable of token ids")
        require_number("logprob", logprob, le=0)
        require_duration("token_delay_s", token_delay_s, allow_zero=True)
        require_duration("first_token_delay_s", first_token_delay_s, allow_zero=True)
        require_int("max_running", max_running, ge=1)
        require_int("kv_tokens", kv_tokens, ge=0)
        if vocab_size is not None:
            require_int("vocab_size", vocab_size, ge=1)
        if context_length is not None:
            require_int("context_length", context_length, ge=2)
        require_int("policy_version", policy_version, ge=0)
        self.reply = reply
        self.logprob = float(logprob)
        self.token_delay_s = token_delay_s  # before every token (a decode step)
        self.first_token_delay_s = first_token_delay_s  # before the first token, on top of token_delay_s (prefill)
        self.max_running = max_running
        self.kv_tokens = kv_tokens  # reported as kv_tokens_total; running requests hold their reserved tokens
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.policy_version = policy_version
        self.calls = 0
        self.requests: list[GenerateRequest] | None = [] if record_requests else None
        self._in_flight: dict[str, _Flight] = {}
        self._waiting: deque[_Flight] = deque()
        self._running = 0
        self._accepting = True
        self._weights_released = False
        self._kv_released = False
        self._idle = asyncio.Event()  # set whenever nothing is in flight (drain waits for it)
        self._idle.set()
        self._hold_after: int | None = None  # hold(): requests wait before their token of this index
        self._held: set[_Flight] = set()  # the requests waiting at the hold
        self._held_changed = asyncio.Event()
        self._session: UpdateSession | None = None  # begin_update .. end_update: no request gets a token
        self._updating: set[_Flight] = set()  # the requests waiting for the session's end
        self._partial_weights: str | None = None  # an aborted session loaded something (protocol: abort_update)

    # ----------------------------------------------------------------- requests

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        chunks = [chunk async for chunk in self.generate_stream(request)]
        last = chunks[-1]
        versions = [chunk.policy_version for chunk in chunks if chunk.token_ids] or [last.policy_version]
        ids = tuple(token for chunk in chunks for token in chunk.token_ids)
        return GenerateResult(
            request_id=request.request_id,
            output_ids=ids,
            output_logprobs=tuple(lp for chunk in chunks for lp in chunk.logprobs),
            finish_reason=last.finish_reason,
            policy_version=versions[0],
            last_policy_version=versions[-1],
            prompt_tokens=len(request.input_ids),
            cached_tokens=0,
            timings=last.timings,
        )

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        if not self._accepting or self._weights_released or self._kv_released:
            raise EngineUnavailableError("the scripted engine is not accepting requests (draining or released)")
        if self._partial_weights is not None:
            raise partial_weights_error(self._partial_weights)
        check_request(
            request, in_flight=self._in_flight, vocab_size=self.vocab_size, context_length=self.context_length
        )
        flight = _Flight(request)
        self._in_flight[request.request_id] = flight
        self._idle.clear()
        try:
            if self._running < self.max_running and not self._waiting:
                self._start(flight)
            else:
                self._waiting.append(flight)
                await flight.admitted.wait()  # set by a freed slot, or by abort
            async for chunk in self._run(flight):
                yield chunk
        finally:
            self._finish(flight)

    async def _run(self, flight: _Flight) -> AsyncIterator[TokenChunk]:
        request, params = flight.request, flight.request.params
        admitted = time.monotonic()
        first_token_at = None
        tokens: Iterator[int] = iter(()) if flight.aborted else iter(self.reply(request))
        upcoming = next(tokens, None)
        index = 0
        while True:
            finish: FinishReason | None = None
            if flight.aborted:
                finish = "abort"
            elif upcoming is None:
                finish = "stop"  # the script ended its turn (a reply that ends without a stop id)
            if finish is not None:  # a last chunk with no token
                yield self._chunk(request, index, (), finish, flight, admitted, first_token_at)
                return
            if self._session is not None:  # a weight update is streaming in: no token until it ends
                await self._wait_released(flight, self._updating)
                continue
            if self._hold_after is not None and index >= self._hold_after:
                await self._wait_released(flight, self._held)
                continue  # released or aborted: look again
            delay = self.token_delay_s + (self.first_token_delay_s if index == 0 else 0.0)
            await asyncio.sleep(delay)
            if flight.aborted:
                continue
            token, upcoming = upcoming, None
            if token in params.stop_token_ids:
                finish = "stop"
            elif index + 1 >= params.max_new_tokens:
                finish = "length"
            else:
                upcoming = next(tokens, None)
                finish = "stop" if upcoming is None else None
            first_token_at = first_token_at or time.monotonic()
            yield self._chunk(request, index, (token,), finish, flight, admitted, first_token_at)
            if finish is not None:
                return
            index += 1

    async def _wait_released(self, flight: _Flight, waiting: set[_Flight]) -> None:
        """Wait in `waiting` (the hold's, the session's) until woken: released, the session ended, or aborted."""
        flight.wake.clear()
        waiting.add(flight)
        if waiting is self._held:
            self._held_changed.set()
        try:
            await flight.wake.wait()
        finally:
            waiting.discard(flight)

    # ----------------------------------------------------------------- holding (tests)

    def hold(self, after_tokens: int = 0) -> None:
        """From now on every request streams at most its first `after_tokens` tokens, then waits in flight until
        `release()` or its abort. Call it on the engine's event loop (`ServerThread.call` from another thread)."""
        require_int("after_tokens", after_tokens, ge=0)
        self._hold_after = after_tokens

    def release(self) -> None:
        """End the hold: the waiting requests go on and later ones are not held."""
        self._hold_after = None
        for flight in self._held:
            flight.wake.set()

    async def until_held(self, count: int = 1) -> None:
        """Return once `count` requests wait at the hold (bound it with a timeout: nothing else ends the wait)."""
        while len(self._held) < count:
            self._held_changed.clear()
            await self._held_changed.wait()

    def _chunk(self, request, index, token_ids, finish, flight, admitted, first_token_at) -> TokenChunk:
        timings = cached = None
        if finish is not None:
            now = time.monotonic()
            timings = GenerateTimings(
                queued_s=admitted - flight.submitted,
                first_token_s=(first_token_at or now) - flight.submitted,
                total_s=now - flight.submitted,
            )
            cached = 0
        return TokenChunk(
            request_id=request.request_id,
            index=index,
            token_ids=token_ids,
            logprobs=(self.logprob,) * len(token_ids),
            policy_version=self.policy_version,
            finish_reason=finish,
            timings=timings,
            cached_tokens=cached,
        )

    def _start(self, flight: _Flight) -> None:
        flight.running = True
        self._running += 1
        self.calls += 1
        if self.requests is not None:
            self.requests.append(flight.request)
        flight.admitted.set()

    def _finish(self, flight: _Flight) -> None:
        """The request left (finished, aborted, cancelled or its stream closed): free its slot, admit the next."""
        self._in_flight.pop(flight.request.request_id, None)
        if flight.running:
            flight.running = False
            self._running -= 1
        elif flight in self._waiting:
            self._waiting.remove(flight)
        while self._waiting and self._running < self.max_running:
            self._start(self._waiting.popleft())
        if not self._in_flight:
            self._idle.set()

    def abort(self, request_id: str) -> bool:
        flight = self._in_flight.get(request_id)
        if flight is None or flight.aborted:
            return flight is not None
        flight.aborted = True
        flight.wake.set()  # a held request ends now
        if not flight.running:  # queued: leave the queue now and end with no tokens
            self._waiting.remove(flight)
            flight.admitted.set()
        return True

    # ----------------------------------------------------------------- lifecycle

    def _in_flight_ids(self) -> list[str]:
        return list(self._in_flight)

    async def release_memory(self, *, weights: bool = True, kv: bool = True) -> None:
        if self._in_flight:
            raise EngineBusyError(f"{len(self._in_flight)} requests are in flight: release_memory needs an idle engine")
        if self._session is not None:
            raise WeightUpdateSessionError("release_memory during a weight-update session: end or abort it first")
        self._weights_released = self._weights_released or weights
        self._kv_released = self._kv_released or kv

    async def resume_memory(self, *, weights: bool = True, kv: bool = True) -> None:
        self._weights_released = self._weights_released and not weights
        self._kv_released = self._kv_released and not kv

    async def update_weights(self, weights: object, *, version: int) -> None:
        """Records `version` only: the script is the model, so no tensor is read."""
        await self.begin_update(version=version)
        await self.end_update(version=version)

    async def begin_update(self, *, version: int) -> None:
        self._session = UpdateSession.begin(
            self._session, version, self.policy_version, released=self._weights_released
        )

    async def load_bucket(self, bucket: object) -> None:
        """Counts as loaded (the session is touched); no tensor is read."""
        UpdateSession.require(self._session, "load_bucket").touched = True

    async def end_update(self, *, version: int) -> None:
        session = UpdateSession.require(self._session, "end_update")
        session.check_end(version, None)  # no model: no parameter names to check
        self._session, self._partial_weights, self.policy_version = None, None, version
        self._wake_updating()

    async def abort_update(self) -> None:
        session, self._session = self._session, None
        if session is not None and session.touched:
            self._partial_weights = f"the update to version {session.version} was aborted after a bucket"
            for request_id in list(self._in_flight):
                self.abort(request_id)
        self._wake_updating()

    def _wake_updating(self) -> None:
        for flight in list(self._updating):
            flight.wake.set()

    async def export_kv(self, request_id: str) -> KVExport:
        raise NotImplementedError("the scripted engine has no KV cache: abort and send prompt + output elsewhere")

    async def import_kv(self, export: KVExport) -> None:
        raise NotImplementedError("the scripted engine has no KV cache: send prompt + output as a new request")

    def release_export(self, request_id: str) -> bool:
        return False

    def load(self) -> EngineLoad:
        released = self._weights_released or self._kv_released
        total = 0 if self._kv_released else self.kv_tokens
        held = sum(f.request.reserved_tokens for f in self._in_flight.values() if f.running)
        return EngineLoad(
            capacity=self.max_running,
            running=self._running,
            queued=len(self._waiting),
            kv_tokens_total=total,
            kv_tokens_free=max(0, total - held),
            accepting=self._accepting and not released and self._partial_weights is None,
            memory_released=released,
            policy_version=self.policy_version,
        )
