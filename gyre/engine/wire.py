"""The engine endpoint's wire format: protocol dataclasses <-> JSON, tensors <-> one framed byte body.

Pure conversions, no sockets: `gyre.engine.endpoint` (server) and `gyre.engine.remote` (client) use them, and the
tests prove the round trips exact (token ids, float log-probs and tensor bytes come back bit for bit: JSON
numbers are written with the shortest repr that reads back to the same double).

A *frame* carries tensors without JSON-encoding them: the 4-byte magic `GYRF`, the header length as 8 bytes
little-endian, the header (JSON, with a `tensors` list of `{dtype, shape, offset, nbytes}`), then the raw bytes
of every tensor back to back. KV exports and flat weight buffers travel as frames. A weights frame can be sent as its
parts (`weights_frame_parts`: the head, then a view of the flat buffer itself), so one bucket sent to many engines at
once is not copied per engine; a frame read into a `bytearray` is decoded in place (`decode_frame`).

Routed experts (a result's or final chunk's `routed_experts`, int16 `[T, L, K]`) travel inside the JSON as
`{"shape": [T, L, K], "i16": base64 of the little-endian int16 bytes}`: 2 bytes per entry before base64, no JSON
number per expert id. A request sends `return_routed_experts` and `routed_experts_start` only when it asks, so a
call that does not ask reads as before. A KV frame carries the export's routing as one more tensor.

Errors travel as `{"error": {"type": ..., "message": ...}}` with an HTTP status; `error_status` and
`error_from_wire` map the protocol's exceptions both ways, so a remote engine raises what a local one would.
The wire's own errors (`WireError`, `PromptBaseUnknown`, `RemoteEngineError`) live in `gyre.engine.errors`,
which imports no torch; they are importable from here too.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import orjson
import torch

from gyre.engine.errors import EngineAuthError, PromptBaseUnknown, RemoteEngineError, WireError
from gyre.engine.protocol import (
    EngineBusyError,
    EngineLoad,
    EngineUnavailableError,
    GenerateRequest,
    GenerateResult,
    GenerateTimings,
    KVExport,
    SamplingParams,
    TokenChunk,
    WeightUpdateSessionError,
)
from gyre.models.flat_weights import (
    ALIGN,
    FlatWeights,
    TensorSpec,
    dtype_name,
    flatten_weights,
    padding,
    raw_bytes,
    torch_dtype,
)
from gyre.models.flat_weights import unflatten_weights as unflatten_weights  # re-exported beside flatten_weights

FRAME_MAGIC = b"GYRF"
_HEADER_LEN = struct.Struct("<Q")


# ----------------------------------------------------------------------------- JSON messages


def dumps(obj) -> bytes:
    return orjson.dumps(obj)


def loads(data: bytes | str):
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as error:
        raise WireError(f"the body is not JSON: {error}") from None


@functools.cache
def _field_names(cls) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def _fields(message: Mapping, cls, *, what: str) -> dict:
    """The keyword arguments of `cls` found in `message`; unknown keys or a non-object are a WireError."""
    if not isinstance(message, Mapping):
        raise WireError(f"{what} must be a JSON object, got {type(message).__name__}")
    names = _field_names(cls)
    if not names.issuperset(message):
        unknown = sorted(set(message) - names)
        raise WireError(f"{what} has unknown fields {unknown}; expected some of {sorted(names)}")
    return dict(message)


def _tuples(fields: dict, *names: str) -> dict:
    """JSON arrays become the tuples the protocol's dataclasses hold."""
    for name in names:
        if name in fields:
            if not isinstance(fields[name], list):
                raise WireError(f"{name} must be a JSON array, got {type(fields[name]).__name__}")
            fields[name] = tuple(fields[name])
    return fields


def ids_to_wire(ids: array) -> str:
    """Token ids as base64 of little-endian int32: a 700K-token prompt is one string, not 700K JSON numbers."""
    if sys.byteorder == "big":
        ids = array("i", ids)
        ids.byteswap()
    return base64.b64encode(ids.tobytes()).decode("ascii")


def ids_from_wire(text: str, *, what: str) -> array:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise WireError(f"{what} is not base64 of int32 token ids") from None
    if len(raw) % 4:
        raise WireError(f"{what}: {len(raw)} bytes is not a whole number of int32 ids")
    ids = array("i")
    ids.frombytes(raw)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids


@dataclass(frozen=True)
class PromptBase:
    """The frame's prompt = the first `length` ids of the prompt of request `request_id` (same execution) + its
    payload. Long histories then cross the wire once: each call sends only what it adds."""

    request_id: str
    length: int


