"""The native rollout engine: `DecoderLM` behind the `Engine` protocol, with continuous batching on asyncio.

Contract (beyond `gyre.engine.protocol`)
- The model is the shared `gyre.models.decoder.DecoderLM`; the engine applies its inference stacking to it in place
  (`gyre.engine.decode.stack_projections`: q|k|v and gate|up one matmul each; names and state_dict unchanged).
- One scheduler task per engine, started by the first request on the running event loop. Each iteration is one
  step: finish aborted requests, admit queued requests (prefill one at a time, first token sampled from the
  prefill logits), then one batched decode of every running request. A step is synchronous (it blocks the event
  loop while torch computes), so every other coroutine of the engine runs between two steps: that is how
  `update_weights`, `export_kv`, `release_memory` get "between two decode steps" without a lock.
- KV: each request owns a buffer of `len(input_ids) + max_new_tokens` token slots per layer, allocated at
  admission and filled in place. Admission holds the sum of running buffers within `max_tokens_in_flight`.
  Decode gathers the running caches into one batch buffer (`_BatchKV`) kept across steps while the running set
  is unchanged: each step the model writes every row's new keys and values into one shared column in place; a
  mask per row hides the columns that are not the row's; positions are explicit, so a row's result does not
  depend on its neighbours except for float reduction order. The decoded tokens are written back to the
  requests' buffers (the KV of record) before the batch is dropped or a request finishes or is exported.
  Trade-off: a gather of O(batch x longest context) bytes when the running set changes (and every 64 steps),
  and a second copy of the running KV. Paged attention would avoid both; correctness first.
- Prefix reuse: when a request finishes, its buffer (the KV of every fed token: prompt + outputs but the last) is
  kept for its execution, one entry per execution, evicted oldest first when admission needs room. A request of
  the same execution reuses the longest common token prefix (at most `len(input_ids) - 1`: the last prompt token
  is always computed, its logits sample the first output) and reports it in `cached_tokens`. `import_kv`
  installs an export as such an entry. KV of a request that spanned a weight update is not kept (mixed versions).
- Memory accounting (`memory_bytes`): bytes of the tensors the engine holds on its device, counted as
  `numel * element_size` of the live parameters and KV buffers (prefix entries and pinned exports included).
  `release_memory(weights=True)` moves the parameters to a host copy (on a CPU device the copy is the same
  storage, so process RAM does not drop; the model's live parameters do) and leaves empty tensors in the model.
- Sampling: one `sample_next` per step over the batch with one `SamplingParams` per row and each row's position of
  the token drawn (`len(fed_ids)`), so a seeded request's tokens are a function of (weights, prompt, params, seed):
  the same alone, in any batch, in any admission order, and across `export_kv`/`import_kv` or a continuation.
- Routed experts (MoE models, `GenerateRequest.return_routed_experts`): the prefill and decode forwards ask the
  model for its routing (`return_routed_experts=True`) only when a request in them wants it, so the dense path and
  requests that do not ask cost nothing. A request that asks keeps an int16 `[capacity, num_hidden_layers, top_k]`
  record in its `KVBuffer`, beside the KV of the same positions, so a prefix entry and a `KVExport` carry the
  routing of the tokens they cover; a reused prefix's positions were not computed here, their routing comes from
  that record. Positions with no known routing (a prefix or an import without a record: its request did not ask,
  or the export came from an engine that kept none; a request aborted while queued) are -1 at every layer.
- Holding the step loop, for tests whose outcome must not depend on when a request ends: `hold()` stops the loop at
  its next step boundary (nothing is admitted, nothing decodes: running requests stay in flight with the tokens they
  have), `release(steps=k)` lets it run exactly `k` more steps and hold again (`release()`: go on for good), and
  `await until_held()` returns once the loop waits at the hold. Held, the engine still aborts (abort, drain's
  deadline), exports KV and queues new requests. A step is one decode token per running request, and an admitted
  request gets its first token from prefill in the same step: `k` steps from held-and-queued give `k + 1` tokens.
- Weights: `update_weights` is `begin_update`, one `load_bucket` and `end_update` without the completeness check. From
  `begin_update` the step loop waits at its step boundary (it still ends aborted requests; new ones queue) until
  `end_update` or `abort_update`. A bucket is checked whole before any tensor is copied, in place, into the parameters
  (so the compiled decode's collected tensors stay valid). `end_update` needs every name of `named_parameters()`
  loaded since `begin_update`. An aborted session that loaded anything leaves the weights mixed: the requests in
  flight are aborted and new ones refused until a whole version is loaded.
- `compile_decode=True` runs the batched decode step as `torch.compile(decode_forward)` (gyre.engine.decode): the
  same tokens, log-probs equal within float noise (1e-5 fp32); compiles per new batch shape (docs/engine.md).
See `docs/engine.md` ("Native engine").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gyre.engine.decode import DecodeWeights, decode_forward, decode_weights, stack_projections
from gyre.engine.protocol import (
    AcceptingLifecycle,
    EngineBusyError,
    EngineLoad,
    EngineUnavailableError,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    GenerateTimings,
    KVExport,
    TokenChunk,
    UpdateSession,
    WeightUpdateSessionError,
    check_request,
    partial_weights_error,
)
from gyre.engine.sampling import sample_next
from gyre.models.decoder import DecoderLM, KVCache
from gyre.models.flat_weights import FlatWeights, unflatten_weights

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)


class KVBuffer:
    """One sequence's keys and values: `[num_layers, num_key_value_heads, capacity, head_dim]` each, filled up to
    `length`. All layers in one tensor, so moving a sequence in or out of a batch is one copy, not one per layer.

    `routed_CLK` (MoE models, when a request asked for its routing): int16 `[capacity, num_hidden_layers, top_k]`,
    the experts each position was routed to, -1 at dense layers and where unknown; written by the engine as it
    feeds positions (it may run ahead of `length` while decoded KV waits in the batch buffer)."""

    def __init__(
        self,
        keys_LKCD: torch.Tensor,
        values_LKCD: torch.Tensor,
        length: int = 0,
        routed_CLK: torch.Tensor | None = None,
    ):
        self.keys_LKCD = keys_LKCD
        self.values_LKCD = values_LKCD
        self.length = length
        self.routed_CLK = routed_CLK

    @classmethod
    def empty(
        cls, model: DecoderLM, capacity: int, device: torch.device, dtype: torch.dtype, *, routed: bool = False
    ) -> KVBuffer:
        """Zeroed KV of `capacity` tokens; with `routed`, a routing record of -1 (unknown) beside it."""
        config = model.config
        shape = (config.num_hidden_layers, config.num_key_value_heads, capacity, config.head_dim)
        routed_CLK = None
        if routed:
            routed_shape = (capacity, config.num_hidden_layers, config.num_experts_per_tok)
            routed_CLK = torch.full(routed_shape, -1, dtype=torch.int16, device=device)
        keys, values = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
        return cls(keys, values, routed_CLK=routed_CLK)

    @property
    def capacity(self) -> int:
        return self.keys_LKCD.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the keys, values and routing record."""
        tensors = (self.keys_LKCD, self.values_LKCD, *(() if self.routed_CLK is None else (self.routed_CLK,)))
        return sum(t.numel() * t.element_size() for t in tensors)

    def append(self, keys_LKTD: torch.Tensor, values_LKTD: torch.Tensor) -> None:
        T = keys_LKTD.shape[2]
        assert self.length + T <= self.capacity, "KV buffer overflow: admission sized it too small"
        self.keys_LKCD[:, :, self.length : self.length + T] = keys_LKTD
        self.values_LKCD[:, :, self.length : self.length + T] = values_LKTD
        self.length += T

    def copy_prefix_from(self, other: KVBuffer, length: int) -> None:
        """The first `length` positions of `other`: KV, and routing where both keep a record (else it stays -1)."""
        self.length = 0
        self.append(other.keys_LKCD[:, :, :length], other.values_LKCD[:, :, :length])
        if self.routed_CLK is not None and other.routed_CLK is not None:
            self.routed_CLK[:length] = other.routed_CLK[:length]

    def room(self) -> KVCache:
        """Per-layer `[1, K, capacity, D]` views of the whole buffer, for a forward with `kv_cache_length`."""
        return KVCache(tuple(self.keys_LKCD[:, None].unbind(0)), tuple(self.values_LKCD[:, None].unbind(0)))


