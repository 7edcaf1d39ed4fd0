"""The rollout engine protocol: what the proxy and the runtime may ask of any engine (native torch or SGLang).

Contract
- Requests are token ids in, token ids out (TITO): `GenerateRequest(request_id, execution_id, input_ids, params)`.
  The engine never tokenizes. Every output token comes with its behavior log-prob: log p of that token under the
  distribution it was actually drawn from (temperature, top-k, top-p applied; see `gyre.engine.sampling`).
- A request ends in exactly one way: `stop` (a stop id was sampled; it is the last output token), `length`
  (`max_new_tokens` reached), or `abort` (`abort(request_id)`, an expired `drain`, or `export_kv`). Ending by
  abort is a result, not an exception: the caller gets every token produced so far with its log-prob.
- Invalid input (empty prompt, out-of-vocabulary id, prompt + max_new_tokens beyond the context limit, bad
  sampling parameters) raises `ValueError` for that request only; the engine keeps serving the others.
- Methods that must wait for the engine's decode loop to reach a step boundary are `async`; `abort`,
  `stop_accepting`, `resume_accepting`, `release_export` and `load` only record intent or read state and return
  at once. Every state change happens between two decode steps, never inside one.
- Weights carry an integer `policy_version`; results report the versions that produced their tokens, which is
  what staleness accounting reads.
- Weights arrive whole (`update_weights`) or streamed in a weight-update session: `begin_update(version=)`, one
  `load_bucket` per bucket (bounded groups of whole tensors), `end_update(version=)`, or `abort_update()` when the
  publication fails mid-way. Nothing decodes from begin to end; requests in flight stay in flight and continue under
  the new weights. `UpdateSession` is the bookkeeping every engine here shares. docs/engine.md, "Streamed weight
  updates".
- Routed experts (mixture-of-experts models): a request with `return_routed_experts=True` gets, in its result and
  its stream's final chunk, the experts each fed position was routed to from `routed_experts_start` on (int16
  `[len(input_ids) + len(output_ids) - 1 - start, num_hidden_layers, top_k]`, -1 at dense layers and where the
  routing is unknown); None when not asked and for a dense model. docs/engine.md, "Routed experts".

Only dataclasses, exceptions and the `Engine` protocol live here: stdlib at import time (torch and numpy only for
type hints), so the proxy can import it without the model stack. The weight format `update_weights` takes,
`FlatWeights` and `TensorSpec`, lives in `gyre.models.flat_weights` (re-exported here on first access, which
imports torch). See `docs/engine.md`.
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from collections.abc import AsyncIterator, Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from gyre.config.checks import ConfigError, is_int, require, require_int, require_number

if TYPE_CHECKING:
    import numpy as np
    import torch

    from gyre.models.flat_weights import FlatWeights

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")
# Below this, logits / temperature can overflow fp32 to inf (NaN probabilities); greedy is temperature 0.
MIN_TEMPERATURE = 1e-5


class EngineUnavailableError(RuntimeError):
    """The engine does not take new requests now: it stopped accepting (draining) or released its memory."""


class EngineBusyError(RuntimeError):
    """An operation that needs an idle engine (`release_memory`) was called with requests in flight or KV pinned."""


class WeightUpdateSessionError(RuntimeError):
    """A weight-update call out of order: `begin_update` (or `update_weights`, `release_memory`) while a session is
    open, `load_bucket` or `end_update` without one."""


def _int_tuple(values, field_name: str) -> tuple[int, ...]:
    """A tuple of non-negative ints from any iterable of ints (lists, tuples, ranges); bools are rejected."""
    require(
        not isinstance(values, (str, bytes)) and hasattr(values, "__iter__"),
        field_name,
        values,
        "a sequence of non-negative integer token ids",
    )
    out = tuple(values)
    for value in out:
        require(
            is_int(value) and value >= 0,
            field_name,
            value,
            "non-negative integer token ids",
        )
    return out


def token_ids(values, field_name: str) -> array:
    """A private int32 array of token ids (>= 0) from an `array` (fast: one memcpy and a vectorized check) or any
    iterable of ints (checked one by one; bools are rejected). Long prompts arrive as arrays from the proxy, so
    a 700K-token request costs no per-token Python work here."""
    if isinstance(values, array):
        try:
            out = values[:] if values.typecode == "i" else array("i", values)
        except OverflowError:
            raise ConfigError(f"{field_name} has ids beyond int32: expected token ids in [0, 2**31)") from None
        if out and _min_int32(out) < 0:
            raise ConfigError(f"{field_name} has negative ids: expected non-negative integer token ids")
        return out
    try:
        return array("i", _int_tuple(values, field_name))
    except OverflowError:
        raise ConfigError(f"{field_name} has ids beyond int32: expected token ids in [0, 2**31)") from None


def starts_with(ids: array, prefix: array) -> bool:
    """Whether int32 array `ids` begins with int32 array `prefix`: one vectorized compare in place (a slice and
    `==` copy and walk per element, ~0.4 ms at 700K ids; this ~0.1 ms)."""
    n = len(prefix)
    if len(ids) < n:
        return False
    if not n:
        return True
    import numpy as np

    return bool(np.array_equal(np.frombuffer(ids, np.int32, n), np.frombuffer(prefix, np.int32, n)))


def _min_int32(ids: array) -> int:
    import numpy as np  # lazily: this module stays stdlib at import time

    return int(np.frombuffer(ids, dtype=np.int32).min())


def check_request(
    request: GenerateRequest, *, in_flight: Container[str], vocab_size: int | None, context_length: int | None
) -> None:
    """The checks every engine makes before queueing a request: a unique id, ids in the vocabulary, prompt +
    `max_new_tokens` within the context (a None limit is not checked), `0 <= routed_experts_start <= len(input_ids)`.
    `ValueError` naming what is wrong; the vocabulary check is vectorized, so a 700K-token prompt costs no per-token
    Python work."""
    if request.request_id in in_flight:
        raise ValueError(f"request_id={request.request_id!r} is already in flight: request ids must be unique")
    if vocab_size is not None:
        import numpy as np  # lazily: this module stays stdlib at import time

        ids = np.frombuffer(request.input_ids, dtype=np.int32)
        if int(ids.max()) >= vocab_size:
            bad = ids[ids >= vocab_size][:5].tolist()
            raise ValueError(f"input_ids={bad} are out of vocabulary: expected ids < {vocab_size}")
    start = request.routed_experts_start
    if not 0 <= start <= len(request.input_ids):
        raise ValueError(
            f"routed_experts_start={start} is not allowed: expected an integer in [0, len(input_ids)="
            f"{len(request.input_ids)}] (the first position whose routed experts are returned)"
        )
    total = request.reserved_tokens
    if context_length is not None and total > context_length:
        raise ValueError(
            f"prompt ({len(request.input_ids)}) + max_new_tokens ({request.params.max_new_tokens}) = {total} "
            f"exceeds the context limit {context_length}"
        )


def check_version(version, current: int) -> None:
    """`update_weights`' and `begin_update`'s version: an integer, not below the engine's current one."""
    if not is_int(version) or version < current:
        raise ValueError(f"version={version!r} is not allowed: expected an integer >= {current}")


