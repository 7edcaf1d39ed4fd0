"""`WeightTransport` over torch.distributed: one broadcast of the flat buffer from the core's rank.

Contract
- Collective: the core's `publish(weights, version)` and every other member's `pull(into, version)` meet in one
  call on `group` (gloo on CPU, nccl on GPU; buffers on that backend's device). The publication (version, byte
  length, manifest) travels first as an object over `object_group` (gloo; same members as `group`; default
  `group`), then every member's verdict (its version and room checks) is all-gathered, and only if all agree do
  the bytes move. So a bad manifest or a stale receiver raises on every member and no member hangs.
- `source_rank` is the core's global rank in the default group; it must be a member of `group`.
- A version newer than the published one is an error here (the core decides what is published in the call).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gyre.distributed.transport import (
    Publication,
    WeightVersionError,
    as_bytes,
    check_receiver,
    publication_of,
)
from gyre.models.flat_weights import FlatWeights


class TorchWeightTransport:
    """Broadcast-based transport; every member of `group` calls `publish` (the core) or `pull` (the others)."""

    def __init__(
        self,
        *,
        source_rank: int,
        group: dist.ProcessGroup | None = None,
        object_group: dist.ProcessGroup | None = None,
    ):
        self.source_rank = source_rank
        self.group = group
        self.object_group = object_group if object_group is not None else group
        members = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        if source_rank not in members:
            raise ValueError(f"source_rank: got {source_rank}, expected a member of the group {list(members)}")
        self._last_version: int | None = None

    def publish(self, weights: FlatWeights, version: int) -> None:
        if dist.get_rank() != self.source_rank:
            raise RuntimeError(f"publish runs on the core's rank {self.source_rank}, not on rank {dist.get_rank()}")
        error: ValueError | None = None
        try:
            publication = publication_of(weights, version)
            if self._last_version is not None and version <= self._last_version:
                raise WeightVersionError(f"version: got {version}, expected > the last published {self._last_version}")
            header = {"publication": publication.to_wire()}
        except ValueError as caught:
            error, header = caught, {"error": f"{type(caught).__name__}: {caught}"}
        self._broadcast_header(header)
        if error is not None:
            raise error
        self._raise_refusals(self._gather_verdicts(None))
        dist.broadcast(as_bytes(weights.buffer, what="weights.buffer"), src=self.source_rank, group=self.group)
        self._last_version = version

    def pull(self, into: torch.Tensor, *, version: int | None = None) -> tuple[FlatWeights, int]:
        if dist.get_rank() == self.source_rank:
            raise RuntimeError(f"rank {self.source_rank} is the core: it publishes, it does not pull")
        header = self._broadcast_header(None)
        if "error" in header:
            raise ValueError(f"the core refused its own publication, nothing moved: {header['error']}")
        error: ValueError | None = None
        try:
            publication = Publication.from_wire(header["publication"])
            check_receiver(publication, into, version)
        except ValueError as caught:
            error = caught
        refusals = self._gather_verdicts(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        self._raise_refusals(refusals)
        data = as_bytes(into, what="into")[: publication.nbytes]
        dist.broadcast(data, src=self.source_rank, group=self.group)
        return FlatWeights(buffer=data, manifest=publication.manifest), publication.version

    def close(self) -> None:
        """Nothing to release: the groups belong to the caller."""

    def _broadcast_header(self, header: dict | None) -> dict:
        box = [header]
        dist.broadcast_object_list(box, src=self.source_rank, group=self.object_group)
        return box[0]

    def _gather_verdicts(self, verdict: str | None) -> list[tuple[int, str]]:
        """Every member's refusal (None: agrees), as (global rank, reason) of those that refused."""
        verdicts: list = [None] * dist.get_world_size(self.object_group)
        dist.all_gather_object(verdicts, (dist.get_rank(), verdict), group=self.object_group)
        return [(rank, reason) for rank, reason in verdicts if reason is not None]

    @staticmethod
    def _raise_refusals(refusals: list[tuple[int, str]]) -> None:
        if not refusals:
            return
        message = "receivers refused the publication, nothing moved: " + "; ".join(
            f"rank {rank}: {reason}" for rank, reason in refusals
        )
        if all(reason.startswith(WeightVersionError.__name__) for _, reason in refusals):
            raise WeightVersionError(message)
        raise ValueError(message)
