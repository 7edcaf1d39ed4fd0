"""TITO records: provenance, context segments, sampled responses and call metadata.

Role: the vocabulary shared by the proxy (which builds records as model calls complete), the
trajectory tree (`gyre.traj.tree`, which stores them) and the on-disk format (`gyre.traj.store`).

Contract (docs/architecture.md, contract 3): a record carries the exact token ids the engine saw and produced
and the behavior log-probs of the produced tokens. A request's context is a sequence of
**segments** - one per chat message/turn or injected block - each a run of token ids with ONE
`Provenance`. A response is one SAMPLED run with per-token log-probs and a finish reason.

Segment keys: `segment_key` is a 16-byte blake2b digest of the provenance code and the ids as
native 32-bit ints. A `Segment` computes its key once, at construction, unless the caller passes a
precomputed one; a proxy that keeps its `Segment` objects across calls therefore never rehashes
history. Keys are process-local (native byte order) and never written to disk. A caller-supplied
key is not rehashed, but the tree compares a segment whose key matches a stored node against that
node's content (provenance, length, ids) and rejects a mismatch.

Ownership: `Segment` and `Response` copy the token/log-prob sequences they are given (a C-level
copy of a few KB per segment), so a caller mutating its own array afterwards cannot change a stored
record. The copies are owned by the `Segment`/`Response`; mutating `segment.ids` or
`response.ids` in place is a caller bug. `CallRouting` copies its experts into a read-only int16 array.

Routing (mixture-of-experts routing replay, docs/moe.md): a call may carry `CallRouting`, the experts the
engine chose for the positions `[start, len(context) + len(output) - 1)` of its full sequence (the last
output token was never fed to the model, so it has none), `[n, num_hidden_layers, top_k]`, -1 at dense layers.
"""

from __future__ import annotations

import enum
import hashlib
import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

KEY_BYTES = 16
_INT32_MAX = 2**31 - 1
_INT16_MAX = 2**15 - 1
NO_ROUTE = -1  # an expert id where the engine did not route (a dense layer, an unrouted position); gyre.trainer.routing


class Provenance(enum.IntEnum):
    """Who supplied a run of tokens. Only SAMPLED tokens with recorded log-probs become targets."""

    SYSTEM = 0  # system prompts and mid-conversation system reminders
    USER = 1  # user turns, task prompts, harness-written user text (e.g. a compaction summary request)
    TOOL = 2  # tool results
    HARNESS_ASSISTANT = 3  # assistant content injected or rewritten by the harness, never sampled by us
    SAMPLED = 4  # our engine's output (restored exactly by the proxy when the harness echoes it)
    EVALUATOR = 5  # evaluator critiques fed back to the policy: condition only, never targets

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def from_label(cls, label: str) -> Provenance:
        try:
            return cls[label.upper()]
        except KeyError:
            known = ", ".join(p.label for p in cls)
            raise ValueError(f"unknown provenance {label!r}; expected one of: {known}") from None


def as_token_array(ids: Sequence[int] | array, what: str) -> array:
    """Copy ids into a new `array('i')` (32-bit ints); range errors become a ValueError naming `what`.

    Always a copy, even of an `array('i')`: the result must not alias the caller's buffer.
    """
    try:
        return array("i", ids)
    except OverflowError:
        raise ValueError(f"{what}: token ids must lie in [0, {_INT32_MAX}]; got an id outside int32") from None
    except TypeError as err:
        raise TypeError(f"{what}: token ids must be integers ({err})") from None


def segment_key(provenance: Provenance, ids: array) -> bytes:
    """blake2b-128 of (provenance code, ids as native int32 bytes): equal keys <=> equal segment."""
    digest = hashlib.blake2b(bytes((int(provenance),)), digest_size=KEY_BYTES)
    digest.update(ids.tobytes())
    return digest.digest()


class Segment:
    """One context segment: a run of token ids with one provenance, and its key.

    `key` may be passed by a caller that already has it (the proxy's cache); it is then not
    rehashed, but `TrajectoryTree` checks a segment whose key matches a stored node against that
    node's content and raises ValueError on a mismatch. `ids` is always a copy of the argument.
    """

    __slots__ = ("ids", "key", "provenance")

    def __init__(self, provenance: Provenance, ids: Sequence[int] | array, key: bytes | None = None) -> None:
        self.provenance = Provenance(provenance)
        self.ids = as_token_array(ids, f"{self.provenance.label} segment")
        if key is not None and (not isinstance(key, bytes) or len(key) != KEY_BYTES):
            raise ValueError(f"segment key must be {KEY_BYTES} bytes; got {key!r}")
        self.key = key if key is not None else segment_key(self.provenance, self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Segment):
            return NotImplemented
        return self.provenance is other.provenance and self.ids == other.ids

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"Segment({self.provenance.name}, {list(self.ids)!r})"


@dataclass(frozen=True, eq=False)
class Response:
    """One model call's output: the sampled ids, their behavior log-probs and the finish reason.

    The constructor copies `ids` into an `array('i')` and `logprobs` into an `array('d')` (never
    keeping the caller's arrays), whichever of `Response(...)` and `Response.build(...)` is used.
    """

    ids: array
    logprobs: array  # natural-log behavior probabilities, one per id, float64
    finish_reason: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", as_token_array(self.ids, "response.ids"))
        object.__setattr__(self, "logprobs", array("d", self.logprobs))
        object.__setattr__(self, "finish_reason", str(self.finish_reason))

    @classmethod
    def build(cls, ids: Sequence[int] | array, logprobs: Sequence[float] | array, finish_reason: str) -> Response:
        return cls(ids, logprobs, finish_reason)  # type: ignore[arg-type]  # __post_init__ converts

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Response):
            return NotImplemented
        return (self.ids, self.logprobs, self.finish_reason) == (other.ids, other.logprobs, other.finish_reason)


