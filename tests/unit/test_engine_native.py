"""The native engine on CPU: continuous batching, exact log-probs, abort, drain, memory, weights, KV migration."""

from __future__ import annotations

import asyncio
import copy
import random

import pytest
import torch
from engine_fixtures import VOCAB, sharp_tiny_model

from gyre.engine.native import NativeEngine
from gyre.engine.protocol import (
    Engine,
    EngineBusyError,
    EngineUnavailableError,
    FlatWeights,
    GenerateRequest,
    SamplingParams,
    TensorSpec,
)
from gyre.engine.sampling import sequence_logprobs

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


def test_satisfies_protocol(model):
    assert isinstance(NativeEngine(copy.deepcopy(model)), Engine)


def test_64_concurrent_greedy_requests_equal_each_run_alone(model):
    batch = prompts(64)
    budgets = [4 + i % 13 for i in range(64)]

    async def alone():
        engine = NativeEngine(copy.deepcopy(model), max_running=1)
        out = []
        for i, (p, n) in enumerate(zip(batch, budgets, strict=True)):
            params = SamplingParams(temperature=0.0, max_new_tokens=n)
            out.append(await engine.generate(request(f"r{i}", p, params)))
        await engine.close()
        return out

    async def together():
        engine = NativeEngine(copy.deepcopy(model), max_running=16)
        calls = [
            engine.generate(request(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=n)))
            for i, (p, n) in enumerate(zip(batch, budgets, strict=True))
        ]
        out = await asyncio.gather(*calls)
        await engine.close()
        return out

    ref, got = run(alone()), run(together())
    for a, b, n in zip(ref, got, budgets, strict=True):
        assert b.output_ids == a.output_ids
        assert b.finish_reason == "length" and len(b.output_ids) == n
        assert torch.allclose(torch.tensor(b.output_logprobs), torch.tensor(a.output_logprobs), atol=1e-5)


def test_sampled_logprobs_equal_teacher_forced_and_seeded_tokens_do_not_depend_on_batch(model):
    cases = [
        SamplingParams(temperature=1.0, max_new_tokens=16, seed=1),
        SamplingParams(temperature=0.7, max_new_tokens=16, seed=2),
        SamplingParams(top_k=5, max_new_tokens=16, seed=3),
        SamplingParams(top_p=0.8, max_new_tokens=16, seed=4),
        SamplingParams(temperature=1.3, top_k=8, top_p=0.9, max_new_tokens=16, seed=5),
    ]
    batch = prompts(len(cases), seed=1)

    async def main():
        engine = NativeEngine(copy.deepcopy(model), max_running=8)
        together = await asyncio.gather(
            *(engine.generate(request(f"s{i}", p, c)) for i, (p, c) in enumerate(zip(batch, cases, strict=True)))
        )
        alone = [
            await engine.generate(request(f"a{i}", p, c)) for i, (p, c) in enumerate(zip(batch, cases, strict=True))
        ]
        await engine.close()
        return together, alone

    together, alone = run(main())
    for p, c, t, a in zip(batch, cases, together, alone, strict=True):
        assert t.output_ids == a.output_ids
        expected = sequence_logprobs(model, p, t.output_ids, c)
        assert torch.allclose(torch.tensor(t.output_logprobs), expected, atol=1e-5, rtol=0)


