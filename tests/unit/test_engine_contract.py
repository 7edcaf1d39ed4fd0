"""The engine contract (docs/engine.md), one suite over every engine that implements `gyre.engine.protocol.Engine`.

Kinds:
- `native`: `NativeEngine` in the test's event loop;
- `remote`: a `NativeEngine` served by `gyre.engine.endpoint` on 127.0.0.1 from its own thread and event loop,
  reached through `RemoteEngine` over real HTTP (what the proxy holds);
- `sglang`: `SGLangEngine` over a real `sglang.Engine`, marked `gpu` and skipped where sglang does not import (it
  needs CUDA torch and a GPU; see docs/sglang.md);
- `scripted`: `gyre.engine.scripted.ScriptedEngine`, the stand-in that tests above the engine serve, with a
  counting script; the request lifecycle holds for it, while the cases that need a model's numerics or a KV cache
  skip it with that reason.

Timing-exact checks that read engine internals (bytes held, which decode step an update lands on) stay in
test_engine_native.py; here every assertion holds whatever the network delays.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.util
import itertools
import random
import re

import numpy as np
import pytest
import torch
from engine_fixtures import VOCAB, sharp_tiny_model

from gyre.engine.endpoint import ServerThread
from gyre.engine.native import NativeEngine
from gyre.engine.protocol import (
    Engine,
    EngineBusyError,
    EngineUnavailableError,
    GenerateRequest,
    SamplingParams,
    WeightUpdateSessionError,
)
from gyre.engine.remote import RemoteEngine
from gyre.engine.sampling import sequence_logprobs
from gyre.engine.scripted import ScriptedEngine
from gyre.engine.wire import flatten_weights

TIMEOUT_S = 60.0
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


def _sglang_skip_reason() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return (
            "sglang does not import here (it needs CUDA torch and a GPU); "
            "the adapter's plumbing is tested with a fake in test_engine_sglang_adapter.py"
        )
    if not torch.cuda.is_available():
        return "sglang is installed but no CUDA device is visible"
    return None


SGLANG_SKIP = _sglang_skip_reason()
KV_MIGRATION = {"native", "remote"}  # SGLang has no per-request KV export (docs/sglang.md)
FILTERED_LOGPROBS = {"native", "remote"}  # SGLang reports log-probs before top-k/top-p: the adapter refuses those
MODEL_NUMERICS = {"native", "remote", "sglang"}  # the scripted engine's tokens come from a script, not from weights
PARAMETER_NAMES = {"native", "remote"}  # engines that know their parameters: they check buckets and completeness
PREFIX_CACHE = {"native", "remote", "sglang"}  # the scripted engine has no KV cache: cached_tokens is always 0
SCRIPTED_CONTEXT = 128  # sharp_tiny_model's max_position_embeddings: the same context limit to check


@pytest.fixture(scope="module")
def model():
    return sharp_tiny_model()


@pytest.fixture(scope="module")
def moe_model():
    """The tiny Qwen3-MoE shape (gyre.models.moe: 4 layers, layer 0 dense, 8 experts, top-2) on the test vocabulary."""
    from gyre.models.decoder import build_model
    from gyre.models.moe import tiny_qwen3_moe_config

    config = tiny_qwen3_moe_config(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None)
    return build_model(config, seed=3).eval()


@pytest.fixture(params=["native", "remote", pytest.param("sglang", marks=pytest.mark.gpu), "scripted"])
def engines(request, model, tmp_path):
    if request.param == "sglang" and SGLANG_SKIP:
        pytest.skip(SGLANG_SKIP)
    return Engines(request.param, model, tmp_path)


class Engines:
    """Opens engines of one kind on the shared tiny model (or a given variant of it)."""

    def __init__(self, kind: str, model, tmp_path):
        self.kind, self.model, self.tmp_path = kind, model, tmp_path
        self.served: dict[RemoteEngine, ServerThread] = {}

    async def hold_running(self, engine, count: int = 1, tokens: int = 2) -> bool:
        """Hold `engine` with the next `count` requests (at most its `max_running`) running and exactly `tokens`
        tokens out each (fewer only if one ends first), whatever the time: call it before submitting them;
        `until_held` returns once they are held, and they wait until `release_held`, their abort or an export.
        Native and remote (the native engine behind the endpoint, on its loop): the step loop held until the
        requests queue, then `tokens - 1` steps (an admitted request's first token comes with its prefill);
        scripted: each held before its token `tokens` (its streams run as they are read: the one `until_held` reads
        is held once its tokens are out, its next read waits). False for sglang, which cannot be held: its requests
        run free (`budget` gives them a window) and `until_held` only waits until they are in flight."""
        if tokens < 2:
            raise ValueError("tokens >= 2: a native step admits and decodes (its first token comes with prefill)")
        self._tokens = tokens
        if self.kind == "sglang":  # pragma: no cover - needs a GPU with sglang
            self._holding = lambda read: until_in_flight(engine, count)
            return False
        if self.kind == "scripted":
            engine.hold(after_tokens=tokens)
            self._holding = lambda read: engine.until_held(count - read)
            return True
        on_loop = self._on_loop(engine)
        await on_loop(lambda native: native.hold())
        self._holding = lambda read: self._steps_when_queued(engine, count, tokens - 1)
        return True

    async def until_held(self, stream=None):
        """Wait until the requests of `hold_running` are held. With `stream` (one of them, not read yet), read it
        meanwhile (its first `__anext__` submits it) and return its chunks so far: its held tokens."""
        reading = None if stream is None else asyncio.ensure_future(until_tokens(stream, self._tokens))
        try:
            await asyncio.wait_for(self._holding(0 if stream is None else 1), TIMEOUT_S / 2)
        except BaseException:
            if reading is not None:
                reading.cancel()
            raise
        return None if reading is None else await asyncio.wait_for(reading, TIMEOUT_S / 2)

    async def _steps_when_queued(self, engine, count: int, steps: int) -> None:
        await until_in_flight(engine, count)  # queued on the held loop
        on_loop = self._on_loop(engine)
        await on_loop(lambda native: native.release(steps=steps))
        await on_loop(lambda native: native.until_held())

    async def release_held(self, engine) -> None:
        if self.kind in ("native", "remote", "scripted"):
            await self._on_loop(engine)(lambda held: held.release())

    def budget(self, tokens: int) -> int:
        """`max_new_tokens` of a request the test acts on while it runs: `tokens` where it is held (it cannot end
        before the test moves on); for sglang, which runs free, a 100-token window."""
        return tokens if self.kind != "sglang" else max(tokens, 100)

    def _on_loop(self, engine):
        """`fn(engine)` on the engine's own loop: a remote engine's native engine is behind its endpoint."""
        thread = self.served.get(engine)

        async def call(fn):
            if thread is None:
                outcome = fn(engine)
                return await outcome if asyncio.iscoroutine(outcome) else outcome
            return await thread.call_async(fn, TIMEOUT_S / 2)

        return call

    def needs_kv_migration(self) -> None:
        if self.kind not in KV_MIGRATION:
            pytest.skip(f"{self.kind} has no per-request KV export (the proxy re-prefills instead)")

    def needs_model_numerics(self) -> None:
        if self.kind not in MODEL_NUMERICS:
            pytest.skip(f"{self.kind} has no model: its tokens and log-probs come from a script, not from weights")

    def needs_prefix_cache(self) -> None:
        if self.kind not in PREFIX_CACHE:
            pytest.skip(f"{self.kind} has no KV cache to reuse (cached_tokens is always 0)")

    @contextlib.asynccontextmanager
    async def open(self, model=None, **options):
        model = copy.deepcopy(model if model is not None else self.model)
        if self.kind == "native":
            engine = NativeEngine(model, **options)
            try:
                yield engine
            finally:
                await engine.close()
        elif self.kind == "remote":
            thread = ServerThread(lambda: NativeEngine(model, **options))
            url = await asyncio.to_thread(thread.start)
            engine = await RemoteEngine.connect(url)
            self.served[engine] = thread  # the native engine behind it, held on its own loop (hold_running)
            try:
                yield engine
            finally:
                await engine.close()
                await asyncio.to_thread(thread.stop)
        elif self.kind == "scripted":
            # no pacing: the cases that need a request in flight hold it (hold_running), none needs a window
            options = {"vocab_size": VOCAB, "context_length": SCRIPTED_CONTEXT} | options
            yield ScriptedEngine(counting_reply, **options)
        else:  # pragma: no cover - needs a GPU with sglang
            engine = self._sglang(model, **options)
            try:
                yield engine
            finally:
                await engine.close()

    def _sglang(self, model, max_running: int = 16, policy_version: int = 0, **_):  # pragma: no cover
        from gyre.engine.sglang_engine import SGLangEngine
        from gyre.models.hf_weights import save_pretrained

        path = self.tmp_path / f"model-{random.randrange(1 << 30)}"
        save_pretrained(model, path)
        return SGLangEngine.from_pretrained(
            str(path),
            adapter_options={"policy_version": policy_version, "max_running": max_running},
            max_running_requests=max_running,
            enable_return_routed_experts=bool(model.config.num_experts),
        )


def counting_reply(request: GenerateRequest):
    """The scripted engine's script: a step-7 walk through the vocabulary from the prompt's sum (distinct ids for
    VOCAB steps), so outputs depend on the prompt only, as greedy outputs do."""
    start = sum(request.input_ids)
    return ((start + 7 * (i + 1)) % VOCAB for i in itertools.count())


def run(coro):
    """Every test body is bounded in time."""
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def request(
    rid: str, prompt, params: SamplingParams = GREEDY, execution: str | None = None, **routing
) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid, execution_id=execution or f"exec-{rid}", input_ids=prompt, params=params, **routing
    )


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 24))] for _ in range(n)]


async def current_load(engine: Engine):
    refresh = getattr(engine, "refresh_load", None)  # a remote engine's load() is its last snapshot
    return await refresh() if refresh is not None else engine.load()


async def until_load(engine: Engine, reached, what: str):
    """Wait (bounded) until the engine's own load satisfies `reached`; returns that load."""
    for _ in range(2000):
        load = await current_load(engine)
        if reached(load):
            return load
        await asyncio.sleep(0.002)
    raise AssertionError(f"the engine never {what}: {load}")


async def until_in_flight(engine: Engine, count: int) -> None:
    """Wait (bounded) until the engine itself holds `count` requests, running or queued."""
    await until_load(engine, lambda load: load.running + load.queued >= count, f"held {count} requests")


async def until_tokens(stream, count: int):
    """Consume a stream until `count` tokens arrived; returns (chunks, the last chunk)."""
    chunks = []
    async for chunk in stream:
        chunks.append(chunk)
        if sum(len(c.token_ids) for c in chunks) >= count or chunk.finish_reason is not None:
            break
    return chunks


def test_satisfies_protocol(engines):
    async def main():
        async with engines.open() as engine:
            assert isinstance(engine, Engine)

    run(main())


def test_64_concurrent_greedy_requests_equal_each_run_alone(engines):
    batch = prompts(64)
    budgets = [4 + i % 13 for i in range(64)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=n) for n in budgets]

    async def main():
        async with engines.open(max_running=1) as engine:
            alone = [
                await engine.generate(request(f"r{i}", p, c))
                for i, (p, c) in enumerate(zip(batch, params, strict=True))
            ]
        async with engines.open(max_running=16) as engine:
            together = await asyncio.gather(
                *(engine.generate(request(f"r{i}", p, c)) for i, (p, c) in enumerate(zip(batch, params, strict=True)))
            )
        return alone, together

    alone, together = run(main())
    for a, b, n in zip(alone, together, budgets, strict=True):
        assert b.output_ids == a.output_ids
        assert b.finish_reason == "length" and len(b.output_ids) == n
        assert torch.allclose(torch.tensor(b.output_logprobs), torch.tensor(a.output_logprobs), atol=1e-5)


