"""After the final update of a burst the core publishes its weights to the rollout engines (flat buffer + manifest +
version), in the engines' own parameter names (HF layout).

`engine_weights` is collective over the core cell (it gathers TP shards and PP stages, `gather_hf_state_dict`):
every rank of the core calls it; all get the same `FlatWeights`. `publish_to_engines` then hands it to each engine
(`Engine.update_weights`: in process, or over HTTP through `RemoteEngine`), concurrently; every engine checks
names, shapes and the version before applying anything (gyre.engine.protocol). One rank of the core publishes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gyre.distributed.transport import flatten_state_dict
from gyre.models.decoder_config import DecoderConfig
from gyre.models.flat_weights import FlatWeights
from gyre.train.convert import gather_hf_state_dict

if TYPE_CHECKING:  # the trainer meets engines only through this protocol's methods; it loads no gyre.engine module
    from gyre.engine.protocol import Engine

__all__ = ["engine_weights", "publish_to_engines"]


def engine_weights(model: torch.nn.Module, config: DecoderConfig, *, dtype: torch.dtype | None = None) -> FlatWeights:
    """The whole model in HF names as one flat buffer (collective over the core's TP and PP groups).
    `dtype`: cast floating tensors (e.g. the engines serve bf16 while the trainer keeps fp32)."""
    tensors = gather_hf_state_dict(model, config)
    if dtype is not None:
        tensors = {n: t.to(dtype) if t.is_floating_point() else t for n, t in tensors.items()}
    return flatten_state_dict(tensors)


async def publish_to_engines(engines: Sequence[Engine], weights: FlatWeights, *, version: int) -> None:
    """`update_weights(weights, version=version)` on every engine at once; the first failure is raised after all
    finished (an engine that refused keeps its previous weights and version)."""
    results = await asyncio.gather(
        *(engine.update_weights(weights, version=version) for engine in engines), return_exceptions=True
    )
    for engine, result in zip(engines, results, strict=True):
        if isinstance(result, BaseException):
            raise RuntimeError(f"publishing version {version} to {engine!r} failed: {result}") from result
