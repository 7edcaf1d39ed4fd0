"""The core's weight stream as the runtime runs it (docs/runtime.md, "Publication"): the control decision that starts
it on the core's other ranks, and the sink that writes a stage leader's buckets into the policy directory.

A `stream` decision carries `dtype`, `bucket_bytes`, `forward` and, for the policy directory, `policy` (`{"staging",
"version"}`). Every core rank runs `gyre.trainer.weight_stream.stream_weights` at the same point of its work (rank 0
on its trainer thread, the others on their main thread when they read the decision):
- `forward=True`, a publication: rank 0 gets every bucket and sends it to the engines; the others only send;
- `forward=False` with `policy`, the policy directory: each stage leader writes its own stage's buckets as part
  files (`PolicyParts`) into the staging directory and posts its weight map under `policy_key(version, rank)`; rank 0
  finishes the directory (`gyre.runtime.job.policy_dir.finish_policy`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gyre.models.decoder_config import DecoderConfig
from gyre.models.flat_weights import FlatWeights, unflatten_weights
from gyre.runtime.job.policy_dir import write_policy_part
from gyre.trainer.weight_stream import stream_weights

__all__ = ["STREAM", "PolicyParts", "policy_key", "run_stream", "stage_leaders"]

STREAM = "stream"  # the control decision: the core's ranks stream its weights now (a collective)


def policy_key(version: int, rank: int) -> str:
    """Where a stage leader posts the weight map of its part files of policy `version`."""
    return f"gyre/policy/{version}/{rank}"


def stage_leaders(cell_size: int, pipeline_parallel_size: int) -> list[int]:
    """The core's stage leaders (in-stage rank 0 of each pipeline stage): the ranks that write policy parts."""
    stage_size = cell_size // pipeline_parallel_size
    return [k * stage_size for k in range(pipeline_parallel_size)]


class PolicyParts:
    """A stage leader's buckets written as policy part files, one file a bucket, as they come."""

    def __init__(self, staging: Path, writer: int) -> None:
        self.staging, self.writer = Path(staging), writer
        self.weight_map: dict[str, str] = {}
        self._index = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def put(self, bucket: FlatWeights) -> None:
        written = write_policy_part(self.staging, unflatten_weights(bucket), writer=self.writer, index=self._index)
        self.weight_map.update(written)
        self._index += 1

    def close(self) -> None:
        pass


def run_stream(trainer, config: DecoderConfig, fields: dict, *, rank: int, leaders: list[int], store) -> None:
    """A core rank's side of a `stream` decision but rank 0's (module docstring)."""
    dtype = getattr(torch, fields["dtype"])
    policy = fields.get("policy")
    sink = PolicyParts(Path(policy["staging"]), rank) if policy and rank in leaders else None
    stream_weights(
        trainer, config, dtype=dtype, bucket_bytes=fields["bucket_bytes"], sink=sink, forward=fields["forward"]
    )
    if sink is not None:
        store.set(policy_key(policy["version"], rank), json.dumps(sink.weight_map))
