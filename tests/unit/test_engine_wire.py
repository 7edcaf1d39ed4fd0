"""The endpoint's wire format round-trips exactly and rejects what is not it."""

from __future__ import annotations

import math

import pytest
import torch

from gyre.engine import wire
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


def roundtrip(message):
    return wire.loads(wire.dumps(message))


def test_requests_results_chunks_and_loads_come_back_equal_to_the_last_bit():
    request = GenerateRequest(
        request_id="r1",
        execution_id="e1",
        input_ids=[0, 5, 151_000],
        params=SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=9, stop_token_ids=[2], seed=3),
    )
    assert wire.request_from_wire(roundtrip(wire.request_to_wire(request))) == request
    logprobs = tuple(float(x) for x in torch.randn(50, generator=torch.Generator().manual_seed(0)).float())
    logprobs += (-1e-45, -88.72283935546875, math.nextafter(-1.0, 0.0))
    timings = GenerateTimings(queued_s=0.1, first_token_s=0.2, total_s=1 / 3)
    result = GenerateResult(
        request_id="r1",
        output_ids=tuple(range(len(logprobs))),
        output_logprobs=logprobs,
        finish_reason="abort",
        policy_version=4,
        last_policy_version=5,
        prompt_tokens=3,
        cached_tokens=2,
        timings=timings,
    )
    assert wire.result_from_wire(roundtrip(wire.result_to_wire(result))) == result
    chunk = TokenChunk(request_id="r1", index=7, token_ids=(1, 2), logprobs=logprobs[:2], policy_version=5)
    assert wire.chunk_from_wire(roundtrip(wire.chunk_to_wire(chunk))) == chunk
    last = TokenChunk(request_id="r1", index=9, token_ids=(), logprobs=(), policy_version=5, finish_reason="stop")
    assert wire.chunk_from_wire(roundtrip(wire.chunk_to_wire(last))) == last
    load = EngineLoad(
        capacity=16,
        running=3,
        queued=1,
        kv_tokens_total=4096,
        kv_tokens_free=100,
        accepting=False,
        memory_released=False,
        policy_version=2,
    )
    assert wire.load_from_wire(roundtrip(wire.load_to_wire(load))) == load


def test_kv_exports_and_weights_travel_as_frames_bit_exact():
    g = torch.Generator().manual_seed(1)
    keys = (torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g).to(torch.bfloat16))
    values = (torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g).to(torch.bfloat16))
    export = KVExport(
        request_id="r",
        execution_id="e",
        token_ids=(1, 2, 3, 4, 5),
        policy_version=3,
        keys=keys,
        values=values,
        output_ids=(4, 5, 6),
        output_logprobs=(-0.5, -0.25, -1.0),
    )
    back = wire.kv_export_from_frame(wire.kv_export_to_frame(export))
    assert (back.request_id, back.execution_id, back.token_ids, back.policy_version) == ("r", "e", (1, 2, 3, 4, 5), 3)
    assert (back.output_ids, back.output_logprobs) == (export.output_ids, export.output_logprobs)
    for a, b in zip((*keys, *values), (*back.keys, *back.values), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)

    named = {
        "a.weight": torch.randn(3, 4, generator=g),
        "b.weight": torch.randn(7, generator=g).to(torch.bfloat16),
        "c.bias": torch.zeros(0),
    }
    flat = wire.flatten_weights(named)
    assert flat.buffer.dtype == torch.uint8 and [s.offset for s in flat.manifest] == [0, 48, 64]
    flat_back, version = wire.weights_from_frame(wire.weights_to_frame(named, version=9))
    assert version == 9 and flat_back.manifest == flat.manifest
    for name, tensor in wire.unflatten_weights(flat_back).items():
        assert tensor.dtype == named[name].dtype and torch.equal(tensor, named[name])


