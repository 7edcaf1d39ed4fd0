"""The native engine's own guarantees, checked on its internals (bytes held, the decode step an update lands on).

The protocol behaviour (batching, log-probs, abort, drain, weights, KV migration, bad input) is in
test_engine_contract.py, which runs on the native engine in process and behind the HTTP endpoint.
"""

from __future__ import annotations

import asyncio
import copy
import random

import pytest
import torch
from engine_fixtures import VOCAB, sharp_tiny_model

from gyre.engine.native import NativeEngine
from gyre.engine.protocol import (
    EngineBusyError,
    EngineUnavailableError,
    FlatWeights,
    GenerateRequest,
    SamplingParams,
    TensorSpec,
    WeightUpdateSessionError,
)
from gyre.models.flat_weights import flatten_weights

TIMEOUT_S = 30.0
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def model():
    return sharp_tiny_model()


async def steps(n: int) -> None:
    """Let the engine run about `n` scheduler steps (each step ends with one event-loop round)."""
    for _ in range(n):
        await asyncio.sleep(0)


def run(coro):
    """Every test body is bounded in time."""
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def request(rid: str, prompt, params: SamplingParams = GREEDY, execution: str | None = None) -> GenerateRequest:
    return GenerateRequest(request_id=rid, execution_id=execution or f"exec-{rid}", input_ids=prompt, params=params)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 24))] for _ in range(n)]


def test_release_and_resume_memory_drop_and_return_bytes_with_identical_outputs(model):
    async def main():
        engine = NativeEngine(copy.deepcopy(model), max_running=4)
        batch = prompts(4, seed=2)
        before = await asyncio.gather(*(engine.generate(request(f"m{i}", p)) for i, p in enumerate(batch)))
        held = engine.memory_bytes()
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert held["weights"] == weight_bytes and held["kv"] > 0  # finished requests' prefix KV
        busy = asyncio.ensure_future(engine.generate(request("busy", [1], SamplingParams(max_new_tokens=50))))
        await asyncio.sleep(0)
        with pytest.raises(EngineBusyError):
            await engine.release_memory()
        engine.abort("busy")
        await busy
        await engine.release_memory()
        assert engine.memory_bytes() == {"weights": 0, "kv": 0}
        assert engine.load().memory_released and engine.load().kv_tokens_total == 0
        with pytest.raises(EngineUnavailableError):
            await engine.generate(request("x", [1]))
        await engine.resume_memory()
        assert engine.memory_bytes()["weights"] == weight_bytes
        after = await asyncio.gather(*(engine.generate(request(f"n{i}", p)) for i, p in enumerate(batch)))
        assert [r.output_ids for r in after] == [r.output_ids for r in before]
        assert [r.output_logprobs for r in after] == [r.output_logprobs for r in before]
        await engine.close()

    run(main())


def test_update_weights_changes_outputs_to_those_of_the_new_weights_and_records_version(model):
    new_model = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in new_model.named_parameters():
            if name.endswith("mlp.up_proj.weight"):
                param.mul_(3.0)
    new_weights = {n: p.detach().clone() for n, p in new_model.named_parameters() if "up_proj" in n}

    async def main():
        engine = NativeEngine(copy.deepcopy(model), max_running=4)
        reference = NativeEngine(new_model, max_running=4, policy_version=3)
        batch = prompts(6, seed=4)
        old = [await engine.generate(request(f"o{i}", p)) for i, p in enumerate(batch)]
        # a long request spans the update: it continues, and its tokens show the switch
        span = engine.generate_stream(request("span", [1, 2], SamplingParams(max_new_tokens=60)))
        chunks = []
        async for chunk in span:
            chunks.append(chunk)
            if len(chunks) == 5:
                with pytest.raises(ValueError, match="unknown parameter"):
                    await engine.update_weights({"nope": torch.zeros(1)}, version=3)
                await engine.update_weights(new_weights, version=3)
                with pytest.raises(ValueError, match="version"):
                    await engine.update_weights(new_weights, version=2)
        assert [c.policy_version for c in chunks] == [0] * 5 + [3] * 55
        assert chunks[-1].finish_reason == "length"
        new = [await engine.generate(request(f"n{i}", p)) for i, p in enumerate(batch)]
        expected = [await reference.generate(request(f"e{i}", p)) for i, p in enumerate(batch)]
        assert [r.output_ids for r in new] == [r.output_ids for r in expected]
        assert [r.output_ids for r in new] != [r.output_ids for r in old]
        assert all(r.policy_version == 3 and r.last_policy_version == 3 for r in new)
        assert engine.load().policy_version == 3
        await engine.close()
        await reference.close()

    run(main())


