"""gyre.trainer.publish: weights trained by Megatron reach a native engine, which then generates exactly what an
engine built from the same weights generates; a refused publication changes nothing. The native trainable
publishes through the same call, without loading Megatron (checked in a fresh interpreter)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from gyre.distributed.transport import unflatten
from gyre.engine.native import NativeEngine
from gyre.engine.protocol import EngineUnavailableError, GenerateRequest, SamplingParams
from gyre.models.decoder import build_model
from gyre.models.decoder_config import DecoderConfig

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
    from gyre.runtime.controller.transitions import publish_to_engines
    from gyre.trainer.convert import load_hf_state_dict
    from gyre.trainer.model import build_gpt_model
    from gyre.trainer.publish import engine_weights

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
    from gyre.trainer.convert import load_hf_state_dict
    from gyre.trainer.logprobs import packed_logprobs
    from gyre.trainer.model import build_gpt_model
    from gyre.trainer.publish import engine_weights

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


def test_native_trainable_publishes_a_copy_of_its_weights_in_the_engines_names():
    from gyre.runtime.controller.transitions import publish_to_engines
    from gyre.trainer.native_trainable import NativeTrainable
    from gyre.trainer.publish import engine_weights

    trainable = NativeTrainable(build_model(CONFIG, seed=3), lr=1e-3)
    weights = engine_weights(trainable)
    state = {n: t.clone() for n, t in trainable.model.state_dict().items()}
    published = unflatten(weights.buffer, weights.manifest)
    assert list(published) == list(state)
    for name, tensor in state.items():
        assert torch.equal(published[name], tensor), name
    assert engine_weights(trainable.model).manifest == weights.manifest  # the module itself: the same call
    with torch.no_grad():  # a later update of the trainer does not reach what was published
        for p in trainable.parameters():
            p.add_(1.0)
    moved = trainable.model.state_dict()
    assert all(torch.equal(published[n], state[n]) and not torch.equal(moved[n], state[n]) for n in state)
    half = engine_weights(trainable, dtype=torch.bfloat16)
    assert {spec.dtype for spec in half.manifest} == {"bfloat16"}

    async def main():  # an engine built from other weights then holds exactly the published ones
        engine = NativeEngine(build_model(CONFIG, seed=8))
        await publish_to_engines([engine], weights, version=1)
        served = engine.model.state_dict()
        assert set(served) == set(published)
        assert all(torch.equal(served[n], t) for n, t in published.items())
        assert engine.load().policy_version == 1
        await engine.close()

    asyncio.run(main())


def test_engine_weights_names_what_it_takes():
    from gyre.trainer.native_trainable import NativeTrainable
    from gyre.trainer.publish import engine_weights

    with pytest.raises(TypeError, match="needs its DecoderConfig"):  # not the native decoder: a Megatron model
        engine_weights(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="expected a trainable with a `model` module"):
        engine_weights(object())
    other = DecoderConfig(**{**CONFIG.__dict__, "num_hidden_layers": 1})
    with pytest.raises(ValueError, match="is not the native model's config"):
        engine_weights(NativeTrainable(build_model(CONFIG, seed=3), lr=1e-3), other)


NATIVE_PUBLICATION = """
import json, sys
from gyre.models.decoder import build_model
from gyre.models.decoder_config import DecoderConfig
from gyre.trainer.native_trainable import NativeTrainable
from gyre.trainer.publish import engine_weights
config = DecoderConfig(model_type="qwen3", vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8)
weights = engine_weights(NativeTrainable(build_model(config, seed=0), lr=1e-3))
print(json.dumps({"tensors": len(weights.manifest), "modules": sorted(sys.modules)}))
"""


def test_a_native_publication_loads_no_megatron():
    """In a fresh interpreter, so another test's imports cannot hide it: a native run's publication path (the
    trainable, `engine_weights`) loads neither megatron nor gyre.trainer.convert, nor any gyre.engine module."""
    out = subprocess.run(
        [sys.executable, "-c", NATIVE_PUBLICATION], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["tensors"] > 0
    loaded = report["modules"]
    for forbidden in ("megatron", "transformer_engine", "gyre.trainer.convert", "gyre.trainer.model", "gyre.engine"):
        bad = [m for m in loaded if m == forbidden or m.startswith(forbidden + ".")]
        assert bad == [], f"a native publication loads {forbidden}: {bad[:10]}"


def streamed(trainer, engines, version, *, bucket_bytes=4096):
    """`stream_to_engines` as the controller runs it: the trainer's stream on a thread, the engines fed here."""
    from gyre.runtime.controller.transitions import stream_to_engines
    from gyre.trainer.weight_stream import BucketPipe, stream_weights

    pipe = BucketPipe(slots=2)

    async def run():
        loop = asyncio.get_running_loop()

        def start():
            produce = lambda: stream_weights(  # noqa: E731
                trainer, CONFIG, dtype=torch.float32, bucket_bytes=bucket_bytes, sink=pipe
            )
            return loop.run_in_executor(None, produce)

        return await stream_to_engines(engines, pipe, start, version=version, timeout_s=60)

    return asyncio.run(run()), pipe


