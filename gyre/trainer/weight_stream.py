"""The core's weights as a stream of buckets of whole HF tensors (docs/training.md, "Publication"): what a
publication sends to the engines and what the policy directory's writers write, without any rank ever holding the
whole model.

`stream_weights(trainable, config, dtype=, bucket_bytes=, sink=, forward=)` is collective over the core: every core
rank calls it with the same arguments but `sink`, on the thread of its collectives. The plan
(`gyre.trainer.stream_plan`) is the same on every rank; bucket by bucket, in order:
- each unit's parts are gathered (`dist.gather`, not all-gather) over its TP or EP group onto the stage leader (the
  stage's in-stage rank 0), which writes them as whole HF tensors, cast to `dtype`, into the bucket's flat buffer;
  a rank outside a unit's group (a dense replica's) does nothing for it;
- `forward=True` (a publication): a later stage's leader sends each finished bucket to rank 0 over its pipeline
  group, and rank 0 hands every bucket of every stage to its `sink`; `forward=False` (the policy directory): every
  stage leader hands its own stage's buckets to its own `sink`.
A native (whole) model streams its own tensors on its one rank, no collective.

Memory: a bucket's buffer comes from `sink.acquire(nbytes)`; `BucketPipe` lends at most two at a time (one being
filled while the other is consumed), so a rank holds its own shards plus at most two buckets, plus one unit's gathered
parts on a stage leader (a layer's q/k/v or gate/up or o_proj whole, in the trainer's dtype; rows gather straight
into the bucket when the dtypes agree). `BucketPipe` is the hand-off between the producing thread and a consumer (the
controller's event loop, a writer thread): `put` gives a bucket, `get` takes it, `release` returns its slot once the
consumer dropped it; `fail` ends the stream early on both sides.

The other ranks learn of a stream from the control plane (`gyre.runtime.cell.worker`) and call it with `sink=None`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from gyre.models.decoder import DecoderLM
from gyre.models.decoder_config import DecoderConfig
from gyre.models.flat_weights import FlatWeights, unflatten_weights
from gyre.models.hf_weights import hf_shapes
from gyre.trainer.stream_plan import EP, TP, Bucket, assemble, native_units, plan_buckets, stage_units

__all__ = ["BucketPipe", "BucketSink", "StreamStats", "stream_plan_of", "stream_weights"]

WAIT_S = 0.5  # how often a blocked hand-off looks whether the other side failed


class BucketSink(Protocol):
    """Where a stream's buckets go on a rank that assembles them."""

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of `nbytes` for the next bucket (may block until one is free)."""

    def put(self, bucket: FlatWeights) -> None:
        """The bucket is complete."""

    def close(self) -> None:
        """No more buckets."""


@dataclass(frozen=True)
class StreamStats:
    buckets: int  # buckets this rank assembled or received
    nbytes: int  # their bytes
    largest: int  # the largest bucket's bytes


class StreamFailed(RuntimeError):
    """The other side of a `BucketPipe` failed: the stream stops."""


class BucketPipe:
    """The hand-off of buckets from the producing thread to one consumer, at most `slots` alive (module docstring)."""

    _END = object()

    def __init__(self, slots: int = 2) -> None:
        self._slots = threading.Semaphore(slots)
        self._queue: queue.Queue = queue.Queue()
        self._failed: BaseException | None = None
        self.in_use = 0
        self.most_in_use = 0
        self._lock = threading.Lock()

    # producer side
    def acquire(self, nbytes: int) -> torch.Tensor:
        while not self._slots.acquire(timeout=WAIT_S):
            if self._failed is not None:
                raise StreamFailed(f"the stream's consumer failed: {self._failed}") from self._failed
        with self._lock:
            self.in_use += 1
            self.most_in_use = max(self.most_in_use, self.in_use)
        return torch.empty(nbytes, dtype=torch.uint8)

    def put(self, bucket: FlatWeights) -> None:
        self._queue.put(bucket)

    def close(self) -> None:
        self._queue.put(self._END)

    # consumer side
    def get(self, timeout_s: float) -> FlatWeights | None:
        """The next bucket, None at the stream's end; TimeoutError after `timeout_s` without one."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                item = self._queue.get(timeout=WAIT_S)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no bucket of the weight stream came in {timeout_s:g}s") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return None if item is self._END else item

    def release(self) -> None:
        """The consumer is done with the bucket it got (and dropped it): its slot is free."""
        with self._lock:
            self.in_use -= 1
        self._slots.release()

    # either side
    def fail(self, error: BaseException) -> None:
        """End the stream with `error`: a blocked producer raises, the consumer gets it from `get`."""
        self._failed = error
        self._queue.put(error)


def _native_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def stream_plan_of(config: DecoderConfig, *, pp_size: int, ep_size: int, dtype: torch.dtype, bucket_bytes: int):
    """The buckets of a Megatron core of `pp_size` stages and EP `ep_size` (every rank computes the same)."""
    shapes = hf_shapes(config)
    stages = [stage_units(config, shapes, stage=k, pp_size=pp_size, ep_size=ep_size) for k in range(pp_size)]
    return plan_buckets(stages, dtype=dtype, bucket_bytes=bucket_bytes)


def stream_weights(
    trainable,
    config: DecoderConfig,
    *,
    dtype: torch.dtype,
    bucket_bytes: int,
    sink: BucketSink | None,
    forward: bool = True,
) -> StreamStats:
    """Stream the core's weights as buckets (module docstring); `sink`: where this rank's assembled (or, on rank 0
    with `forward`, received) buckets go; None on a rank that assembles none. The sink is closed at the end."""
    model = trainable if isinstance(trainable, torch.nn.Module) else trainable.model
    try:
        if isinstance(model, DecoderLM):
            stats = _stream_native(model, dtype=dtype, bucket_bytes=bucket_bytes, sink=sink)
        else:
            stats = _stream_megatron(model, config, dtype=dtype, bucket_bytes=bucket_bytes, sink=sink, forward=forward)
    except BaseException as error:
        if isinstance(sink, BucketPipe):
            sink.fail(error)
        raise
    if sink is not None:
        sink.close()
    return stats


