"""The SGLang adapter: its pure translation, and its async plumbing over a fake of `sglang.Engine`.

Nothing here runs SGLang, which does not install on these machines (CUDA torch, a GPU). The test over a real engine
on a tiny local model is tests/gpu/test_sglang_engine_real.py (it reuses `request` and `run` from here).
"""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import pytest
import torch

from gyre.engine.protocol import (
    Engine,
    EngineBusyError,
    EngineUnavailableError,
    FlatWeights,
    GenerateRequest,
    SamplingParams,
    TensorSpec,
)
from gyre.engine.sglang_engine import (
    SGLangEngine,
    SGLangIO,
    SGLangUnavailableError,
    logprob_mismatch,
    map_finish_reason,
    new_output_tokens,
    original_logprob_enabled,
    read_limits,
    rejected_input_message,
    to_sglang_sampling_params,
)

TIMEOUT_S = 10.0
VOCAB = 50
SAMPLED = SamplingParams(temperature=0.7, max_new_tokens=5)
STALL_AT = 1000
LONG = SamplingParams(temperature=0.7, max_new_tokens=STALL_AT)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def request(request_id: str, input_ids=(1, 2, 3), params: SamplingParams = SAMPLED) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, execution_id="x", input_ids=input_ids, params=params)


# ----------------------------------------------------------------- pure translation


def test_sampling_params_translation():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=12, stop_token_ids=(5, 9), seed=4)
    assert to_sglang_sampling_params(params) == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,  # gyre 0 (off) is SGLang -1
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_new_tokens": 0,
        "max_new_tokens": 12,
        "ignore_eos": False,
        "no_stop_trim": True,
        "stop_token_ids": [5, 9],
        "sampling_seed": 4,
    }
    greedy = to_sglang_sampling_params(SamplingParams(temperature=0, top_k=3, top_p=0.5), forward_seed=False)
    assert (greedy["temperature"], greedy["top_k"], greedy["top_p"]) == (0.0, -1, 1.0)  # filters do not apply
    assert greedy["ignore_eos"] and "stop_token_ids" not in greedy and "sampling_seed" not in greedy
    assert to_sglang_sampling_params(SamplingParams(top_k=8))["top_k"] == 8


def test_logprob_mismatch():
    assert logprob_mismatch(SamplingParams(temperature=0.7), original_logprob=False) is None
    assert logprob_mismatch(SamplingParams(temperature=0, top_k=3), original_logprob=True) is None
    assert logprob_mismatch(SamplingParams(temperature=1.0), original_logprob=True) is None
    assert "before temperature" in logprob_mismatch(SamplingParams(temperature=0.7), original_logprob=True)
    assert "top_k=5" in logprob_mismatch(SamplingParams(top_k=5), original_logprob=False)
    assert "top_p=0.9" in logprob_mismatch(SamplingParams(top_p=0.9), original_logprob=False)


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("True", True), ("0", False), ("", False)])
def test_original_logprob_env(value, expected):
    assert original_logprob_enabled({"SGLANG_RETURN_ORIGINAL_LOGPROB": value}) is expected
    assert original_logprob_enabled({}) is False


def test_finish_reason_mapping():
    assert map_finish_reason(None) is None
    assert map_finish_reason({"type": "stop", "matched": 7}) == "stop"
    assert map_finish_reason({"type": "stop", "matched": "NaN happened"}) == "stop"
    assert map_finish_reason({"type": "length", "length": 5}) == "length"
    assert map_finish_reason({"type": "abort", "message": "Abort in waiting queue"}) == "abort"
    with pytest.raises(ValueError, match="unknown SGLang finish_reason"):
        map_finish_reason({"type": "tool_calls"})
    assert rejected_input_message({"type": "abort", "message": "too long", "status_code": 400}) == "too long"
    assert rejected_input_message({"type": "abort", "message": "Aborted", "status_code": None}) is None


def triples(*pairs):
    return [(logprob, token_id, None) for token_id, logprob in pairs]