def test_a_stream_reaches_every_engine_in_buckets_and_generates_as_the_trainer():
    trainer = build_model(CONFIG, seed=5)
    engines = [NativeEngine(build_model(CONFIG, seed=0)) for _ in range(2)]
    phases, pipe = streamed(trainer, engines, 3)
    assert phases["bytes"] >= sum(t.numel() * 4 for t in trainer.state_dict().values())
    assert 1 <= pipe.most_in_use <= 2  # never more than two buckets alive
    reference = NativeEngine(build_model(CONFIG, seed=5))
    expected = asyncio.run(greedy(reference, "r"))
    for i, engine in enumerate(engines):
        assert engine.policy_version == 3
        assert asyncio.run(greedy(engine, f"e{i}")) == expected


def test_an_engine_that_refuses_a_bucket_is_left_out_and_the_others_still_get_the_version():
    trainer = build_model(CONFIG, seed=5)
    wrong = dataclasses.replace(CONFIG, intermediate_size=40)  # refuses the MLP tensors
    good, bad = NativeEngine(build_model(CONFIG, seed=0)), NativeEngine(build_model(wrong, seed=0))
    with pytest.raises(RuntimeError, match=r"publishing version 2 to .* failed"):
        streamed(trainer, [good, bad], 2)
    assert good.policy_version == 2 and bad.policy_version == 0
    with pytest.raises(EngineUnavailableError):  # bad holds partial weights
        asyncio.run(greedy(bad, "b"))


def test_a_policy_directory_streams_into_an_engine_in_buckets(tmp_path):
    """A cell that returns inside a burst loads the last publication from its policy directory, in buckets."""
    from gyre.models.hf_weights import checkpoint_buckets, save_pretrained
    from gyre.runtime.controller.transitions import stream_checkpoint_to_engine

    trained = build_model(CONFIG, seed=5)
    save_pretrained(trained, tmp_path / "v4", max_shard_bytes=8192)
    buckets = list(checkpoint_buckets(tmp_path / "v4", dtype=torch.float32, bucket_bytes=4096))
    assert len(buckets) > 2 and all(len(b.manifest) == 1 or b.buffer.numel() <= 4096 + 16 * 8 for b in buckets)
    engine = NativeEngine(build_model(CONFIG, seed=0))
    asyncio.run(stream_checkpoint_to_engine(engine, tmp_path / "v4", version=4, dtype=torch.float32, bucket_bytes=4096))
    assert engine.policy_version == 4
    assert asyncio.run(greedy(engine, "p")) == asyncio.run(greedy(NativeEngine(build_model(CONFIG, seed=5)), "r"))
