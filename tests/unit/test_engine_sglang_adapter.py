"""The SGLang adapter: its pure translation, and its async plumbing over a fake of `sglang.Engine`.

Nothing here runs SGLang, which does not install on these machines (CUDA torch, a GPU). The test over a real engine
on a tiny local model is tests/gpu/test_sglang_engine_real.py (it reuses `request` and `run` from here).
"""

from __future__ import annotations

import asyncio
import base64
import sys
from types import SimpleNamespace

import numpy as np
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
    WeightUpdateSessionError,
)
from gyre.engine.sglang_engine import (
    RoutedLayout,
    SGLangEngine,
    SGLangIO,
    SGLangUnavailableError,
    logprob_mismatch,
    map_finish_reason,
    new_output_tokens,
    original_logprob_enabled,
    read_limits,
    rejected_input_message,
    routed_experts_from_sglang,
    routed_layout,
    sglang_engine_args,
    to_sglang_sampling_params,
)

TIMEOUT_S = 10.0
VOCAB = 50
SAMPLED = SamplingParams(temperature=0.7, max_new_tokens=5)
STALL_AT = 1000
LONG = SamplingParams(temperature=0.7, max_new_tokens=STALL_AT)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def request(request_id: str, input_ids=(1, 2, 3), params: SamplingParams = SAMPLED, **routing) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, execution_id="x", input_ids=input_ids, params=params, **routing)


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
        "routed_layout": None,  # no hf_text_config: dense or unknown
        "routed_experts_enabled": None,
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
    fake itself; every call it receives is appended to `calls`. The model is a MoE of `FAKE_MOE`'s shape: a finished
    request that asked for routed experts gets `fake_routing` in SGLang's encoding (base64 of int32 rows from
    `routed_experts_start_len` to seqlen - 1, 0 at the dense layer 0).
    """

    def __init__(self, *, incremental: bool = False, reject_names: bool = False):
        self.incremental = incremental
        self.reject_names = reject_names
        self.calls: list[tuple] = []
        self.aborted: set[str] = set()
        self.tokenizer_manager = self
        self.model_config = SimpleNamespace(vocab_size=VOCAB, hf_text_config=SimpleNamespace(**FAKE_MOE))
        self.context_len = 2048
        self.server_args = SimpleNamespace(tp_size=2, max_running_requests=8, enable_return_routed_experts=True)
        self.scheduler_info = {"max_total_num_tokens": 4096}
        self._running = asyncio.Event()  # cleared while generation is paused
        self._running.set()
        self._paused = False
        self._session = False  # SGLang 0.5.23 loads weights only inside a weight-update session
        self.routing_asked: dict[str, tuple[bool, int]] = {}

    async def async_generate(
        self,
        *,
        input_ids,
        sampling_params,
        return_logprob,
        stream,
        rid,
        return_routed_experts=False,
        routed_experts_start_len=0,
    ):
        assert return_logprob and stream
        self.calls.append(("generate", rid, sampling_params))
        self.routing_asked[rid] = (return_routed_experts, routed_experts_start_len)
        return self._stream(input_ids, sampling_params, rid, return_routed_experts, routed_experts_start_len)

    async def _stream(self, input_ids, sampling_params, rid, routed=False, routed_start=0):
        triples, stops = [], set(sampling_params.get("stop_token_ids", ()))
        budget = sampling_params["max_new_tokens"]

        def output(finish=None, new=1):
            entries = triples  # cumulative; incremental sends only the new ones (an abort is cumulative anyway)
            if self.incremental and finish != "abort":
                entries = triples[-new:] if new else []
            meta = {"output_token_logprobs": list(entries), "completion_tokens": len(triples)}
            meta["cached_tokens"] = len(input_ids) - 1
            meta["finish_reason"] = None if finish is None else {"type": finish}
            if routed and finish in ("stop", "length") and self.server_args.enable_return_routed_experts:
                sglang_rows = fake_routing(len(input_ids) + len(triples) - 1).astype(np.int32)
                sglang_rows[:, 0] = 0  # SGLang's buffer is never written at a dense layer
                meta["routed_experts"] = base64.b64encode(sglang_rows[routed_start:].tobytes()).decode()
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

    async def begin_weight_update(self, obj, request):
        self.calls.append(("begin", obj))
        if self._session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self._session = True
        return True, "Success"

    async def end_weight_update(self, obj, request):
        self.calls.append(("end", obj))
        if not self._session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self._session = False
        return True, "Success"

    async def update_weights_from_tensor(self, obj, request):
        self.calls.append(("update", obj, self._paused))
        if not self._session:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        if self.reject_names:
            return False, "unknown parameter nope.weight"
        return True, "ok"

    async def init_weights_update_group(self, obj, request):
        self.calls.append(("init_group", obj))
        return (False, "no route to 10.0.0.1") if self.reject_names else (True, "ok")

    async def update_weights_from_distributed(self, obj, request):
        self.calls.append(("update_distributed", obj, self._paused))
        if not self._session:
            return False, "update_weights_from_distributed runs between begin_weight_update() and end_weight_update()"
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


FAKE_MOE = {"num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [0]}


def fake_routing(positions: int) -> np.ndarray:
    """The fake model's routing of positions 0..positions-1 (protocol layout: -1 at the dense layer 0)."""
    t = np.arange(positions)[:, None, None]
    routed = (t + np.arange(3)[None, :, None] + np.arange(2)[None, None, :]) % 8
    routed[:, 0] = -1
    return routed.astype(np.int16)


