"""gyre.runtime.cell.engines and what it builds on: which engine a cell serves (`engine.backend`), the one-line refusals
where the backend cannot run here, the SGLang engine's arguments and the cell's GPUs it runs on. The SGLang
engine itself is tested through its stand-in (test_train_sglang_standin.py) and its adapter
(test_engine_sglang_adapter.py); a real SGLang needs a GPU (tests/gpu)."""

from __future__ import annotations

import importlib.util
import types

import pytest

from gyre.config import ConfigError, TrainConfig
from gyre.config.engine import EngineConfig, EngineServeConfig
from gyre.config.serve import ServeConfig
from gyre.distributed.backends import BackendError, cell_engine_gpus
from gyre.engine.protocol import EngineUnavailableError
from gyre.engine.sglang_engine import sglang_engine_args
from gyre.engine.sglang_standin import PATH as STANDIN
from gyre.runtime.cell import engines
from gyre.runtime.job.plan import PlanError, check_engine_backend


def test_weight_sync_is_checked_and_broadcasts_with_sglang_only():
    assert not engines.uses_weight_groups(config()) and engines.uses_weight_groups(config(backend="sglang"))
    assert not engines.uses_weight_groups(config(backend="sglang", weight_sync="http"))
    assert engines.uses_weight_groups(config(backend="sglang", weight_sync="broadcast"))
    with pytest.raises(ConfigError, match=r"engine.weight_sync='nccl' is not allowed: expected one of auto, http"):
        EngineConfig(weight_sync="nccl")
    with pytest.raises(ConfigError, match=r"engine.weight_sync='broadcast' is not allowed: expected http or auto"):
        EngineConfig(weight_sync="broadcast")


class RefusingEngine:
    """An engine refusing a group update at once (released weights): `GroupPublishing` must not broadcast to it."""

    def __init__(self):
        self.asked = []

    async def update_weights_from_group(self, **fields):
        self.asked.append(fields)
        raise EngineUnavailableError("weights are released: resume_memory first, then update the weights")

    def load(self):
        return "its load"


def test_a_group_publication_the_engine_refuses_at_once_broadcasts_nothing():
    import asyncio

    import torch

    engine = RefusingEngine()
    publishing = engines.GroupPublishing(engine, None, group_name="gyre-weights-3", device=None)  # no group to use
    weights = {"model.norm.weight": torch.ones(4, dtype=torch.bfloat16), "lm_head.weight": torch.zeros(8, 4)}
    with pytest.raises(EngineUnavailableError, match="weights are released"):
        asyncio.run(publishing.update_weights(weights, version=3))
    (asked,) = engine.asked
    assert asked == {
        "names": ["model.norm.weight", "lm_head.weight"],
        "dtypes": ["bfloat16", "float32"],
        "shapes": [[4], [8, 4]],
        "group_name": "gyre-weights-3",
        "version": 3,
    }
    assert publishing.load() == "its load"  # every other call is the engine's


def test_engine_backend_is_checked_and_sglang_args_need_sglang():
    assert EngineConfig().backend == "native" and EngineConfig(backend="sglang").sglang_args == {}
    with pytest.raises(ConfigError, match=r"engine.backend='vllm' is not allowed: expected one of native, sglang"):
        EngineConfig(backend="vllm")
    with pytest.raises(ConfigError, match=r"engine.sglang_args=.*empty unless engine.backend=sglang"):
        EngineConfig(sglang_args={"mem_fraction_static": 0.7})
    with pytest.raises(ConfigError, match=r"engine.sglang_args.tp_size=8 is not allowed: expected no value: gyre"):
        EngineConfig(backend="sglang", sglang_args={"tp_size": 8})  # the weight group's size and the cell's GPUs
    with pytest.raises(ConfigError, match=r"engine.sglang_args.skip_tokenizer_init=False is not allowed"):
        EngineConfig(backend="sglang", sglang_args={"skip_tokenizer_init": False})
    with pytest.raises(ConfigError, match=r"engine.sglang_args=.*a mapping of SGLang ServerArgs names"):
        EngineConfig(backend="sglang", sglang_args=["mem_fraction_static"])
    for app in (ServeConfig, EngineServeConfig):  # SGLang runs in the training program's cells only
        with pytest.raises(ConfigError, match=r"engine.backend=.sglang. is not allowed: expected native"):
            app(engine=EngineConfig(backend="sglang"))


