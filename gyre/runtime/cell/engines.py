"""A cell's rollout engine as the runtime builds it (`engine.backend`; docs/sglang.md, "In the training program").

`engine_factory(cfg, model_dir, version, cell_size=)` is what a cell's leader (rank 0 for the core) hands to its
endpoint's `ServerThread`, which calls it on the endpoint's event loop:

- `native`: gyre's `NativeEngine` on the checkpoint, loaded here (on the caller's thread) in `engine.dtype` on this
  rank's `engine.device`;
- `sglang`: `SGLangEngine.from_pretrained`, one `sglang.Engine` per cell with `tp_size` = the cell's size on the
  cell's GPUs (`cell_engine_gpus`), built on the endpoint's loop (SGLang installs no signal handler off the main
  thread). SGLang loads the checkpoint itself; its start takes minutes on a GPU (`start_timeout_s`).

Whether the backend can run here (SGLang installed, on CUDA) is the run plan's check (`gyre.runtime.job.plan`).

Publications (`engine.weight_sync`): over each engine's endpoint (`update_weights`), or, with SGLang, broadcast by rank
0 over a process group with the engine's tensor-parallel workers: `join_weight_group` makes the group once per engine
(each cell's, the separate pool's) at start (rank 0 serves its rendezvous on `job.host`; the engine's workers are ranks
1..tp_size), and the engine is then a `GroupPublishing`, whose `update_weights` asks the engine to receive
(`update_weights_from_group`) while rank 0 broadcasts (`gyre.distributed.weight_groups`), and whose streamed update
(`begin_update`, `load_bucket` per bucket, `end_update`) does so bucket by bucket in the engine's session
(`load_bucket_from_group`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre.config import TrainConfig
from gyre.config.trainer import device_kind
from gyre.runtime.cell.trainer_thread import TrainerThread

if TYPE_CHECKING:
    import torch

    from gyre.engine.protocol import Engine
    from gyre.models.flat_weights import FlatWeights

log = logging.getLogger(__name__)

__all__ = [
    "SGLANG_START_S",
    "GroupPublishing",
    "engine_factory",
    "join_weight_group",
    "start_timeout_s",
    "uses_weight_groups",
]

NATIVE_START_S = 30.0
SGLANG_START_S = 1800.0  # SGLang loads the checkpoint, profiles memory and captures CUDA graphs before it serves


def start_timeout_s(cfg: TrainConfig) -> float:
    return SGLANG_START_S if cfg.engine.backend == "sglang" else NATIVE_START_S


def engine_factory(cfg: TrainConfig, model_dir: Path, version: int, *, cell_size: int) -> Callable[[], Engine]:
    """The factory of this cell's engine on `model_dir` serving `version` (module docstring)."""
    e = cfg.engine
    if e.backend == "sglang":
        from gyre.engine.sglang_engine import SGLangEngine, sglang_engine_args

        args = sglang_engine_args(
            tp_size=cell_size,
            base_gpu_id=_first_gpu(cfg, cell_size),
            dtype=e.dtype,
            max_running=e.max_running,
            max_total_tokens=e.max_total_tokens,
            seed=cfg.seed,
            extra=e.sglang_args,
            return_routed_experts=cfg.trainer.routing_replay,
        )
        from gyre.models.decoder_config import read_config
        from gyre.models.hf_weights import hf_shapes

        # the names a whole publication carries: the adapter refuses others and checks a streamed update is complete
        options = {"policy_version": version, "parameter_names": tuple(hf_shapes(read_config(model_dir)))}
        return lambda: SGLangEngine.from_pretrained(str(model_dir), adapter_options=options, **args)

    import torch

    from gyre.engine.native import NativeEngine
    from gyre.models.hf_weights import load_pretrained

    model = load_pretrained(model_dir, getattr(torch, e.dtype), e.device)
    return lambda: NativeEngine(
        model,
        max_running=e.max_running,
        max_tokens_in_flight=e.max_total_tokens or None,
        policy_version=version,
    )