def test_a_weights_frame_is_sent_as_parts_that_view_the_buffer_and_read_in_place_from_a_bytearray():
    named = {
        "a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b.weight": torch.ones(5, dtype=torch.int8),
    }
    flat = wire.flatten_weights(named)
    parts = wire.weights_frame_parts(flat, version=None)
    assert b"".join(parts) == wire.weights_to_frame(flat, version=None)
    head, payload, *padding = parts
    assert len(head) % 16 == 0 and payload.nbytes == flat.buffer.numel() and sum(map(len, padding)) < 16
    flat.buffer[0] = 255  # the part is the buffer's own memory: no copy was made
    assert payload[0] == 255

    body = bytearray(b"".join(parts))
    bucket = wire.bucket_from_frame(body)
    assert bucket.manifest == flat.manifest and torch.equal(bucket.buffer, flat.buffer)
    body[len(head)] = 7  # the decoded buffer is the body itself (no copy), 16-aligned in it
    assert bucket.buffer[0] == 7
    copied = wire.bucket_from_frame(bytes(body))  # bytes are read-only: one writable copy
    body[len(head)] = 9
    assert copied.buffer[0] == 7 and bucket.buffer[0] == 9

    with pytest.raises(wire.WireError, match="carries no version"):
        wire.bucket_from_frame(wire.weights_to_frame(flat, version=3))
    with pytest.raises(wire.WireError, match="an integer version"):
        wire.weights_from_frame(body)
    flat_back, version = wire.weights_from_frame(bytearray(wire.weights_to_frame(named, version=3)))
    assert version == 3 and all(torch.equal(t, named[n]) for n, t in wire.unflatten_weights(flat_back).items())


@pytest.mark.parametrize(
    ("message", "match"),
    [
        ({"request_id": "r", "execution_id": "e", "input_ids": [1], "surprise": 1}, "unknown fields"),
        ({"request_id": "r", "execution_id": "e"}, "input_ids"),
        ({"request_id": "r", "execution_id": "e", "input_ids": [1], "params": {"top_p": 1.5}}, "top_p=1.5"),
        ({"request_id": "r", "execution_id": "e", "input_ids": [-1]}, "input_ids"),
        ({"request_id": "", "execution_id": "e", "input_ids": [1]}, "request_id"),
        ([1, 2], "JSON object"),
    ],
)
def test_a_bad_request_message_is_a_value_error_naming_the_field(message, match):
    with pytest.raises(ValueError, match=match):
        wire.request_from_wire(message)


def test_a_body_that_is_not_a_frame_is_rejected():
    with pytest.raises(wire.WireError, match="magic"):
        wire.decode_frame(b"not a frame at all")
    frame = bytearray(wire.encode_frame({"x": 1}, [torch.ones(4)]))
    with pytest.raises(wire.WireError, match="beyond the payload"):
        wire.decode_frame(frame[:-4])
    with pytest.raises(wire.WireError, match="not JSON"):
        wire.loads(b"{nope")


def test_errors_map_to_statuses_and_back_to_the_same_exception_types():
    for error, status in [
        (ValueError("bad"), 400),
        (KeyError("r9"), 404),
        (EngineBusyError("busy"), 409),
        (WeightUpdateSessionError("no session"), 409),
        (EngineUnavailableError("gone"), 503),
        (NotImplementedError("no"), 501),
    ]:
        code, body = wire.error_status(error)
        assert code == status
        back = wire.error_from_wire(code, wire.dumps(body))
        assert type(back) is type(error) and str(error).strip("'") in str(back)
    code, body = wire.error_status(ZeroDivisionError("x"))
    assert code == 500 and isinstance(wire.error_from_wire(code, wire.dumps(body)), wire.RemoteEngineError)
    assert isinstance(wire.error_from_wire(502, b"<html>bad gateway</html>"), wire.RemoteEngineError)