MISSING_NAMES_SHOWN = 5  # end_update's refusal names this many of the parameters not loaded, and counts them all


@dataclass(eq=False)
class UpdateSession:
    """One open weight-update session (`begin_update` .. `end_update`), the bookkeeping every engine here keeps.

    `loaded`: the parameter names loaded since `begin_update` (what `end_update` checks for completeness);
    `touched`: whether anything may have been written into the weights (an engine that aborts a touched session
    holds a mix of two versions; an untouched one holds its old weights whole)."""

    version: int  # the version end_update installs
    loaded: set[str] = field(default_factory=set)
    touched: bool = False

    @classmethod
    def begin(cls, current: UpdateSession | None, version, policy_version: int, *, released: bool) -> UpdateSession:
        """The session `begin_update(version=)` opens, or its refusal: a session already open
        (`WeightUpdateSessionError`), released weights (`EngineUnavailableError`), a version that is not an integer
        or is below the current one (`ValueError`)."""
        if current is not None:
            raise WeightUpdateSessionError(
                f"version {version!r}: a weight-update session for version {current.version} is open "
                "(end_update or abort_update it first)"
            )
        if released:
            raise EngineUnavailableError("weights are released: resume_memory first, then update the weights")
        check_version(version, policy_version)
        return cls(version=version)

    @staticmethod
    def require(session: UpdateSession | None, call: str) -> UpdateSession:
        """The open session, or `WeightUpdateSessionError` naming `call`."""
        if session is None:
            raise WeightUpdateSessionError(f"{call} needs an open weight-update session: call begin_update first")
        return session

    def check_end(self, version, expected: Iterable[str] | None) -> None:
        """`end_update(version=)`'s refusals (`ValueError`; the session stays open): another version than the one
        begun, or a name of `expected` (every parameter of the model; None: not known, not checked) not loaded."""
        if not is_int(version) or version != self.version:
            raise ValueError(f"end_update(version={version!r}): the session began for version {self.version}")
        if expected is None:
            return
        missing = [name for name in expected if name not in self.loaded]
        if missing:
            shown = ", ".join(missing[:MISSING_NAMES_SHOWN]) + (", ..." if len(missing) > MISSING_NAMES_SHOWN else "")
            raise ValueError(
                f"end_update(version={version}): {len(missing)} parameters were not loaded since begin_update "
                f"({shown}): load them (load_bucket) or abort_update"
            )