@dataclass(frozen=True)
class CallMeta:
    """Metadata of one model call. `role_signals` is opaque here: the role classifiers read it."""

    execution: str
    request_id: str
    policy_version: int = 0
    engine: str = ""
    timings: Mapping[str, float] = field(default_factory=dict)  # seconds, e.g. queued_s, first_token_s, total_s
    role_signals: Mapping[str, Any] = field(default_factory=dict)
    usage: Mapping[str, int] = field(default_factory=dict)  # tokens: prompt_tokens, cached_tokens (empty: unknown)


@dataclass(frozen=True, eq=False)
class CallRouting:
    """The experts the engine chose for one call's tokens (mixture-of-experts routing replay, docs/moe.md).

    `experts[i, l, k]` is the k-th expert the engine routed position `start + i` of the call's full sequence
    (context then output) to at layer l; -1 at layers without experts. It covers `[start, len(context) +
    len(output) - 1)`: the last output token was never fed to the model. `start` is what the proxy asked the
    engine for (`TrajectoryTree.routed_prefix_len`: positions before it are routed by earlier calls).

    The constructor validates (ValueError naming the field) and copies `experts` into a read-only int16 array.
    """

    start: int
    experts: np.ndarray  # int16 [n, num_hidden_layers, top_k], -1 where not routed

    def __post_init__(self) -> None:
        start = self.start
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
            raise ValueError(f"routing.start = {start!r}: expected an integer >= 0 (the first routed position)")
        experts = np.asarray(self.experts)
        if experts.ndim != 3 or experts.shape[1] < 1 or experts.shape[2] < 1:
            raise ValueError(
                f"routing.experts has shape {experts.shape}: expected [tokens, num_hidden_layers >= 1, top_k >= 1]"
            )
        if experts.dtype.kind not in "iu" and experts.size:  # an empty array of any dtype is no routing
            raise TypeError(f"routing.experts has dtype {experts.dtype}: expected integer expert ids")
        if experts.size:
            low, high = int(experts.min()), int(experts.max())
            if low < -1 or high > _INT16_MAX:
                bad = low if low < -1 else high
                raise ValueError(
                    f"routing.experts holds {bad}: expert ids must lie in [0, {_INT16_MAX}], or -1 where not routed"
                )
        copy = np.array(experts, dtype=np.int16)  # always a copy: the record owns its routing
        copy.flags.writeable = False
        object.__setattr__(self, "start", int(start))
        object.__setattr__(self, "experts", copy)

    @property
    def num_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def end(self) -> int:
        """One past the last routed position of the call's full sequence."""
        return self.start + self.num_tokens

    @property
    def layers_topk(self) -> tuple[int, int]:
        """(num_hidden_layers, top_k)."""
        return int(self.experts.shape[1]), int(self.experts.shape[2])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CallRouting):
            return NotImplemented
        return self.start == other.start and np.array_equal(self.experts, other.experts)


@dataclass(frozen=True, eq=False)
class CallRecord:
    """One recorded model call (and what one line of the store holds).

    `parent` is the deepest node that existed before this call and that `segments` extend: the
    call's exact context is `path(parent)` followed by `segments`. `context_node` is the node the
    response hangs from and `response_node` the SAMPLED node holding the output. `routing`: the
    experts the engine chose (`CallRouting`), or None when the engine returned none. The tree keeps
    its records without their routing (it lives in the tree's nodes, once per position); the record
    `TrajectoryTree.insert` returns and hands to `before_commit` carries it for the record file.
    """

    index: int
    parent: int
    segments: tuple[Segment, ...]
    response: Response
    meta: CallMeta
    context_node: int
    response_node: int
    routing: CallRouting | None = None


def validate_ids(ids: array, vocab_size: int, what: str) -> None:
    """ValueError naming `what` if any id is negative or >= vocab_size."""
    if not ids:
        return
    low, high = min(ids), max(ids)
    if low < 0:
        raise ValueError(f"{what}: token id {low} is negative")
    if high >= vocab_size:
        raise ValueError(f"{what}: token id {high} is out of vocabulary (vocab_size={vocab_size})")


def validate_response(response: Response, vocab_size: int) -> None:
    """Empty output, length mismatch, out-of-vocabulary ids, NaN/inf or positive log-probs."""
    if len(response.ids) == 0:
        raise ValueError("response.ids is empty: a model call must produce at least one token")
    if len(response.ids) != len(response.logprobs):
        raise ValueError(
            f"response.logprobs has {len(response.logprobs)} values for {len(response.ids)} response.ids; "
            "expected one behavior log-prob per output token"
        )
    validate_ids(response.ids, vocab_size, "response.ids")
    for position, logprob in enumerate(response.logprobs):
        if not math.isfinite(logprob) or logprob > 0.0:
            raise ValueError(f"response.logprobs[{position}] = {logprob!r}: behavior log-probs must be finite and <= 0")
