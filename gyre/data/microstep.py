"""Token rows and micro-steps: the training input the stream packing buffer emits.

A `TokenRow` is one admitted trajectory materialized: the root-to-leaf path's token ids, its frozen
target mask, the behavior log-probs at the targets, its execution's advantage A_i and L_i (the number of
admitted targets of the execution over ALL its trajectories, Eq. 6).

A `MicroStep` is rows packed back to back into flat arrays of U tokens (suffix `_U`), with a local table
of the E executions it touches (suffix `_E`). Conventions:
- Row r spans `ids_U[row_offsets_R1[r]:row_offsets_R1[r + 1]]`. Positions and attention restart at every
  row boundary: the trainer builds per-row position ids (`positions_U()`) and a block-diagonal causal
  mask (or varlen cu_seqlens = `row_offsets_R1`); a token never attends across rows.
- Targets are token-aligned: `target_U[u]` says token u is trained, `behavior_logp_U[u]` is the recorded
  log-prob of `ids_U[u]` given the row's tokens before it (0.0 where not a target). The trainer takes
  the log-prob of token u from the logits at u - 1 of the same row; a row's first token is never a target.
- `execution_U` indexes the local table for every token (targets or not). `num_targets_E` is L_i over
  the execution's whole admitted target set, which is larger than its targets here when its rows are
  spread over several micro-steps (`split_E`): pass it as `policy_loss(..., num_targets_E=...)`.
- `batch_execution_E` is each execution's slot in the batch, in [0, num_executions): the position of its
  group in the batch's pull order times N plus its member index. It is the same in every micro-step and
  cell, so a trainer accumulates the s_i sums of split executions (`gyre.rl.sequence_log_ratio_sums`)
  into a [2, num_executions] tensor with `index_add_`, all-reduces it and calls `finalize_sequence_ratio`.
- `split_E` marks the executions whose rows are in several micro-steps: their s_i (Eq. 5, hence the
  shared mask m_i) cannot be computed from this micro-step alone, so `loss_inputs` requires `seq_ratio_E`
  when any is set.
- `num_executions` is the batch's B * N raw executions, excluded ones included: the batch-mean denominator.
- `routed_experts_ULK` (mixture-of-experts routing replay, `gyre.trainer.routing`, docs/moe.md): int16
  `[U, num_hidden_layers, top_k]`, the experts the rollout's engine chose for each token, -1 where it routed none
  (a row's last token; positions no recorded call routed). It is the rows' `routed_experts_TLK` concatenated; a
  row without routing in a micro-step whose other rows have some is all -1 (its tokens are not replayed: the
  Megatron trainer's routers choose for them). None when no row has routing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gyre.traj.record import NO_ROUTE

__all__ = ["MicroStep", "TokenRow", "build_microstep"]


@dataclass(frozen=True, eq=False)
class TokenRow:
    """One admitted trajectory as a training row (arrays have one entry per path token)."""

    group_id: int
    execution: str
    leaf: int
    role: str
    ids: np.ndarray  # int64
    targets: np.ndarray  # bool: the admitted trajectory's frozen targets
    behavior_logprobs: np.ndarray  # float64: recorded log-probs at targets, 0.0 elsewhere
    advantage: float  # A_i of the execution
    execution_num_targets: int  # L_i: admitted targets of the execution over all its trajectories
    batch_execution: int  # the execution's slot in its batch, in [0, B * N) (see MicroStep.batch_execution_E)
    routed_experts_TLK: np.ndarray | None = None  # int16 [T, L, K]: `TrajectoryTree.path_routing(leaf)`, or None

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def num_targets(self) -> int:
        return int(self.targets.sum())


@dataclass(frozen=True, eq=False)
class MicroStep:
    """Packed rows of one micro-step of batch `batch` (see the module docstring for the conventions)."""

    batch: int  # the batch (stream) this micro-step belongs to
    index: int  # emission order within the batch, from 0
    ids_U: np.ndarray  # int64 [U]
    row_offsets_R1: np.ndarray  # int64 [R + 1], row_offsets_R1[0] = 0, row_offsets_R1[-1] = U
    target_U: np.ndarray  # bool [U]
    behavior_logp_U: np.ndarray  # float64 [U], 0.0 where not a target
    execution_U: np.ndarray  # int64 [U], index into the local execution table
    row_execution_R: np.ndarray  # int64 [R], local execution of each row
    row_leaf_R: np.ndarray  # int64 [R], leaf node of each row in its execution's tree
    advantage_E: np.ndarray  # float64 [E], A_i
    num_targets_E: np.ndarray  # int64 [E], L_i over the execution's whole admitted target set
    execution_ids: tuple[str, ...]  # [E] global execution ids
    group_ids: tuple[int, ...]  # [E] group of each local execution
    num_executions: int  # B * N raw executions of the batch
    batch_execution_E: np.ndarray  # int64 [E], slot of each execution in the batch, in [0, num_executions)
    split_E: np.ndarray  # bool [E], the execution's rows are in several micro-steps (s_i needs them all)
    routed_experts_ULK: np.ndarray | None = None  # int16 [U, L, K], the engine's experts per token (module docstring)

    @property
    def num_rows(self) -> int:
        return int(self.row_offsets_R1.shape[0] - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.ids_U.shape[0])

    @property
    def num_targets(self) -> int:
        return int(self.target_U.sum())

    def row_lengths_R(self) -> np.ndarray:
        return np.diff(self.row_offsets_R1)

    def positions_U(self) -> np.ndarray:
        """Position of every token within its row (restarts at 0 at each row boundary)."""
        starts_U = np.repeat(self.row_offsets_R1[:-1], self.row_lengths_R())
        return np.arange(self.num_tokens, dtype=np.int64) - starts_U

    @property
    def has_split(self) -> bool:
        """Some execution here has rows in other micro-steps too: `loss_inputs` needs `seq_ratio_E`."""
        return bool(self.split_E.any())

    def target_inputs(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """`behavior_logp_T` and `execution_T` over this micro-step's targets, and `num_local` (E): what the
        no-grad s_i pass needs, `sequence_log_ratio_sums(logp_T - behavior_logp_T, execution_T, num_local)`."""
        target = self.target_U
        return {
            "behavior_logp_T": torch.from_numpy(self.behavior_logp_U[target]).to(dtype),
            "execution_T": torch.from_numpy(self.execution_U[target]).to(torch.int64),
            "num_local": len(self.execution_ids),
        }

    def loss_inputs(
        self,
        dtype: torch.dtype = torch.float32,
        *,
        seq_ratio_E: torch.Tensor | None = None,
        allow_partial_seq_ratio: bool = False,
    ) -> dict[str, Any]:
        """The target-side arguments of `gyre.rl.policy_loss` as tensors, flat over this micro-step's targets:
        `policy_loss(logp_U[target_U], **step.loss_inputs(...), config=...)`.

        seq_ratio_E: s_i per local execution over its WHOLE target set, [E] (float64), e.g.
            `finalize_sequence_ratio(acc_2B[0], acc_2B[1])[step.batch_execution_E]` after a no-grad pass.
            Required when the micro-step has split executions (`split_E`): a ValueError otherwise, since
            s_i of the part here would decide the shared mask m_i. Optional otherwise.
        allow_partial_seq_ratio: accept that approximation instead (m_i decided per micro-step).
        """
        if self.has_split and seq_ratio_E is None and not allow_partial_seq_ratio:
            split = [e for e, s in zip(self.execution_ids, self.split_E.tolist(), strict=True) if s]
            raise ValueError(
                f"micro-step {self.index} of batch {self.batch} carries part of split executions {split[:5]!r} "
                "(rows in several micro-steps): pass seq_ratio_E, s_i over each execution's whole target set "
                "(accumulate gyre.rl.sequence_log_ratio_sums over the batch's micro-steps by batch_execution_E, "
                "all-reduce, then gyre.rl.finalize_sequence_ratio), or allow_partial_seq_ratio=True to accept "
                "a mask m_i decided per micro-step"
            )
        inputs = self.target_inputs(dtype)
        del inputs["num_local"]
        inputs["advantage_E"] = torch.from_numpy(self.advantage_E).to(dtype)
        inputs["num_executions"] = self.num_executions
        inputs["num_targets_E"] = torch.from_numpy(self.num_targets_E).to(torch.int64)
        if seq_ratio_E is not None:
            inputs["seq_ratio_E"] = seq_ratio_E
        if allow_partial_seq_ratio:
            inputs["allow_partial_seq_ratio"] = True
        return inputs

    def __repr__(self) -> str:
        return (
            f"MicroStep(batch={self.batch}, index={self.index}, rows={self.num_rows}, tokens={self.num_tokens}, "
            f"targets={self.num_targets}, executions={len(self.execution_ids)})"
        )


def build_microstep(
    batch: int, index: int, rows: Sequence[TokenRow], num_executions: int, split: Collection[str] = ()
) -> MicroStep:
    """Concatenate `rows` (in the order given) into a micro-step; executions are numbered by first appearance.
    `split`: the executions whose rows are in other micro-steps too (`split_E`). ValueError when rows' routing
    disagrees in (layers, top_k) or in length with its row."""
    if not rows:
        raise ValueError("a micro-step needs at least one row")
    local: dict[str, int] = {}
    advantage: list[float] = []
    num_targets: list[int] = []
    groups: list[int] = []
    slots: list[int] = []
    row_execution: list[int] = []
    for row in rows:
        e = local.get(row.execution)
        if e is None:
            e = local[row.execution] = len(local)
            advantage.append(row.advantage)
            num_targets.append(row.execution_num_targets)
            groups.append(row.group_id)
            slots.append(row.batch_execution)
        row_execution.append(e)
    lengths = np.array([row.num_tokens for row in rows], dtype=np.int64)
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    row_execution_R = np.array(row_execution, dtype=np.int64)
    return MicroStep(
        batch=batch,
        index=index,
        ids_U=np.concatenate([row.ids for row in rows]).astype(np.int64, copy=False),
        row_offsets_R1=offsets,
        target_U=np.concatenate([row.targets for row in rows]),
        behavior_logp_U=np.concatenate([row.behavior_logprobs for row in rows]).astype(np.float64, copy=False),
        execution_U=np.repeat(row_execution_R, lengths),
        row_execution_R=row_execution_R,
        row_leaf_R=np.array([row.leaf for row in rows], dtype=np.int64),
        advantage_E=np.array(advantage, dtype=np.float64),
        num_targets_E=np.array(num_targets, dtype=np.int64),
        execution_ids=tuple(local),
        group_ids=tuple(groups),
        num_executions=num_executions,
        batch_execution_E=np.array(slots, dtype=np.int64),
        split_E=np.array([e in split for e in local], dtype=np.bool_),
        routed_experts_ULK=_step_routing(rows),
    )


def _step_routing(rows: Sequence[TokenRow]) -> np.ndarray | None:
    """The rows' routing concatenated (`MicroStep.routed_experts_ULK`): -1 for a row without any; None if none has."""
    routed = [row for row in rows if row.routed_experts_TLK is not None]
    if not routed:
        return None
    first = routed[0]
    layers_topk = first.routed_experts_TLK.shape[1:]
    for row in routed:
        routes = row.routed_experts_TLK
        if routes.ndim != 3 or routes.shape[1:] != layers_topk or routes.shape[0] != row.num_tokens:
            raise ValueError(
                f"row of execution {row.execution!r} (leaf {row.leaf}) has routing of shape {routes.shape}; expected "
                f"[{row.num_tokens} tokens, {layers_topk[0]} layers, top-{layers_topk[1]}] (as the row of execution "
                f"{first.execution!r}, leaf {first.leaf})"
            )
    return np.concatenate(
        [
            row.routed_experts_TLK.astype(np.int16, copy=False)
            if row.routed_experts_TLK is not None
            else np.full((row.num_tokens, *layers_topk), NO_ROUTE, dtype=np.int16)
            for row in rows
        ]
    )