def partial_weights_error(reason: str) -> EngineUnavailableError:
    """What an engine holding a mix of two versions (a touched session aborted) answers to a new request."""
    return EngineUnavailableError(
        f"the engine holds partial weights ({reason}): load a whole version first (a complete weight-update session, "
        "or update_weights of every parameter)"
    )


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to draw each output token. The filters apply in this order: temperature, top-k, top-p."""

    temperature: float = 1.0  # logits are divided by it; 0 = greedy (argmax). RL should sample with > 0.
    top_p: float = 1.0  # nucleus: keep the smallest top set whose probability reaches top_p; 1 = off
    top_k: int = 0  # keep the k most likely tokens (ties with the k-th kept); 0 = off
    max_new_tokens: int = 256  # the request ends with finish reason "length" after this many output tokens
    stop_token_ids: tuple[int, ...] = ()  # sampling one ends the request ("stop"); it is kept as the last output
    seed: int | None = None  # None: torch's global RNG. Set: tokens are a function of (weights, prompt, params,
    # seed), whatever is batched beside the request, and a continuation (prompt + outputs so far) goes on alike

    def __post_init__(self) -> None:
        require_number("temperature", self.temperature, ge=0, note="0 = greedy")
        require(
            self.temperature == 0 or self.temperature >= MIN_TEMPERATURE,
            "temperature",
            self.temperature,
            f"0 (greedy) or a number >= {MIN_TEMPERATURE}",
        )
        require_number("top_p", self.top_p, gt=0, le=1, note="1 = off")
        require_int("top_k", self.top_k, ge=0, note="0 = off")
        require_int("max_new_tokens", self.max_new_tokens, ge=1)
        require(
            self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**63),
            "seed",
            self.seed,
            "None or an integer in [0, 2**63)",
        )
        object.__setattr__(self, "stop_token_ids", _int_tuple(self.stop_token_ids, "stop_token_ids"))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filters(self) -> bool:
        """True when top-k or top-p removes tokens (for some vocabulary)."""
        return self.top_k > 0 or self.top_p < 1


def call_seed(run_seed: int, execution_id: str, input_ids: Iterable[int]) -> int:
    """A model call's `SamplingParams.seed` in [0, 2**63), from the run's seed, the call's execution and its prompt.

    What the proxy sends when `proxy.sampling.seed` is set (docs/proxy.md). A call's request id is random, so it
    cannot make a run repeatable; the execution id (the runtime's name for it) and the prompt (each turn's holds the
    earlier outputs) can, whatever order concurrent calls arrive in. Two calls of one execution with the same prompt
    get the same seed, hence (on the same weights) the same tokens. BLAKE2b of the three, its first 63 bits.
    """
    require(is_int(run_seed) and 0 <= run_seed < 2**63, "run_seed", run_seed, "an integer in [0, 2**63)")
    digest = hashlib.blake2b(digest_size=8)
    digest.update(run_seed.to_bytes(8, "little"))
    digest.update(execution_id.encode())
    digest.update(b"\0")
    digest.update(array("q", input_ids).tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """One model call: continue `input_ids` (the whole context, not a delta) for the execution `execution_id`.

    `execution_id` lets the engine reuse the KV of an earlier request of the same execution whose tokens are a
    prefix of these (and of a `KVExport` imported for it). Token ids are range-checked by the engine, which knows
    its vocabulary; `routed_experts_start` is checked against `input_ids` by `check_request`.
    """

    request_id: str  # unique among the engine's in-flight requests; the handle for abort and export_kv
    execution_id: str  # the execution (harness session) this call belongs to
    input_ids: array  # prompt token ids, at least one; any sequence of ints is accepted and kept as array("i")
    params: SamplingParams = field(default_factory=SamplingParams)
    return_routed_experts: bool = False  # MoE models: return the experts each fed position was routed to
    # (GenerateResult.routed_experts; SGLang's return_routed_experts)
    routed_experts_start: int = 0  # first position returned, in [0, len(input_ids)] (SGLang's
    # routed_experts_start_len): a turn extending an earlier call passes that call's prompt + outputs - 1

    def __post_init__(self) -> None:
        require(
            isinstance(self.request_id, str) and self.request_id != "",
            "request_id",
            self.request_id,
            "a non-empty string",
        )
        require(
            isinstance(self.execution_id, str) and self.execution_id != "",
            "execution_id",
            self.execution_id,
            "a non-empty string",
        )
        object.__setattr__(self, "input_ids", token_ids(self.input_ids, "input_ids"))
        require(len(self.input_ids) > 0, "input_ids", self.input_ids, "at least one prompt token")
        require(isinstance(self.params, SamplingParams), "params", self.params, "a SamplingParams")
        require(
            isinstance(self.return_routed_experts, bool),
            "return_routed_experts",
            self.return_routed_experts,
            "a bool",
        )
        require_int("routed_experts_start", self.routed_experts_start, ge=0)

    @property
    def reserved_tokens(self) -> int:
        """KV slots the request may need: prompt + `max_new_tokens`."""
        return len(self.input_ids) + self.params.max_new_tokens


@dataclass(frozen=True, kw_only=True)
class GenerateTimings:
    """Wall-clock seconds of one request, measured by the engine."""

    queued_s: float  # submission -> admitted into the running batch
    first_token_s: float  # submission -> first output token sampled (time to first token)
    total_s: float  # submission -> finished


@dataclass(frozen=True, kw_only=True)
class GenerateResult:
    """The outcome of one request; `output_logprobs[i]` is the behavior log-prob of `output_ids[i]`."""

    request_id: str
    output_ids: tuple[int, ...]  # sampled tokens; a stop id, if any, is the last one
    output_logprobs: tuple[float, ...]  # one per output token (see gyre.engine.sampling)
    finish_reason: FinishReason
    policy_version: int  # weights version that produced the first output token (at admission if none)
    last_policy_version: int  # version that produced the last token; differs only across a mid-request update
    prompt_tokens: int  # len(input_ids)
    cached_tokens: int  # prompt tokens whose KV was reused (prefix of the same execution or imported), not computed
    timings: GenerateTimings
    # Asked for (`return_routed_experts`) on a MoE model: int16 `[len(input_ids) + len(output_ids) - 1 - start,
    # num_hidden_layers, top_k]`, the experts of each position fed to the model from `routed_experts_start` on, -1 at
    # dense layers and where unknown. None otherwise. Not compared by `==` (an array has no single truth value).
    routed_experts: np.ndarray | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        require(self.finish_reason in FINISH_REASONS, "finish_reason", self.finish_reason, f"one of {FINISH_REASONS}")
        check_routed_experts(self.routed_experts)
        require(
            len(self.output_logprobs) == len(self.output_ids),
            "output_logprobs",
            f"{len(self.output_logprobs)} values",
            f"one per output token ({len(self.output_ids)})",
        )
        require(
            0 <= self.cached_tokens <= self.prompt_tokens,
            "cached_tokens",
            self.cached_tokens,
            f"between 0 and prompt_tokens={self.prompt_tokens}",
        )


@dataclass(frozen=True, kw_only=True)
class TokenChunk:
    """A piece of a streamed request. Concatenating the chunks' tokens gives `GenerateResult.output_ids`.

    The last chunk of a stream has `finish_reason` set (and may carry no tokens, e.g. after an abort); every other
    chunk has `finish_reason=None`.
    """

    request_id: str
    index: int  # position of token_ids[0] among the request's output tokens
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # behavior log-prob of each token
    policy_version: int  # weights version that produced these tokens
    finish_reason: FinishReason | None = None
    timings: GenerateTimings | None = None  # on the last chunk only
    cached_tokens: int | None = None  # on the last chunk only: as GenerateResult.cached_tokens
    routed_experts: np.ndarray | None = field(default=None, compare=False)  # last chunk only: as GenerateResult's

    def __post_init__(self) -> None:
        check_routed_experts(self.routed_experts)
        require(
            self.finish_reason is None or self.finish_reason in FINISH_REASONS,
            "finish_reason",
            self.finish_reason,
            f"None or one of {FINISH_REASONS}",
        )
        require(
            len(self.logprobs) == len(self.token_ids),
            "logprobs",
            f"{len(self.logprobs)} values",
            f"one per token ({len(self.token_ids)})",
        )


@dataclass(frozen=True, kw_only=True)
class KVExport:
    """One request's KV state, enough for another engine with the same weights to continue without prefill.

    `token_ids` are the tokens whose keys and values are held (the prompt and the output tokens already fed
    back); the last sampled token is usually not among them. The source keeps these blocks pinned until
    `release_export(request_id)`.
    """

    request_id: str
    execution_id: str
    token_ids: tuple[int, ...]  # tokens covered, in order; len == keys[i].shape[1]
    policy_version: int  # weights the KV was computed with; the destination must hold the same version
    keys: tuple[torch.Tensor, ...]  # per layer [num_key_value_heads, len(token_ids), head_dim], RoPE applied
    values: tuple[torch.Tensor, ...]  # per layer, same shape as keys
    output_ids: tuple[int, ...] = ()  # tokens the request generated here; token_ids is a prefix of prompt + these
    output_logprobs: tuple[float, ...] = ()  # their behavior log-probs (the same as in the source's result)
    # MoE models, when the source recorded them: int16 [len(token_ids), num_hidden_layers, top_k], the experts each
    # covered token was routed to (-1 at dense layers and where unknown), kept beside the KV for later requests'
    # routed_experts. None: not recorded (the destination returns -1 for these positions).
    routed_experts: torch.Tensor | None = field(default=None, compare=False)

    @property
    def nbytes(self) -> int:
        tensors = (*self.keys, *self.values, *(() if self.routed_experts is None else (self.routed_experts,)))
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True, kw_only=True)
class EngineLoad:
    """A snapshot for routing and scheduling; counts are requests, KV is in tokens."""

    capacity: int  # most requests decoded concurrently (running slots)
    running: int  # requests in the running batch
    queued: int  # requests accepted but waiting for a slot
    kv_tokens_total: int  # KV capacity in tokens (0 while memory is released)
    kv_tokens_free: int  # not held by running requests, pinned exports or the prefix cache's non-evictable part
    accepting: bool  # False after stop_accepting / while memory is released
    memory_released: bool
    policy_version: int


def check_routed_experts(routed) -> None:
    """A result's or chunk's `routed_experts`: None or a 3-D int16 array (checked without importing numpy)."""
    if routed is not None and (getattr(routed, "ndim", None) != 3 or str(getattr(routed, "dtype", "")) != "int16"):
        kind = f"{getattr(routed, 'dtype', type(routed).__name__)} {list(getattr(routed, 'shape', ()))}"
        raise ConfigError(
            f"routed_experts={kind} is not allowed: expected None or an int16 numpy array "
            "[positions, num_hidden_layers, top_k]"
        )


async def drain_in_flight(
    idle: asyncio.Event,
    in_flight: Callable[[], Iterable[str]],
    abort: Callable[[str], bool],
    abort_after_s: float | None,
) -> None:
    """The common `drain` of an engine that already stopped accepting: wait until `idle` is set; with a deadline,
    abort whatever is still in flight when it passes (callers get partial outputs), then wait for idle."""
    if abort_after_s is None:
        await idle.wait()
        return
    try:
        await asyncio.wait_for(idle.wait(), abort_after_s)
    except asyncio.TimeoutError:  # not the builtin TimeoutError on Python 3.10
        for request_id in list(in_flight()):
            abort(request_id)
        await idle.wait()


class AcceptingLifecycle:
    """`stop_accepting`, `resume_accepting` and `drain` as every engine here implements them (mixin).

    The engine keeps `_accepting` (checked when a request arrives), `_idle` (an `asyncio.Event` set whenever
    nothing is in flight) and `_in_flight_ids()`; `drain` stops accepting and waits for idle, aborting what is
    still in flight after `abort_after_s` (`drain_in_flight`)."""

    _accepting: bool
    _idle: asyncio.Event

    def _in_flight_ids(self) -> Iterable[str]:
        raise NotImplementedError  # each engine says which request ids are in flight

    def stop_accepting(self) -> None:
        self._accepting = False

    def resume_accepting(self) -> None:
        self._accepting = True

    async def drain(self, *, abort_after_s: float | None = None) -> None:
        self.stop_accepting()
        await drain_in_flight(self._idle, self._in_flight_ids, self.abort, abort_after_s)


@runtime_checkable
class Engine(Protocol):
    """A rollout engine. Implementations: the native torch engine; the SGLang adapter (GPU clusters)."""

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Run one request to its end and return all its tokens with behavior log-probs.

        Raises `ValueError` (bad input, duplicate in-flight `request_id`) or `EngineUnavailableError` (not
        accepting, memory released) before anything is queued. An aborted request returns normally with
        `finish_reason="abort"` and the tokens produced so far. Cancelling the awaiting task aborts the request.
        """
        ...

    def generate_stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """Like `generate`, but yield tokens as they are sampled (implementations are `async def` generators).

        The same errors are raised on the first `__anext__`. The last chunk carries the finish reason; closing the
        iterator early (`aclose()`, leaving an `async for`) aborts the request.
        """
        ...

    def abort(self, request_id: str) -> bool:
        """Ask the request to end at the next step boundary; its `generate` returns `finish_reason="abort"`.

        Returns True if the request was queued or running (a queued one ends with no tokens), False if the id is
        unknown or already finished (abort is idempotent and never raises for an unknown id). An abort also
        releases a pinned export of that request id.
        """
        ...

    def stop_accepting(self) -> None:
        """New `generate` calls raise `EngineUnavailableError` from now on; queued and running requests go on."""
        ...

    def resume_accepting(self) -> None:
        """Undo `stop_accepting` (e.g. when a cell returns to the rollout role)."""
        ...

    async def drain(self, *, abort_after_s: float | None = None) -> None:
        """Stop accepting, then return once no request is queued or running (each finishes normally).

        With `abort_after_s`, requests still in flight after that many seconds are aborted (their callers get
        `finish_reason="abort"` and their partial output), so a role transition has a bounded wait.
        """
        ...

    async def release_memory(self, *, weights: bool = True, kv: bool = True) -> None:
        """Free device memory of the weights and/or the KV cache (the prefix cache is dropped with it).

        The engine must be idle: raises `EngineBusyError` if any request is queued or running, or an export is
        still pinned. While released, `generate` raises `EngineUnavailableError` and `load()` reports it.
        """
        ...

    async def resume_memory(self, *, weights: bool = True, kv: bool = True) -> None:
        """Reallocate what `release_memory` freed; weights come back as they were (same version) unless
        `update_weights` was called in between, and the engine accepts again unless `stop_accepting` is in force."""
        ...

    async def update_weights(self, weights: Mapping[str, torch.Tensor] | FlatWeights, *, version: int) -> None:
        """Copy new weights in by HF parameter name (all of them or a subset, e.g. one bucket) and set `version`.

        Applied atomically between two decode steps. In-flight requests are not aborted: they keep their KV and
        continue under the new weights (each token's log-prob is still the exact behavior log-prob; the result's
        `last_policy_version` shows the switch). Callers that want no mixing drain first. The prefix cache of
        finished requests is dropped (KV of old weights is not reused). Raises `ValueError` for an unknown name,
        a wrong shape or dtype size, or `version` lower than the current one (nothing is applied then), and
        `EngineUnavailableError` while the weights are released (resume first, then update: SGLang's order).
        Within the engine it is `begin_update`, one `load_bucket`, `end_update`, without the completeness check;
        `WeightUpdateSessionError` while a session is open.
        """
        ...

    async def begin_update(self, *, version: int) -> None:
        """Open a weight-update session for `version` (streamed publication: then `load_bucket` per bucket, then
        `end_update`). From here to `end_update` (or `abort_update`) the engine decodes nothing: requests in flight
        stay in flight, new ones queue, aborts still end requests; after `end_update` they continue under the new
        weights, as across `update_weights`.

        Refuses before anything changes: a session already open (`WeightUpdateSessionError`), released weights
        (`EngineUnavailableError`), `version` not an integer or below the current one (`ValueError`).
        """
        ...

    async def load_bucket(self, bucket: FlatWeights | Mapping[str, torch.Tensor]) -> None:
        """Copy one bucket (whole tensors by HF parameter name) into the weights, inside the open session.

        Every tensor is checked (known name, shape, element size) before any is copied: a bad bucket raises
        `ValueError` (`TypeError` for a value that is not a tensor) and applies nothing of that bucket; the session
        stays open with the buckets loaded before. Outside a session: `WeightUpdateSessionError`. SGLang loads
        tensor by tensor and knows no shapes ahead: there a refused bucket may be partly applied (docs/sglang.md).
        """
        ...

    async def end_update(self, *, version: int) -> None:
        """Close the session: set `policy_version = version`, drop the prefix cache (KV of old weights is not reused),
        resume decoding.

        Refuses with `ValueError` naming what is missing (the first few names and the count) unless every parameter of
        the model was loaded since `begin_update`, or when `version` is not the one begun; the engine then stays in
        the session, not decoding (load the rest, or `abort_update`). Without a session: `WeightUpdateSessionError`.
        An engine that cannot know its parameter names (the scripted one; SGLang's adapter unless given them) does
        not check completeness.
        """
        ...

    async def abort_update(self) -> None:
        """End the session without a version change (a publication that failed mid-way); no session: nothing happens.

        Nothing loaded yet: the engine goes on as before the session. Otherwise it keeps the partial weights it has
        (a mix of two versions), aborts the requests in flight (their callers get `finish_reason="abort"` with their
        tokens so far, all from the old weights) and refuses new ones with `EngineUnavailableError` (`load()` says
        not accepting) until a whole version is loaded (a complete session, or `update_weights` of every
        parameter): the caller fails the run or reloads.
        """
        ...

    async def export_kv(self, request_id: str) -> KVExport:
        """End a running request here and hand over its KV, pinned until `release_export(request_id)`.

        The request's `generate` returns `finish_reason="abort"` with its tokens so far; the same tokens are in
        the export. Raises `KeyError` if the request is not running. To continue elsewhere: `import_kv(export)`
        on the destination, then `generate` with `input_ids = prompt + output so far` and the remaining budget;
        the destination prefills only the tokens not in `export.token_ids`.
        """
        ...

    async def import_kv(self, export: KVExport) -> None:
        """Install an exported KV so the next request of `export.execution_id` extending `export.token_ids` reuses it.

        Raises `ValueError` if the layout (layers, KV heads, head_dim, dtype) or `policy_version` differs from this
        engine's, or if there is no free KV for it.
        """
        ...

    def release_export(self, request_id: str) -> bool:
        """The destination confirmed the import: unpin the exported KV. Returns False if nothing was pinned."""
        ...

    def load(self) -> EngineLoad:
        """Current capacity and load (cheap; no device sync)."""
        ...


def __getattr__(name: str):
    """`FlatWeights` and `TensorSpec` live in `gyre.models.flat_weights` (torch); re-exported here on first access,
    so that importing the protocol stays stdlib-only (PEP 562)."""
    if name in ("FlatWeights", "TensorSpec"):
        from gyre.models import flat_weights

        return getattr(flat_weights, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