def generate_to_frame(
    request: GenerateRequest, *, stream: bool, submission_id: str | None, base: PromptBase | None = None
) -> bytes:
    """A `/generate` body as a frame: the request's fields as JSON, its prompt ids as raw little-endian int32
    (all of them, or those after `base`).

    What `RemoteEngine` sends: encoding costs a memcpy of the ids (about 0.1 ms at 700K tokens) where JSON or
    base64 would cost milliseconds on the proxy's CPU."""
    ids = request.input_ids if base is None else request.input_ids[base.length :]
    if sys.byteorder == "big":
        ids = array("i", ids)
        ids.byteswap()
    fields = {
        "request_id": request.request_id,
        "execution_id": request.execution_id,
        "params": dataclasses.asdict(request.params),
        **_routing_request_fields(request),
    }
    header = {"request": fields, "stream": stream, "submission_id": submission_id}
    if base is not None:
        header["base"] = {"request_id": base.request_id, "length": base.length}
    return _pack(header, [memoryview(ids)])


def generate_from_frame(
    body: bytes | bytearray, *, resolve_base: Callable[[str, PromptBase], array] | None = None
) -> tuple[GenerateRequest, bool, str | None]:
    """(request, stream, submission_id) of a `/generate` frame. A frame with a base needs `resolve_base(execution,
    base)`, which returns that base prompt's first `base.length` ids or raises `PromptBaseUnknown`."""
    header, payload = _unpack(body)
    if payload.nbytes % 4:
        raise WireError(f"the prompt ids ({payload.nbytes} bytes) are not a whole number of int32 ids")
    ids = array("i")
    ids.frombytes(payload)
    if sys.byteorder == "big":
        ids.byteswap()
    message = header.get("request")
    if not isinstance(message, dict) or "input_ids" in message or "input_ids_i32" in message:
        raise WireError("a /generate frame's header needs a request object without ids (they are the payload)")
    base = header.get("base")
    if base is not None:
        if resolve_base is None:
            raise PromptBaseUnknown("this endpoint keeps no base prompts: send the whole prompt")
        try:
            base = PromptBase(request_id=str(base["request_id"]), length=int(base["length"]))
        except (KeyError, TypeError, ValueError):
            raise WireError("a frame's base needs a request_id and an integer length") from None
        ids = resolve_base(str(message.get("execution_id")), base) + ids
    request = request_from_wire({**message, "input_ids": ids})
    submission = header.get("submission_id")
    if submission is not None and not isinstance(submission, str):
        raise WireError("submission_id must be a string")
    return request, bool(header.get("stream", False)), submission


class PromptStore:
    """The latest prompt of each execution an endpoint received (or a client sent), for frames that extend it
    (`PromptBase`). One prompt per execution, least recently used dropped beyond `max_bytes` (4 bytes per id) or
    `max_entries`: the engine's KV for the same tokens is ~1000x larger, so this is small next to it."""

    def __init__(self, max_bytes: int = 1 << 30, max_entries: int | None = None):
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._prompts: OrderedDict[str, tuple[str, array]] = OrderedDict()
        self._bytes = 0

    def latest(self, execution: str) -> tuple[str, array] | None:
        """(request id, prompt ids) of the execution's latest prompt, if held."""
        return self._prompts.get(execution)

    def resolve(self, execution: str, base: PromptBase) -> array:
        entry = self._prompts.get(execution)
        if entry is None or entry[0] != base.request_id or not 0 <= base.length <= len(entry[1]):
            raise PromptBaseUnknown(
                f"execution {execution!r}: the base prompt of request {base.request_id!r} is not held here "
                "(evicted or superseded): send the whole prompt"
            )
        self._prompts.move_to_end(execution)
        return entry[1][: base.length]

    def remember(self, request: GenerateRequest) -> None:
        old = self._prompts.pop(request.execution_id, None)
        if old is not None:
            self._bytes -= 4 * len(old[1])
        self._prompts[request.execution_id] = (request.request_id, request.input_ids)
        self._bytes += 4 * len(request.input_ids)
        while len(self._prompts) > 1 and (
            self._bytes > self.max_bytes or (self.max_entries is not None and len(self._prompts) > self.max_entries)
        ):
            _, (_, dropped) = self._prompts.popitem(last=False)
            self._bytes -= 4 * len(dropped)


def _routing_request_fields(request: GenerateRequest) -> dict:
    """The routed-experts fields of a request, only when it asks for them."""
    if not request.return_routed_experts:
        return {}
    return {"return_routed_experts": True, "routed_experts_start": request.routed_experts_start}


