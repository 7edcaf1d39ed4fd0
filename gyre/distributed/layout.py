"""Where every rank sits: cells, in-cell coordinates, cell leaders, rollout ranks and prefix groups.

Pure (stdlib only): `gyre.distributed.groups` turns this plan into torch.distributed groups, and the tests check the
plan by hand without starting a process.

Contract (docs/architecture.md, process model)
- Ranks `0 .. num_cells * cell_size - 1` form K = `num_cells` cells of `cell_size` consecutive ranks; cell 0 is
  the core. Rank r of a cell has cell `r // cell_size` and in-cell coordinate `r % cell_size`; a cell's leader is
  its coordinate-0 rank. The `num_rollout_ranks` ranks after the cells are the separate rollout pool: no cell,
  no coordinate.
- For each coordinate c and each k = 2..K, the prefix group `(k, c)` holds the ranks at coordinate c of cells
  0..k-1: gradients of the k cells training are summed over it. A 1-cell prefix needs no group.
- `creation_order()` is the one sequence of groups every rank creates (torch.distributed requires the same
  order on every rank): the control group (all ranks), the cell groups (cell 0 first), then the prefix groups
  largest first (k = K down to 2, coordinate 0 first within one k). Largest first matters: with
  `use_local_synchronization=True`, smallest first deadlocks in torch 2.13 (docs/distributed.md, group creation order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gyre.config.checks import is_int

GroupKind = Literal["control", "cell", "prefix"]


@dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """One process group to create: its kind, its ranks in ascending order, and what it stands for."""

    kind: GroupKind
    ranks: tuple[int, ...]
    cell: int | None = None  # kind "cell": which cell
    coordinate: int | None = None  # kind "prefix": the in-cell coordinate its members share
    num_cells: int | None = None  # kind "prefix": k, the number of leading cells it spans (2..K)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The rank layout of one job; validated on construction (`ValueError` naming the field)."""

    world_size: int  # processes in the job (torchrun's WORLD_SIZE)
    num_cells: int  # K; cell 0 is the core
    cell_size: int  # ranks per cell (the training layout: TP x PP x max(1, EP / TP), gyre.config.trainer)
    num_rollout_ranks: int = 0  # separate rollout pool after the cells (0: none, or external servers by URL)

    def __post_init__(self) -> None:
        for name in ("world_size", "num_cells", "cell_size", "num_rollout_ranks"):
            value = getattr(self, name)
            minimum = 0 if name == "num_rollout_ranks" else 1
            if not is_int(value) or value < minimum:
                raise ValueError(f"{name}: got {value!r}, expected an integer >= {minimum}")
        cells = self.num_cells * self.cell_size
        if cells + self.num_rollout_ranks != self.world_size:
            if self.num_rollout_ranks == 0 and self.world_size % self.cell_size:
                detail = f"world_size {self.world_size} is not divisible by cell_size {self.cell_size}"
            else:
                detail = (
                    f"num_cells * cell_size + num_rollout_ranks = {self.num_cells} * {self.cell_size} + "
                    f"{self.num_rollout_ranks} = {cells + self.num_rollout_ranks}"
                )
            raise ValueError(f"world_size: got {self.world_size}, expected {cells + self.num_rollout_ranks} ({detail})")

    @property
    def num_cell_ranks(self) -> int:
        """Ranks that belong to a cell (all but the separate rollout pool)."""
        return self.num_cells * self.cell_size

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank: got {rank!r}, expected 0 <= rank < world_size {self.world_size}")

    def _check_cell(self, cell: int) -> None:
        if not isinstance(cell, int) or not 0 <= cell < self.num_cells:
            raise ValueError(f"cell: got {cell!r}, expected 0 <= cell < num_cells {self.num_cells}")

    def cell_of(self, rank: int) -> int | None:
        """The rank's cell, or None for a separate rollout rank."""
        self._check_rank(rank)
        return rank // self.cell_size if rank < self.num_cell_ranks else None

    def coordinate_of(self, rank: int) -> int | None:
        """The rank's in-cell coordinate (0 .. cell_size-1), or None for a separate rollout rank."""
        self._check_rank(rank)
        return rank % self.cell_size if rank < self.num_cell_ranks else None

    def cell_ranks(self, cell: int) -> tuple[int, ...]:
        self._check_cell(cell)
        return tuple(range(cell * self.cell_size, (cell + 1) * self.cell_size))

    @property
    def cell_leaders(self) -> tuple[int, ...]:
        """The coordinate-0 rank of each cell, cell 0 (the core's leader, rank 0: the controller) first."""
        return tuple(cell * self.cell_size for cell in range(self.num_cells))

    @property
    def core_ranks(self) -> tuple[int, ...]:
        return self.cell_ranks(0)

    @property
    def rollout_ranks(self) -> tuple[int, ...]:
        """The separate rollout pool's ranks (after the cells)."""
        return tuple(range(self.num_cell_ranks, self.world_size))

    def prefix_ranks(self, num_cells: int, coordinate: int) -> tuple[int, ...]:
        """Ranks at `coordinate` of cells 0..num_cells-1: the prefix group `(num_cells, coordinate)`."""
        if not isinstance(num_cells, int) or not 1 <= num_cells <= self.num_cells:
            raise ValueError(f"num_cells: got {num_cells!r}, expected 1 <= num_cells <= {self.num_cells}")
        if not isinstance(coordinate, int) or not 0 <= coordinate < self.cell_size:
            raise ValueError(f"coordinate: got {coordinate!r}, expected 0 <= coordinate < cell_size {self.cell_size}")
        return tuple(cell * self.cell_size + coordinate for cell in range(num_cells))

    def prefix_groups(self, coordinate: int) -> tuple[GroupSpec, ...]:
        """The K-1 prefix groups of one coordinate, in creation order (k = K down to 2)."""
        return tuple(
            GroupSpec(kind="prefix", ranks=self.prefix_ranks(k, coordinate), coordinate=coordinate, num_cells=k)
            for k in range(self.num_cells, 1, -1)
        )

    def creation_order(self) -> tuple[GroupSpec, ...]:
        """Every group of the job in the order every rank must create them (see the module docstring)."""
        control = GroupSpec(kind="control", ranks=tuple(range(self.world_size)))
        cells = tuple(GroupSpec(kind="cell", ranks=self.cell_ranks(c), cell=c) for c in range(self.num_cells))
        prefixes = tuple(
            GroupSpec(kind="prefix", ranks=self.prefix_ranks(k, c), coordinate=c, num_cells=k)
            for k in range(self.num_cells, 1, -1)
            for c in range(self.cell_size)
        )
        return (control, *cells, *prefixes)

    def describe(self, rank: int) -> str:
        """One line for logs: `rank 5: cell 2, coordinate 1 (leader 4)` or `rank 8: rollout pool`."""
        cell = self.cell_of(rank)
        if cell is None:
            return f"rank {rank}: rollout pool"
        return f"rank {rank}: cell {cell}, coordinate {self.coordinate_of(rank)} (leader {self.cell_leaders[cell]})"