def test_a_request_blocked_by_a_pinned_export_waits_without_spinning_and_runs_once_it_is_released(model):
    """Nothing decodes and the next request does not fit next to a pinned export: the engine waits for the release
    (it stepped through empty steps at 100% of a core before), then serves the request."""

    async def main():
        engine = NativeEngine(copy.deepcopy(model), max_running=2, max_tokens_in_flight=64)
        task = asyncio.ensure_future(engine.generate(request("p", [1, 2, 3], SamplingParams(max_new_tokens=40))))
        await steps(3)
        export = await engine.export_kv("p")
        await task
        calls = 0
        step = engine._step

        def counting_step():
            nonlocal calls
            calls += 1
            step()

        engine._step = counting_step
        blocked = asyncio.ensure_future(engine.generate(request("b", [4, 5, 6], SamplingParams(max_new_tokens=60))))
        await asyncio.sleep(0.3)
        assert not blocked.done() and calls <= 2, calls  # 64 - pinned < 63 tokens: it cannot be admitted
        assert engine.release_export("p") is True
        result = await asyncio.wait_for(blocked, 30)
        assert len(result.output_ids) == 60 and len(export.token_ids) > 1
        await engine.close()

    run(main())


def test_update_weights_from_a_flat_buffer(model):
    name = "model.layers.0.mlp.up_proj.weight"
    tensor = dict(model.named_parameters())[name].detach() * 2.0
    flat = FlatWeights(
        buffer=tensor.contiguous().view(-1).view(torch.uint8).clone(),
        manifest=(TensorSpec(name=name, dtype="float32", shape=tuple(tensor.shape), offset=0),),
    )

    async def main():
        engine = NativeEngine(copy.deepcopy(model))
        await engine.update_weights(flat, version=1)
        assert torch.equal(dict(engine.model.named_parameters())[name], tensor)
        await engine.close()

    run(main())


def test_export_stays_pinned_until_released(model):
    async def main():
        engine = NativeEngine(copy.deepcopy(model), max_running=2, max_tokens_in_flight=64)
        task = asyncio.ensure_future(engine.generate(request("p", [1, 2, 3], SamplingParams(max_new_tokens=40))))
        await steps(3)
        export = await engine.export_kv("p")
        assert (await task).finish_reason == "abort"
        assert engine.memory_bytes()["kv"] == export.nbytes
        assert engine.load().kv_tokens_free == 64 - len(export.token_ids)
        with pytest.raises(EngineBusyError):
            await engine.release_memory()
        with pytest.raises(KeyError):
            await engine.export_kv("p")
        assert engine.release_export("p") is True and engine.release_export("p") is False
        assert engine.memory_bytes()["kv"] == 0
        await engine.close()

    run(main())