def config(**engine) -> TrainConfig:
    return TrainConfig(engine=EngineConfig(**engine))


def test_the_plan_names_the_gpu_extra_or_the_device_for_sglang(monkeypatch):
    check_engine_backend(config())  # native: nothing to check
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PlanError) as problem:
        check_engine_backend(config(backend="sglang"))
    assert "sglang package is not installed" in str(problem.value) and "gpu extra" in str(problem.value)
    assert "\n" not in str(problem.value)
    real = types.SimpleNamespace(origin="/site-packages/sglang/__init__.py")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: real)
    with pytest.raises(PlanError, match=r"SGLang serves on CUDA GPUs; set engine\.device=cuda"):
        check_engine_backend(config(backend="sglang"))
    standin = types.SimpleNamespace(origin=str(STANDIN / "sglang" / "__init__.py"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: standin)
    check_engine_backend(config(backend="sglang"))  # the stand-in serves on the CPU


def test_sglang_engine_args_derive_from_the_cell_and_user_args_win():
    args = sglang_engine_args(
        tp_size=4, base_gpu_id=4, dtype="bfloat16", max_running=32, max_total_tokens=0, seed=7, extra=None
    )
    assert args == {
        "tp_size": 4,
        "base_gpu_id": 4,
        "dtype": "bfloat16",
        "max_running_requests": 32,
        "random_seed": 7,
        "skip_tokenizer_init": True,  # token ids in and out: the proxy renders and parses
        "enable_memory_saver": True,  # release_memory_occupation frees the GPU for the trainer
    }  # max_total_tokens 0: SGLang sizes the KV pool from mem_fraction_static
    extra = {"max_running_requests": 8, "mem_fraction_static": 0.7}
    args = sglang_engine_args(
        tp_size=1, base_gpu_id=0, dtype="float32", max_running=32, max_total_tokens=9000, seed=0, extra=extra
    )
    assert (args["max_running_requests"], args["mem_fraction_static"], args["max_total_tokens"]) == (8, 0.7, 9000)


@pytest.mark.parametrize(
    ("leader", "cell_size", "visible", "first"),
    [(0, 1, 8, 0), (4, 4, 8, 4), (0, 8, 8, 0), (6, 2, 8, 6), (0, 1, 1, 0)],
)
def test_a_cells_sglang_engine_runs_on_the_cells_gpus(leader, cell_size, visible, first):
    assert cell_engine_gpus(leader, cell_size, visible) == first


@pytest.mark.parametrize(("leader", "cell_size", "visible"), [(0, 2, 1), (6, 4, 8), (4, 8, 8)])
def test_a_cell_whose_gpus_its_leader_cannot_use_is_one_line(leader, cell_size, visible):
    with pytest.raises(BackendError, match=f"cluster.cell_size={cell_size}: the cell's leader") as error:
        cell_engine_gpus(leader, cell_size, visible)
    assert "\n" not in str(error.value) and "--gpus-per-node" in str(error.value)


def test_the_native_factory_builds_the_native_engine(tmp_path):
    from gyre.engine.native import NativeEngine
    from gyre.models.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "m")
    engine = engines.engine_factory(config(max_running=9), model_dir, 5, cell_size=1)()
    assert isinstance(engine, NativeEngine) and engine.policy_version == 5 and engine.max_running == 9
    assert engines.start_timeout_s(config()) < engines.start_timeout_s(config(backend="sglang"))