def test_new_output_tokens_cumulative_and_incremental():
    # Cumulative (SGLang's default): the whole list every time.
    first = {"output_token_logprobs": triples((11, -0.5)), "completion_tokens": 1}
    second = {"output_token_logprobs": triples((11, -0.5), (12, -0.25), (13, -1.0)), "completion_tokens": 3}
    assert new_output_tokens(first, 0) == ((11,), (-0.5,))
    assert new_output_tokens(second, 1) == ((12, 13), (-0.25, -1.0))
    # Incremental (--incremental-streaming-output): only the delta.
    delta = {"output_token_logprobs": triples((12, -0.25), (13, -1.0)), "completion_tokens": 3}
    assert new_output_tokens(delta, 1) == ((12, 13), (-0.25, -1.0))
    # An abort's output is cumulative even in incremental mode; nothing new here.
    assert new_output_tokens(second, 3) == ((), ())
    # No completion_tokens: read as cumulative. Lists (msgspec/JSON) work as well as tuples.
    assert new_output_tokens({"output_token_logprobs": [[-0.5, 11, None], [-2.0, 4, None]]}, 1) == ((4,), (-2.0,))
    assert new_output_tokens({"finish_reason": {"type": "abort"}}, 2) == ((), ())
    with pytest.raises(RuntimeError, match="inconsistent"):
        new_output_tokens({"output_token_logprobs": triples((12, -0.25)), "completion_tokens": 5}, 1)
    with pytest.raises(RuntimeError, match="no log-prob"):
        new_output_tokens({"output_token_logprobs": [(None, 11, None)], "completion_tokens": 1}, 0)


def test_read_limits_from_engine_attributes():
    manager = SimpleNamespace(model_config=SimpleNamespace(vocab_size=151936), context_len=32768)
    engine_05 = SimpleNamespace(
        tokenizer_manager=manager,
        server_args=SimpleNamespace(tp_size=2, max_running_requests=None),
        scheduler_info={"max_total_num_tokens": 500_000, "max_req_input_len": 32760},
    )
    assert read_limits(engine_05).__dict__ == {
        "vocab_size": 151936,
        "context_length": 32768,
        "max_running": None,
        "kv_tokens_total": 500_000,
        "tp_size": 2,
    }
    engine_main = SimpleNamespace(
        tokenizer_manager=manager,
        server_args=SimpleNamespace(tp_size=1, max_running_requests=64),
        _scheduler_init_result=SimpleNamespace(scheduler_infos=[{"max_total_num_tokens": 9000}]),
    )
    limits = read_limits(engine_main)
    assert (limits.max_running, limits.kv_tokens_total, limits.tp_size) == (64, 9000, 1)
    assert read_limits(SimpleNamespace()).vocab_size is None


# ----------------------------------------------------------------- the fake


class FakeSGLangEngine:
    """Stands in for sglang.Engine, which cannot run here: the surface the adapter touches, nothing more.

    Output token i of a prompt ending in id t is (t + i + 1) % VOCAB with log-prob -0.1 * (i + 1), one token per
    millisecond; a request asking for STALL_AT tokens stalls after three until aborted. `tokenizer_manager` is the
    fake itself; every call it receives is appended to `calls`.
    """

    def __init__(self, *, incremental: bool = False, reject_names: bool = False):
        self.incremental = incremental
        self.reject_names = reject_names
        self.calls: list[tuple] = []
        self.aborted: set[str] = set()
        self.tokenizer_manager = self
        self.model_config = SimpleNamespace(vocab_size=VOCAB)
        self.context_len = 2048
        self.server_args = SimpleNamespace(tp_size=2, max_running_requests=8)
        self.scheduler_info = {"max_total_num_tokens": 4096}
        self._running = asyncio.Event()  # cleared while generation is paused
        self._running.set()
        self._paused = False

    async def async_generate(self, *, input_ids, sampling_params, return_logprob, stream, rid):
        assert return_logprob and stream
        self.calls.append(("generate", rid, sampling_params))
        return self._stream(input_ids, sampling_params, rid)

    async def _stream(self, input_ids, sampling_params, rid):
        triples, stops = [], set(sampling_params.get("stop_token_ids", ()))
        budget = sampling_params["max_new_tokens"]

        def output(finish=None, new=1):
            entries = triples  # cumulative; incremental sends only the new ones (an abort is cumulative anyway)
            if self.incremental and finish != "abort":
                entries = triples[-new:] if new else []
            meta = {"output_token_logprobs": list(entries), "completion_tokens": len(triples)}
            meta["cached_tokens"] = len(input_ids) - 1
            meta["finish_reason"] = None if finish is None else {"type": finish}
            return {"meta_info": meta}

        while True:
            await asyncio.sleep(0.001)
            await self._running.wait()
            if rid in self.aborted:
                yield output("abort", new=0)
                return
            if budget >= STALL_AT and len(triples) >= 3:
                continue  # stalls until aborted
            token = (input_ids[-1] + len(triples) + 1) % VOCAB
            triples.append((-0.1 * (len(triples) + 1), token, None))
            if token in stops:
                yield output("stop")
                return
            if len(triples) == budget:
                yield output("length")
                return
            yield output()

    # tokenizer_manager
    def abort_request(self, rid):
        self.aborted.add(rid)

    async def pause_generation(self, obj):
        self.calls.append(("pause", obj))
        self._paused = True
        self._running.clear()

    async def continue_generation(self, obj):
        self.calls.append(("continue", obj))
        self._paused = False
        self._running.set()

    async def update_weights_from_tensor(self, obj, request):
        self.calls.append(("update", obj, self._paused))
        if self.reject_names:
            return False, "unknown parameter nope.weight"
        return True, "ok"

    async def init_weights_update_group(self, obj, request):
        self.calls.append(("init_group", obj))
        return (False, "no route to 10.0.0.1") if self.reject_names else (True, "ok")

    async def update_weights_from_distributed(self, obj, request):
        self.calls.append(("update_distributed", obj, self._paused))
        if self.reject_names:
            return False, "unknown parameter nope.weight"
        return True, "ok"

    async def release_memory_occupation(self, obj, request):
        self.calls.append(("release", obj))

    async def resume_memory_occupation(self, obj, request):
        self.calls.append(("resume", obj))

    async def flush_cache(self):
        self.calls.append(("flush",))
        return SimpleNamespace(success=True)

    def shutdown(self):
        self.calls.append(("shutdown",))