def test_behavior_logprobs_equal_teacher_forced_and_seeded_tokens_do_not_depend_on_the_batch(engines, model):
    engines.needs_model_numerics()
    cases = [
        SamplingParams(temperature=1.0, max_new_tokens=16, seed=1),
        SamplingParams(temperature=0.7, max_new_tokens=16, seed=2),
        SamplingParams(top_k=5, max_new_tokens=16, seed=3),
        SamplingParams(top_p=0.8, max_new_tokens=16, seed=4),
        SamplingParams(temperature=1.3, top_k=8, top_p=0.9, max_new_tokens=16, seed=5),
    ]
    if engines.kind not in FILTERED_LOGPROBS:
        cases = [c for c in cases if not c.filters]
    batch = prompts(len(cases), seed=1)

    async def main():
        async with engines.open(max_running=8) as engine:
            together = await asyncio.gather(
                *(engine.generate(request(f"s{i}", p, c)) for i, (p, c) in enumerate(zip(batch, cases, strict=True)))
            )
            alone = [
                await engine.generate(request(f"a{i}", p, c)) for i, (p, c) in enumerate(zip(batch, cases, strict=True))
            ]
        return together, alone

    together, alone = run(main())
    for p, c, t, a in zip(batch, cases, together, alone, strict=True):
        assert t.output_ids == a.output_ids
        expected = sequence_logprobs(model, p, t.output_ids, c)
        assert torch.allclose(torch.tensor(t.output_logprobs), expected, atol=1e-5, rtol=0)