def test_a_mixture_of_experts_model_generates_and_its_logprobs_equal_the_full_forward():
    """The native engine serves the shared model's MoE layout (gyre.models.moe, docs/moe.md): batched, prefix-cached
    generation of several requests gives the log-probs a teacher-forced full forward assigns to the same tokens."""
    from gyre.models.decoder import build_model
    from gyre.models.moe import tiny_qwen3_moe_config

    config = tiny_qwen3_moe_config(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None)
    moe = build_model(config, seed=3).eval()
    with pytest.raises(ValueError, match="compile_decode"):
        NativeEngine(copy.deepcopy(moe), compile_decode=True)

    async def main():
        engine = NativeEngine(copy.deepcopy(moe), max_running=3)
        return await asyncio.gather(*(engine.generate(request(f"e{i}", p)) for i, p in enumerate(prompts(3, seed=5))))

    results = run(main())
    for prompt, result in zip(prompts(3, seed=5), results, strict=True):
        ids = torch.tensor([[*prompt, *result.output_ids]])
        with torch.no_grad():
            logits, _ = moe(ids, torch.arange(ids.shape[1])[None])
        logprobs = torch.log_softmax(logits[0, len(prompt) - 1 : -1].double(), -1)
        expected = logprobs.gather(-1, torch.tensor(result.output_ids)[:, None])[:, 0]
        assert len(result.output_ids) == GREEDY.max_new_tokens
        assert torch.allclose(torch.tensor(result.output_logprobs, dtype=torch.float64), expected, atol=1e-4)


def test_routing_is_asked_of_the_model_only_for_requests_that_want_it():
    """The model computes routed experts only in forwards holding a request that asked (the dense path and requests
    that do not ask cost nothing); a request aborted while queued fed nothing: its record is all -1 (unknown)."""
    from gyre.models.decoder import build_model
    from gyre.models.moe import tiny_qwen3_moe_config

    moe = build_model(tiny_qwen3_moe_config(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None), seed=3).eval()
    engine = NativeEngine(copy.deepcopy(moe), max_running=1)
    asked: list[tuple[int, bool]] = []  # (tokens in the forward, return_routed_experts)
    forward = engine.model.forward

    def spy(ids, *args, **kwargs):
        asked.append((ids.shape[1], kwargs.get("return_routed_experts", False)))
        return forward(ids, *args, **kwargs)

    engine.model.forward = spy
    wants = GenerateRequest(
        request_id="w", execution_id="w", input_ids=[1, 2, 3, 4], params=GREEDY, return_routed_experts=True
    )
    queued = GenerateRequest(
        request_id="q", execution_id="q", input_ids=[5, 6, 7], params=GREEDY, return_routed_experts=True
    )

    async def main():
        plain = await engine.generate(request("p", [1, 2, 3, 4]))
        assert not any(flag for _, flag in asked) and plain.routed_experts is None
        asked.clear()
        first = asyncio.ensure_future(engine.generate(wants))
        later = asyncio.ensure_future(engine.generate(queued))
        await asyncio.sleep(0)
        assert engine.abort("q") is True
        return await first, await later

    first, aborted = run(main())
    assert asked[0] == (4, True) and all(flag for _, flag in asked)  # prefill, then every decode step
    assert first.routed_experts.shape == (4 + 12 - 1, 4, 2)
    assert aborted.finish_reason == "abort" and aborted.routed_experts.shape == (2, 4, 2)
    assert (aborted.routed_experts == -1).all()


def test_a_cached_prefix_without_routing_is_computed_again_for_a_request_that_asks():
    """Found in review: a prefix cached by a request that did not ask for routing was reused with -1 routing, so the
    proxy asked from position 0 at every later call and each carried the whole history's routing. A request that
    asks recomputes from the first position it asks for that the cache does not know; later calls reuse it."""
    import numpy as np

    from gyre.models.decoder import build_model
    from gyre.models.moe import tiny_qwen3_moe_config

    moe = build_model(tiny_qwen3_moe_config(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None), seed=3).eval()
    params = SamplingParams(temperature=0.0, max_new_tokens=5)

    async def main():
        engine = NativeEngine(copy.deepcopy(moe))
        context = [3, 1, 4, 1, 5, 9, 2, 6]
        first = await engine.generate(
            GenerateRequest(request_id="c0", execution_id="x", input_ids=context, params=params)
        )
        context += list(first.output_ids)
        turns = []
        for turn in range(1, 3):
            context += [7, 7]
            asked = GenerateRequest(
                request_id=f"c{turn}",
                execution_id="x",
                input_ids=context,
                params=params,
                return_routed_experts=True,
                routed_experts_start=0,
            )
            result = await engine.generate(asked)
            turns.append((result.cached_tokens, np.flatnonzero((result.routed_experts == -1).all(axis=(1, 2)))))
            context += list(result.output_ids)
        return turns

    (cached_1, unrouted_1), (cached_2, unrouted_2) = run(main())
    assert cached_1 == 0 and cached_2 > 0  # recomputed once, then reused with its routing
    assert len(unrouted_1) == 0 and len(unrouted_2) == 0