FAKE_IO = SGLangIO(
    release_memory=lambda tags: {"release": {"tags": tags}},
    resume_memory=lambda tags: {"resume": {"tags": tags}},
    update_weights=lambda **kwargs: kwargs,
    pause=lambda mode: {"mode": mode},
    resume_generation=lambda: {},
    serialize=lambda named: [(name, tuple(tensor.shape)) for name, tensor in named],
    init_group=lambda **kwargs: {"init_group": kwargs},
    update_distributed=lambda **kwargs: {"update_distributed": kwargs},
)


def adapter(fake: FakeSGLangEngine | None = None, **options) -> tuple[SGLangEngine, FakeSGLangEngine]:
    fake = fake or FakeSGLangEngine()
    return SGLangEngine(fake, sglang_io=FAKE_IO, environ={}, **options), fake


def expected_tokens(last_prompt_id: int, n: int) -> tuple[int, ...]:
    return tuple((last_prompt_id + i + 1) % VOCAB for i in range(n))


def test_generate_result_and_forwarded_params():
    engine, fake = adapter(policy_version=3)
    assert isinstance(engine, Engine)
    result = run(engine.generate(request("r1", (4, 9))))
    assert result.output_ids == expected_tokens(9, 5) and result.finish_reason == "length"
    assert result.output_logprobs == pytest.approx((-0.1, -0.2, -0.3, -0.4, -0.5))
    assert (result.policy_version, result.last_policy_version, result.prompt_tokens, result.cached_tokens) == (
        3,
        3,
        2,
        1,
    )
    assert 0 <= result.timings.first_token_s <= result.timings.total_s
    assert fake.calls[0] == ("generate", "r1", to_sglang_sampling_params(SAMPLED))
    assert engine.load().running == 0 and engine.limits.vocab_size == VOCAB


@pytest.mark.parametrize("incremental", [False, True])
def test_stream_chunks_concatenate_to_the_result(incremental):
    engine, _ = adapter(FakeSGLangEngine(incremental=incremental))
    stop_at = expected_tokens(3, 4)[-1]
    params = SamplingParams(temperature=0.7, max_new_tokens=10, stop_token_ids=(stop_at,))

    async def go():
        chunks = [chunk async for chunk in engine.generate_stream(request("s", (1, 2, 3), params))]
        return chunks, await engine.generate(request("g", (1, 2, 3), params))

    chunks, result = run(go())
    assert [c.index for c in chunks] == [0, 1, 2, 3] and chunks[-1].finish_reason == "stop"
    assert all(c.finish_reason is None for c in chunks[:-1]) and chunks[-1].timings is not None
    assert sum((c.token_ids for c in chunks), ()) == result.output_ids == expected_tokens(3, 4)
    assert sum((c.logprobs for c in chunks), ()) == result.output_logprobs


def test_abort_mid_stream_returns_partial_output_and_engine_serves_on():
    engine, fake = adapter()

    async def go():
        chunks = []
        async for chunk in engine.generate_stream(request("long", (1,), LONG)):
            chunks.append(chunk)
            if len(chunks) == 2:
                assert engine.abort("long") is True
        assert engine.abort("long") is False and engine.abort("unknown") is False
        return chunks, await engine.generate(request("after", (1,)))

    chunks, after = run(go())
    assert chunks[-1].finish_reason == "abort" and "long" in fake.aborted
    tokens = sum((c.token_ids for c in chunks), ())
    assert len(tokens) in (2, 3) and tokens == expected_tokens(1, len(tokens))
    assert after.finish_reason == "length" and engine.load().running == 0


