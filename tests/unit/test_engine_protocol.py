"""The engine protocol's dataclasses validate their input with errors naming field, value and what is allowed."""

from __future__ import annotations

import ast
from array import array
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.engine import protocol
from gyre.engine.protocol import (
    Engine,
    GenerateRequest,
    GenerateResult,
    GenerateTimings,
    SamplingParams,
    TokenChunk,
    call_seed,
    starts_with,
)
from gyre.engine.scripted import ScriptedEngine

TIMINGS = GenerateTimings(queued_s=0.0, first_token_s=0.01, total_s=0.02)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1e-9}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": True}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_sampling_params_rejects(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}=.* is not allowed: expected"):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_normalization():
    params = SamplingParams(stop_token_ids=[2, 7], temperature=0)
    assert params.stop_token_ids == (2, 7) and params.greedy and not params.filters
    assert SamplingParams(top_p=1).top_p == 1 and SamplingParams(top_k=3).filters
    assert hash(params) == hash(SamplingParams(stop_token_ids=(2, 7), temperature=0))  # frozen and hashable
    with pytest.raises(AttributeError):
        params.temperature = 1.0


def test_call_seed_is_a_function_of_the_run_seed_the_execution_and_the_prompt():
    seed = call_seed(7, "g000001-e0000002", [5, 6, 7])
    assert 0 <= seed < 2**63 and SamplingParams(seed=seed).seed == seed
    assert call_seed(7, "g000001-e0000002", array("i", [5, 6, 7])) == seed  # any sequence of ids, same bytes
    others = {
        call_seed(8, "g000001-e0000002", [5, 6, 7]),
        call_seed(7, "g000001-e0000003", [5, 6, 7]),
        call_seed(7, "g000001-e0000002", [5, 6, 7, 8]),
        call_seed(7, "g000001-e000000", [2, 5, 6, 7]),  # the execution id and the prompt do not run together
    }
    assert seed not in others and len(others) == 4
    with pytest.raises(ValueError, match=r"^run_seed=-1 is not allowed"):
        call_seed(-1, "x", [1])


def test_generate_request_validation():
    request = GenerateRequest(request_id="r1", execution_id="e1", input_ids=[1, 2, 3])
    assert list(request.input_ids) == [1, 2, 3] and request.params == SamplingParams()
    for kwargs, field in [
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1, -1]}, "input_ids"),
        ({"input_ids": [1, True]}, "input_ids"),
        ({"request_id": ""}, "request_id"),
        ({"execution_id": 5}, "execution_id"),
        ({"params": {"temperature": 1}}, "params"),
        ({"return_routed_experts": 1}, "return_routed_experts"),
        ({"routed_experts_start": -1}, "routed_experts_start"),
        ({"routed_experts_start": 1.0}, "routed_experts_start"),
    ]:
        base = {"request_id": "r1", "execution_id": "e1", "input_ids": [1]} | kwargs
        with pytest.raises(ValueError, match=rf"^{field}="):
            GenerateRequest(**base)


def test_result_and_chunk_validation():
    common = {"request_id": "r", "policy_version": 3, "last_policy_version": 3, "timings": TIMINGS}
    result = GenerateResult(
        output_ids=(4, 5),
        output_logprobs=(-0.1, -2.0),
        finish_reason="stop",
        prompt_tokens=3,
        cached_tokens=2,
        **common,
    )
    assert result.finish_reason == "stop"
    with pytest.raises(ValueError, match=r"^finish_reason='eos'"):
        GenerateResult(
            output_ids=(), output_logprobs=(), finish_reason="eos", prompt_tokens=1, cached_tokens=0, **common
        )
    with pytest.raises(ValueError, match=r"^output_logprobs="):
        GenerateResult(
            output_ids=(1,), output_logprobs=(), finish_reason="length", prompt_tokens=1, cached_tokens=0, **common
        )
    with pytest.raises(ValueError, match=r"^cached_tokens=4"):
        GenerateResult(
            output_ids=(), output_logprobs=(), finish_reason="abort", prompt_tokens=3, cached_tokens=4, **common
        )
    TokenChunk(request_id="r", index=0, token_ids=(), logprobs=(), policy_version=0, finish_reason="abort")
    with pytest.raises(ValueError, match=r"^logprobs="):
        TokenChunk(request_id="r", index=0, token_ids=(1, 2), logprobs=(0.0,), policy_version=0)