def test_a_held_step_loop_moves_only_by_the_steps_released_and_still_aborts_and_exports(model):
    """`hold()`: queued requests wait unadmitted whatever the time; `release(steps=k)` admits and runs exactly k steps
    (k + 1 tokens: the first comes from prefill); held, an abort ends its request and an export takes the KV;
    `release()` lets the rest finish exactly as an unheld engine would."""
    long = SamplingParams(temperature=0.0, max_new_tokens=40)

    async def main():
        engine = NativeEngine(copy.deepcopy(model), max_running=4)
        reference = await engine.generate(request("ref", [1, 2, 3], long))
        engine.hold()
        tasks = {rid: asyncio.ensure_future(engine.generate(request(rid, [1, 2, 3], long))) for rid in "abc"}
        await asyncio.sleep(0.05)
        assert engine.load().queued == 3 and not any(task.done() for task in tasks.values())
        engine.release(steps=4)
        await asyncio.wait_for(engine.until_held(), 10)
        await asyncio.sleep(0.05)  # time passes: nothing moves
        assert engine.load().running == 3 and not any(task.done() for task in tasks.values())
        assert engine.abort("a") is True
        aborted = await asyncio.wait_for(tasks["a"], 10)
        export = await engine.export_kv("b")
        exported = await tasks["b"]
        engine.release()
        finished = await tasks["c"]
        assert engine.release_export("b") is True
        await engine.close()
        return reference, aborted, export, exported, finished

    reference, aborted, export, exported, finished = run(main())
    assert aborted.finish_reason == "abort" and aborted.output_ids == reference.output_ids[:5]
    assert exported.finish_reason == "abort" and export.output_ids == reference.output_ids[:5]
    assert finished.output_ids == reference.output_ids and finished.finish_reason == "length"
    with pytest.raises(ValueError, match="steps"):
        NativeEngine(copy.deepcopy(model)).release(steps=0)


def _new_weights(model) -> dict[str, torch.Tensor]:
    """Every parameter changed (a weight update a bucketed publication would stream)."""
    return {name: param.detach() * 1.5 + 0.01 for name, param in model.named_parameters()}


def test_a_bucket_by_bucket_update_equals_a_whole_update_bit_for_bit(model):
    weights = _new_weights(model)
    names = list(weights)
    buckets = [flatten_weights({n: weights[n] for n in names[i : i + 4]}) for i in range(0, len(names), 4)]

    async def main():
        whole, streamed = NativeEngine(copy.deepcopy(model)), NativeEngine(copy.deepcopy(model))
        await whole.update_weights(flatten_weights(weights), version=2)
        await streamed.begin_update(version=2)
        for bucket in reversed(buckets):  # any order
            await streamed.load_bucket(bucket)
        await streamed.end_update(version=2)
        outputs = []
        for engine in (whole, streamed):
            outputs.append(await engine.generate(request("r", [3, 1, 4, 1, 5])))
            await engine.close()
        return whole, streamed, outputs

    whole, streamed, (a, b) = run(main())
    got, expected = dict(streamed.model.named_parameters()), dict(whole.model.named_parameters())
    assert len(buckets) > 1 and list(got) == names
    assert all(torch.equal(got[n], expected[n]) and torch.equal(got[n], weights[n]) for n in names)
    assert (a.output_ids, a.output_logprobs) == (b.output_ids, b.output_logprobs) and b.policy_version == 2