def test_cancelling_generate_aborts_the_request():
    engine, fake = adapter()

    async def go():
        task = asyncio.ensure_future(engine.generate(request("c", (1,), LONG)))
        for _ in range(5):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.drain()  # the pump sees SGLang's abort through

    run(go())
    assert "c" in fake.aborted and engine.load().running == 0


def test_drain_stop_and_resume_accepting():
    engine, fake = adapter()

    async def go():
        long = asyncio.ensure_future(engine.generate(request("long", (1,), LONG)))
        short = asyncio.ensure_future(engine.generate(request("short", (1,))))
        await asyncio.sleep(0)
        await engine.drain(abort_after_s=0.05)
        with pytest.raises(EngineUnavailableError, match="stopped accepting"):
            await engine.generate(request("late"))
        assert not engine.load().accepting
        engine.resume_accepting()
        return await long, await short, await engine.generate(request("again"))

    long, short, again = run(go())
    assert (long.finish_reason, short.finish_reason, again.finish_reason) == ("abort", "length", "length")
    assert fake.aborted == {"long"}


def test_update_weights_versions_pause_and_failures():
    engine, fake = adapter(policy_version=1)
    weights = {"model.norm.weight": torch.ones(4)}

    async def go():
        stream = engine.generate_stream(request("span", (1,), SamplingParams(max_new_tokens=30)))
        first = await stream.__anext__()
        await engine.update_weights(weights, version=2)
        rest = [chunk async for chunk in stream]
        result = await engine.generate(request("new", (1,)))
        return first, rest, result

    first, rest, result = run(go())
    assert first.policy_version == 1 and rest[-1].policy_version == 2 and result.policy_version == 2
    kinds = [call[0] for call in fake.calls]
    assert kinds[kinds.index("update") - 1 : kinds.index("update") + 2] == ["pause", "update", "continue"]
    update = next(call for call in fake.calls if call[0] == "update")
    assert update[2] is True  # generation was paused during the update
    assert update[1]["serialized_named_tensors"] == [[("model.norm.weight", (4,))]] * 2  # one payload per TP rank
    # A request was in flight: SGLang cannot flush then (it asserts), so the adapter flushed once idle.
    assert update[1]["flush_cache"] is False and ("flush",) in fake.calls[kinds.index("update") :]

    with pytest.raises(ValueError, match="version=1 is not allowed"):
        run(engine.update_weights(weights, version=1))
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor"):
        run(engine.update_weights({"w": [1.0]}, version=3))
    spec = TensorSpec(name="w", dtype="float32", shape=(2,), offset=0)
    flat = FlatWeights(buffer=torch.zeros(8, dtype=torch.uint8), manifest=(spec,))
    run(engine.update_weights(flat, version=3))
    assert engine.policy_version == 3 and fake.calls[-2][1]["flush_cache"] is True  # idle: flushed with the update

    rejecting, _ = adapter(FakeSGLangEngine(reject_names=True))
    with pytest.raises(ValueError, match="rejected the weight update to version 5: unknown parameter"):
        run(rejecting.update_weights({"nope.weight": torch.ones(1)}, version=5))
    assert rejecting.policy_version == 0


def test_release_and_resume_memory():
    engine, fake = adapter()

    async def busy():
        task = asyncio.ensure_future(engine.generate(request("busy", (1,), LONG)))
        await asyncio.sleep(0)
        with pytest.raises(EngineBusyError, match="1 requests in flight"):
            await engine.release_memory()
        engine.abort("busy")
        return await task

    assert run(busy()).finish_reason == "abort"
    run(engine.release_memory(weights=False, kv=True))
    assert fake.calls[-1] == ("release", {"release": {"tags": ["kv_cache"]}})
    run(engine.release_memory())
    assert fake.calls[-1] == ("release", {"release": {"tags": None}})
    load = engine.load()
    assert load.memory_released and not load.accepting and load.kv_tokens_total == 0
    with pytest.raises(EngineUnavailableError, match="memory is released"):
        run(engine.generate(request("r")))
    with pytest.raises(EngineUnavailableError, match="resume_memory first"):
        run(engine.update_weights({"w": torch.ones(1)}, version=1))
    run(engine.resume_memory())
    assert fake.calls[-1] == ("resume", {"resume": {"tags": None}})
    assert not engine.load().memory_released and run(engine.generate(request("r"))).finish_reason == "length"