@dataclass
class _Prefix:
    """Reusable KV of one execution: `buffer` holds the keys and values of `token_ids`."""

    token_ids: tuple[int, ...]
    buffer: KVBuffer


class _BatchKV:
    """The running requests' KV gathered for decode: `[num_layers, B, num_key_value_heads, columns, head_dim]` keys
    and values, a bool `mask_BS` of the columns each row attends to, and each row's next position and token id.

    Row b's first `gathered[b]` tokens (its buffer at the gather) sit at columns 0..gathered[b]-1, zeros up to
    `start`; the tokens decoded since sit at columns start, start+1, ..., one column per step, shared by all rows
    (the model writes them in place: `kv_cache_length=next_column`). The gap between is masked out; positions
    are explicit and keys carry their RoPE rotation, so where a key sits does not change the attention (up to
    float summation order). Kept across decode steps while the running set is unchanged, so a step writes one
    column and no per-row copy; rebuilt (with up to `GROW` free columns) when the set changes or the columns run
    out. The requests' `KVBuffer`s stay the KV of record: `write_back` copies the tokens decoded since the gather
    into them, and the engine calls it before a row's buffer is read (finish, export) or the batch is dropped.
    """

    GROW = 64  # free columns per rebuild: one gather per 64 steps of an unchanged batch

    def __init__(self, rows: list[_Request], device: torch.device, column_multiple: int = 1):
        self.rows = list(rows)
        self.gathered = [e.buffer.length for e in rows]
        self.start = self.next_column = max(self.gathered)
        # Each row ends (and the set changes) before it outgrows its buffer, so no row needs more free columns.
        free = min(e.buffer.capacity - e.buffer.length for e in rows)
        first = rows[0].buffer.keys_LKCD
        L, K, _, D = first.shape
        columns = self.start + min(free, self.GROW)
        # Rounded up (compiled decode: shapes repeat, so fewer recompilations). Columns past a row's room are never
        # reached: the row finishes first, and only decoded columns are written back.
        columns = -(-columns // column_multiple) * column_multiple
        shape = (L, len(rows), K, columns, D)
        self.keys_LBKSD = torch.zeros(shape, dtype=first.dtype, device=device)
        self.values_LBKSD = torch.zeros(shape, dtype=first.dtype, device=device)
        for b, e in enumerate(rows):
            self.keys_LBKSD[:, b, :, : self.gathered[b]] = e.buffer.keys_LKCD[:, :, : self.gathered[b]]
            self.values_LBKSD[:, b, :, : self.gathered[b]] = e.buffer.values_LKCD[:, :, : self.gathered[b]]
        self.past = KVCache(tuple(self.keys_LBKSD.unbind(0)), tuple(self.values_LBKSD.unbind(0)))
        gathered_B = torch.tensor(self.gathered, device=device)
        self.mask_BS = torch.arange(shape[3], device=device)[None, :] < gathered_B[:, None]
        self.positions_B1 = gathered_B[:, None]  # the position of each row's next token
        self.ids_B1 = torch.tensor([[e.next_token] for e in rows], dtype=torch.long, device=device)
        self.written = 0  # decoded columns already copied back into the rows' buffers

    def fits(self, rows: list[_Request]) -> bool:
        """True if this holds exactly `rows`' KV and has a free column."""
        return (
            len(rows) == len(self.rows)
            and all(a is b for a, b in zip(rows, self.rows, strict=True))
            and self.next_column < self.keys_LBKSD.shape[3]
        )

    def write_back(self) -> None:
        """Copy the tokens decoded since the last write-back into each row's `KVBuffer` (idempotent)."""
        end = self.next_column - self.start
        if end == self.written:
            return
        columns = slice(self.start + self.written, self.start + end)
        for b, e in enumerate(self.rows):
            assert e.buffer.length == self.gathered[b] + self.written, "a batched row's buffer changed underneath"
            e.buffer.append(self.keys_LBKSD[:, b, :, columns], self.values_LBKSD[:, b, :, columns])
        self.written = end


@dataclass(eq=False)
class _Request:
    request: GenerateRequest
    future: asyncio.Future
    chunks: asyncio.Queue | None  # set for streamed requests
    submitted: float
    buffer: KVBuffer | None = None
    fed_ids: list[int] = field(default_factory=list)  # tokens whose KV is in `buffer`
    next_token: int | None = None  # sampled, not yet fed
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    first_version: int = 0
    last_version: int = 0
    admitted: float | None = None
    first_token: float | None = None
    abort_requested: bool = False
    routed_experts: np.ndarray | None = None  # the result's routing, taken once when it ends (`_routed_experts`)

    @property
    def reserved_tokens(self) -> int:
        return self.request.reserved_tokens

    @property
    def records_routing(self) -> bool:
        return self.buffer is not None and self.buffer.routed_CLK is not None


class NativeEngine(AcceptingLifecycle):
    """Continuous-batching engine over a `DecoderLM`; implements `gyre.engine.protocol.Engine`."""

    COMPILED_COLUMN_MULTIPLE = 64  # compiled decode: batch KV columns rounded up to this (repeating shapes)

    def __init__(
        self,
        model: DecoderLM,
        *,
        max_running: int = 16,
        max_tokens_in_flight: int | None = None,
        device: torch.device | str | None = None,
        policy_version: int = 0,
        compile_decode: bool = False,
    ):
        """`compile_decode`: run each batched decode step through `torch.compile(decode_forward)` (inductor)
        instead of the module forward: fewer, fused kernels per step (see docs/engine.md, "Throughput"). The first
        steps of each new batch shape compile (seconds; cached on disk by inductor); prefill stays eager. On CPU
        inductor needs a C++ compiler; without one the first decode step fails (and with it the engine)."""
        if not isinstance(max_running, int) or max_running < 1:
            raise ValueError(f"max_running={max_running!r} is not allowed: expected an integer >= 1")
        config = model.config
        if compile_decode and config.num_experts:
            raise ValueError(
                "compile_decode=True is not available for a mixture-of-experts model (the compiled decode step is "
                "dense); leave it off"
            )
        if max_tokens_in_flight is None:
            max_tokens_in_flight = max_running * config.max_position_embeddings
        if not isinstance(max_tokens_in_flight, int) or max_tokens_in_flight < 2:
            raise ValueError(f"max_tokens_in_flight={max_tokens_in_flight!r} is not allowed: expected an integer >= 2")
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = stack_projections(model.to(self.device).eval())  # q|k|v and gate|up: one matmul each
        self.dtype = next(model.parameters()).dtype
        self._moe = config.num_experts > 0  # routing can be recorded (GenerateRequest.return_routed_experts)
        self.max_running = max_running
        self.max_tokens_in_flight = max_tokens_in_flight
        self.policy_version = policy_version
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._by_id: dict[str, _Request] = {}
        self._prefix: OrderedDict[str, _Prefix] = OrderedDict()  # execution_id -> reusable KV, oldest first
        self._pinned: dict[str, KVExport] = {}
        self._batch_kv: _BatchKV | None = None  # decode's gathered KV of the running set (see _BatchKV)
        self._accepting = True
        self._weights_released = False
        self._kv_released = False
        self._weight_backup: dict[str, torch.Tensor] = {}
        self._session: UpdateSession | None = None  # begin_update .. end_update: the step loop does not step
        self._partial_weights: str | None = None  # why the weights are a mix of two versions (an aborted session)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._holding = False  # hold(): the loop waits at its next step boundary
        self._steps_before_hold: int | None = None  # release(steps=k): steps to run before holding again
        self._at_hold = asyncio.Event()  # set while the loop waits at the hold (until_held)
        self._task: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._decode_forward = torch.compile(decode_forward) if compile_decode else None
        # The model's tensors for `decode_forward`, collected once: parameters are replaced only by
        # release_memory/resume_memory (which drop this); update_weights writes them in place.
        self._decode_weights: DecodeWeights | None = None

    # ----------------------------------------------------------------- requests

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        entry = self._submit(request, stream=False)
        try:
            return await entry.future
        except asyncio.CancelledError:
            self.abort(request.request_id)
            raise

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        entry = self._submit(request, stream=True)
        finished = False
        try:
            while True:
                chunk = await entry.chunks.get()
                if isinstance(chunk, BaseException):
                    raise chunk
                yield chunk
                if chunk.finish_reason is not None:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request.request_id)

    def _submit(self, request: GenerateRequest, *, stream: bool) -> _Request:
        if not isinstance(request, GenerateRequest):
            raise TypeError(f"request must be a GenerateRequest, got {type(request).__name__}")
        if self._error is not None:
            raise EngineUnavailableError(f"the engine's scheduler failed: {self._error!r}")
        if not self._accepting:
            raise EngineUnavailableError("the engine stopped accepting requests (drain or stop_accepting)")
        if self._weights_released or self._kv_released:
            raise EngineUnavailableError("the engine's memory is released: call resume_memory first")
        if self._partial_weights is not None:
            raise partial_weights_error(self._partial_weights)
        self._validate(request)
        loop = asyncio.get_running_loop()
        entry = _Request(
            request=request,
            future=loop.create_future(),
            chunks=asyncio.Queue() if stream else None,
            submitted=time.monotonic(),
        )
        self._by_id[request.request_id] = entry
        self._waiting.append(entry)
        self._idle.clear()
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name="gyre-native-engine")
        return entry

    def _validate(self, request: GenerateRequest) -> None:
        config = self.model.config
        check_request(
            request,
            in_flight=self._by_id,
            vocab_size=config.vocab_size,
            context_length=config.max_position_embeddings,
        )
        if request.reserved_tokens > self.max_tokens_in_flight:
            raise ValueError(
                f"prompt + max_new_tokens = {request.reserved_tokens} exceeds the engine's KV budget of "
                f"{self.max_tokens_in_flight} tokens (engine.max_total_tokens): it could never be admitted"
            )

    def abort(self, request_id: str) -> bool:
        if self._pinned.pop(request_id, None) is not None:  # an abort also releases a pinned export of this id
            self._wake.set()  # a request waiting for room may fit now
        entry = self._by_id.get(request_id)  # finished requests leave _by_id
        if entry is None:
            return False
        entry.abort_requested = True
        self._wake.set()
        return True

    # ----------------------------------------------------------------- accepting / drain

    def _in_flight_ids(self) -> list[str]:
        return list(self._by_id)

    async def close(self) -> None:
        """Abort everything in flight and stop the scheduler task (not part of the protocol)."""
        for request_id in list(self._by_id):
            self.abort(request_id)
        await self._idle.wait()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # ----------------------------------------------------------------- holding (tests)

    def hold(self) -> None:
        """Stop the step loop at its next step boundary (module docstring, "Holding"). Call it on the engine's loop
        (`ServerThread.call` from another thread)."""
        self._holding, self._steps_before_hold = True, None

    def release(self, steps: int | None = None) -> None:
        """Let the held loop go on: for good, or for exactly `steps` steps and then hold again."""
        if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
            raise ValueError(f"steps={steps!r} is not allowed: expected None or an integer >= 1")
        self._holding, self._steps_before_hold = False, steps
        self._at_hold.clear()
        self._wake.set()

    async def until_held(self) -> None:
        """Return once the loop waits at the hold with a request in flight (bound it with a timeout)."""
        await self._at_hold.wait()

    # ----------------------------------------------------------------- memory

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of live tensors the engine holds: `weights` (model parameters), `kv` (running, prefix, pinned; the
        routing records kept beside the KV included)."""
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        kv = sum(e.buffer.nbytes for e in self._running if e.buffer is not None)
        kv += sum(p.buffer.nbytes for p in self._prefix.values())
        kv += sum(x.nbytes for x in self._pinned.values())
        return {"weights": weights, "kv": kv}

    def _check_idle(self, what: str) -> None:
        if self._by_id or self._pinned:
            raise EngineBusyError(
                f"{what} needs an idle engine: {len(self._by_id)} requests in flight, "
                f"{len(self._pinned)} exports pinned (drain and release_export first)"
            )

    async def release_memory(self, *, weights: bool = True, kv: bool = True) -> None:
        self._check_idle("release_memory")
        if self._session is not None:
            raise WeightUpdateSessionError("release_memory during a weight-update session: end or abort it first")
        if kv:
            self._prefix.clear()
            self._kv_released = True
        if weights and not self._weights_released:
            with torch.no_grad():
                for name, param in self.model.named_parameters():
                    host = param.data if param.device.type == "cpu" else param.data.to("cpu")
                    self._weight_backup[name] = host
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            self._weights_released = True
            self._decode_weights = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    async def resume_memory(self, *, weights: bool = True, kv: bool = True) -> None:
        if weights and self._weights_released:
            with torch.no_grad():
                for name, param in self.model.named_parameters():
                    param.data = self._weight_backup.pop(name).to(self.device)
            self._weights_released = False
            self._decode_weights = None
        if kv:
            self._kv_released = False

    # ----------------------------------------------------------------- weights

    async def update_weights(self, weights: Mapping[str, torch.Tensor] | FlatWeights, *, version: int) -> None:
        await self.begin_update(version=version)
        try:
            await self.load_bucket(weights)
        except BaseException:
            await self.abort_update()  # nothing of the refused bucket was applied: the engine goes on as it was
            raise
        self._end_update(self._session, version)  # a subset is allowed here (protocol)

    async def begin_update(self, *, version: int) -> None:
        self._session = UpdateSession.begin(
            self._session, version, self.policy_version, released=self._weights_released
        )

    async def load_bucket(self, bucket: Mapping[str, torch.Tensor] | FlatWeights) -> None:
        session = UpdateSession.require(self._session, "load_bucket")
        named = unflatten_weights(bucket) if isinstance(bucket, FlatWeights) else dict(bucket)
        params = dict(self.model.named_parameters())
        for name, tensor in named.items():  # check everything before applying anything
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"update_weights: {name} is a {type(tensor).__name__}, expected a torch.Tensor")
            if name not in params:
                raise ValueError(f"update_weights: unknown parameter name {name!r}")
            param = params[name]
            if tuple(tensor.shape) != tuple(param.shape) or tensor.element_size() != param.element_size():
                raise ValueError(
                    f"update_weights: {name} is {tensor.dtype} {tuple(tensor.shape)}, "
                    f"expected {param.dtype} {tuple(param.shape)}"
                )
        session.touched = session.touched or bool(named)
        with torch.no_grad():
            for name, tensor in named.items():
                params[name].copy_(tensor.to(device=self.device, dtype=params[name].dtype))
        session.loaded.update(named)

    async def end_update(self, *, version: int) -> None:
        session = UpdateSession.require(self._session, "end_update")
        session.check_end(version, [name for name, _ in self.model.named_parameters()])
        self._end_update(session, version)

    def _end_update(self, session: UpdateSession, version: int) -> None:
        if self._partial_weights is not None and session.loaded.issuperset(n for n, _ in self.model.named_parameters()):
            self._partial_weights = None  # a whole version again
        self.policy_version = version
        self._prefix.clear()  # KV computed with the old weights is not reused
        self._session = None
        self._wake.set()  # the step loop goes on

    async def abort_update(self) -> None:
        session, self._session = self._session, None
        if session is None:
            return
        if session.touched:  # a mix of two versions: nothing decodes on it (protocol)
            self._partial_weights = (
                f"the update to version {session.version} was aborted after {len(session.loaded)} tensors"
            )
            self._prefix.clear()
            for request_id in list(self._by_id):
                self.abort(request_id)
        self._wake.set()

    # ----------------------------------------------------------------- KV migration

    async def export_kv(self, request_id: str) -> KVExport:
        entry = self._by_id.get(request_id)
        if entry is None or entry not in self._running:
            raise KeyError(f"request {request_id!r} is not running on this engine")
        if self._batch_kv is not None:
            self._batch_kv.write_back()
        buffer = entry.buffer
        export = KVExport(
            request_id=request_id,
            execution_id=entry.request.execution_id,
            token_ids=tuple(entry.fed_ids),
            policy_version=self.policy_version,
            keys=tuple(buffer.keys_LKCD[:, :, : buffer.length].clone().unbind(0)),
            values=tuple(buffer.values_LKCD[:, :, : buffer.length].clone().unbind(0)),
            output_ids=tuple(entry.output_ids),
            output_logprobs=tuple(entry.output_logprobs),
            routed_experts=None if buffer.routed_CLK is None else buffer.routed_CLK[: buffer.length].clone(),
        )
        self._pinned[request_id] = export
        self._wake.set()  # a held loop looks again (the running set changed)
        self._running.remove(entry)
        self._finish(entry, "abort", keep_prefix=False)  # moved: not kept for prefix reuse here
        return export

    async def import_kv(self, export: KVExport) -> None:
        config = self.model.config
        expected = (config.num_key_value_heads, len(export.token_ids), config.head_dim)
        if len(export.keys) != config.num_hidden_layers or len(export.values) != config.num_hidden_layers:
            raise ValueError(f"import_kv: export has {len(export.keys)} layers, expected {config.num_hidden_layers}")
        for t in (*export.keys, *export.values):
            if tuple(t.shape) != expected or t.dtype != self.dtype:
                raise ValueError(f"import_kv: tensor {t.dtype} {tuple(t.shape)}, expected {self.dtype} {expected}")
        if export.policy_version != self.policy_version:
            raise ValueError(
                f"import_kv: export computed with policy_version={export.policy_version}, "
                f"this engine holds {self.policy_version}"
            )
        routed = export.routed_experts
        if routed is not None:
            routed_shape = (len(export.token_ids), config.num_hidden_layers, config.num_experts_per_tok)
            if not config.num_experts or tuple(routed.shape) != routed_shape or routed.is_floating_point():
                raise ValueError(
                    f"import_kv: routed_experts {routed.dtype} {tuple(routed.shape)}, expected "
                    + (f"an integer {routed_shape} tensor" if config.num_experts else "None (this model is dense)")
                )
        if self._kv_released:
            raise EngineUnavailableError("KV memory is released: resume_memory first")
        if len(export.token_ids) > self._free_tokens(evict=True):
            raise ValueError(f"import_kv: no free KV for {len(export.token_ids)} tokens")
        buffer = KVBuffer(torch.stack(export.keys).to(self.device), torch.stack(export.values).to(self.device))
        buffer.length = len(export.token_ids)
        if routed is not None:
            buffer.routed_CLK = routed.to(device=self.device, dtype=torch.int16)
        self._prefix.pop(export.execution_id, None)
        self._prefix[export.execution_id] = _Prefix(tuple(export.token_ids), buffer)

    def release_export(self, request_id: str) -> bool:
        released = self._pinned.pop(request_id, None) is not None
        if released:
            self._wake.set()  # a request waiting for room may fit now
        return released

    # ----------------------------------------------------------------- load

    def load(self) -> EngineLoad:
        released = self._weights_released or self._kv_released
        total = 0 if self._kv_released else self.max_tokens_in_flight
        return EngineLoad(
            capacity=self.max_running,
            running=len(self._running),
            queued=len(self._waiting),
            kv_tokens_total=total,
            kv_tokens_free=max(0, total - self._held_tokens()),
            accepting=self._accepting and not released and self._partial_weights is None,
            memory_released=released,
            policy_version=self.policy_version,
        )

    def _held_tokens(self) -> int:
        """Tokens not available to admission: running reservations and pinned exports (prefixes are evictable)."""
        return sum(e.reserved_tokens for e in self._running) + sum(len(x.token_ids) for x in self._pinned.values())

    def _free_tokens(self, *, evict: bool) -> int:
        free = self.max_tokens_in_flight - self._held_tokens()
        return free if evict else free - sum(p.buffer.capacity for p in self._prefix.values())

    # ----------------------------------------------------------------- scheduler

    async def _run(self) -> None:
        while True:
            if self._session is not None:  # a weight update is streaming in (begin_update): nothing decodes
                self._reap_aborts()
                self._wake.clear()
                await self._wake.wait()  # end_update, abort_update, an abort or a new request wakes it
                continue
            if self._holding:
                self._reap_aborts()  # held: aborts still end requests, nothing else moves
                if self._waiting or self._running:
                    self._at_hold.set()
                    self._wake.clear()
                    await self._wake.wait()  # release, abort, a new request or an export wakes it
                    self._at_hold.clear()
                    continue
            if not self._waiting and not self._running:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                self._step()
                self._count_step_before_hold()
            except Exception as error:  # fail every caller with the real error, then stop serving
                logger.exception("native engine step failed")
                self._error = error
                for entry in [*self._waiting, *self._running]:
                    self._fail(entry, error)
                self._waiting.clear()
                self._running.clear()
                self._batch_kv = None
                self._by_id.clear()
                self._idle.set()
                return
            if self._waiting and not self._running and self._free_tokens(evict=True) < self._waiting[0].reserved_tokens:
                # Blocked: nothing decodes and the next request does not fit next to the pinned exports. Wait for
                # what can change that (a release, an abort, a new request), not spin through empty steps.
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(0)  # step boundary: other coroutines of the engine run here

    def _count_step_before_hold(self) -> None:
        if self._steps_before_hold is not None:
            self._steps_before_hold -= 1
            if self._steps_before_hold == 0:
                self._holding, self._steps_before_hold = True, None

    def _reap_aborts(self) -> None:
        for entry in [e for e in self._waiting if e.abort_requested]:
            self._waiting.remove(entry)
            self._finish(entry, "abort", keep_prefix=False)
        for entry in [e for e in self._running if e.abort_requested]:
            self._running.remove(entry)
            self._finish(entry, "abort", keep_prefix=True)

    @torch.no_grad()
    def _step(self) -> None:
        self._reap_aborts()
        while self._waiting and len(self._running) < self.max_running:
            entry = self._waiting[0]
            if not self._make_room(entry.reserved_tokens):
                break
            self._waiting.popleft()
            if self._prefill(entry):
                self._running.append(entry)
        if self._running:
            self._decode()
        if not self._running:
            self._batch_kv = None

    def _make_room(self, tokens: int) -> bool:
        """Evict prefix entries (oldest first) until `tokens` fit next to the running reservations."""
        while self._free_tokens(evict=False) < tokens and self._prefix:
            self._prefix.popitem(last=False)
        return self._free_tokens(evict=False) >= tokens

    def _prefill(self, entry: _Request) -> bool:
        """Admit: reuse a prefix, compute the rest of the prompt, sample the first token. False if it finished."""
        request = entry.request
        prompt = list(request.input_ids)
        entry.admitted = time.monotonic()
        routed = request.return_routed_experts and self._moe
        entry.buffer = KVBuffer.empty(self.model, entry.reserved_tokens, self.device, self.dtype, routed=routed)
        prefix = self._prefix.pop(request.execution_id, None)
        reused = 0
        if prefix is not None:
            limit = min(len(prefix.token_ids), len(prompt) - 1)
            while reused < limit and prefix.token_ids[reused] == prompt[reused]:
                reused += 1
            if routed:
                reused = _routed_reuse(prefix.buffer.routed_CLK, request.routed_experts_start, reused)
            if reused:
                entry.buffer.copy_prefix_from(prefix.buffer, reused)
        entry.cached_tokens = reused
        entry.first_version = entry.last_version = self.policy_version
        ids_1T = torch.tensor([prompt[reused:]], dtype=torch.long, device=self.device)
        positions_1T = torch.arange(reused, len(prompt), device=self.device)[None]
        # The model writes the prompt's keys and values straight into the request's buffer, after the reused prefix.
        out = self.model(
            ids_1T,
            positions_1T,
            kv_cache=entry.buffer.room(),
            num_logits_to_keep=1,
            kv_cache_length=reused,
            return_routed_experts=routed,
        )
        logits_1TV = out[0]
        if routed:
            entry.buffer.routed_CLK[reused : len(prompt)] = out[2][0]
        entry.buffer.length = len(prompt)
        entry.fed_ids = list(prompt)
        # The first output sits at position len(prompt): a seeded request's draw there is its (seed, position) uniform.
        token_B, logp_B = sample_next(logits_1TV[:, -1], request.params, [len(prompt)])
        return not self._record(entry, int(token_B[0]), float(logp_B[0]))

    def _decode(self) -> None:
        """One token for every running request: forward over the batch KV (other rows' columns masked), sample."""
        batch = self._running
        if self._batch_kv is None or not self._batch_kv.fits(batch):
            if self._batch_kv is not None:
                self._batch_kv.write_back()
            self._batch_kv = _BatchKV(
                batch, self.device, self.COMPILED_COLUMN_MULTIPLE if self._decode_forward is not None else 1
            )
        gathered = self._batch_kv
        S = gathered.next_column
        if self._decode_forward is not None:
            # Attends to the masked-in columns of the whole buffer and to itself; the new keys/values come back.
            logits_BV, keys_LBK1D, values_LBK1D = self._decode_forward(
                gathered.ids_B1,
                gathered.positions_B1,
                gathered.keys_LBKSD,
                gathered.values_LBKSD,
                gathered.mask_BS,
                self._current_decode_weights(),
            )
            gathered.keys_LBKSD[:, :, :, S] = keys_LBK1D[:, :, :, 0]
            gathered.values_LBKSD[:, :, :, S] = values_LBK1D[:, :, :, 0]
            gathered.mask_BS[:, S] = True
        else:
            gathered.mask_BS[:, S] = True  # every row's new token goes to column S, and attends to itself
            # rows that record routing (only requests that asked, on a MoE model: a dense model checks nothing)
            recording = [b for b, e in enumerate(batch) if e.records_routing] if self._moe else []
            out = self.model(
                gathered.ids_B1,
                gathered.positions_B1,
                kv_cache=gathered.past,
                attention_mask=gathered.mask_BS[:, None, None, : S + 1],
                kv_cache_length=S,
                return_routed_experts=bool(recording),
            )
            logits_BV = out[0][:, -1]
            if recording:
                routed_B1LK = out[2]
                for b in recording:  # the token fed at position len(fed_ids), appended below
                    batch[b].buffer.routed_CLK[len(batch[b].fed_ids)] = routed_B1LK[b, 0]
        gathered.next_column += 1
        gathered.positions_B1 += 1
        for e in batch:
            e.fed_ids.append(e.next_token)
        # positions_B1 now holds each row's position of the token drawn (its len(fed_ids)): the seeded counter.
        tokens_B, logps_B = sample_next(logits_BV, [e.request.params for e in batch], gathered.positions_B1[:, 0])
        gathered.ids_B1 = tokens_B[:, None]
        tokens, logps = tokens_B.tolist(), logps_B.tolist()
        finished = [e for b, e in enumerate(batch) if self._record(e, tokens[b], logps[b])]
        for e in finished:
            self._running.remove(e)

    def _current_decode_weights(self) -> DecodeWeights:
        if self._decode_weights is None:
            self._decode_weights = decode_weights(self.model, self.device)
        return self._decode_weights

    def _record(self, entry: _Request, token: int, logprob: float) -> bool:
        """Append a sampled token; stream it; finish the request if it ended. True if it finished."""
        params = entry.request.params
        if entry.first_token is None:
            entry.first_token = time.monotonic()
        entry.output_ids.append(token)
        entry.output_logprobs.append(logprob)
        entry.last_version = self.policy_version
        entry.next_token = token
        reason: FinishReason | None = None
        if token in params.stop_token_ids:
            reason = "stop"
        elif len(entry.output_ids) >= params.max_new_tokens:
            reason = "length"
        if entry.chunks is not None:
            index = len(entry.output_ids) - 1
            chunk = TokenChunk(
                request_id=entry.request.request_id,
                index=index,
                token_ids=(token,),
                logprobs=(logprob,),
                policy_version=self.policy_version,
                finish_reason=reason,
                timings=self._timings(entry) if reason else None,
                cached_tokens=entry.cached_tokens if reason else None,
                routed_experts=self._routed_experts(entry) if reason else None,
            )
            entry.chunks.put_nowait(chunk)
        if reason is not None:
            self._finish(entry, reason, keep_prefix=True, streamed_final=True)
            return True
        return False

    def _timings(self, entry: _Request) -> GenerateTimings:
        now = time.monotonic()
        admitted = entry.admitted if entry.admitted is not None else now
        first = entry.first_token if entry.first_token is not None else now
        return GenerateTimings(
            queued_s=admitted - entry.submitted, first_token_s=first - entry.submitted, total_s=now - entry.submitted
        )

    def _finish(self, entry: _Request, reason: FinishReason, *, keep_prefix: bool, streamed_final: bool = False):
        request = entry.request
        if self._batch_kv is not None and any(e is entry for e in self._batch_kv.rows):
            self._batch_kv.write_back()  # its buffer becomes the prefix entry below
        self._by_id.pop(request.request_id, None)
        routed_experts = self._routed_experts(entry)  # before the buffer goes
        # KV from before a weight update is never reused (update_weights dropped the prefix cache for that reason).
        fresh = entry.first_version == self.policy_version
        if keep_prefix and fresh and entry.buffer is not None and entry.buffer.length > 0:
            self._prefix.pop(request.execution_id, None)
            self._prefix[request.execution_id] = _Prefix(tuple(entry.fed_ids), entry.buffer)
        entry.buffer = None
        timings = self._timings(entry)
        if entry.chunks is not None and not streamed_final:
            entry.chunks.put_nowait(
                TokenChunk(
                    request_id=request.request_id,
                    index=len(entry.output_ids),
                    token_ids=(),
                    logprobs=(),
                    policy_version=entry.last_version,
                    finish_reason=reason,
                    timings=timings,
                    cached_tokens=entry.cached_tokens,
                    routed_experts=routed_experts,
                )
            )
        if not entry.future.done():
            entry.future.set_result(
                GenerateResult(
                    request_id=request.request_id,
                    output_ids=tuple(entry.output_ids),
                    output_logprobs=tuple(entry.output_logprobs),
                    finish_reason=reason,
                    policy_version=entry.first_version if entry.admitted is not None else self.policy_version,
                    last_policy_version=entry.last_version if entry.admitted is not None else self.policy_version,
                    prompt_tokens=len(request.input_ids),
                    cached_tokens=entry.cached_tokens,
                    timings=timings,
                    routed_experts=routed_experts,
                )
            )
        if not self._by_id:
            self._idle.set()

    def _routed_experts(self, entry: _Request) -> np.ndarray | None:
        """The request's `routed_experts` (protocol): its record from `routed_experts_start` to the last fed position,
        int16 `[len(input_ids) + len(output_ids) - 1 - start, L, K]` (at least 0 rows) on the host, -1 where no
        routing is known (a request aborted while queued fed nothing). None when not asked or the model is dense.
        Taken once, while the buffer is still the request's: the final chunk and the result share it."""
        request = entry.request
        if not (request.return_routed_experts and self._moe):
            return None
        if entry.routed_experts is None:
            config = self.model.config
            start = request.routed_experts_start
            rows = max(0, len(request.input_ids) + len(entry.output_ids) - 1 - start)
            routed = torch.full((rows, config.num_hidden_layers, config.num_experts_per_tok), -1, dtype=torch.int16)
            if entry.records_routing:
                known = entry.buffer.routed_CLK[start : start + rows]
                routed[: known.shape[0]] = known.cpu()
            entry.routed_experts = routed.numpy()
            entry.routed_experts.setflags(write=False)  # shared by the final chunk and the result
        return entry.routed_experts

    def _fail(self, entry: _Request, error: BaseException) -> None:
        if not entry.future.done():
            entry.future.set_exception(error)
            entry.future.exception()  # mark retrieved: a streamed request's future is never awaited
        if entry.chunks is not None:
            entry.chunks.put_nowait(error)


def _routed_reuse(routed_CLK: torch.Tensor | None, start: int, reused: int) -> int:
    """How much of a cached prefix a request that asks for routing from `start` may reuse: up to its first position
    at or after `start` whose routing the cache does not know (a request that did not ask filled that prefix, or an
    export without routing came in). From there the prompt is computed again, so the gap is filled once instead of
    being asked for again by every later call (found in review: such a gap made each call carry the whole history)."""
    if reused <= start:
        return reused
    if routed_CLK is None:
        return start
    unknown = (routed_CLK[start:reused] == -1).flatten(1).all(dim=1).nonzero()
    return start + int(unknown[0, 0]) if len(unknown) else reused