def test_engine_protocol_is_structural():
    # The runtime check looks at method names only; the package's scripted stand-in is one such structural Engine.
    assert isinstance(ScriptedEngine(lambda request: ()), Engine)
    assert not isinstance(object(), Engine)


def test_protocol_module_needs_no_torch_at_runtime():
    """protocol.py itself imports stdlib and gyre.config only (torch for type hints under TYPE_CHECKING), so it
    can move out of the torch-importing `gyre.engine` package without change."""
    tree = ast.parse(Path(protocol.__file__).read_text())
    modules = set()
    for node in tree.body:  # top level only: the TYPE_CHECKING block is an `if`, not an import
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            modules.add((node.module or "").split(".")[0] if node.module != "gyre.config.checks" else "gyre.config")
    assert modules <= {
        "__future__",
        "array",
        "asyncio",
        "collections",
        "dataclasses",
        "hashlib",
        "typing",
        "gyre.config",
    }, modules


def test_prompt_ids_are_kept_as_a_private_int32_array():
    from array import array

    source = array("i", [3, 1, 4])
    request = GenerateRequest(request_id="r", execution_id="e", input_ids=source)
    source[0] = 99  # the request holds its own copy
    assert request.input_ids == array("i", [3, 1, 4]) and request.input_ids.typecode == "i"
    assert GenerateRequest(request_id="r", execution_id="e", input_ids=array("q", [7])).input_ids == array("i", [7])
    with pytest.raises(ValueError, match="negative"):
        GenerateRequest(request_id="r", execution_id="e", input_ids=array("i", [1, -1]))
    with pytest.raises(ValueError, match="int32"):
        GenerateRequest(request_id="r", execution_id="e", input_ids=array("q", [2**40]))
    with pytest.raises(ValueError, match="int32"):
        GenerateRequest(request_id="r", execution_id="e", input_ids=[2**40])


def test_routed_experts_fields():
    from gyre.engine.protocol import check_request

    request = GenerateRequest(request_id="r", execution_id="e", input_ids=[1, 2, 3])
    assert (request.return_routed_experts, request.routed_experts_start) == (False, 0)
    check_request(
        GenerateRequest(request_id="r", execution_id="e", input_ids=[1, 2, 3], routed_experts_start=3),
        in_flight=(),
        vocab_size=None,
        context_length=None,
    )
    beyond = GenerateRequest(request_id="r", execution_id="e", input_ids=[1, 2, 3], routed_experts_start=4)
    with pytest.raises(ValueError, match=r"^routed_experts_start=4 is not allowed: expected an integer in \[0, "):
        check_request(beyond, in_flight=(), vocab_size=None, context_length=None)

    import numpy as np

    common = {"request_id": "r", "policy_version": 0, "last_policy_version": 0, "timings": TIMINGS}
    fields = {"output_ids": (4,), "output_logprobs": (-0.1,), "finish_reason": "length", "prompt_tokens": 2}
    routed = np.full((2, 3, 2), -1, dtype=np.int16)
    result = GenerateResult(**fields, cached_tokens=0, routed_experts=routed, **common)
    assert result == GenerateResult(**fields, cached_tokens=0, **common)  # not compared: arrays have no single truth
    for bad in (routed.astype(np.int32), routed[0], [[[-1]]]):
        with pytest.raises(ValueError, match=r"^routed_experts=.* expected None or an int16"):
            GenerateResult(**fields, cached_tokens=0, routed_experts=bad, **common)
        with pytest.raises(ValueError, match=r"^routed_experts="):
            TokenChunk(request_id="r", index=0, token_ids=(), logprobs=(), policy_version=0, routed_experts=bad)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=40), st.lists(st.integers(0, 2**31 - 1), max_size=40))
def test_starts_with_is_a_prefix_test(ids, prefix):
    whole, part = array("i", ids), array("i", prefix)
    assert starts_with(whole, part) == (ids[: len(prefix)] == prefix)
    assert starts_with(array("i", prefix + ids), part)