def test_a_seeded_request_samples_one_stream_whatever_runs_beside_it(engines):
    """Seeded sampling is a function of (weights, prompt, params, seed): the same request alone, or among unseeded
    and other seeded requests admitted in another order into fewer slots (so batches form and change differently),
    samples the same tokens with the same log-probs; another seed samples others."""
    engines.needs_model_numerics()
    batch = prompts(6, seed=7)
    seeded = [SamplingParams(temperature=1.0, max_new_tokens=10 + 3 * i, seed=100 + i) for i in range(6)]
    unseeded = SamplingParams(temperature=1.0, max_new_tokens=9)

    async def main():
        async with engines.open(max_running=8) as engine:
            alone = [
                await engine.generate(request(f"a{i}", p, c))
                for i, (p, c) in enumerate(zip(batch, seeded, strict=True))
            ]
            reseeded = await engine.generate(
                request("other-seed", batch[0], SamplingParams(temperature=1.0, max_new_tokens=10, seed=999))
            )
        mixed = {}
        for order, slots in (([0, 1, 2, 3, 4, 5], 8), ([5, 3, 1, 4, 0, 2], 3)):
            async with engines.open(max_running=slots) as engine:
                calls = []
                for i in order:
                    calls.append(engine.generate(request(f"s{i}", batch[i], seeded[i])))
                    calls.append(engine.generate(request(f"u{i}", batch[(i + 1) % 6], unseeded)))
                results = await asyncio.gather(*calls)
                mixed[slots] = {order[k // 2]: r for k, r in enumerate(results) if k % 2 == 0}
        return alone, reseeded, mixed

    alone, reseeded, mixed = run(main())
    for together in mixed.values():
        for i, a in enumerate(alone):
            assert together[i].output_ids == a.output_ids
            assert torch.allclose(torch.tensor(together[i].output_logprobs), torch.tensor(a.output_logprobs), atol=1e-5)
    assert reseeded.output_ids != alone[0].output_ids[: len(reseeded.output_ids)]


def test_abort_mid_stream_returns_partial_output_and_the_engine_keeps_serving(engines):
    """An abort ends a running stream with the tokens it has, a cancelled generate is aborted, and the engine serves
    on. Both requests are held running when the test ends them, so neither can end by itself first."""

    async def main():
        async with engines.open(max_running=4) as engine:
            long_params = SamplingParams(temperature=0.0, max_new_tokens=engines.budget(12))
            held = await engines.hold_running(engine, count=2, tokens=3)
            other = asyncio.ensure_future(engine.generate(request("other", [5, 6, 7], GREEDY)))
            stream = engine.generate_stream(request("long", [1, 2, 3], long_params))
            chunks = await engines.until_held(stream)
            assert engine.abort("long") is True
            chunks += [c async for c in stream]
            assert chunks[-1].finish_reason == "abort"
            streamed = [t for c in chunks for t in c.token_ids]
            assert len(streamed) == 3 if held else 3 <= len(streamed) < long_params.max_new_tokens
            assert engine.abort("unknown") is False
            await engines.release_held(engine)
            result = await other
            assert result.finish_reason == "length" and len(result.output_ids) == GREEDY.max_new_tokens
            # cancelling a generate aborts its request: held, it leaves the engine only by that abort
            await engines.hold_running(engine)
            task = asyncio.ensure_future(engine.generate(request("cancelled", [4], long_params)))
            await engines.until_held()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until_load(engine, lambda load: load.running == load.queued == 0, "dropped the cancelled request")
            await engines.release_held(engine)
            after = await engine.generate(request("after", [5, 6, 7], GREEDY))
            assert after.output_ids == result.output_ids

    run(main())


def test_abort_of_a_queued_request_ends_it_with_no_tokens(engines):
    """The one slot is held taken, so the second request is queued at the engine when it is aborted."""

    async def main():
        async with engines.open(max_running=1) as engine:
            await engines.hold_running(engine)
            first_params = SamplingParams(max_new_tokens=engines.budget(12))
            first = asyncio.ensure_future(engine.generate(request("first", [1, 2], first_params)))
            await engines.until_held()
            queued = asyncio.ensure_future(engine.generate(request("queued", [3], GREEDY)))
            await until_in_flight(engine, 2)  # it reached the engine, behind the held one
            assert engine.abort("queued") is True
            result = await queued
            assert result.finish_reason == "abort" and result.output_ids == () and result.output_logprobs == ()
            await engines.release_held(engine)
            assert (await first).finish_reason == "length"

    run(main())


def test_drain_finishes_in_flight_requests_and_rejects_new_ones(engines):
    """The drain starts while its five requests are held (two running, three queued: none can end before it), and
    returns once they finished; a bounded drain aborts what is held running."""

    async def main():
        async with engines.open(max_running=2) as engine:
            held = await engines.hold_running(engine, count=2)
            tasks = [asyncio.ensure_future(engine.generate(request(f"d{i}", p))) for i, p in enumerate(prompts(5))]
            await engines.until_held()
            await until_in_flight(engine, 5)
            drain = asyncio.ensure_future(engine.drain())
            await until_load(engine, lambda load: not load.accepting, "stopped accepting")
            assert not (held and drain.done())  # it waits for the held requests
            await engines.release_held(engine)
            await drain
            results = [t.result() for t in tasks]
            assert all(r.finish_reason == "length" and len(r.output_ids) == 12 for r in results)
            with pytest.raises(EngineUnavailableError):
                await engine.generate(request("late", [1]))
            assert engine.load().accepting is False
            engine.resume_accepting()
            assert (await engine.generate(request("late", [1]))).finish_reason == "length"
            # a bounded drain aborts what is still running (held running, so it cannot end first)
            await engines.hold_running(engine)
            slow_params = SamplingParams(max_new_tokens=engines.budget(12))
            slow = asyncio.ensure_future(engine.generate(request("slow", [1], slow_params)))
            await engines.until_held()
            await engine.drain(abort_after_s=0.0)
            assert (await slow).finish_reason == "abort"
            await engines.release_held(engine)

    run(main())


def test_release_and_resume_memory_refuse_a_busy_engine_and_keep_outputs(engines):
    async def main():
        async with engines.open(max_running=4) as engine:
            batch = prompts(4, seed=2)
            before = await asyncio.gather(*(engine.generate(request(f"m{i}", p)) for i, p in enumerate(batch)))
            await engines.hold_running(engine)  # busy cannot end before release_memory is refused
            busy_params = SamplingParams(max_new_tokens=engines.budget(12))
            busy = asyncio.ensure_future(engine.generate(request("busy", [1], busy_params)))
            await engines.until_held()
            with pytest.raises(EngineBusyError):
                await engine.release_memory()
            engine.abort("busy")
            assert (await busy).finish_reason == "abort"
            await engines.release_held(engine)
            await engine.release_memory()
            load = await current_load(engine)
            assert load.memory_released and load.kv_tokens_total == 0 and not load.accepting
            with pytest.raises(EngineUnavailableError):
                await engine.generate(request("x", [1]))
            await engine.resume_memory()
            assert not (await current_load(engine)).memory_released
            after = await asyncio.gather(*(engine.generate(request(f"n{i}", p)) for i, p in enumerate(batch)))
            assert [r.output_ids for r in after] == [r.output_ids for r in before]
            for a, b in zip(after, before, strict=True):  # batch composition may differ: fp32 noise only
                assert torch.allclose(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5)

    run(main())


def _scaled(model, suffix: str, factor: float):
    new_model = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in new_model.named_parameters():
            if name.endswith(suffix):
                param.mul_(factor)
    weights = {n: p.detach().clone() for n, p in new_model.named_parameters() if n.endswith(suffix)}
    return new_model, weights


@pytest.mark.parametrize("form", ["named", "flat"])
def test_update_weights_makes_outputs_those_of_the_new_weights_and_records_the_version(engines, model, form):
    engines.needs_model_numerics()
    new_model, new_weights = _scaled(model, "mlp.up_proj.weight", 3.0)
    update = new_weights if form == "named" else flatten_weights(new_weights)
    batch = prompts(6, seed=4)

    async def main():
        async with engines.open(max_running=4) as engine, engines.open(new_model, policy_version=3) as reference:
            old = [await engine.generate(request(f"o{i}", p)) for i, p in enumerate(batch)]
            # the update lands while the stream is held running after its first 5 tokens
            held = await engines.hold_running(engine, tokens=5)
            span_params = SamplingParams(max_new_tokens=engines.budget(12))
            stream = engine.generate_stream(request("span", [1, 2], span_params))
            before = await engines.until_held(stream)
            with pytest.raises(ValueError, match="unknown parameter"):
                await engine.update_weights({"nope": torch.zeros(1)}, version=3)
            await engine.update_weights(update, version=3)
            with pytest.raises(ValueError, match="version"):
                await engine.update_weights(update, version=2)
            await engines.release_held(engine)
            after = [c async for c in stream]
            versions = [c.policy_version for c in before + after]
            assert sum(len(c.token_ids) for c in before) >= 5 and {c.policy_version for c in before} == {0}
            assert versions[-1] == 3 and versions == sorted(versions) and after[-1].finish_reason == "length"
            if held:  # nothing decoded between the hold and the update: exactly 5 old tokens, the rest new
                assert sum(len(c.token_ids) for c in before) == 5 and {c.policy_version for c in after} == {3}
            new = [await engine.generate(request(f"n{i}", p)) for i, p in enumerate(batch)]
            expected = [await reference.generate(request(f"e{i}", p)) for i, p in enumerate(batch)]
            assert [r.output_ids for r in new] == [r.output_ids for r in expected]
            assert [r.output_ids for r in new] != [r.output_ids for r in old]
            assert all(r.policy_version == 3 and r.last_policy_version == 3 for r in new)
            assert (await current_load(engine)).policy_version == 3

    run(main())


def test_a_request_spanning_an_update_records_both_versions_and_its_kv_is_not_reused(engines, model):
    _, update = _scaled(model, "down_proj.weight", 1.5)

    async def main():
        async with engines.open() as engine:
            await engines.hold_running(engine, tokens=3)  # the update lands while it runs
            span_params = SamplingParams(max_new_tokens=engines.budget(12))
            stream = engine.generate_stream(request("span", [1, 2], span_params, "ex"))
            chunks = await engines.until_held(stream)
            await engine.update_weights(update, version=7)
            await engines.release_held(engine)
            chunks += [c async for c in stream]
            tokens = tuple(t for c in chunks for t in c.token_ids)
            assert (chunks[0].policy_version, chunks[-1].policy_version) == (0, 7)
            assert chunks[-1].finish_reason == "length"
            extended = await engine.generate(request("next", (1, 2, *tokens, 5), GREEDY, "ex"))
            assert extended.cached_tokens == 0  # mixed-version KV is dropped, not reused
            assert (extended.policy_version, extended.last_policy_version) == (7, 7)

    run(main())


def _buckets(weights: dict, per_bucket: int) -> list:
    """`weights` as flat buckets of `per_bucket` whole tensors each, in order."""
    names = list(weights)
    return [
        flatten_weights({n: weights[n] for n in names[i : i + per_bucket]}) for i in range(0, len(names), per_bucket)
    ]


def test_a_streamed_update_decodes_nothing_until_it_ends_and_then_serves_the_new_weights(engines, model):
    """begin_update, a bucket at a time, end_update: the held request gets no token in between and continues under the
    new weights; a bad bucket, an incomplete or out-of-order session are refused naming why, the session staying."""
    new_model, _ = _scaled(model, "mlp.up_proj.weight", 3.0)
    buckets = _buckets({n: p.detach().clone() for n, p in new_model.named_parameters()}, per_bucket=3)
    batch = prompts(4, seed=5)
    knows_names = engines.kind in PARAMETER_NAMES

    async def main():
        async with engines.open(max_running=4) as engine, engines.open(new_model, policy_version=4) as reference:
            with pytest.raises(WeightUpdateSessionError, match="begin_update first"):
                await engine.load_bucket(buckets[0])
            held = await engines.hold_running(engine, tokens=3)
            stream = engine.generate_stream(request("span", [1, 2], SamplingParams(max_new_tokens=engines.budget(9))))
            before = await engines.until_held(stream)
            await engine.begin_update(version=4)
            await engines.release_held(engine)  # only the session holds it now
            pending = asyncio.ensure_future(stream.__anext__())
            with pytest.raises(WeightUpdateSessionError, match="session for version 4 is open"):
                await engine.begin_update(version=5)
            with pytest.raises(WeightUpdateSessionError, match="session for version 4 is open"):
                await engine.update_weights({}, version=5)
            if knows_names:
                bad = flatten_weights({"model.norm.weight": torch.ones(3)})
                with pytest.raises(ValueError, match=r"model.norm.weight is torch.float32 \(3,\)"):
                    await engine.load_bucket(bad)
            for bucket in buckets[:-3]:
                await engine.load_bucket(bucket)
            if knows_names:  # the first five names not loaded, and how many
                missing = [spec.name for bucket in buckets[-3:] for spec in bucket.manifest]
                shown = re.escape(
                    f"{len(missing)} parameters were not loaded since begin_update ({', '.join(missing[:5])}, ...)"
                )
                with pytest.raises(ValueError, match=shown):
                    await engine.end_update(version=4)
            for bucket in buckets[-3:]:
                await engine.load_bucket(bucket)
            with pytest.raises(ValueError, match="the session began for version 4"):
                await engine.end_update(version=5)
            await asyncio.sleep(0.2)
            if held:  # nothing decoded from begin_update to here, whatever the time
                assert not pending.done() and (await current_load(engine)).policy_version == 0
            await engine.end_update(version=4)
            after = [await pending] + [c async for c in stream]
            assert {c.policy_version for c in before} == {0} and after[-1].finish_reason == "length"
            if held:
                assert sum(len(c.token_ids) for c in before) == 3 and {c.policy_version for c in after} == {4}
            with pytest.raises(WeightUpdateSessionError, match="begin_update first"):
                await engine.end_update(version=4)
            with pytest.raises(ValueError, match="version=3 is not allowed"):
                await engine.begin_update(version=3)
            await engine.abort_update()  # no session: nothing happens
            new = [await engine.generate(request(f"n{i}", p)) for i, p in enumerate(batch)]
            assert (await current_load(engine)).policy_version == 4
            assert all(r.policy_version == r.last_policy_version == 4 for r in new)
            if engines.kind in MODEL_NUMERICS:
                expected = [await reference.generate(request(f"e{i}", p)) for i, p in enumerate(batch)]
                assert [r.output_ids for r in new] == [r.output_ids for r in expected]

    run(main())


def test_an_aborted_update_keeps_serving_if_nothing_was_loaded_and_else_refuses_until_a_whole_version(engines, model):
    new_model, _ = _scaled(model, "down_proj.weight", 2.0)
    buckets = _buckets({n: p.detach().clone() for n, p in new_model.named_parameters()}, per_bucket=4)

    async def main():
        async with engines.open(max_running=4) as engine:
            await engine.begin_update(version=2)
            await engine.abort_update()  # nothing loaded: the engine goes on as it was
            first = await engine.generate(request("a", [1, 2, 3]))
            assert first.policy_version == 0 and (await current_load(engine)).accepting

            await engines.hold_running(engine, tokens=2)
            stream = engine.generate_stream(request("span", [4, 5], SamplingParams(max_new_tokens=engines.budget(8))))
            before = await engines.until_held(stream)
            await engine.begin_update(version=2)
            await engine.load_bucket(buckets[0])
            await engine.abort_update()  # a mix of two versions: the request in flight ends, new ones are refused
            await engines.release_held(engine)
            chunks = before + [c async for c in stream]
            assert chunks[-1].finish_reason == "abort" and {c.policy_version for c in chunks} == {0}
            with pytest.raises(EngineUnavailableError, match=r"partial weights|stopped accepting"):  # remote: its load
                await engine.generate(request("b", [1, 2, 3]))
            assert not (await current_load(engine)).accepting
            engine.resume_accepting()  # does not make mixed weights servable
            with pytest.raises(EngineUnavailableError, match="partial weights"):
                await engine.generate(request("c", [1, 2, 3]))

            await engine.begin_update(version=2)  # a whole version: serving again
            for bucket in buckets:
                await engine.load_bucket(bucket)
            await engine.end_update(version=2)
            assert (await current_load(engine)).accepting
            assert (await engine.generate(request("d", [1, 2, 3]))).policy_version == 2

    run(main())


def test_kv_export_import_continues_like_an_unmigrated_run_computing_only_new_tokens(engines):
    engines.needs_kv_migration()
    prompt = [7, 3, 11, 42, 5, 9]
    total = 40

    async def main():
        async with engines.open(max_running=4) as source, engines.open(max_running=4) as destination:
            greedy = SamplingParams(temperature=0.0, max_new_tokens=total)
            unmigrated = await source.generate(request("ref", prompt, greedy))
            await engines.hold_running(source, count=2, tokens=8)  # exported while held: it cannot end first
            neighbour = asyncio.ensure_future(source.generate(request("nb", [1, 2, 3], GREEDY)))
            stream = source.generate_stream(request("mig", prompt, greedy))
            await engines.until_held(stream)
            export = await source.export_kv("mig")
            rest = [c async for c in stream]
            assert rest[-1].finish_reason == "abort" and rest[-1].token_ids == ()
            await engines.release_held(source)
            assert len(export.output_ids) == 8 and export.token_ids == (*prompt, *export.output_ids[:-1])
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
            assert source.release_export("mig") is True

    run(main())


def test_a_seeded_stream_continues_unchanged_across_a_kv_migration(engines):
    """Seeded draws are counter-based (seed, position): the continuation on another engine (prompt + outputs so far,
    the same seed) samples exactly the tokens the unmigrated request sampled."""
    engines.needs_kv_migration()
    prompt = [7, 3, 11, 42, 5, 9]
    total = 40
    params = SamplingParams(temperature=1.0, max_new_tokens=total, seed=31)

    async def main():
        async with engines.open(max_running=4) as source, engines.open(max_running=4) as destination:
            unmigrated = await source.generate(request("ref", prompt, params))
            await engines.hold_running(source, tokens=8)  # exported while held: it cannot end first
            stream = source.generate_stream(request("mig", prompt, params))
            await engines.until_held(stream)
            export = await source.export_kv("mig")
            [c async for c in stream]
            await engines.release_held(source)
            assert len(export.output_ids) == 8
            await destination.import_kv(export)
            done = len(export.output_ids)
            rest = SamplingParams(temperature=1.0, max_new_tokens=total - done, seed=31)
            cont = await destination.generate(
                request("cont", (*prompt, *export.output_ids), rest, execution="exec-mig")
            )
            assert cont.cached_tokens == len(prompt) + done - 1
            assert export.output_ids + cont.output_ids == unmigrated.output_ids
            logprobs = torch.tensor(export.output_logprobs + cont.output_logprobs)
            assert torch.allclose(logprobs, torch.tensor(unmigrated.output_logprobs), atol=1e-5)
            source.release_export("mig")

    run(main())


def test_an_export_stays_pinned_until_released(engines):
    engines.needs_kv_migration()

    async def main():
        async with engines.open(max_running=2) as engine:
            await engines.hold_running(engine, tokens=3)  # exported while held: it cannot end first
            stream = engine.generate_stream(request("p", [1, 2, 3], SamplingParams(max_new_tokens=12)))
            await engines.until_held(stream)
            export = await engine.export_kv("p")
            assert [c async for c in stream][-1].finish_reason == "abort"
            await engines.release_held(engine)
            assert len(export.output_ids) == 3
            free = (await current_load(engine)).kv_tokens_free
            assert free <= (await current_load(engine)).kv_tokens_total - len(export.token_ids)
            with pytest.raises(EngineBusyError):
                await engine.release_memory()
            with pytest.raises(KeyError):
                await engine.export_kv("p")
            assert engine.release_export("p") is True and engine.release_export("p") is False
            await engine.release_memory()  # nothing pinned any more
            await engine.resume_memory()

    run(main())


def test_import_rejects_another_policy_version(engines):
    engines.needs_kv_migration()

    async def main():
        async with engines.open() as source, engines.open(policy_version=1) as other:
            await engines.hold_running(source, tokens=3)  # exported while held: it cannot end first
            stream = source.generate_stream(request("p", [1, 2, 3], SamplingParams(max_new_tokens=12)))
            await engines.until_held(stream)
            export = await source.export_kv("p")
            _ = [c async for c in stream]
            await engines.release_held(source)
            with pytest.raises(ValueError, match="policy_version"):
                await other.import_kv(export)
            source.release_export("p")

    run(main())


def test_prefix_reuse_for_a_request_extending_an_earlier_one_of_the_same_execution(engines):
    engines.needs_prefix_cache()
    prompt = [4, 8, 15, 16, 23, 42]

    async def main():
        async with engines.open(max_running=4) as engine, engines.open(max_running=4) as fresh:
            first = await engine.generate(request("t1", prompt, execution="agent"))
            assert first.cached_tokens == 0
            turn2 = (*prompt, *first.output_ids, 60, 61, 62)
            second = await engine.generate(request("t2", turn2, execution="agent"))
            assert second.cached_tokens == len(prompt) + len(first.output_ids) - 1
            expected = await fresh.generate(request("f2", turn2))
            assert expected.cached_tokens == 0
            assert second.output_ids == expected.output_ids
            got, want = torch.tensor(second.output_logprobs), torch.tensor(expected.output_logprobs)
            assert torch.allclose(got, want, atol=1e-5)
            other = await engine.generate(request("o", turn2, execution="someone-else"))
            assert other.cached_tokens == 0
            # a stream reports the same on its last chunk
            streamed_first = await engine.generate(request("s1", prompt, execution="streamer"))
            turn2 = (*prompt, *streamed_first.output_ids, 60, 61, 62)
            chunks = [c async for c in engine.generate_stream(request("s2", turn2, execution="streamer"))]
            assert chunks[-1].cached_tokens == len(prompt) + len(streamed_first.output_ids) - 1

    run(main())


def test_bad_input_raises_for_that_request_and_the_engine_keeps_serving(engines):
    async def main():
        async with engines.open(max_running=4) as engine:
            await engines.hold_running(engine)  # good stays in flight through every check below
            good_params = SamplingParams(max_new_tokens=engines.budget(12))
            good = asyncio.ensure_future(engine.generate(request("good", [1, 2, 3], good_params)))
            await engines.until_held()
            with pytest.raises(ValueError, match="out of vocabulary"):
                await engine.generate(request("oov", [1, VOCAB]))
            with pytest.raises(ValueError, match="context limit"):
                await engine.generate(request("long", [1] * 100, SamplingParams(max_new_tokens=100)))
            with pytest.raises(ValueError, match="already in flight"):
                await engine.generate(request("good", [1]))
            with pytest.raises(ValueError, match="already in flight"):
                async for _ in engine.generate_stream(request("good", [1])):
                    pass
            if engines.kind in KV_MIGRATION:
                with pytest.raises(KeyError):
                    await engine.export_kv("nobody")
            await engines.release_held(engine)
            assert (await good).finish_reason == "length"

    run(main())


def test_a_stop_token_ends_the_request_and_stream_chunks_concatenate_to_the_result(engines):
    async def main():
        async with engines.open() as engine:
            probe = await engine.generate(request("probe", [9, 9, 9]))
            stop_id = probe.output_ids[4]
            params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[stop_id])
            chunks = [c async for c in engine.generate_stream(request("s", [9, 9, 9], params))]
            tokens = [t for c in chunks for t in c.token_ids]
            assert tokens[-1] == stop_id and stop_id not in tokens[:-1]
            assert chunks[-1].finish_reason == "stop" and chunks[-1].timings is not None
            assert [c.index for c in chunks] == [sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))]
            result = await engine.generate(request("s2", [9, 9, 9], params))
            assert result.output_ids == tuple(tokens) and result.finish_reason == "stop"

    run(main())


