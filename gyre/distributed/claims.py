"""Cross-process micro-step claims: the controller's queue seen by every training cell through a key-value store.

Role: the stream packing buffer fills a `gyre.data.MicroStepQueue` on the controller; training cells run in other
processes. This module moves the queue's content into a `torch.distributed.Store` (the job's TCPStore) as *claim
units*, and gives each cell leader an atomic claim (paper: "cells claim micro-steps atomically from a shared queue
whenever compute frees up"). It also carries the step's membership: which prefix of cells trains this step.

Keys of optimizer step `s` (under `gyre/step/{s}/`):
- `unit/{i}`: the i-th claim unit, encoded (`encode_unit`), or `CLOSED` once the stream has ended before it. A unit
  over `STORE_VALUE_MAX_BYTES` travels in parts: `unit/{i}/{j}`, j = 0 .. k - 1, written first, then `unit/{i}` =
  `PARTS` + k (routing replay makes a long micro-step tens of MB: ~0.8 KB per token at 48 layers x top-8).
- `next`: the claim counter. A leader's `store.add(next, 1) - 1` is the index it owns: claims are disjoint and
  nothing is lost, because each index is handed out once and every index is eventually written (a unit or
  `CLOSED`).
- `cells`: the number of training cells of the step (a prefix 0..k-1 of the cells, core first), written once by
  `close` before any `CLOSED`; a cell that reads `CLOSED` then reads it to pick the prefix group it reduces over.
- `join/{c}`: whether cell c trains the step: `1` for the cells training when the board opens and for each cell
  `admit` lets in, `0` for every other cell at `close`. A cell not yet training waits on it (`StepClaimer.admitted`)
  before it pulls the core's weights; it is kept by `clear` (a cell told `0` may read it late).

Claim units (`gyre.data.claim_units`). A split execution (rows in several micro-steps, `MicroStep.split_E`) needs
s_i (Eq. 5) over all its micro-steps before any of them computes its loss. Its micro-steps all come from one pull
(not necessarily consecutive), so the controller ships the pull's micro-steps linked by shared split executions as
one unit (docs/data.md, "Claim units"): the claiming cell does a no-grad pass over the unit, then the forward-backward
of each micro-step, and no cross-cell reduction of s_i is needed mid-stream. Every other micro-step is a unit alone.

Sentinels. Each cell leader holds at most one claimed index it has not yet received. So at close, with n units
put, `CLOSED` is written at n .. n + max_cells - 1: every outstanding claim gets an answer, and a cell that joins
after the close claims an index in that range and stops at once.

Size. TCPStore's libuv backend (torch's default) drops the connection of a client that sets a value over 8 MiB
(`STORE_VALUE_MAX_BYTES`), so `StepBoard` cuts a larger unit into parts of at most that size (above), and the
claimer joins them.

Cell side. `claim_in_cell` is a claim for every rank of a cell: the leader claims, the other ranks get the index over
the cell group and read the same unit. `gyre.distributed.step_pump` is the controller's pump from the packing
buffer's queue onto the board; docs/distributed.md has the whole protocol.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from dataclasses import fields

import numpy as np
import torch
import torch.distributed as dist

from gyre.data.claim_units import ClaimUnitAssembler
from gyre.data.microstep import MicroStep

__all__ = [
    "CLOSED",
    "PARTS",
    "STORE_VALUE_MAX_BYTES",
    "StepBoard",
    "StepClaimer",
    "claim_in_cell",
    "decode_unit",
    "encode_unit",
]

CLOSED = b"gyre:closed"
PARTS = b"gyre:parts:"  # `unit/{i}` of a unit sent in parts: this prefix, then the number of parts (ASCII)
STORE_VALUE_MAX_BYTES = 8 << 20  # TCPStore's libuv backend refuses a larger payload (torch 2.13, measured)
_MAGIC = b"GYREUNIT1\n"
# Every array field; an optional one that is None (`routed_experts_ULK` of a dense run) is left out of the encoding.
_ARRAY_FIELDS = tuple(f.name for f in fields(MicroStep) if f.name.endswith(("_U", "_R", "_R1", "_E", "_ULK")))
_PLAIN_FIELDS = ("batch", "index", "num_executions", "execution_ids", "group_ids")


def _prefix(step: int) -> str:
    return f"gyre/step/{step}/"


# ----------------------------------------------------------------------------- encoding


def encode_unit(unit: Sequence[MicroStep]) -> bytes:
    """Micro-steps as bytes: a JSON header line (fields, dtypes, shapes) then the arrays' raw bytes, in order. An
    array field that is None is not listed (it decodes to its default, None)."""
    if not unit:
        raise ValueError("a claim unit needs at least one micro-step")
    header: list[dict] = []
    blobs: list[bytes] = []
    for step in unit:
        arrays = []
        for name in _ARRAY_FIELDS:
            value = getattr(step, name)
            if value is None:
                continue
            array = np.ascontiguousarray(value)
            arrays.append([name, array.dtype.str, list(array.shape)])
            blobs.append(array.tobytes())
        header.append({"plain": {name: getattr(step, name) for name in _PLAIN_FIELDS}, "arrays": arrays})
    return _MAGIC + json.dumps(header, separators=(",", ":")).encode() + b"\n" + b"".join(blobs)


def decode_unit(data: bytes) -> tuple[MicroStep, ...]:
    """The inverse of `encode_unit` (arrays are copies, writable)."""
    if not data.startswith(_MAGIC):
        raise ValueError(f"not an encoded claim unit (starts with {data[:16]!r})")
    end = data.index(b"\n", len(_MAGIC))
    header = json.loads(data[len(_MAGIC) : end])
    offset = end + 1
    steps = []
    for entry in header:
        values: dict = dict(entry["plain"])
        values["execution_ids"] = tuple(values["execution_ids"])
        values["group_ids"] = tuple(values["group_ids"])
        for name, dtype, shape in entry["arrays"]:
            dtype = np.dtype(dtype)
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            count = size // dtype.itemsize
            flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset) if count else np.empty(0, dtype)
            values[name] = flat.reshape(shape).copy()
            offset += size
        steps.append(MicroStep(**values))
    if offset != len(data):
        raise ValueError(f"claim unit has {len(data) - offset} trailing bytes")
    return tuple(steps)


# ----------------------------------------------------------------------------- store adapters


class StepBoard:
    """Controller side of one optimizer step: puts units, admits cells, closes the stream.

    store: a `torch.distributed.Store` every cell leader reaches. max_cells: the number of cells of the job (the
    sentinel count). cells: training cells at the start of the step (the core alone is 1). part_bytes: the largest
    value written; a larger unit goes in parts (module docstring)."""

    def __init__(
        self, store, step: int, *, max_cells: int, cells: int = 1, part_bytes: int = STORE_VALUE_MAX_BYTES
    ) -> None:
        if max_cells < 1 or not 1 <= cells <= max_cells:
            raise ValueError(f"need 1 <= cells <= max_cells, got cells={cells}, max_cells={max_cells}")
        if (
            isinstance(part_bytes, bool)
            or not isinstance(part_bytes, int)
            or not 64 <= part_bytes <= STORE_VALUE_MAX_BYTES
        ):
            raise ValueError(f"part_bytes: got {part_bytes!r}, expected 64 .. {STORE_VALUE_MAX_BYTES}")
        self.store, self.step, self.max_cells, self.part_bytes = store, step, max_cells, part_bytes
        self._parts: dict[int, int] = {}  # unit index -> number of parts, for the units sent in parts
        self._prefix = _prefix(step)
        self._assembler = ClaimUnitAssembler()
        self.num_units = 0
        self.cells = cells
        self.closed = False
        for cell in range(cells):
            self.store.set(f"{self._prefix}join/{cell}", b"1")

    def put(self, step: MicroStep) -> None:
        """Enqueue one micro-step (in emission order); it becomes claimable when its unit is complete."""
        if self.closed:
            raise ValueError(f"step {self.step}: the stream is closed after {self.num_units} units")
        for unit in self._assembler.add(step):
            self._put_unit(unit)

    def flush(self) -> int:
        """Put the held-back units now: the caller knows a pull has ended (the packer emits every micro-step of an
        execution in one pull, docs/data.md, so a pull's end completes its units). Returns units put."""
        if self.closed:
            return 0
        before = self.num_units
        for unit in self._assembler.flush():
            self._put_unit(unit)
        return self.num_units - before

    def claims(self) -> int:
        """How many unit indices cell leaders have claimed so far (the claim counter; indices 0 .. claims - 1)."""
        return int(self.store.add(self._prefix + "next", 0))

    def admit(self) -> int:
        """Let the next cell (a satellite, in cell order) join the step; returns its cell index."""
        if self.closed:
            raise ValueError(f"step {self.step}: the join window closed with the stream")
        if self.cells >= self.max_cells:
            raise ValueError(f"step {self.step}: all {self.max_cells} cells already train")
        self.cells += 1
        self.store.set(f"{self._prefix}join/{self.cells - 1}", b"1")
        return self.cells - 1

    def close(self) -> int:
        """End the stream (and the join window): flush the held-back unit, write the membership, then the
        sentinels. Returns the number of units."""
        if self.closed:
            return self.num_units
        for unit in self._assembler.flush():
            self._put_unit(unit)
        self.store.set(self._prefix + "cells", str(self.cells))
        for cell in range(self.cells, self.max_cells):
            self.store.set(f"{self._prefix}join/{cell}", b"0")
        for i in range(self.num_units, self.num_units + self.max_cells):
            self.store.set(f"{self._prefix}unit/{i}", CLOSED)
        self.closed = True
        return self.num_units

    def abandon(self) -> int:
        """End the step now, for a run that stops: every unit no cell has claimed yet reads `CLOSED`, the held-back
        units are dropped, then `close`. Each cell finishes at most the unit it holds, claims `CLOSED` and goes on
        to its reduction, so a stop waits for one unit, not the rest of the step. Returns the units dropped."""
        if self.closed:
            return 0
        claimed = self.claims()
        for i in range(claimed, self.num_units):
            self.store.set(f"{self._prefix}unit/{i}", CLOSED)
        self._assembler = ClaimUnitAssembler()
        self.close()
        return max(0, self.num_units - claimed)

    def clear(self) -> None:
        """Delete the step's units and counters once every cell is past it (the core's reduction proves it): units
        can be MBs. The join keys stay (a few bytes each)."""
        for i in range(self.num_units + self.max_cells):
            self.store.delete_key(f"{self._prefix}unit/{i}")
        for i, parts in self._parts.items():
            for j in range(parts):
                self.store.delete_key(f"{self._prefix}unit/{i}/{j}")
        self._parts = {}
        for name in ("next", "cells"):
            self.store.delete_key(self._prefix + name)

    def _put_unit(self, unit: tuple[MicroStep, ...]) -> None:
        data = encode_unit(unit)
        key = f"{self._prefix}unit/{self.num_units}"
        if len(data) <= self.part_bytes:
            self.store.set(key, data)
        else:  # the parts first: a claimer that sees `key` finds them all
            starts = range(0, len(data), self.part_bytes)
            for j, start in enumerate(starts):
                self.store.set(f"{key}/{j}", data[start : start + self.part_bytes])
            self.store.set(key, PARTS + str(len(starts)).encode())
            self._parts[self.num_units] = len(starts)
        self.num_units += 1


class StepClaimer:
    """Cell side of one optimizer step: `claim` on the cell leader, `receive` on the cell's other ranks.

    timeout_s bounds every wait on the store (a controller that died must not hang the job forever). Micro-steps
    arrive as executions finish, which can take hours, so the default is a day; a wait that runs out raises a
    TimeoutError naming the step and the unit."""

    def __init__(self, store, step: int, *, timeout_s: float = 24 * 3600.0) -> None:
        self.store, self.step = store, step
        self._prefix = _prefix(step)
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self.claimed: list[int] = []  # unit indices this cell took (monitoring and tests)

    def claim_index(self) -> int:
        """Atomically own the next unit index (cell leader only)."""
        return int(self.store.add(self._prefix + "next", 1)) - 1

    def receive(self, index: int) -> tuple[MicroStep, ...] | None:
        """The unit at `index`, waiting until it is written; None when the stream closed before it."""
        key = f"{self._prefix}unit/{index}"
        self._wait(key, f"unit {index}")
        data = self.store.get(key)
        if data == CLOSED:
            return None
        if data.startswith(PARTS):  # written before `key`: all there
            data = b"".join(self.store.get(f"{key}/{j}") for j in range(int(data[len(PARTS) :])))
        self.claimed.append(index)
        return decode_unit(data)

    def claim(self) -> tuple[int, tuple[MicroStep, ...]] | None:
        """The next (unit index, unit) for this cell, or None when the step's stream is done."""
        index = self.claim_index()
        unit = self.receive(index)
        return None if unit is None else (index, unit)

    def admitted(self, cell: int) -> bool:
        """Whether `cell` trains this step: waits until the controller decided (the board opened with it, admitted
        it, or closed without it)."""
        key = f"{self._prefix}join/{cell}"
        self._wait(key, f"the admission of cell {cell}")
        return self.store.get(key) == b"1"

    def cells(self) -> int:
        """The number of cells that train this step (valid once `claim` returned None)."""
        key = self._prefix + "cells"
        self._wait(key, "the membership")
        return int(self.store.get(key))

    def _wait(self, key: str, what: str) -> None:
        try:
            self.store.wait([key], self._timeout)
        except (RuntimeError, TimeoutError) as error:  # torch's DistStoreError is a RuntimeError
            raise TimeoutError(
                f"step {self.step}: {what} did not arrive within {self._timeout.total_seconds():g} s "
                f"(is the controller alive?): {error}"
            ) from error


def claim_in_cell(
    claimer: StepClaimer, *, cell_group: dist.ProcessGroup | None, leader_rank: int
) -> tuple[int, tuple[MicroStep, ...]] | None:
    """One claim for every rank of a cell: the leader (global rank `leader_rank`) claims the next index, the cell's
    other ranks get it by a broadcast over `cell_group` and every rank reads the same unit from the store. A cell of
    one rank passes `cell_group=None` (no broadcast). Returns (index, unit), or None on every rank once the step's
    stream is done; `train_step`'s `claim` (gyre.trainer.streaming)."""
    if cell_group is None:
        return claimer.claim()
    is_leader = dist.get_rank() == leader_rank
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(cell_group) == "nccl" else None
    index = torch.tensor([claimer.claim_index() if is_leader else -1], dtype=torch.int64, device=device)
    dist.broadcast(index, src=leader_rank, group=cell_group)
    unit = claimer.receive(int(index))
    return None if unit is None else (int(index), unit)