def test_prompt_ids_travel_as_base64_int32_and_plain_json_arrays_are_accepted_too():
    from array import array

    ids = array("i", [0, 1, 151_935, 2**31 - 1] * 1000)
    request = GenerateRequest(request_id="r", execution_id="e", input_ids=ids)
    message = roundtrip(wire.request_to_wire(request))
    assert "input_ids" not in message and isinstance(message["input_ids_i32"], str)
    assert wire.request_from_wire(message) == request
    by_hand = {"request_id": "r", "execution_id": "e", "input_ids": list(ids)}
    assert wire.request_from_wire(by_hand) == request
    with pytest.raises(wire.WireError, match="base64"):
        wire.request_from_wire({**message, "input_ids_i32": "***"})
    with pytest.raises(wire.WireError, match="whole number"):
        wire.request_from_wire({**message, "input_ids_i32": "AAA="})
    with pytest.raises(wire.WireError, match="both"):
        wire.request_from_wire({**message, "input_ids": [1]})
    negative = wire.ids_to_wire(array("i", [5, -1]))
    with pytest.raises(ValueError, match="negative"):
        wire.request_from_wire({**message, "input_ids_i32": negative})


def test_generate_frames_carry_the_prompt_as_raw_int32_and_round_trip():
    from array import array

    ids = array("i", range(0, 300_000, 3))
    params = SamplingParams(temperature=0.5, max_new_tokens=7, stop_token_ids=(2,), seed=9)
    request = GenerateRequest(request_id="r", execution_id="e", input_ids=ids, params=params)
    frame = wire.generate_to_frame(request, stream=True, submission_id="s1")
    assert wire.is_frame(frame) and len(frame) < 4 * len(ids) + 1024  # the ids are not JSON
    assert wire.generate_from_frame(frame) == (request, True, "s1")
    assert wire.generate_from_frame(wire.generate_to_frame(request, stream=False, submission_id=None))[1:] == (
        False,
        None,
    )
    with pytest.raises(wire.WireError, match="whole number"):
        wire.generate_from_frame(frame[:-1])
    with pytest.raises(wire.WireError, match="magic"):
        wire.generate_from_frame(b"{}")
    bad = wire._pack({"request": {"request_id": "r", "execution_id": "e", "input_ids": [1]}}, [b""])
    with pytest.raises(wire.WireError, match="without ids"):
        wire.generate_from_frame(bad)


def test_a_frame_can_extend_the_executions_last_prompt_and_an_unknown_base_is_refused():
    from array import array

    store = wire.PromptStore(max_bytes=4 * 1000)
    first = GenerateRequest(request_id="r1", execution_id="e", input_ids=array("i", range(1, 301)))
    store.remember(first)
    second = GenerateRequest(request_id="r2", execution_id="e", input_ids=array("i", [*range(1, 301), 7, 8, 9]))
    base = wire.PromptBase(request_id="r1", length=300)
    frame = wire.generate_to_frame(second, stream=False, submission_id=None, base=base)
    assert len(frame) < 400  # three ids travel, not 303
    assert wire.generate_from_frame(frame, resolve_base=store.resolve)[0] == second
    with pytest.raises(wire.PromptBaseUnknown):
        wire.generate_from_frame(frame)  # an endpoint that keeps no bases
    for stale in (wire.PromptBase(request_id="r0", length=300), wire.PromptBase(request_id="r1", length=301)):
        with pytest.raises(wire.PromptBaseUnknown, match="send the whole prompt"):
            wire.generate_from_frame(
                wire.generate_to_frame(second, stream=False, submission_id=None, base=stale),
                resolve_base=store.resolve,
            )
    store.remember(GenerateRequest(request_id="x", execution_id="other", input_ids=array("i", range(800))))
    with pytest.raises(wire.PromptBaseUnknown):  # e's prompt was dropped to stay within 4,000 bytes
        store.resolve("e", base)
    status, body = wire.error_status(wire.PromptBaseUnknown("gone"))
    assert status == 409 and isinstance(wire.error_from_wire(status, wire.dumps(body)), wire.PromptBaseUnknown)