def teacher_forced_routing(model, ids) -> np.ndarray:
    """The experts a full forward (no cache) routes each of `ids` to: int16 `[len(ids), L, K]`, -1 at dense layers."""
    with torch.no_grad():
        _, _, routed_1TLK = model(torch.tensor([list(ids)]), torch.arange(len(ids))[None], return_routed_experts=True)
    return routed_1TLK[0].numpy().astype(np.int16)


def test_routed_experts_of_prefix_cached_turns_equal_a_teacher_forced_forward(engines, moe_model):
    """Batched generation across turns of several executions: each turn asks for the routing from the previous
    turn's last fed position on (`routed_experts_start` = previous prompt + outputs - 1), so the turns' records
    concatenate to the whole sequence's; the cached prefix's positions come from the engine's record of them."""
    engines.needs_model_numerics()
    firsts = prompts(3, seed=11)
    sampled = [GREEDY, SamplingParams(temperature=1.0, max_new_tokens=9, seed=4), SamplingParams(max_new_tokens=7)]

    async def turns(engine, i: int):
        ex = f"agent-{i}"
        first = await engine.generate(request(f"t1-{i}", firsts[i], sampled[i], ex, return_routed_experts=True))
        fed = len(firsts[i]) + len(first.output_ids) - 1
        second_prompt = (*firsts[i], *first.output_ids, 60 + i, 61)
        second = request(f"t2-{i}", second_prompt, sampled[i], ex, return_routed_experts=True, routed_experts_start=fed)
        if i == 2:  # streamed: the final chunk carries the routing, the others none
            chunks = [c async for c in engine.generate_stream(second)]
            assert all(c.routed_experts is None for c in chunks[:-1])
            tokens = tuple(t for c in chunks for t in c.token_ids)
            return first, second_prompt, tokens, chunks[-1].routed_experts, chunks[-1].cached_tokens
        result = await engine.generate(second)
        return first, second_prompt, result.output_ids, result.routed_experts, result.cached_tokens

    async def main():
        async with engines.open(moe_model, max_running=4) as engine:
            runs = await asyncio.gather(*(turns(engine, i) for i in range(3)))
            # start=0 on a cached continuation: the whole sequence, the cached part from the engine's record
            _, second_prompt, tokens, _, _ = runs[0]
            whole = await engine.generate(
                request("again", (*second_prompt, *tokens), GREEDY, "agent-0", return_routed_experts=True)
            )
            unasked = await engine.generate(request("unasked", firsts[0], GREEDY))
            with pytest.raises(ValueError, match="routed_experts_start"):
                await engine.generate(
                    request("bad", [1, 2], GREEDY, return_routed_experts=True, routed_experts_start=3)
                )
        return runs, whole, unasked

    runs, whole, unasked = run(main())
    L, K = moe_model.config.num_hidden_layers, moe_model.config.num_experts_per_tok
    for i, (first, second_prompt, tokens, routed, cached) in enumerate(runs):
        fed = len(firsts[i]) + len(first.output_ids) - 1
        expected = teacher_forced_routing(moe_model, (*second_prompt, *tokens))
        assert first.routed_experts.dtype == np.int16 and first.routed_experts.shape == (fed, L, K)
        np.testing.assert_array_equal(first.routed_experts, expected[:fed])
        assert routed.shape == (len(second_prompt) + len(tokens) - 1 - fed, L, K)
        np.testing.assert_array_equal(routed, expected[fed:-1])
        assert (routed[:, 0] == -1).all() and (routed[:, 1:] >= 0).all()  # layer 0 is dense
        if engines.kind in PREFIX_CACHE:
            assert cached == fed
    _, second_prompt, tokens, _, _ = runs[0]
    again = (*second_prompt, *tokens)
    expected = teacher_forced_routing(moe_model, (*again, *whole.output_ids))
    assert whole.cached_tokens == len(again) - 1
    np.testing.assert_array_equal(whole.routed_experts, expected[:-1])
    assert unasked.routed_experts is None


