"""gyre.train.publish: weights trained by Megatron reach a native engine, which then generates exactly what an
engine built from the same weights generates; a refused publication changes nothing."""

from __future__ import annotations

import asyncio

import pytest
import torch

from gyre.distributed.transport import unflatten
from gyre.engine.hf_config import DecoderConfig
from gyre.engine.model import build_model
from gyre.engine.native import NativeEngine
from gyre.engine.protocol import GenerateRequest, SamplingParams

CONFIG = DecoderConfig(
    model_type="qwen3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    qk_norm=True,
)


async def greedy(engine: NativeEngine, name: str) -> list[list[int]]:
    prompts = [[1, 2, 3], [5, 9, 11, 4], [7]]
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    results = [
        await engine.generate(GenerateRequest(request_id=f"{name}{i}", execution_id="x", input_ids=p, params=params))
        for i, p in enumerate(prompts)
    ]
    return [list(r.output_ids) for r in results]


def test_trained_weights_reach_the_engine(model_parallel):
    from gyre.train.convert import load_hf_state_dict
    from gyre.train.model import build_gpt_model
    from gyre.train.publish import engine_weights, publish_to_engines

    native = build_model(CONFIG, seed=5)
    model = build_gpt_model(CONFIG)
    load_hf_state_dict(model, native.state_dict(), CONFIG)
    with torch.no_grad():  # "training": move every parameter
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    weights = engine_weights(model, CONFIG)
    stale = engine_weights(build_gpt_model(CONFIG), CONFIG)
    trained = build_model(CONFIG, seed=0)
    trained.load_state_dict({n: t.clone() for n, t in unflatten(weights.buffer, weights.manifest).items()})

    async def main():
        engine, fresh = NativeEngine(build_model(CONFIG, seed=5)), NativeEngine(trained)
        before = await greedy(engine, "before")
        await publish_to_engines([engine], weights, version=2)
        assert engine.load().policy_version == 2
        expected = await greedy(fresh, "fresh")
        assert await greedy(engine, "after") == expected
        assert expected != before
        with pytest.raises(RuntimeError, match="version 1"):  # older: refused, nothing applied
            await publish_to_engines([engine], stale, version=1)
        assert await greedy(engine, "still") == expected
        assert engine.load().policy_version == 2
        await engine.close()
        await fresh.close()

    asyncio.run(main())


def test_engine_behavior_logprobs_equal_the_trainers_after_a_round_trip(model_parallel):
    """docs/architecture.md contract 5 end to end: HF -> Megatron -> HF -> engine; the engine samples (temperature 1)
    and reports behavior log-probs; the trainer's log-probs of the same tokens agree within 1e-4 (fp32)."""
    from gyre.train.convert import load_hf_state_dict
    from gyre.train.logprobs import packed_logprobs
    from gyre.train.model import build_gpt_model
    from gyre.train.publish import engine_weights

    model = build_gpt_model(CONFIG)
    load_hf_state_dict(model, build_model(CONFIG, seed=9).state_dict(), CONFIG)
    weights = engine_weights(model, CONFIG)
    served = build_model(CONFIG, seed=0)
    served.load_state_dict({n: t.clone() for n, t in unflatten(weights.buffer, weights.manifest).items()})
    prompts = [[1, 2, 3], [5, 9, 11, 4, 8, 8], [7]]

    async def sample():
        engine = NativeEngine(served)
        params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=11)
        results = [
            await engine.generate(GenerateRequest(request_id=f"s{i}", execution_id="x", input_ids=p, params=params))
            for i, p in enumerate(prompts)
        ]
        await engine.close()
        return results

    worst = 0.0
    for prompt, result in zip(prompts, asyncio.run(sample()), strict=True):
        ids = [*prompt, *result.output_ids]
        with torch.no_grad():
            logp_U = packed_logprobs(model, ids, [0, len(ids)])
        trainer = logp_U[len(prompt) :]
        engine = torch.tensor(result.output_logprobs, dtype=torch.float32)
        worst = max(worst, float((trainer - engine).abs().max()))
    print(f"engine vs trainer log-probs: max |diff| {worst:.2e}")
    assert worst <= 1e-4, f"engine vs trainer log-probs: max |diff| {worst:.2e}"