def test_routed_experts_travel_as_base64_int16_with_their_shape():
    import base64

    import numpy as np

    routed = np.array([[[-1, -1], [3, 0]], [[-1, -1], [7, 32767]], [[-1, -1], [1, 2]]], dtype=np.int16)  # [T, L, K]
    timings = GenerateTimings(queued_s=0.0, first_token_s=0.1, total_s=0.2)
    result = GenerateResult(
        request_id="r",
        output_ids=(4, 5),
        output_logprobs=(-0.5, -0.25),
        finish_reason="length",
        policy_version=1,
        last_policy_version=1,
        prompt_tokens=2,
        cached_tokens=0,
        timings=timings,
        routed_experts=routed,
    )
    message = roundtrip(wire.result_to_wire(result))
    assert message["routed_experts"]["shape"] == [3, 2, 2]
    assert base64.b64decode(message["routed_experts"]["i16"]) == routed.astype("<i2").tobytes()  # 2 bytes an entry
    back = wire.result_from_wire(message)
    assert back == result and back.routed_experts.dtype == np.int16
    np.testing.assert_array_equal(back.routed_experts, routed)
    chunk = TokenChunk(
        request_id="r",
        index=2,
        token_ids=(),
        logprobs=(),
        policy_version=1,
        finish_reason="stop",
        routed_experts=routed,
    )
    np.testing.assert_array_equal(wire.chunk_from_wire(roundtrip(wire.chunk_to_wire(chunk))).routed_experts, routed)
    plain = TokenChunk(request_id="r", index=0, token_ids=(1,), logprobs=(-0.1,), policy_version=1)
    assert wire.chunk_to_wire(plain) is plain  # no routing: orjson writes the dataclass itself, as before
    assert wire.chunk_from_wire(roundtrip(plain)).routed_experts is None
    for bad, match in [
        ({"shape": [3, 2], "i16": ""}, "three integers in"),
        ({"shape": [2**63, 0, 1], "i16": ""}, "three integers in"),  # a hostile engine: a WireError, not numpy's
        ({"shape": [3, 2, 2], "i16": "***"}, "base64"),
        ({"shape": [3, 2, 2], "i16": "AAAA"}, "do not hold"),
        ([1, 2], "null or"),
    ]:
        with pytest.raises(wire.WireError, match=match):
            wire.result_from_wire({**message, "routed_experts": bad})

    # a request's routing fields travel only when it asks, in JSON and in frames
    asks = GenerateRequest(
        request_id="r", execution_id="e", input_ids=[1, 2, 3], return_routed_experts=True, routed_experts_start=2
    )
    assert wire.request_from_wire(roundtrip(wire.request_to_wire(asks))) == asks
    assert wire.generate_from_frame(wire.generate_to_frame(asks, stream=True, submission_id=None))[0] == asks
    silent = GenerateRequest(request_id="r", execution_id="e", input_ids=[1])
    assert "return_routed_experts" not in wire.request_to_wire(silent)

    # a KV export's routing record is one more frame tensor
    keys = (torch.randn(2, 3, 4),)
    export = KVExport(
        request_id="r",
        execution_id="e",
        token_ids=(1, 2, 3),
        policy_version=0,
        keys=keys,
        values=keys,
        routed_experts=torch.from_numpy(routed),
    )
    back = wire.kv_export_from_frame(wire.kv_export_to_frame(export))
    assert back.routed_experts.dtype == torch.int16 and torch.equal(back.routed_experts, export.routed_experts)
    assert torch.equal(back.values[0], keys[0]) and back.nbytes == export.nbytes
    bare = wire.kv_export_from_frame(wire.kv_export_to_frame(KVExport(**{**export.__dict__, "routed_experts": None})))
    assert bare.routed_experts is None and len(bare.values) == 1
