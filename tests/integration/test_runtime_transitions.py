"""gyre.runtime.controller.transitions on a real NativeEngine (the tiny model), in process and behind its endpoint
(real HTTP
on 127.0.0.1 through `RemoteEngine`): a cell leaves rollout (the call in flight ends as an abort, the memory is
released, nothing is accepted) and returns with a publication: the engine then reports the new version, holds
exactly the published weights, generates what an engine built from them generates, and accepts. The wrong orders
raise as gyre.engine.protocol says; a refused publication leaves the engine resumed but not accepting.
"""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
import torch

from gyre.engine.endpoint import ServerThread
from gyre.engine.native import NativeEngine
from gyre.engine.protocol import EngineBusyError, EngineUnavailableError, GenerateRequest, SamplingParams
from gyre.engine.remote import RemoteEngine
from gyre.models.hf_weights import load_pretrained
from gyre.models.tiny import tiny_model_dir
from gyre.runtime.controller.transitions import leave_rollout, return_to_rollout
from gyre.trainer.native_trainable import NativeTrainable
from gyre.trainer.publish import engine_weights

PROMPTS = ([1, 2, 3], [5, 9, 11, 4], [7])


@pytest.fixture(scope="module")
def tiny_model():
    return load_pretrained(tiny_model_dir(), torch.float32, "cpu")


def trained_copy(model):
    """The model after "training": every parameter moved."""
    trained = copy.deepcopy(model)
    with torch.no_grad():
        for i, p in enumerate(trained.parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    return trained


class CallOrderEngine(NativeEngine):
    """The native engine, recording each lifecycle call with the version it held then."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, int]] = []

    def stop_accepting(self) -> None:
        self.calls.append(("stop_accepting", self.policy_version))
        super().stop_accepting()

    def resume_accepting(self) -> None:
        self.calls.append(("resume_accepting", self.policy_version))
        super().resume_accepting()

    async def drain(self, *, abort_after_s=None) -> None:
        self.calls.append(("drain", self.policy_version))
        await super().drain(abort_after_s=abort_after_s)

    async def release_memory(self, *, weights=True, kv=True) -> None:
        self.calls.append(("release_memory", self.policy_version))
        await super().release_memory(weights=weights, kv=kv)

    async def resume_memory(self, *, weights=True, kv=True) -> None:
        self.calls.append(("resume_memory", self.policy_version))
        await super().resume_memory(weights=weights, kv=kv)

    async def update_weights(self, weights, *, version) -> None:
        self.calls.append(("update_weights", self.policy_version))
        await super().update_weights(weights, version=version)


async def greedy(engine, name: str) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    results = [
        await engine.generate(
            GenerateRequest(request_id=f"{name}{i}", execution_id=f"{name}{i}", input_ids=p, params=params)
        )
        for i, p in enumerate(PROMPTS)
    ]
    return [list(r.output_ids) for r in results]


async def current_load(engine):
    """The engine's own report: a RemoteEngine asks its endpoint, the native engine answers in process."""
    return await engine.refresh_load() if isinstance(engine, RemoteEngine) else engine.load()


async def wait_in_flight(engine) -> None:
    deadline = time.monotonic() + 30.0
    while (load := await current_load(engine)).running + load.queued == 0:
        assert time.monotonic() < deadline, "the request never reached the engine"
        await asyncio.sleep(0.01)


async def leave_and_return(engine, native: NativeEngine, trained) -> None:
    """The scenario, on `engine` (the native engine itself or a RemoteEngine in front of it)."""
    context = native.model.config.max_position_embeddings
    endless = GenerateRequest(  # no stop ids and the whole context to fill: it ends only by abort
        request_id="endless",
        execution_id="endless",
        input_ids=[1, 2],
        params=SamplingParams(max_new_tokens=context - 2),
    )
    in_flight = asyncio.create_task(engine.generate(endless))
    await wait_in_flight(engine)
    with pytest.raises(EngineBusyError):  # release before drain: refused, nothing released
        await engine.release_memory()
    assert not (await current_load(engine)).memory_released

    await leave_rollout(engine, drain_s=0.0)
    assert (await in_flight).finish_reason == "abort"
    load = await current_load(engine)
    assert load.memory_released and not load.accepting and load.running + load.queued == 0
    with pytest.raises(EngineUnavailableError):
        await engine.generate(GenerateRequest(request_id="refused", execution_id="x", input_ids=[1]))

    weights = engine_weights(NativeTrainable(trained, lr=1e-3))
    with pytest.raises(EngineUnavailableError):  # update before resume: refused, nothing applied
        await engine.update_weights(weights, version=1)
    assert (await current_load(engine)).policy_version == 0

    await return_to_rollout(engine, weights, version=1)
    reference = NativeEngine(copy.deepcopy(trained))
    assert await greedy(engine, "after") == await greedy(reference, "reference")  # it accepts, with the new weights
    await reference.close()
    load = await current_load(engine)
    assert load.policy_version == 1 and load.accepting and not load.memory_released
    served, published = native.model.state_dict(), trained.state_dict()
    assert set(served) == set(published)
    for name, tensor in published.items():
        assert torch.equal(served[name], tensor), name

    await leave_rollout(engine, drain_s=1.0)  # the next burst ends with an older version: refused
    with pytest.raises(ValueError, match="version"):
        await return_to_rollout(engine, weights, version=0)
    load = await current_load(engine)
    assert load.policy_version == 1 and not load.accepting and not load.memory_released


def test_leave_and_return_to_rollout_in_process(tiny_model):
    async def main():
        native = CallOrderEngine(copy.deepcopy(tiny_model))
        try:
            await leave_and_return(native, native, trained_copy(tiny_model))
        finally:
            await native.close()

    asyncio.run(main())


def test_the_order_of_the_engine_calls(tiny_model):
    """Leaving: stop accepting, drain, release. Returning: resume, update, and only then accept (at version 1)."""

    async def main():
        engine = CallOrderEngine(copy.deepcopy(tiny_model))
        await leave_rollout(engine, drain_s=1.0)
        await return_to_rollout(engine, engine_weights(trained_copy(tiny_model)), version=1)
        await engine.close()
        return engine.calls

    calls = asyncio.run(main())
    assert [name for name, _ in calls if name != "stop_accepting"] == [
        "drain", "release_memory", "resume_memory", "update_weights", "resume_accepting"
    ]  # fmt: skip
    assert calls[0] == ("stop_accepting", 0) and calls[-1] == ("resume_accepting", 1)


def test_leave_and_return_to_rollout_behind_the_endpoint(tiny_model):
    server = ServerThread(lambda: NativeEngine(copy.deepcopy(tiny_model)))
    url = server.start()

    async def main():
        remote = await RemoteEngine.connect(url)
        try:
            await leave_and_return(remote, server.engine, trained_copy(tiny_model))
        finally:
            await remote.close()

    try:
        asyncio.run(main())
    finally:
        server.stop()


def test_leave_rollout_takes_a_bounded_drain():
    for bad in (None, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="drain_s"):
            asyncio.run(leave_rollout(object(), drain_s=bad))