def test_bad_input_is_rejected_per_request():
    engine, _ = adapter()
    with pytest.raises(ValueError, match="out of vocabulary"):
        run(engine.generate(request("v", (1, VOCAB))))
    with pytest.raises(ValueError, match="exceeds the context limit 2048"):
        run(engine.generate(request("c", (1,) * 60, SamplingParams(max_new_tokens=2000))))
    with pytest.raises(ValueError, match="before top-k/top-p"):
        run(engine.generate(request("f", params=SamplingParams(top_p=0.8))))
    with pytest.raises(ValueError, match="before temperature"):
        run(SGLangEngine(FakeSGLangEngine(), environ={"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}).generate(request("t")))

    async def duplicate():
        first = asyncio.ensure_future(engine.generate(request("d", (1,), SamplingParams(max_new_tokens=20))))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="already in flight"):
            await engine.generate(request("d"))
        return await first

    assert run(duplicate()).finish_reason == "length"
    lenient, _ = adapter(allow_unfiltered_logprobs=True)
    assert run(lenient.generate(request("f", params=SamplingParams(top_k=5)))).finish_reason == "length"


def test_sglang_rejection_raises_value_error():
    engine, fake = adapter()

    async def rejecting_stream(*args):
        yield {"meta_info": {"finish_reason": {"type": "abort", "message": "input too long", "status_code": 400}}}

    fake._stream = rejecting_stream
    with pytest.raises(ValueError, match="SGLang rejected request 'r': input too long"):
        run(engine.generate(request("r")))
    assert engine.load().running == 0


def test_kv_migration_is_not_supported():
    engine, _ = adapter()
    with pytest.raises(NotImplementedError, match="re-prefill"):
        run(engine.export_kv("r"))
    with pytest.raises(NotImplementedError, match="new request"):
        run(engine.import_kv(None))
    assert engine.release_export("r") is False


def test_from_pretrained_without_sglang(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError
    with pytest.raises(SGLangUnavailableError, match="needs the `sglang` package"):
        SGLangEngine.from_pretrained("/nonexistent")
    assert issubclass(SGLangUnavailableError, ImportError)  # callers may catch ImportError


def test_publication_by_group_joins_once_and_updates_inside_a_pause():
    engine, fake = adapter(policy_version=1)
    group = {
        "address": "10.0.0.5",
        "port": 29555,
        "rank_offset": 1,
        "world_size": 3,
        "group_name": "g",
        "backend": "nccl",
    }
    run(engine.init_weights_group(**group))
    assert fake.calls[-1] == (
        "init_group",
        {
            "init_group": {
                **{k: v for k, v in group.items() if k not in ("address", "port")},
                "master_address": "10.0.0.5",
                "master_port": 29555,
            }
        },
    )
    spec = {"names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [[4]], "group_name": "g"}

    async def go():
        stream = engine.generate_stream(request("span", (1,), SamplingParams(max_new_tokens=30)))
        first = await stream.__anext__()
        await engine.update_weights_from_group(**spec, version=2)
        rest = [chunk async for chunk in stream]
        return first, rest

    first, rest = run(go())
    assert first.policy_version == 1 and rest[-1].policy_version == 2 and engine.policy_version == 2
    kinds = [call[0] for call in fake.calls]
    at = kinds.index("update_distributed")
    assert kinds[at - 1 : at + 2] == ["pause", "update_distributed", "continue"]
    update = fake.calls[at]
    assert update[2] is True  # received while paused in place: the call in flight went on after, not aborted
    sent = update[1]["update_distributed"]
    assert {k: sent[k] for k in spec} == spec and sent["flush_cache"] is False and sent["load_format"] is None
    assert "span" not in fake.aborted

    with pytest.raises(ValueError, match="version=1 is not allowed"):
        run(engine.update_weights_from_group(**spec, version=1))
    with pytest.raises(ValueError, match="as many names, dtypes and shapes"):
        run(engine.update_weights_from_group(**{**spec, "shapes": []}, version=3))
    run(engine.release_memory())
    with pytest.raises(EngineUnavailableError, match="weights are released"):
        run(engine.update_weights_from_group(**spec, version=3))
    rejecting, _ = adapter(FakeSGLangEngine(reject_names=True))
    with pytest.raises(ValueError, match="could not join the weight group 'g': no route"):
        run(rejecting.init_weights_group(**group))
    with pytest.raises(ValueError, match="rejected the weight update to version 1: unknown parameter"):
        run(rejecting.update_weights_from_group(**spec, version=1))
    assert rejecting.policy_version == 0