def test_routed_experts_are_none_for_a_dense_model(engines):
    async def main():
        async with engines.open() as engine:
            result = await engine.generate(request("d", [1, 2, 3], GREEDY, return_routed_experts=True))
            chunks = [c async for c in engine.generate_stream(request("s", [1, 2], GREEDY, return_routed_experts=True))]
        return result, chunks

    result, chunks = run(main())
    assert result.finish_reason == "length" and result.routed_experts is None
    assert all(c.routed_experts is None for c in chunks)


def test_a_kv_export_carries_the_routing_of_the_positions_it_covers(engines, moe_model):
    """Imported KV brings its routing along: the continuation's record from position 0 equals the full forward's.
    An export without routing (its request did not ask) is not reused by a request that asks from 0: the engine
    computes those positions again, so their routing is known (a gap would be asked for by every later call)."""
    engines.needs_kv_migration()
    prompt = [7, 3, 11, 42, 5, 9]
    long = SamplingParams(temperature=0.0, max_new_tokens=12)

    async def migrate(source, destination, rid: str, ask: bool):
        await engines.hold_running(source, tokens=6)  # exported while held: it cannot end first
        stream = source.generate_stream(request(rid, prompt, long, return_routed_experts=ask))
        await engines.until_held(stream)
        export = await source.export_kv(rid)
        last = [c async for c in stream][-1]
        await engines.release_held(source)
        assert len(export.output_ids) == 6
        await destination.import_kv(export)
        rest = SamplingParams(temperature=0.0, max_new_tokens=5)
        cont = await destination.generate(
            request(f"{rid}-c", (*prompt, *export.output_ids), rest, f"exec-{rid}", return_routed_experts=True)
        )
        source.release_export(rid)
        return export, last, cont

    async def main():
        async with engines.open(moe_model) as source, engines.open(moe_model) as destination:
            return await migrate(source, destination, "m", True), await migrate(source, destination, "n", False)

    (export, last, cont), (bare, _, bare_cont) = run(main())
    covered = len(export.token_ids)
    assert export.routed_experts.dtype == torch.int16 and len(export.routed_experts) == covered
    assert last.finish_reason == "abort" and last.routed_experts.shape[0] == covered  # the aborted request's record
    assert cont.cached_tokens == covered
    expected = teacher_forced_routing(moe_model, (*prompt, *export.output_ids, *cont.output_ids))
    np.testing.assert_array_equal(export.routed_experts.numpy(), expected[:covered])
    np.testing.assert_array_equal(last.routed_experts, expected[:covered])
    np.testing.assert_array_equal(cont.routed_experts, expected[:-1])
    assert bare.routed_experts is None and bare_cont.cached_tokens == 0
    expected = teacher_forced_routing(moe_model, (*prompt, *bare.output_ids, *bare_cont.output_ids))
    np.testing.assert_array_equal(bare_cont.routed_experts, expected[:-1])