def _first_gpu(cfg: TrainConfig, cell_size: int) -> int:
    """The first of the cell's GPUs for its SGLang engine: this rank's current CUDA device (the job made it so:
    `gyre.runtime.job.spmd.open_job`); 0 on the stand-in's CPU."""
    if device_kind(cfg.engine.device) != "cuda":
        return 0
    import torch

    from gyre.distributed.backends import cell_engine_gpus

    return cell_engine_gpus(torch.cuda.current_device(), cell_size, torch.cuda.device_count())


def uses_weight_groups(cfg: TrainConfig) -> bool:
    """Whether publications are broadcast over weight groups (`engine.weight_sync`; auto: with SGLang)."""
    sync = cfg.engine.weight_sync
    return sync == "broadcast" or (sync == "auto" and cfg.engine.backend == "sglang")


WEIGHT_GROUP_TIMEOUT_S = 600.0  # joining the group, and each broadcast of a publication


async def join_weight_group(engine, *, routing_name: str, host: str, tp_size: int, device_kind: str) -> GroupPublishing:
    """Make the weight group of the engine the routing table names `routing_name` (`cell-<c>`, or `pool`: the
    separate rollout pool) (module docstring): rank 0 serves the rendezvous on `host`, the engine's `tp_size` workers
    join as ranks 1..tp_size; NCCL on CUDA, gloo on the CPU."""
    from gyre.distributed.weight_groups import WeightGroupStore, open_weight_group

    backend = "nccl" if device_kind == "cuda" else "gloo"
    name = f"gyre-weights-{routing_name}"
    world_size = 1 + tp_size
    store = await asyncio.to_thread(WeightGroupStore, host, world_size, timeout_s=WEIGHT_GROUP_TIMEOUT_S)
    joined = asyncio.ensure_future(
        engine.init_weights_group(
            address=host, port=store.port, rank_offset=1, world_size=world_size, group_name=name, backend=backend
        )
    )
    try:
        group = await asyncio.to_thread(open_weight_group, store, backend=backend, group_name=name)
    except BaseException:
        joined.cancel()
        raise
    await joined
    device = None
    if backend == "nccl":
        import torch

        device = torch.device("cuda", torch.cuda.current_device())
    log.info("%s: weight group %s of %d ranks (%s) at %s:%d", routing_name, name, world_size, backend, host, store.port)
    return GroupPublishing(engine, group, group_name=name, device=device, store=store)


