"""Create the job's process groups from a `Layout`: the gloo control group, the cell groups and the prefix groups.

Contract
- `build_process_groups(layout, backend=...)` must be called on every rank of an initialized default process
  group, after `init_process_group` and before any other `new_group`; it walks `layout.creation_order()` on every
  rank, so group creation is identical everywhere (torch.distributed requires it, members or not).
- The control group spans all ranks and is always gloo (decisions and small objects travel over it even on GPU).
  Cell and prefix groups use `backend` (gloo on CPU, `cpu:gloo,cuda:nccl` on GPU: gyre.distributed.backends) and
  `use_local_synchronization=True`: creating a group waits only for its members, which is why the plan is largest
  first (docs/distributed.md).
- Such a group's name hashes its ranks with the number of groups the creating rank already holds, so its
  members must hold equally many. Groups created before (Megatron's: a pipeline stage holds more than another)
  would give members different names and a hang: `build_process_groups` refuses to run when any group but the
  default one exists (RuntimeError). Megatron's groups come after it (`gyre.trainer.model`,
  `build_process_groups_and_model_parallel`).
- `ProcessGroups.prefix_group(k)` is the group over which the k cells training sum gradients, for this rank's
  in-cell coordinate: None when k == 1 (nothing to sum across cells); a `ValueError` when this rank is not in
  one of the first k cells.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch.distributed as dist

from gyre.distributed.backends import CONTROL_BACKEND
from gyre.distributed.layout import Layout

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ProcessGroups:
    """This rank's view of the job's groups (only the groups it belongs to are held)."""

    layout: Layout
    rank: int
    control_group: dist.ProcessGroup  # all ranks, gloo
    cell_group: dist.ProcessGroup | None  # this rank's cell; None on a separate rollout rank
    prefix_groups: dict[int, dist.ProcessGroup] = field(default_factory=dict)  # k (2..K) -> group at my coordinate

    @property
    def cell(self) -> int | None:
        return self.layout.cell_of(self.rank)

    @property
    def coordinate(self) -> int | None:
        return self.layout.coordinate_of(self.rank)

    @property
    def is_cell_leader(self) -> bool:
        return self.rank in self.layout.cell_leaders

    def prefix_group(self, num_cells_training: int) -> dist.ProcessGroup | None:
        """The group summing gradients over the first `num_cells_training` cells at this rank's coordinate."""
        k = num_cells_training
        if not isinstance(k, int) or not 1 <= k <= self.layout.num_cells:
            raise ValueError(f"num_cells_training: got {k!r}, expected 1 <= k <= num_cells {self.layout.num_cells}")
        cell = self.cell
        if cell is None or cell >= k:
            raise ValueError(
                f"num_cells_training: {self.layout.describe(self.rank)} is not in the first {k} "
                "cells, so it takes part in no gradient sum over them"
            )
        return None if k == 1 else self.prefix_groups[k]


def build_process_groups(layout: Layout, *, backend: str = "gloo") -> ProcessGroups:
    """Create every group of `layout` on this rank, in `layout.creation_order()` (see the module docstring)."""
    if not dist.is_initialized():
        raise RuntimeError("build_process_groups needs torch.distributed.init_process_group to have run")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != layout.world_size:
        raise ValueError(f"world_size: the layout has {layout.world_size}, the process group has {world_size}")
    existing = len(dist.distributed_c10d._world.pg_names) - 1  # torch's registry of this rank's groups, default incl.
    if existing:
        raise RuntimeError(
            f"build_process_groups must create the job's first groups, but this rank already holds {existing} "
            "besides the default group (e.g. megatron's parallel_state initialized first): call it right after "
            "init_process_group and before init_model_parallel (docs/distributed.md, group creation order)"
        )
    control = cell_group = None
    prefixes: dict[int, dist.ProcessGroup] = {}
    for spec in layout.creation_order():
        if spec.kind == "control":
            group = dist.new_group(ranks=list(spec.ranks), backend=CONTROL_BACKEND)
        else:
            group = dist.new_group(ranks=list(spec.ranks), backend=backend, use_local_synchronization=True)
        if rank not in spec.ranks:
            continue
        if spec.kind == "control":
            control = group
        elif spec.kind == "cell":
            cell_group = group
        else:
            assert spec.num_cells is not None
            prefixes[spec.num_cells] = group
    assert control is not None
    log.info("process groups ready: %s; %d prefix groups", layout.describe(rank), len(prefixes))
    return ProcessGroups(layout=layout, rank=rank, control_group=control, cell_group=cell_group, prefix_groups=prefixes)