def test_abort_mid_generation_returns_partial_output_and_engine_keeps_serving(model):
    async def main():
        engine = NativeEngine(copy.deepcopy(model), max_running=4)
        long_params = SamplingParams(temperature=0.0, max_new_tokens=100)
        other = asyncio.ensure_future(engine.generate(request("other", [5, 6, 7], GREEDY)))
        chunks = []
        stream = engine.generate_stream(request("long", [1, 2, 3], long_params))
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                assert engine.abort("long") is True
        assert chunks[-1].finish_reason == "abort"
        streamed = [t for c in chunks for t in c.token_ids]
        assert 3 <= len(streamed) < 100
        assert engine.abort("long") is False and engine.abort("unknown") is False
        # a cancelled generate aborts its request too
        task = asyncio.ensure_future(engine.generate(request("cancelled", [4], long_params)))
        await steps(3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        result = await other
        assert result.finish_reason == "length" and len(result.output_ids) == GREEDY.max_new_tokens
        after = await engine.generate(request("after", [5, 6, 7], GREEDY))
        assert after.output_ids == result.output_ids
        assert engine.load().running == 0 and engine.load().queued == 0
        await engine.close()

    run(main())


def test_abort_of_queued_request_ends_it_with_no_tokens(model):
    async def main():
        engine = NativeEngine(copy.deepcopy(model), max_running=1)
        first = asyncio.ensure_future(engine.generate(request("first", [1, 2], SamplingParams(max_new_tokens=30))))
        queued = asyncio.ensure_future(engine.generate(request("queued", [3], GREEDY)))
        await asyncio.sleep(0)
        assert engine.abort("queued") is True
        result = await queued
        assert result.finish_reason == "abort" and result.output_ids == () and result.output_logprobs == ()
        assert (await first).finish_reason == "length"
        await engine.close()

    run(main())


def test_drain_finishes_in_flight_requests_and_rejects_new_ones(model):
    async def main():
        engine = NativeEngine(copy.deepcopy(model), max_running=2)
        tasks = [asyncio.ensure_future(engine.generate(request(f"d{i}", p))) for i, p in enumerate(prompts(5))]
        await asyncio.sleep(0)
        await engine.drain()
        results = [t.result() for t in tasks]
        assert all(r.finish_reason == "length" and len(r.output_ids) == 12 for r in results)
        with pytest.raises(EngineUnavailableError):
            await engine.generate(request("late", [1]))
        assert engine.load().accepting is False
        engine.resume_accepting()
        assert (await engine.generate(request("late", [1]))).finish_reason == "length"
        # a bounded drain aborts what is still running
        slow = asyncio.ensure_future(engine.generate(request("slow", [1], SamplingParams(max_new_tokens=110))))
        await asyncio.sleep(0)
        await engine.drain(abort_after_s=0.0)
        assert (await slow).finish_reason == "abort"
        await engine.close()

    run(main())


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


def test_kv_export_import_continues_like_an_unmigrated_run_computing_only_new_tokens(model):
    prompt = [7, 3, 11, 42, 5, 9]
    total = 30

    async def main():
        source = NativeEngine(copy.deepcopy(model), max_running=4)
        destination = NativeEngine(copy.deepcopy(model), max_running=4)
        unmigrated = await source.generate(
            request("ref", prompt, SamplingParams(temperature=0.0, max_new_tokens=total))
        )
        # migrate mid-generation, with a neighbour in the batch
        neighbour = asyncio.ensure_future(source.generate(request("nb", [1, 2, 3], GREEDY)))
        stream = source.generate_stream(request("mig", prompt, SamplingParams(temperature=0.0, max_new_tokens=total)))
        count = 0
        async for chunk in stream:
            count += len(chunk.token_ids)
            if count == 8 and chunk.finish_reason is None:
                export = await source.export_kv("mig")
        assert chunk.finish_reason == "abort"
        assert export.token_ids == (*prompt, *export.output_ids[:-1])
        await destination.import_kv(export)
        done = len(export.output_ids)
        cont = await destination.generate(
            request(
                "cont",
                (*prompt, *export.output_ids),
                SamplingParams(temperature=0.0, max_new_tokens=total - done),
                execution="exec-mig",
            )
        )
        assert cont.cached_tokens == len(export.token_ids) == len(prompt) + done - 1
        assert export.output_ids + cont.output_ids == unmigrated.output_ids
        assert (await neighbour).finish_reason == "length"
        await source.close()
        await destination.close()

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


def test_import_rejects_other_policy_version(model):
    async def main():
        source = NativeEngine(copy.deepcopy(model))
        task = asyncio.ensure_future(source.generate(request("p", [1, 2, 3], SamplingParams(max_new_tokens=40))))
        await steps(3)
        export = await source.export_kv("p")
        await task
        other = NativeEngine(copy.deepcopy(model), policy_version=1)
        with pytest.raises(ValueError, match="policy_version"):
            await other.import_kv(export)
        await source.close()

    run(main())


def test_prefix_reuse_for_a_request_extending_an_earlier_one_of_the_same_execution(model):
    prompt = [4, 8, 15, 16, 23, 42]

    async def main():
        engine = NativeEngine(copy.deepcopy(model), max_running=4)
        fresh = NativeEngine(copy.deepcopy(model), max_running=4)
        first = await engine.generate(request("t1", prompt, execution="agent"))
        assert first.cached_tokens == 0
        turn2 = (*prompt, *first.output_ids, 60, 61, 62)
        second = await engine.generate(request("t2", turn2, execution="agent"))
        assert second.cached_tokens == len(prompt) + len(first.output_ids) - 1
        expected = await fresh.generate(request("f2", turn2))
        assert expected.cached_tokens == 0
        assert second.output_ids == expected.output_ids
        assert torch.allclose(torch.tensor(second.output_logprobs), torch.tensor(expected.output_logprobs), atol=1e-5)
        # another execution never reuses it
        other = await engine.generate(request("o", turn2, execution="someone-else"))
        assert other.cached_tokens == 0
        await engine.close()
        await fresh.close()

    run(main())


def test_bad_input_raises_for_that_request_and_engine_keeps_serving(model):
    async def main():
        engine = NativeEngine(copy.deepcopy(model), max_running=4)
        good = asyncio.ensure_future(engine.generate(request("good", [1, 2, 3])))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="out of vocabulary"):
            await engine.generate(request("oov", [1, VOCAB]))
        with pytest.raises(ValueError, match="context limit"):
            await engine.generate(request("long", [1] * 100, SamplingParams(max_new_tokens=100)))
        with pytest.raises(ValueError, match="already in flight"):
            await engine.generate(request("good", [1]))
        with pytest.raises(ValueError, match="already in flight"):
            async for _ in engine.generate_stream(request("good", [1])):
                pass
        assert (await good).finish_reason == "length"
        await engine.close()

    run(main())