FAKE_IO = SGLangIO(
    release_memory=lambda tags: {"release": {"tags": tags}},
    resume_memory=lambda tags: {"resume": {"tags": tags}},
    update_weights=lambda **kwargs: kwargs,
    pause=lambda mode: {"mode": mode},
    resume_generation=lambda: {},
    serialize=lambda named: [(name, tuple(tensor.shape)) for name, tensor in named],
    init_group=lambda **kwargs: {"init_group": kwargs},
    update_distributed=lambda **kwargs: {"update_distributed": kwargs},
    begin_update=lambda selector: {"selector": selector},
    end_update=lambda: {},
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
    # inside a pause in place and a weight-update session (SGLang 0.5.23 refuses an update outside one)
    window = kinds[kinds.index("update") - 2 : kinds.index("update") + 3]
    assert window == ["pause", "begin", "update", "end", "continue"]
    update = next(call for call in fake.calls if call[0] == "update")
    assert update[2] is True  # generation was paused during the update
    assert update[1]["serialized_named_tensors"] == [[("model.norm.weight", (4,))]] * 2  # one payload per TP rank
    assert update[1]["weight_version"] == "2"  # SGLang records it with the weights
    # A request was in flight: SGLang cannot flush then, so the adapter flushed once idle.
    assert update[1]["flush_cache"] is False and ("flush",) in fake.calls[kinds.index("update") :]
    assert "flush" not in kinds[: kinds.index("continue")]

    with pytest.raises(ValueError, match="version=1 is not allowed"):
        run(engine.update_weights(weights, version=1))
    calls = len(fake.calls)
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor"):
        run(engine.update_weights({"w": [1.0]}, version=3))
    assert [call[0] for call in fake.calls[calls:]] == ["pause", "begin", "end", "continue"]  # nothing was sent
    assert engine.load().accepting  # so the engine goes on with its weights
    spec = TensorSpec(name="w", dtype="float32", shape=(2,), offset=0)
    flat = FlatWeights(buffer=torch.zeros(8, dtype=torch.uint8), manifest=(spec,))
    calls = len(fake.calls)
    run(engine.update_weights(flat, version=3))
    # idle: flushed before generation continues (paused, nothing can slip in between)
    assert [call[0] for call in fake.calls[calls:]] == ["pause", "begin", "update", "end", "flush", "continue"]
    assert engine.policy_version == 3 and fake.calls[-4][1]["flush_cache"] is False

    rejecting, fake = adapter(FakeSGLangEngine(reject_names=True))
    with pytest.raises(ValueError, match="rejected the weight update to version 5: unknown parameter"):
        run(rejecting.update_weights({"nope.weight": torch.ones(1)}, version=5))
    # SGLang may have applied part of what it refused: the session was aborted, and nothing is served on it
    assert rejecting.policy_version == 0 and not rejecting.load().accepting
    assert [call[0] for call in fake.calls][:5] == ["pause", "begin", "update", "end", "continue"]  # a flush once idle
    with pytest.raises(EngineUnavailableError, match="partial weights"):
        run(rejecting.generate(request("after")))


PARAMETERS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def test_a_streamed_update_is_one_paused_sglang_session_with_one_update_per_bucket():
    """begin_update pauses in place and opens SGLang's session; each bucket is one update_weights_from_tensor with
    flush_cache=False and the session's weight_version; names the model lacks are refused before sending; end_update
    refuses an incomplete version (the session stays), then closes it; the call in flight continues, new version."""
    engine, fake = adapter(policy_version=1, parameter_names=PARAMETERS)
    embed, norm, head = ({name: torch.ones(2)} for name in PARAMETERS)

    async def go():
        stream = engine.generate_stream(request("span", (1,), SamplingParams(max_new_tokens=30)))
        first = await stream.__anext__()
        await engine.begin_update(version=2)
        with pytest.raises(WeightUpdateSessionError, match="session for version 2 is open"):
            await engine.begin_update(version=3)
        await engine.load_bucket({**embed, **norm})
        with pytest.raises(ValueError, match=r"unknown parameter name 'nope\.weight'"):
            await engine.load_bucket({"nope.weight": torch.ones(1)})
        with pytest.raises(ValueError, match=r"1 parameters were not loaded since begin_update \(lm_head.weight\)"):
            await engine.end_update(version=2)
        await engine.load_bucket(head)
        await engine.end_update(version=2)
        rest = [chunk async for chunk in stream]
        return first, rest

    first, rest = run(go())
    assert first.policy_version == 1 and rest[-1].policy_version == 2 and engine.policy_version == 2
    kinds = [call[0] for call in fake.calls if call[0] != "generate"]
    assert kinds == ["pause", "begin", "update", "update", "end", "continue", "flush"]  # flushed once idle
    updates = [call for call in fake.calls if call[0] == "update"]
    assert [[name for name, _ in u[1]["serialized_named_tensors"][0]] for u in updates] == [
        list(PARAMETERS[:2]),
        [PARAMETERS[2]],
    ]
    assert all(u[2] and u[1]["flush_cache"] is False and u[1]["weight_version"] == "2" for u in updates)
    with pytest.raises(WeightUpdateSessionError, match="load_bucket needs an open weight-update session"):
        run(engine.load_bucket(head))


def test_an_aborted_streamed_update_goes_on_untouched_and_else_serves_nothing_until_a_whole_version():
    engine, fake = adapter(parameter_names=PARAMETERS)
    whole = {name: torch.ones(2) for name in PARAMETERS}

    async def go():
        await engine.begin_update(version=1)
        await engine.abort_update()  # nothing sent: SGLang's weights are whole
        assert engine.load().accepting and [c[0] for c in fake.calls] == ["pause", "begin", "end", "continue"]
        stalled = asyncio.ensure_future(engine.generate(request("stalled", (1,), LONG)))
        while "stalled" not in {c[1] for c in fake.calls if c[0] == "generate"}:
            await asyncio.sleep(0.001)
        await engine.begin_update(version=1)
        await engine.load_bucket({PARAMETERS[0]: torch.ones(2)})
        await engine.abort_update()
        aborted = await stalled
        with pytest.raises(EngineUnavailableError, match="partial weights"):
            await engine.generate(request("refused"))
        refused_load = engine.load()
        await engine.begin_update(version=1)
        await engine.load_bucket(whole)
        await engine.end_update(version=1)
        return aborted, refused_load, await engine.generate(request("served"))

    aborted, refused_load, served = run(go())
    assert aborted.finish_reason == "abort" and "stalled" in fake.aborted and not refused_load.accepting
    assert served.policy_version == 1 and engine.load().accepting and engine.policy_version == 1


def test_a_bucket_from_the_weight_group_loads_in_the_session():
    engine, fake = adapter(policy_version=1)
    spec = {"names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [[4]], "group_name": "g"}
    with pytest.raises(WeightUpdateSessionError, match="load_bucket_from_group needs an open weight-update session"):
        run(engine.load_bucket_from_group(**spec))

    async def go():
        await engine.begin_update(version=4)
        with pytest.raises(ValueError, match="as many names, dtypes and shapes"):
            await engine.load_bucket_from_group(**{**spec, "dtypes": []})
        await engine.load_bucket_from_group(**spec)
        await engine.load_bucket_from_group(**{**spec, "names": ["lm_head.weight"]})
        await engine.end_update(version=4)

    run(go())
    kinds = [call[0] for call in fake.calls]
    assert kinds == ["pause", "begin", "update_distributed", "update_distributed", "end", "flush", "continue"]
    sent = [call[1]["update_distributed"] for call in fake.calls if call[0] == "update_distributed"]
    assert [s["names"] for s in sent] == [["model.norm.weight"], ["lm_head.weight"]]
    assert all(s["flush_cache"] is False and s["weight_version"] == "4" and s["load_format"] is None for s in sent)
    assert engine.policy_version == 4


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
    assert kinds[at - 2 : at + 3] == ["pause", "begin", "update_distributed", "end", "continue"]
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


def test_an_update_is_refused_when_no_weight_update_session_opens_and_generation_resumes():
    """SGLang 0.5.23 loads weights only between begin_weight_update and end_weight_update: a session that does not
    open (one left open elsewhere) refuses the update, loads nothing, and the pause in place still ends."""
    engine, fake = adapter()
    fake._session = True  # a session someone else left open
    with pytest.raises(ValueError, match="no weight-update session: a weight-update session is already open"):
        run(engine.update_weights({"model.norm.weight": torch.ones(4)}, version=2))
    kinds = [call[0] for call in fake.calls]
    assert "update" not in kinds and kinds[-1] == "continue" and engine.policy_version == 0


# ----------------------------------------------------------------- routed experts


def test_routed_layout_reads_qwens_moe_fields():
    qwen3_moe = SimpleNamespace(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0])
    assert routed_layout(qwen3_moe) == RoutedLayout(num_hidden_layers=4, top_k=2, moe_layers=(1, 2, 3))
    sparse_step = {"num_hidden_layers": 4, "num_local_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 2}
    assert routed_layout(sparse_step) == RoutedLayout(num_hidden_layers=4, top_k=2, moe_layers=(1, 3))
    assert routed_layout(SimpleNamespace(num_hidden_layers=4, num_experts_per_tok=None)) is None  # dense
    assert routed_layout(None) is None


def test_routed_experts_from_sglang_decode_its_int32_rows_with_minus_one_at_dense_layers():
    layout = RoutedLayout(num_hidden_layers=3, top_k=2, moe_layers=(1, 2))
    rows = np.arange(12, dtype=np.int32).reshape(2, 3, 2)  # 0 and 1 at the dense layer, as SGLang leaves zeros
    routed = routed_experts_from_sglang(base64.b64encode(rows.tobytes()).decode(), layout, rows=2)
    assert routed.dtype == np.int16 and routed.shape == (2, 3, 2)
    assert routed.tolist() == [[[-1, -1], [2, 3], [4, 5]], [[-1, -1], [8, 9], [10, 11]]]
    assert (routed_experts_from_sglang(None, layout, rows=4) == -1).all()  # none sent: unknown
    assert routed_experts_from_sglang(None, layout, rows=0).shape == (0, 3, 2)
    with pytest.raises(RuntimeError, match="expected 3 positions x 3 layers x top-2"):
        routed_experts_from_sglang(base64.b64encode(rows.tobytes()).decode(), layout, rows=3)
    with pytest.raises(RuntimeError, match="not base64"):
        routed_experts_from_sglang("***", layout, rows=2)


def test_routed_experts_pass_to_sglang_and_come_back_in_the_protocols_layout():
    engine, fake = adapter()
    assert engine.limits.routed_layout == RoutedLayout(num_hidden_layers=3, top_k=2, moe_layers=(1, 2))
    prompt = (4, 9, 11, 2)

    async def go():
        whole = await engine.generate(request("w", prompt, SAMPLED, return_routed_experts=True))
        tail = request("t", prompt, SAMPLED, return_routed_experts=True, routed_experts_start=3)
        chunks = [chunk async for chunk in engine.generate_stream(tail)]
        plain = await engine.generate(request("p", prompt))
        return whole, chunks, plain

    whole, chunks, plain = run(go())
    fed = len(prompt) + SAMPLED.max_new_tokens - 1
    np.testing.assert_array_equal(whole.routed_experts, fake_routing(fed))
    assert all(c.routed_experts is None for c in chunks[:-1])
    np.testing.assert_array_equal(chunks[-1].routed_experts, fake_routing(fed)[3:])
    assert plain.routed_experts is None
    assert fake.routing_asked == {"w": (True, 0), "t": (True, 3), "p": (False, 0)}

    async def abort_mid_stream():
        chunks = []
        async for chunk in engine.generate_stream(request("a", (1,), LONG, return_routed_experts=True)):
            chunks.append(chunk)
            if len(chunks) == 2:
                engine.abort("a")
        return chunks[-1], sum((c.token_ids for c in chunks), ())

    aborted, tokens = run(abort_mid_stream())
    assert aborted.finish_reason == "abort" and (aborted.routed_experts == -1).all()  # SGLang sent none: unknown
    assert aborted.routed_experts.shape == (len(tokens), 3, 2)  # prompt 1 + outputs - 1 fed positions


def test_routed_experts_need_sglangs_capture_and_are_none_for_a_dense_model():
    fake = FakeSGLangEngine()
    fake.server_args.enable_return_routed_experts = False
    engine, _ = adapter(fake)
    with pytest.raises(ValueError, match="enable_return_routed_experts=True"):
        run(engine.generate(request("r", return_routed_experts=True)))
    assert run(engine.generate(request("ok"))).routed_experts is None
    dense = FakeSGLangEngine()
    dense.model_config.hf_text_config = SimpleNamespace(num_hidden_layers=3, num_experts_per_tok=None)
    engine, _ = adapter(dense)
    assert engine.limits.routed_layout is None
    assert run(engine.generate(request("d", return_routed_experts=True))).routed_experts is None
    args = dict(tp_size=1, base_gpu_id=0, dtype="bfloat16", max_running=8, max_total_tokens=0, seed=0)
    assert sglang_engine_args(**args, return_routed_experts=True)["enable_return_routed_experts"] is True
    assert "enable_return_routed_experts" not in sglang_engine_args(**args)


def test_routed_experts_through_the_sglang_standin_equal_the_models_own(tmp_path, monkeypatch):
    """The adapter over gyre's SGLang stand-in (gyre.engine.sglang_standin, imported under another name so `sglang`
    stays unimported here) on the tiny MoE: SGLang's encoding (int32, 0 at the dense layer) decodes to the shared
    model's own routing of the same tokens (-1 at the dense layer)."""
    import importlib.util

    from gyre.engine.sglang_standin import PATH
    from gyre.models.decoder import build_model
    from gyre.models.hf_weights import save_pretrained
    from gyre.models.moe import tiny_qwen3_moe_config

    name = "gyre_test_sglang_standin"
    spec = importlib.util.spec_from_file_location(
        name, PATH / "sglang" / "__init__.py", submodule_search_locations=[str(PATH / "sglang")]
    )
    standin = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, standin)
    spec.loader.exec_module(standin)
    moe = build_model(tiny_qwen3_moe_config(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None), seed=3).eval()
    save_pretrained(moe, tmp_path / "moe")
    prompt = (3, 14, 15, 9, 2)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=5)

    async def go():
        sgl = standin.Engine(
            model_path=str(tmp_path / "moe"), skip_tokenizer_init=True, enable_return_routed_experts=True
        )
        engine = SGLangEngine(sgl, sglang_io=FAKE_IO, environ={})
        assert engine.limits.routed_layout == RoutedLayout(num_hidden_layers=4, top_k=2, moe_layers=(1, 2, 3))
        return await engine.generate(request("s", prompt, params, return_routed_experts=True, routed_experts_start=2))

    result = run(go())
    ids = [*prompt, *result.output_ids]
    with torch.no_grad():
        _, _, routed_1TLK = moe(torch.tensor([ids]), torch.arange(len(ids))[None], return_routed_experts=True)
    np.testing.assert_array_equal(result.routed_experts, routed_1TLK[0, 2:-1].numpy())
    assert (result.routed_experts[:, 0] == -1).all()