def request_to_wire(request: GenerateRequest) -> dict:
    return {
        "request_id": request.request_id,
        "execution_id": request.execution_id,
        "input_ids_i32": ids_to_wire(request.input_ids),
        "params": dataclasses.asdict(request.params),
        **_routing_request_fields(request),
    }


def request_from_wire(message: Mapping) -> GenerateRequest:
    """A validated request; bad field values raise the protocol's own ValueError (`ConfigError`).

    Prompt ids come as `input_ids_i32` (base64, what `request_to_wire` writes) or as a JSON array `input_ids`
    (handy by hand: `curl -d '{"request": {"input_ids": [1, 2, 3], ...}}'`)."""
    if isinstance(message, Mapping) and "input_ids_i32" in message:
        message = dict(message)
        encoded = message.pop("input_ids_i32")
        if "input_ids" in message:
            raise WireError("request has both input_ids and input_ids_i32: send one")
        if not isinstance(encoded, str):
            raise WireError("request.input_ids_i32 must be a base64 string")
        message["input_ids"] = ids_from_wire(encoded, what="request.input_ids_i32")
    fields = _fields(message, GenerateRequest, what="request")
    fields["params"] = SamplingParams(**_fields(fields.get("params", {}), SamplingParams, what="params"))
    try:
        return GenerateRequest(**fields)
    except TypeError as error:  # a missing required field
        raise WireError(f"request: {error}") from None


def _timings_from_wire(message: Mapping | None) -> GenerateTimings | None:
    return None if message is None else GenerateTimings(**_fields(message, GenerateTimings, what="timings"))


def routed_experts_to_wire(routed: np.ndarray) -> dict:
    """int16 `[T, L, K]` routing as `{"shape", "i16"}`: base64 of its little-endian int16 bytes."""
    return {"shape": list(routed.shape), "i16": base64.b64encode(routed.astype("<i2").tobytes()).decode("ascii")}