def _fill(sink: BucketSink, bucket: Bucket) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    buffer = sink.acquire(bucket.nbytes)
    return buffer, unflatten_weights(FlatWeights(buffer=buffer, manifest=bucket.manifest))


def _stream_native(model: DecoderLM, *, dtype: torch.dtype, bucket_bytes: int, sink: BucketSink | None) -> StreamStats:
    state = _native_state(model)
    units = native_units({name: tuple(t.shape) for name, t in state.items()})
    buckets = plan_buckets([units], dtype=dtype, bucket_bytes=bucket_bytes)
    if sink is None:
        raise ValueError("stream_weights: a native model's one rank must have a sink")
    for bucket in buckets:
        buffer, out = _fill(sink, bucket)
        for unit in bucket.units:
            assemble(unit, [state[unit.local]], out, model.config)
        sink.put(FlatWeights(buffer=buffer, manifest=bucket.manifest))
        del buffer, out
    return _stats(buckets)


def _stats(buckets) -> StreamStats:
    sizes = [b.nbytes for b in buckets]
    return StreamStats(buckets=len(sizes), nbytes=sum(sizes), largest=max(sizes, default=0))


def _stream_megatron(
    model: torch.nn.Module,
    config: DecoderConfig,
    *,
    dtype: torch.dtype,
    bucket_bytes: int,
    sink: BucketSink | None,
    forward: bool,
) -> StreamStats:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from gyre.trainer.convert import EXTRA_STATE, to_local_names

    local = to_local_names({n: t.detach() for n, t in model.state_dict().items() if not n.endswith(EXTRA_STATE)})
    pp_size = ps.get_pipeline_model_parallel_world_size()
    stage = ps.get_pipeline_model_parallel_rank()
    groups = {TP: ps.get_tensor_model_parallel_group(), EP: ps.get_expert_model_parallel_group()}
    members = {kind: dist.get_process_group_ranks(group) for kind, group in groups.items()}
    pp_group = ps.get_pipeline_model_parallel_group()
    me = dist.get_rank()
    # The stage leader is the in-stage rank 0: the core's ranks are 0 .. cell_size - 1 in Megatron's TP-PP-DP order,
    # so a stage's ranks are a block, its leader the block's first (gyre.trainer.model).
    stage_size = dist.get_world_size(groups[TP]) * _replicas(members)
    leader = stage * stage_size
    first_leaders = [k * stage_size for k in range(pp_size)]
    plan = stream_plan_of(config, pp_size=pp_size, ep_size=len(members[EP]), dtype=dtype, bucket_bytes=bucket_bytes)
    is_leader = me == leader
    receives = forward and me == 0
    if (receives or (is_leader and not (forward and stage > 0))) and sink is None:
        raise ValueError(f"stream_weights: rank {me} assembles buckets and needs a sink")
    mine = []
    for bucket in plan:
        if bucket.stage == stage:
            if is_leader and not (forward and stage > 0):
                buffer, out = _fill(sink, bucket)
            elif is_leader:  # a later stage's leader: its own buffer, sent to rank 0 when full
                buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
                out = unflatten_weights(FlatWeights(buffer=buffer, manifest=bucket.manifest))
            else:
                buffer, out = None, None
            for unit in bucket.units:
                _unit(unit, local, out, config, groups=groups, members=members, leader=leader, me=me)
            if is_leader and forward and stage > 0:
                dist.send(buffer, dst=0, group=pp_group)
            elif is_leader:
                sink.put(FlatWeights(buffer=buffer, manifest=bucket.manifest))
                mine.append(bucket)
            del buffer, out
        elif receives:  # rank 0: a later stage's bucket, received whole
            buffer = sink.acquire(bucket.nbytes)
            dist.recv(buffer, src=first_leaders[bucket.stage], group=pp_group)
            sink.put(FlatWeights(buffer=buffer, manifest=bucket.manifest))
            mine.append(bucket)
            del buffer
    return _stats(mine)


def _replicas(members: Mapping[str, list[int]]) -> int:
    """Dense copies in a stage: EP / TP when experts spread over more ranks than TP (gyre.config.trainer)."""
    return max(1, len(members[EP]) // len(members[TP]))


def _unit(unit, local, out, config, *, groups, members, leader: int, me: int) -> None:
    import torch.distributed as dist

    if unit.group is None:
        if me == leader:
            assemble(unit, [local[unit.local]], out, config)
        return
    ranks = members[unit.group]
    if leader not in ranks:  # a dense replica's group: the leader's group sends
        return
    part = local[unit.local].contiguous()
    if len(ranks) == 1:
        assemble(unit, [part], out, config)
        return
    if me != leader:
        dist.gather(part, None, dst=leader, group=groups[unit.group])
        return
    target = out[unit.outputs[0][0]]
    if unit.kind == "rows" and target.dtype == part.dtype:  # straight into the bucket: rows are contiguous
        rows = target.shape[0] // len(ranks)
        views = [target[r * rows : (r + 1) * rows] for r in range(len(ranks))]
        dist.gather(part, views, dst=leader, group=groups[unit.group])
        return
    parts = [torch.empty_like(part) for _ in ranks]
    dist.gather(part, parts, dst=leader, group=groups[unit.group])
    assemble(unit, parts, out, config)