def test_no_step_runs_from_begin_update_to_end_update(model):
    """The step loop waits at its boundary for the whole session however long it takes; the request then goes on,
    its tokens after the update from the new weights."""

    async def main():
        engine = NativeEngine(copy.deepcopy(model), max_running=2)
        calls = 0
        step = engine._step

        def counting_step():
            nonlocal calls
            calls += 1
            step()

        engine._step = counting_step
        stream = engine.generate_stream(request("s", [1, 2], SamplingParams(temperature=0.0, max_new_tokens=40)))
        chunks = [await stream.__anext__() for _ in range(3)]
        await engine.begin_update(version=1)
        at_begin, tokens_at_begin = calls, len(engine._running[0].output_ids)
        queued = asyncio.ensure_future(engine.generate(request("q", [5], SamplingParams(max_new_tokens=2))))
        await engine.load_bucket(flatten_weights(_new_weights(model)))
        await asyncio.sleep(0.2)
        held = (calls - at_begin, len(engine._running[0].output_ids) - tokens_at_begin, engine.load().queued)
        await engine.end_update(version=1)
        chunks += [chunk async for chunk in stream]
        late = await queued
        await engine.close()
        return held, chunks, late

    (steps_held, tokens_held, queued), chunks, late = run(main())
    assert (steps_held, tokens_held, queued) == (0, 0, 1)
    versions = [c.policy_version for c in chunks]
    assert versions[:3] == [0, 0, 0] and versions[-1] == 1 and versions == sorted(versions)
    assert chunks[-1].finish_reason == "length" and late.policy_version == late.last_policy_version == 1


def test_a_bad_bucket_applies_nothing_and_the_session_stays_open(model):
    weights = _new_weights(model)
    good = "model.layers.0.mlp.up_proj.weight"

    async def main():
        engine = NativeEngine(copy.deepcopy(model))
        before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        await engine.begin_update(version=1)
        bad_shape = {good: weights[good], "model.norm.weight": torch.ones(3)}
        with pytest.raises(ValueError, match=r"model.norm.weight is torch.float32 \(3,\), expected torch.float32"):
            await engine.load_bucket(flatten_weights(bad_shape))
        with pytest.raises(ValueError, match="unknown parameter name 'nope'"):
            await engine.load_bucket({good: weights[good], "nope": torch.zeros(1)})
        with pytest.raises(TypeError, match=r"expected a torch\.Tensor"):
            await engine.load_bucket({good: weights[good], "model.norm.weight": [1.0]})
        untouched = all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())
        await engine.abort_update()  # nothing was applied: the engine serves its old weights as before
        result = await engine.generate(request("r", [1, 2, 3]))
        await engine.close()
        return untouched, result, engine.load()

    untouched, result, load = run(main())
    assert untouched and result.policy_version == 0 and load.accepting and load.policy_version == 0


def test_weight_update_sessions_refuse_out_of_order_calls_and_released_weights(model):
    bucket = flatten_weights({"model.norm.weight": torch.ones(32)})

    async def main():
        engine = NativeEngine(copy.deepcopy(model), policy_version=3)
        with pytest.raises(WeightUpdateSessionError, match="load_bucket needs an open weight-update session"):
            await engine.load_bucket(bucket)
        with pytest.raises(WeightUpdateSessionError, match="end_update needs an open weight-update session"):
            await engine.end_update(version=3)
        await engine.abort_update()  # no session: nothing to do
        for bad in (2, "4", 4.0, True):
            with pytest.raises(ValueError, match=f"version={bad!r} is not allowed: expected an integer >= 3"):
                await engine.begin_update(version=bad)
        await engine.begin_update(version=3)  # the same version again is allowed
        with pytest.raises(WeightUpdateSessionError, match="a weight-update session for version 3 is open"):
            await engine.update_weights(bucket, version=4)
        with pytest.raises(WeightUpdateSessionError, match="release_memory during a weight-update session"):
            await engine.release_memory()
        await engine.abort_update()
        await engine.release_memory()
        with pytest.raises(EngineUnavailableError, match="weights are released"):
            await engine.begin_update(version=4)
        await engine.resume_memory()
        await engine.update_weights(bucket, version=4)  # a subset is fine for update_weights
        await engine.close()
        return engine.load().policy_version

    assert run(main()) == 4