def routed_experts_from_wire(message) -> np.ndarray | None:
    """`routed_experts_to_wire`'s inverse (None stays None); a malformed value is a WireError."""
    if message is None:
        return None
    if not isinstance(message, Mapping) or set(message) != {"shape", "i16"}:
        raise WireError('routed_experts must be null or {"shape": [T, L, K], "i16": base64 of little-endian int16}')
    shape = message["shape"]
    if not isinstance(shape, list) or len(shape) != 3 or not all(type(n) is int and 0 <= n < 2**31 for n in shape):
        raise WireError(f"routed_experts.shape={shape!r}: expected three integers in [0, 2**31) [T, L, K]")
    try:
        raw = base64.b64decode(message["i16"], validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise WireError("routed_experts.i16 is not base64 of int16 expert ids") from None
    if len(raw) != 2 * shape[0] * shape[1] * shape[2]:
        raise WireError(f"routed_experts: {len(raw)} bytes do not hold {shape} int16 entries")
    return np.frombuffer(raw, dtype="<i2").astype(np.int16).reshape(shape)


def _with_routing(message: GenerateResult | TokenChunk) -> GenerateResult | TokenChunk | dict:
    """What `dumps` writes: orjson serializes the dataclass itself (~0.3 us; `asdict` costs ~10 us), or, when it
    carries routed experts, its fields with the routing encoded (`routed_experts_to_wire`)."""
    if message.routed_experts is None:
        return message
    fields = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    fields["routed_experts"] = routed_experts_to_wire(message.routed_experts)
    return fields


def result_to_wire(result: GenerateResult) -> GenerateResult | dict:
    """The result as `dumps` writes it (`_with_routing`)."""
    return _with_routing(result)


def result_from_wire(message: Mapping) -> GenerateResult:
    fields = _fields(message, GenerateResult, what="result")
    fields["timings"] = _timings_from_wire(fields["timings"])
    fields["routed_experts"] = routed_experts_from_wire(fields.get("routed_experts"))
    return GenerateResult(**_tuples(fields, "output_ids", "output_logprobs"))


def chunk_to_wire(chunk: TokenChunk) -> TokenChunk | dict:
    """The chunk as `dumps` writes it (`_with_routing`: one line per token stays cheap)."""
    return _with_routing(chunk)


def chunk_from_wire(message: Mapping) -> TokenChunk:
    fields = _fields(message, TokenChunk, what="chunk")
    fields["timings"] = _timings_from_wire(fields.get("timings"))
    fields["routed_experts"] = routed_experts_from_wire(fields.get("routed_experts"))
    return TokenChunk(**_tuples(fields, "token_ids", "logprobs"))


def load_to_wire(load: EngineLoad) -> dict:
    return dataclasses.asdict(load)


def load_from_wire(message: Mapping) -> EngineLoad:
    return EngineLoad(**_fields(message, EngineLoad, what="load"))


# ----------------------------------------------------------------------------- errors

# (exception class, HTTP status, wire type); the first match wins, so subclasses come before their bases.
_ERRORS: tuple[tuple[type[BaseException], int, str], ...] = (
    (PromptBaseUnknown, 409, "base_unknown"),
    (EngineUnavailableError, 503, "unavailable"),
    (EngineBusyError, 409, "busy"),
    (WeightUpdateSessionError, 409, "update_session"),
    (NotImplementedError, 501, "not_implemented"),
    (KeyError, 404, "not_found"),
    (ValueError, 400, "invalid_request"),
    (TypeError, 400, "invalid_request"),
    (EngineAuthError, 401, "unauthorized"),  # the endpoint's own answers (`EngineServer`, secret): no engine raises
    (EngineAuthError, 403, "forbidden"),
)


def error_status(error: BaseException) -> tuple[int, dict]:
    """HTTP status and body for an exception raised by an engine; anything unexpected is a 500."""
    for cls, status, kind in _ERRORS:
        if isinstance(error, cls):
            message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
            return status, {"error": {"type": kind, "message": str(message)}}
    return 500, {"error": {"type": "internal", "message": f"{type(error).__name__}: {error}"}}


def error_from_wire(status: int, body: bytes) -> BaseException:
    """The exception a local engine would have raised, rebuilt from an error response."""
    try:
        error = orjson.loads(body)["error"]
        kind, message = error["type"], error["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return RemoteEngineError(f"HTTP {status}: {body[:200]!r}")
    for cls, _, name in _ERRORS:
        if name == kind:
            return cls(message)
    return RemoteEngineError(f"HTTP {status} {kind}: {message}")


# ----------------------------------------------------------------------------- frames


def _dtype(name: str) -> torch.dtype:
    dtype = torch_dtype(name)
    if dtype is None:
        raise WireError(f"unknown dtype {name!r}")
    return dtype


def encode_frame(header: Mapping, tensors: Sequence[torch.Tensor]) -> bytes:
    """One body: magic, header length, JSON header (with a `tensors` table), raw tensor bytes, each 16-aligned."""
    return b"".join(encode_frame_parts(header, tensors))


def encode_frame_parts(header: Mapping, tensors: Sequence[torch.Tensor]) -> list[bytes | memoryview]:
    """`encode_frame`'s body as parts that follow one another, not joined: the head (magic, header length, JSON
    header), then each tensor's bytes (a view of a CPU-contiguous tensor's own memory, no copy) and its padding."""
    table, parts, offset = [], [], 0
    for tensor in tensors:
        raw = raw_bytes(tensor)
        table.append({"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape), "offset": offset})
        parts.append(raw)
        offset += raw.nbytes
        parts.append(padding(offset))
        offset += len(parts[-1])
    return _pack_parts({**header, "tensors": table}, parts)


def _pack(header: Mapping, parts: Sequence) -> bytes:
    return b"".join(_pack_parts(header, parts))


def _pack_parts(header: Mapping, parts: Sequence) -> list:
    head = dumps(header)
    # JSON may end in blanks: the payload then starts 16-aligned in the body, so tensors decoded in place are aligned
    head += b" " * (-(len(FRAME_MAGIC) + _HEADER_LEN.size + len(head)) % ALIGN)
    return [FRAME_MAGIC + _HEADER_LEN.pack(len(head)) + head, *(part for part in parts if len(part))]


def _unpack(body: bytes | bytearray) -> tuple[dict, memoryview]:
    """A frame's JSON header and a view of its payload (no copy)."""
    prefix = len(FRAME_MAGIC) + _HEADER_LEN.size
    if len(body) < prefix or bytes(body[: len(FRAME_MAGIC)]) != FRAME_MAGIC:
        raise WireError("the body is not a gyre frame (bad magic)")
    (head_len,) = _HEADER_LEN.unpack_from(body, len(FRAME_MAGIC))
    if prefix + head_len > len(body):
        raise WireError(f"the frame header ({head_len} bytes) runs past the body ({len(body)} bytes)")
    header = loads(bytes(body[prefix : prefix + head_len]))
    if not isinstance(header, dict):
        raise WireError("a frame header must be a JSON object")
    return header, memoryview(body)[prefix + head_len :]


def is_frame(body: bytes | bytearray) -> bool:
    return bytes(body[: len(FRAME_MAGIC)]) == FRAME_MAGIC


def decode_frame(body: bytes | bytearray) -> tuple[dict, list[torch.Tensor]]:
    """Header and tensors of a frame. The tensors are views of `body` itself when it is a `bytearray` (writable: no
    copy; they keep it alive), else of one writable copy of the payload."""
    header, view = _unpack(body)
    if not view.nbytes:
        flat = torch.empty(0, dtype=torch.uint8)
    elif isinstance(body, bytearray):
        flat = torch.frombuffer(body, dtype=torch.uint8, offset=len(body) - view.nbytes)
    else:
        flat = torch.frombuffer(bytearray(view), dtype=torch.uint8)
    del view  # a bytearray with an exported view cannot be resized: release it
    tensors = []
    for spec in header.pop("tensors", []):
        dtype = _dtype(spec["dtype"])
        shape = tuple(spec["shape"])
        size = torch.empty(0, dtype=dtype).element_size()
        nbytes = torch.Size(shape).numel() * size
        start = spec["offset"]
        if not isinstance(start, int) or start < 0 or start % size:
            raise WireError(f"a frame tensor's offset {start!r} is not a multiple of its element size {size}")
        if start + nbytes > flat.numel():
            raise WireError(f"a frame tensor ({nbytes} bytes at {start}) lies beyond the payload")
        tensors.append(flat[start : start + nbytes].view(dtype).reshape(shape))
    return header, tensors


def kv_export_to_frame(export: KVExport) -> bytes:
    header = {
        "request_id": export.request_id,
        "execution_id": export.execution_id,
        "token_ids": list(export.token_ids),
        "policy_version": export.policy_version,
        "output_ids": list(export.output_ids),
        "output_logprobs": list(export.output_logprobs),
        "layers": len(export.keys),
        "routed": export.routed_experts is not None,  # the routing record is one more tensor, after the values
    }
    routed = () if export.routed_experts is None else (export.routed_experts,)
    return encode_frame(header, [*export.keys, *export.values, *routed])


def kv_export_from_frame(body: bytes | bytearray) -> KVExport:
    header, tensors = decode_frame(body)
    layers = header.pop("layers", None)
    routed = bool(header.pop("routed", False))
    if not isinstance(layers, int) or len(tensors) != 2 * layers + routed:
        raise WireError(f"a KV frame must carry keys and values for each of its layers ({layers!r})")
    fields = _tuples(_fields(header, KVExport, what="kv export"), "token_ids", "output_ids", "output_logprobs")
    return KVExport(
        **fields,
        keys=tuple(tensors[:layers]),
        values=tuple(tensors[layers : 2 * layers]),
        routed_experts=tensors[2 * layers] if routed else None,
    )


def weights_to_frame(weights: Mapping[str, torch.Tensor] | FlatWeights, *, version: int | None) -> bytes:
    """A weights frame as one body (`weights_frame_parts` joined)."""
    return b"".join(weights_frame_parts(weights, version=version))


def weights_frame_parts(
    weights: Mapping[str, torch.Tensor] | FlatWeights, *, version: int | None
) -> list[bytes | memoryview]:
    """A weights frame (`/update_weights` with a `version`; `/update_bucket` with None) as parts to send one after
    another: the head, then a view of the flat buffer's own memory (no copy when it is on the CPU; a device buffer is
    copied to the host) and its padding. Named tensors are flattened first (one copy)."""
    flat = weights if isinstance(weights, FlatWeights) else flatten_weights(weights)
    header: dict = {"manifest": [dataclasses.asdict(spec) for spec in flat.manifest]}
    if version is not None:
        header["version"] = version
    return encode_frame_parts(header, [flat.buffer])


def weights_from_frame(body: bytes | bytearray) -> tuple[FlatWeights, int]:
    """The flat weights and version of an `/update_weights` frame."""
    header, tensors = decode_frame(body)
    if not isinstance(header.get("version"), int):
        raise WireError("a weights frame carries one buffer and an integer version")
    return _flat_weights(header, tensors), header["version"]


def bucket_from_frame(body: bytes | bytearray) -> FlatWeights:
    """The flat weights of an `/update_bucket` frame (a weights frame without a version)."""
    header, tensors = decode_frame(body)
    if "version" in header:
        raise WireError("a bucket frame carries no version: end_update sets it")
    return _flat_weights(header, tensors)


def _flat_weights(header: dict, tensors: list[torch.Tensor]) -> FlatWeights:
    manifest = header.get("manifest")
    if len(tensors) != 1 or not isinstance(manifest, list):
        raise WireError("a weights frame carries one buffer and its manifest")
    specs = tuple(TensorSpec(**_fields(spec, TensorSpec, what="tensor spec")) for spec in manifest)
    return FlatWeights(buffer=tensors[0], manifest=specs)