class GroupPublishing:
    """A cell's SGLang engine (its `RemoteEngine`) whose publications rank 0 broadcasts over its weight group; every
    other call goes to the engine as it is.

    Whole (`update_weights`: the engine's `update_weights_from_group`) or streamed in the engine's weight-update session
    (`begin_update`, then per bucket `load_bucket`: the engine's `load_bucket_from_group` while rank 0 broadcasts the
    bucket tensor by tensor, then `end_update` or `abort_update`, which go to the engine as they are). The engine
    refuses what it refuses at once (released weights, an old version, a session already open) at `begin_update`,
    before anything is broadcast; a whole update, and a session's first bucket, are also waited on for
    `EARLY_FAILURE_S` before rank 0 broadcasts, so a refusal there leaves the group intact.

    A publication that fails once the broadcast began (the engine's workers gone or refusing mid-way) leaves the
    group's collectives out of step: the group is then broken, that publication (or bucket) and every later one go
    through the engine's endpoint instead (`update_weights` / `load_bucket`, SGLang's `update_weights_from_tensor`, in
    the same session), with a warning. Rank 0's broadcast runs on a daemon thread of its own, so a broadcast stuck
    until the group's timeout holds neither the publication nor the run's end
    (`gyre.runtime.cell.trainer_thread.TrainerThread`)."""

    EARLY_FAILURE_S = 0.2  # an update the engine refuses at once (released weights, an old version) is not waited on

    def __init__(self, engine, group, *, group_name: str, device: torch.device | None, store: Any = None):
        self.engine, self.group, self.group_name, self.device = engine, group, group_name, device
        self._store = store  # rank 0 serves the group's rendezvous store: kept for the group's life
        self.broken: str | None = None  # why the group is no longer used, once a broadcast failed
        self._thread = TrainerThread(name=f"{group_name}-broadcast")  # a daemon: a stuck broadcast holds nothing
        self._session: tuple[int, int] | None = None  # (version, buckets sent) of the open weight-update session

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def __repr__(self) -> str:
        return f"GroupPublishing({self.engine!r}, group={self.group_name})"

    async def update_weights(self, weights: Mapping[str, torch.Tensor] | FlatWeights, *, version: int) -> None:
        """The engine receives `version` over the group while rank 0 broadcasts it, tensor by tensor in one order
        (through the endpoint once the group is broken: class docstring)."""
        if self.broken is not None:
            await self.engine.update_weights(weights, version=version)
            return
        named = _named(weights)
        await self._over_group(
            named,
            receive=lambda: self.engine.update_weights_from_group(**self._spec(named), version=version),
            fallback=lambda: self.engine.update_weights(weights, version=version),
            what=f"version {version}",
            early=True,
        )

    async def begin_update(self, *, version: int) -> None:
        await self.engine.begin_update(version=version)
        self._session = (version, 0)

    async def load_bucket(self, bucket: Mapping[str, torch.Tensor] | FlatWeights) -> None:
        """The engine receives the bucket over the group while rank 0 broadcasts it (through the endpoint once the
        group is broken: class docstring)."""
        version, sent = self._session if self._session is not None else (None, 0)
        if self.broken is not None or version is None:  # no session: the engine's own refusal
            await self.engine.load_bucket(bucket)
            return
        self._session = (version, sent + 1)
        named = _named(bucket)
        await self._over_group(
            named,
            receive=lambda: self.engine.load_bucket_from_group(**self._spec(named)),
            fallback=lambda: self.engine.load_bucket(bucket),
            what=f"version {version} bucket {sent + 1}",
            early=sent == 0,
        )

    async def end_update(self, *, version: int) -> None:
        await self.engine.end_update(version=version)
        self._session = None

    async def abort_update(self) -> None:
        self._session = None
        await self.engine.abort_update()

    def _spec(self, named: dict) -> dict:
        return {
            "names": list(named),
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in named.values()],
            "shapes": [list(t.shape) for t in named.values()],
            "group_name": self.group_name,
        }

    async def _over_group(self, named: dict, *, receive, fallback, what: str, early: bool) -> None:
        """`receive()` (the engine's receiving call) while rank 0 broadcasts `named`; `fallback()` once it broke."""
        receiving = asyncio.ensure_future(receive())
        if early:
            done, _ = await asyncio.wait({receiving}, timeout=self.EARLY_FAILURE_S)
            if done:  # refused before receiving anything (or nothing to receive): no broadcast, the group is intact
                receiving.result()
                return
        started = time.monotonic()
        broadcasting = self._thread.submit(self._broadcast, list(named.items()))
        done, _ = await asyncio.wait({receiving, broadcasting}, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((task for task in (receiving, broadcasting) if task in done and task.exception()), None)
        if failed is None:
            sent = await broadcasting
            await receiving
            log.info(
                "%s: %s broadcast, %.1f MB in %.2f s", self.group_name, what, sent / 1e6, time.monotonic() - started
            )
            return
        if broadcasting.done() and broadcasting.exception() is None:  # all sent: the engine refused to load it
            receiving.result()  # raises its error; the group is in step
        receiving.cancel()
        self.broken = f"{what}: {failed.exception()!r}"
        log.warning(
            "%s broke at %s; this publication and the later ones go through the engine's endpoint",
            self.group_name,
            self.broken,
        )
        await fallback()

    def _broadcast(self, named: list) -> int:
        from gyre.distributed.weight_groups import broadcast_weights

        return broadcast_weights(self.group, named, device=self.device)


def _named(weights: Mapping[str, torch.Tensor] | FlatWeights) -> dict:
    from gyre.models.flat_weights import FlatWeights, unflatten_weights

    return unflatten_weights(weights) if isinstance(weights, FlatWeights) else dict(weights)