def test_a_streamed_update_through_the_sglang_standin_serves_the_new_weights(tmp_path, monkeypatch):
    """The adapter over gyre's SGLang stand-in (its request types and serializer, imported as `sglang` for this test
    only) on the tiny test model: a session of buckets, with a call held in flight across it, makes the engine answer
    as the native engine on the new weights; the stand-in recorded the weight version the adapter sent."""
    import copy
    import importlib

    from engine_fixtures import sharp_tiny_model

    from gyre.engine.native import NativeEngine
    from gyre.engine.sglang_standin import PATH
    from gyre.models.flat_weights import flatten_weights
    from gyre.models.hf_weights import save_pretrained

    model = sharp_tiny_model()
    save_pretrained(model, tmp_path / "m")
    new_model = copy.deepcopy(model)
    with torch.no_grad():
        for param in new_model.parameters():
            param.mul_(1.25)
    weights = {name: param.detach().clone() for name, param in new_model.named_parameters()}
    names = list(weights)
    buckets = [flatten_weights({n: weights[n] for n in names[i : i + 6]}) for i in range(0, len(names), 6)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompts = [(3, 1, 4), (1, 5, 9, 2), (6,)]

    monkeypatch.syspath_prepend(str(PATH))
    before = set(sys.modules)
    try:
        sglang = importlib.import_module("sglang")
        assert sglang.STANDIN

        async def go():
            sgl = sglang.Engine(model_path=str(tmp_path / "m"), skip_tokenizer_init=True)
            engine = SGLangEngine(sgl, environ={}, parameter_names=[name for name, _ in model.named_parameters()])
            stream = engine.generate_stream(request("span", (2, 7), SamplingParams(temperature=0.0, max_new_tokens=40)))
            first = await stream.__anext__()
            await engine.begin_update(version=3)
            for bucket in buckets:
                await engine.load_bucket(bucket)
            await engine.end_update(version=3)
            rest = [chunk async for chunk in stream]
            served = [await engine.generate(request(f"n{i}", p, greedy)) for i, p in enumerate(prompts)]
            reference = NativeEngine(new_model)
            expected = [await reference.generate(request(f"e{i}", p, greedy)) for i, p in enumerate(prompts)]
            await reference.close()
            await engine.close()
            return first, rest, served, expected, sgl.tokenizer_manager.weight_version

        first, rest, served, expected, weight_version = run(go())
    finally:
        for name in set(sys.modules) - before:
            if name == "sglang" or name.startswith("sglang."):
                del sys.modules[name]
    assert len(buckets) > 1 and first.policy_version == 0 and rest[-1].policy_version == 3
    assert rest[-1].finish_reason == "length" and weight_version == "3"
    assert [r.output_ids for r in served] == [r.output_ids for r in expected]
    assert [r.output_logprobs for r in served] == [r.output_logprobs for r in expected]