def test_the_sglang_factory_gives_the_adapter_the_names_a_whole_publication_carries(tmp_path, monkeypatch):
    """The adapter refuses other names and checks a streamed update is complete against the checkpoint's parameters,
    the shared decoder's names (what a publication sends: `gyre.trainer.publish.engine_weights`)."""
    from gyre.engine.sglang_engine import SGLangEngine
    from gyre.models.hf_weights import load_pretrained
    from gyre.models.tiny import build_tiny_model

    built = []
    monkeypatch.setattr(SGLangEngine, "from_pretrained", classmethod(lambda cls, path, **kw: built.append((path, kw))))
    model_dir = build_tiny_model(tmp_path / "m")
    engines.engine_factory(config(backend="sglang"), model_dir, 4, cell_size=1)()
    ((path, kwargs),) = built
    options = kwargs["adapter_options"]
    assert path == str(model_dir) and options["policy_version"] == 4
    assert options["parameter_names"] == tuple(load_pretrained(model_dir).state_dict())


class GroupEngine:
    """An engine whose group update ends after `receive_s` with `outcome` (None: success, else that exception),
    and whose endpoint update records what it got."""

    def __init__(self, receive_s: float, outcome: BaseException | None):
        self.receive_s, self.outcome, self.over_endpoint = receive_s, outcome, []

    async def update_weights_from_group(self, **fields):
        import asyncio

        await asyncio.sleep(self.receive_s)
        if self.outcome is not None:
            raise self.outcome

    async def update_weights(self, weights, *, version):
        self.over_endpoint.append(version)


def test_a_broadcast_that_breaks_mid_way_goes_through_the_endpoint_from_then_on(monkeypatch):
    import asyncio
    import threading

    import torch

    from gyre.engine.errors import EngineUnreachable

    stuck = threading.Event()  # the broadcast of a group whose workers went away: it returns at the group's timeout
    broadcasts = []

    def broadcast(group, named, *, device=None):
        broadcasts.append([name for name, _ in named])
        if group == "stuck":
            stuck.wait(30)
            raise RuntimeError("gloo: connection closed by peer")
        return 64

    monkeypatch.setattr("gyre.distributed.weight_groups.broadcast_weights", broadcast)
    weights = {"model.norm.weight": torch.ones(4)}

    # The workers die mid-way: the endpoint gets this publication and the later ones; the stuck broadcast holds
    # nothing (its thread is a daemon).
    engine = GroupEngine(receive_s=0.5, outcome=EngineUnreachable("the endpoint is gone"))
    publishing = engines.GroupPublishing(engine, "stuck", group_name="gyre-weights-1", device=None)
    asyncio.run(asyncio.wait_for(publishing.update_weights(weights, version=2), 10))
    assert engine.over_endpoint == [2] and "version 2: EngineUnreachable" in publishing.broken
    asyncio.run(asyncio.wait_for(publishing.update_weights(weights, version=3), 10))
    assert engine.over_endpoint == [2, 3] and len(broadcasts) == 1  # no broadcast over a broken group
    stuck.set()

    # All sent, and the engine refuses to load it (an unknown name): its error, and the group stays in use.
    engine = GroupEngine(receive_s=0.5, outcome=ValueError("SGLang rejected the weight update to version 2"))
    publishing = engines.GroupPublishing(engine, "fine", group_name="gyre-weights-2", device=None)
    with pytest.raises(ValueError, match="rejected the weight update"):
        asyncio.run(asyncio.wait_for(publishing.update_weights(weights, version=2), 10))
    assert publishing.broken is None and engine.over_endpoint == []

    engine = GroupEngine(receive_s=0.5, outcome=None)  # the usual case
    publishing = engines.GroupPublishing(engine, "fine", group_name="gyre-weights-3", device=None)
    asyncio.run(asyncio.wait_for(publishing.update_weights(weights, version=4), 10))
    assert publishing.broken is None and engine.over_endpoint == []