def test_stop_token_ends_request_and_stream_chunks_concatenate_to_result(model):
    async def main():
        engine = NativeEngine(copy.deepcopy(model))
        probe = await engine.generate(request("probe", [9, 9, 9]))
        stop_id = probe.output_ids[4]
        params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[stop_id])
        chunks = [c async for c in engine.generate_stream(request("s", [9, 9, 9], params))]
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens[-1] == stop_id and stop_id not in tokens[:-1]
        assert chunks[-1].finish_reason == "stop" and chunks[-1].timings is not None
        assert [c.index for c in chunks] == list(range(len(chunks)))
        result = await engine.generate(request("s2", [9, 9, 9], params))
        assert result.output_ids == tuple(tokens) and result.finish_reason == "stop"
        await engine.close()

    run(main())


def test_result_of_a_request_spanning_an_update_records_both_versions_and_its_kv_is_not_reused(model):
    update = {n: p.detach() * 1.5 for n, p in model.named_parameters() if n.endswith("down_proj.weight")}

    async def main():
        engine = NativeEngine(copy.deepcopy(model))
        task = asyncio.ensure_future(engine.generate(request("span", [1, 2], SamplingParams(max_new_tokens=60), "ex")))
        await steps(3)
        await engine.update_weights(update, version=7)
        span = await task
        assert (span.policy_version, span.last_policy_version, span.finish_reason) == (0, 7, "length")
        extended = await engine.generate(request("next", (1, 2, *span.output_ids, 5), GREEDY, "ex"))
        assert extended.cached_tokens == 0  # mixed-version KV is dropped, not reused
        assert (extended.policy_version, extended.last_policy_version) == (7, 7)
        await engine.close()

    run(main())
