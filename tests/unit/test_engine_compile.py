"""The native engine's compiled decode (`compile_decode=True`): the same tokens and log-probs as the eager engine.

Inductor on CPU compiles C++ kernels, so these tests need a C++ compiler; without one they are skipped (with the
reason). Each new batch shape compiles again (C++ kernels: 15-30 s on 2 cores with a cold inductor cache, as CI's
is), so every decode step here runs a batch of 4 and the file compiles once: ~30 s cold, where batches shrinking
4 -> 3 -> 1 compiled three times (46-92 s). A batch that changes shape is torch's recompilation, not gyre's code
(the compiled step takes the same arguments at every shape).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import random
import shutil

import pytest
import torch
from engine_fixtures import VOCAB, sharp_tiny_model

from gyre.engine.decode import decode_forward, decode_weights
from gyre.engine.native import NativeEngine
from gyre.engine.protocol import GenerateRequest, SamplingParams
from gyre.engine.sampling import sequence_logprobs
from gyre.models.decoder import DecoderLM, KVCache
from gyre.models.decoder_config import RopeScaling

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="torch.compile's CPU backend (inductor) needs a C++ compiler (g++ or c++); none found",
)
TIMEOUT_S = 120.0  # includes compiling


@pytest.fixture(scope="module")
def model():
    return sharp_tiny_model()


def run_all(engine: NativeEngine, requests: list[GenerateRequest]):
    async def go():
        try:
            return await asyncio.wait_for(asyncio.gather(*(engine.generate(r) for r in requests)), TIMEOUT_S)
        finally:
            await engine.close()

    return asyncio.run(go())


def make_requests(tag: str) -> list[GenerateRequest]:
    """Eight requests of varied prompts and sampling, each 12 new tokens: with `max_running=4` every decode step
    runs a batch of 4, so the compiled step compiles once (a new batch shape would compile again: C++ kernels, tens
    of seconds on 2 cores with a cold inductor cache) and the whole file stays cheap."""
    rng = random.Random(0)
    requests = []
    for i in range(8):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        if i % 2 == 0:
            params = SamplingParams(temperature=0.0, max_new_tokens=12)
        else:
            params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_new_tokens=12, seed=i)
        requests.append(
            GenerateRequest(request_id=f"{tag}{i}", execution_id=f"{tag}{i}", input_ids=prompt, params=params)
        )
    return requests


def yarn_variant(model: DecoderLM) -> DecoderLM:
    """`model`'s weights under YaRN RoPE whose original length (8) the test's positions (10-19) pass."""
    scaling = RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=8)
    variant = DecoderLM(dataclasses.replace(model.config, rope_scaling=scaling))
    variant.load_state_dict(model.state_dict())
    return variant.eval()


@pytest.mark.parametrize("rope", ["plain", "yarn"])
def test_decode_forward_equals_the_module_forward_with_a_cache(model, rope):
    model = yarn_variant(model) if rope == "yarn" else model
    torch.manual_seed(0)
    config = model.config
    L, K, D, B, S = config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 3, 10
    keys_LBKSD, values_LBKSD = torch.randn(L, B, K, S, D), torch.randn(L, B, K, S, D)
    mask_BS = torch.rand(B, S) < 0.7
    mask_BS[:, 0] = True
    ids_B1, positions_B1 = torch.randint(VOCAB, (B, 1)), torch.randint(S, 2 * S, (B, 1))
    with torch.no_grad():
        logits_BV, new_keys, new_values = decode_forward(
            ids_B1, positions_B1, keys_LBKSD, values_LBKSD, mask_BS, decode_weights(model, torch.device("cpu"))
        )
        # The module forward over the same buffers with one extra column for the new token.
        pad = torch.zeros(L, B, K, 1, D)
        past = KVCache(tuple(torch.cat((keys_LBKSD, pad), 3)), tuple(torch.cat((values_LBKSD, pad), 3)))
        mask = torch.cat((mask_BS, torch.ones(B, 1, dtype=torch.bool)), 1)[:, None, None]
        expected_B1V, cache = model(ids_B1, positions_B1, kv_cache=past, attention_mask=mask, kv_cache_length=S)
    torch.testing.assert_close(logits_BV, expected_B1V[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_keys, torch.stack(cache.keys)[:, :, :, S:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(new_values, torch.stack(cache.values)[:, :, :, S:], atol=1e-6, rtol=1e-6)


def test_compiled_decode_gives_the_eager_engines_tokens_and_logprobs(model):
    eager = run_all(NativeEngine(model, max_running=4), make_requests("e"))
    compiled = run_all(NativeEngine(model, max_running=4, compile_decode=True), make_requests("c"))
    for request, a, b in zip(make_requests("x"), eager, compiled, strict=True):
        assert a.output_ids == b.output_ids
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
        teacher = sequence_logprobs(model, request.input_ids, b.output_ids, request.params)
        assert teacher.tolist() == pytest.approx(list(b.output_logprobs), abs=1e-5)


def test_compiled_decode_follows_release_resume_and_weight_updates(model):
    """The compiled step reads the parameters it is given each step: resumed and updated weights are used."""
    other = sharp_tiny_model()
    with torch.no_grad():
        for param in other.parameters():
            param.add_(0.01 * torch.randn_like(param))
    requests = make_requests

    async def compiled_run():
        engine = NativeEngine(copy.deepcopy(model), max_running=4, compile_decode=True)
        try:
            before = await asyncio.gather(*(engine.generate(r) for r in requests("a")))
            await engine.release_memory()
            await engine.resume_memory()
            resumed = await asyncio.gather(*(engine.generate(r) for r in requests("b")))
            await engine.update_weights(dict(other.named_parameters()), version=1)
            updated = await asyncio.gather(*(engine.generate(r) for r in requests("c")))
            return before, resumed, updated
        finally:
            await engine.close()

    before, resumed, updated = asyncio.run(asyncio.wait_for(compiled_run(), TIMEOUT_S))
    expected = run_all(NativeEngine(copy.deepcopy(other), max_running=4), requests("d"))
    for a, b in zip(before, resumed, strict=True):
        assert (a.output_ids, a.output_logprobs) == (b.output_ids, b.output_logprobs)
    assert any(a.output_ids != b.output_ids for a, b in zip(before, updated, strict=True))  # the update mattered
    for a, b in zip(expected, updated, strict=True):
        assert a.output_ids == b.output_ids
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