class SessionEngine:
    """An engine with a weight-update session: each bucket from the group is received after `receive_s` with
    `outcomes` in turn (None: success, else that exception); every call it gets is recorded in `calls`."""

    def __init__(self, receive_s: float, outcomes: list):
        self.receive_s, self.outcomes, self.calls = receive_s, list(outcomes), []

    async def begin_update(self, *, version):
        self.calls.append(("begin", version))

    async def load_bucket_from_group(self, **fields):
        import asyncio

        self.calls.append(("from_group", fields["names"]))
        await asyncio.sleep(self.receive_s)
        outcome = self.outcomes.pop(0)
        if outcome is not None:
            raise outcome

    async def load_bucket(self, bucket):
        self.calls.append(("over_endpoint", list(bucket)))

    async def end_update(self, *, version):
        self.calls.append(("end", version))

    async def abort_update(self):
        self.calls.append(("abort",))


def test_a_streamed_publication_broadcasts_each_bucket_in_the_engines_session(monkeypatch):
    """Each bucket: the engine receives it over the group (`load_bucket_from_group`, its names, dtypes, shapes) while
    rank 0 broadcasts that bucket; begin and end are the engine's. A broadcast that breaks at the second bucket sends
    that bucket and the later ones through the endpoint, in the same session; a first bucket refused at once is not
    broadcast at all."""
    import asyncio
    import threading

    import torch

    from gyre.engine.errors import EngineUnreachable

    stuck = threading.Event()
    broadcasts = []

    def broadcast(group, named, *, device=None):
        broadcasts.append((group, [name for name, _ in named]))
        if group == "stuck" and len(broadcasts) == 2:
            stuck.wait(30)
            raise RuntimeError("gloo: connection closed by peer")
        return 64

    monkeypatch.setattr("gyre.distributed.weight_groups.broadcast_weights", broadcast)
    buckets = [{"model.norm.weight": torch.ones(4, dtype=torch.bfloat16)}, {"lm_head.weight": torch.zeros(8, 4)}]
    buckets.append({"model.embed_tokens.weight": torch.zeros(8, 4)})

    async def publish(publishing, version):
        await publishing.begin_update(version=version)
        for bucket in buckets:
            await publishing.load_bucket(bucket)
        await publishing.end_update(version=version)

    engine = SessionEngine(receive_s=0.3, outcomes=[None, None, None])
    publishing = engines.GroupPublishing(engine, "fine", group_name="gyre-weights-1", device=None)
    asyncio.run(asyncio.wait_for(publish(publishing, 5), 10))
    assert engine.calls == [("begin", 5), *(("from_group", list(b)) for b in buckets), ("end", 5)]
    assert broadcasts == [("fine", list(b)) for b in buckets] and publishing.broken is None

    broadcasts.clear()
    engine = SessionEngine(receive_s=0.3, outcomes=[None, EngineUnreachable("the endpoint is gone")])
    publishing = engines.GroupPublishing(engine, "stuck", group_name="gyre-weights-2", device=None)
    asyncio.run(asyncio.wait_for(publish(publishing, 6), 10))
    assert engine.calls == [
        ("begin", 6),
        ("from_group", ["model.norm.weight"]),
        ("from_group", ["lm_head.weight"]),
        ("over_endpoint", ["lm_head.weight"]),  # the bucket whose broadcast broke, then the rest, in the session
        ("over_endpoint", ["model.embed_tokens.weight"]),
        ("end", 6),
    ]
    assert len(broadcasts) == 2 and "version 6 bucket 2: EngineUnreachable" in publishing.broken
    stuck.set()

    broadcasts.clear()
    engine = SessionEngine(receive_s=0.0, outcomes=[ValueError("Group gyre-weights-3 not initialized")])
    publishing = engines.GroupPublishing(engine, "fine", group_name="gyre-weights-3", device=None)

    async def refused():
        await publishing.begin_update(version=7)
        with pytest.raises(ValueError, match="not initialized"):
            await publishing.load_bucket(buckets[0])
        await publishing.abort_update()

    asyncio.run(asyncio.wait_for(refused(), 10))
    assert broadcasts == [] and publishing.broken is None  # refused at once: nothing broadcast, the group intact
    assert engine.calls == [("begin", 7), ("from_group", ["model.norm.weight"]), ("abort",)]
