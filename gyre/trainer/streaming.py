"""Streaming micro-steps with dynamic membership: one optimizer step of one training cell.

Paper ("Streaming training with dynamic membership"): cells claim micro-steps from the controller's queue whenever
compute frees up and accumulate gradients; weights are frozen during accumulation, so a satellite that joins
mid-step computes against the same snapshot; when the stream is closed and drained, gradients are summed over the
prefix group of the cells that trained this step; the core alone normalizes, clips and updates; after a non-final
update of a burst the core broadcasts the new parameters to the current satellites.

Contract (docs/architecture.md, contract 7): the parameters after a step equal those of one process running the same
micro-steps, whatever cells claimed which micro-steps and whenever satellites joined (fp32, up to summation order).
That holds because the loss of a micro-step is its share of the batch loss (`gyre.rl.policy_loss` with the batch's
`num_executions` and each execution's whole L_i), so per-cell gradient sums add up to the batch gradient; a split
execution's micro-steps arrive as one claim unit (`gyre.distributed.claims`) so s_i (Eq. 5) is computed over all of
them.

The model side is a `Trainable` (a torch module here, Megatron in `gyre.trainer.megatron_trainable`); this module
owns the order of operations, not the math of the model. `train_step` takes its claims as callables;
`train_claimed_step` is the same step wired to the job: claims from the step's `StepBoard` in the job's store
(`gyre.distributed.claims`), a satellite's admission and its pull of the core's weights (docs/training.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from gyre.config.loss import LossConfig
from gyre.data.microstep import MicroStep
from gyre.distributed.claims import StepClaimer, claim_in_cell
from gyre.distributed.groups import ProcessGroups
from gyre.distributed.transport import WeightTransport, flatten_state_dict, unflatten
from gyre.rl import finalize_sequence_ratio, policy_loss, sequence_log_ratio_sums
from gyre.rl.loss_metrics import LossMetricSums

log = logging.getLogger(__name__)

__all__ = [
    "StepResult",
    "Trainable",
    "accumulate_unit",
    "add_sequence_sums",
    "broadcast_parameters",
    "loss_inputs_on",
    "publish_parameters",
    "pull_parameters",
    "reduce_gradients",
    "train_claimed_step",
    "train_step",
]


class Trainable(Protocol):
    """What the step needs from a model on one rank: log-probs of packed rows, its trainable tensors, an update."""

    def logprobs(self, step: MicroStep) -> Tensor:
        """Per-token log-probs `[U]` of `step.ids_U` given the row before them (0 at a row's first token);
        differentiable."""
        ...

    def parameters(self) -> list[Tensor]:
        """This rank's trainable tensors (its shards under tensor parallelism), in a fixed order: the weights it
        computes with, which a step broadcasts and satellites pull."""
        ...

    def gradients(self) -> list[Tensor]:
        """The gradients accumulated since the last update, one dense tensor per parameter in the same order (fp32
        main gradients under mixed precision: `gyre.trainer.precision`); `reduce_gradients` sums into them in place."""
        ...

    def drop_gradients(self) -> None:
        """Forget the accumulated gradients (a satellite after its step's reduction)."""
        ...

    def update(self) -> dict[str, float]:
        """Core only: clip and apply the optimizer to the accumulated (reduced) gradients; then zero them."""
        ...


@dataclass
class StepResult:
    """What one cell did in one step."""

    units: list[int] = field(default_factory=list)  # claim-unit indices this cell processed
    micro_steps: int = 0
    tokens: int = 0
    loss: float = 0.0  # this cell's share of the batch loss
    metrics: LossMetricSums = field(default_factory=LossMetricSums)  # the loss metrics of its micro-steps
    cells: int = 1  # cells that trained the step (the prefix length)
    update: dict[str, float] = field(default_factory=dict)  # core: the optimizer's metrics (grad norm, ...)
    compute_s: float = 0.0  # seconds in forward and backward passes (the claims' waits left out)
    pull_s: float = 0.0  # a joining satellite: seconds pulling the core's weights of the step
    update_s: float = 0.0  # seconds from the last micro-step to the step's end: reduce, update, broadcast


def add_sequence_sums(sums_2B: Tensor, step: MicroStep, logp_U: Tensor) -> None:
    """Add one micro-step's pieces of Eq. 5 (sum of log rho and target count per execution) into `sums_2B`, indexed
    by the executions' batch slots: after all micro-steps of a unit, `finalize_sequence_ratio(*sums_2B)` is s_i."""
    inputs = step.target_inputs()
    logp_T = logp_U.detach().float().cpu()[torch.from_numpy(step.target_U)]  # the sums live on the CPU
    sum_E, count_E = sequence_log_ratio_sums(
        logp_T - inputs["behavior_logp_T"], inputs["execution_T"], inputs["num_local"]
    )
    slots = torch.from_numpy(step.batch_execution_E)
    sums_2B[0].index_add_(0, slots, sum_E)
    sums_2B[1].index_add_(0, slots, count_E.double())


def loss_inputs_on(step: MicroStep, device: torch.device, seq_ratio_E: Tensor | None) -> dict:
    """`step.loss_inputs(...)` (CPU tensors) on the device of the log-probs (the GPU when training there)."""
    inputs = step.loss_inputs(seq_ratio_E=seq_ratio_E)
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in inputs.items()}


def accumulate_unit(
    model: Trainable, unit: Sequence[MicroStep], config: LossConfig, metrics: LossMetricSums | None = None
) -> float:
    """Forward and backward over one claim unit, gradients added into `.grad`; returns the summed loss. Each
    micro-step's loss metrics are added to `metrics` when given.

    A unit with split executions first takes s_i (Eq. 5) over all its micro-steps in a no-grad pass: the weights
    do not change during accumulation, so that pass sees the same log-probs as the backward passes."""
    seq_ratio = None
    if any(step.has_split for step in unit):
        sums = torch.zeros(2, unit[0].num_executions, dtype=torch.float64)
        with torch.no_grad():
            for step in unit:
                add_sequence_sums(sums, step, model.logprobs(step))
        seq_ratio = finalize_sequence_ratio(sums[0], sums[1])
    total = 0.0
    for step in unit:
        ratio_E = seq_ratio[torch.from_numpy(step.batch_execution_E)] if seq_ratio is not None else None
        logp_U = model.logprobs(step)
        logp_T = logp_U[torch.from_numpy(step.target_U).to(logp_U.device)].float()
        loss, step_metrics = policy_loss(logp_T, **loss_inputs_on(step, logp_T.device, ratio_E), config=config)
        loss.backward()
        total += float(loss.detach())
        if metrics is not None:
            metrics.add(step_metrics)
    return total


def reduce_gradients(grads: Sequence[Tensor], dst: int, group: dist.ProcessGroup | None) -> None:
    """Sum the gradient tensors `grads` (`Trainable.gradients`) over `group` onto global rank `dst` (the core's rank
    at this coordinate), in place, through one flat buffer; None (one cell) does nothing. Only `dst`'s gradients
    are meaningful afterwards."""
    if group is None:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.reduce(flat, dst=dst, op=dist.ReduceOp.SUM, group=group)
    if dist.get_rank() != dst:
        return
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def broadcast_parameters(params: Sequence[Tensor], src: int, group: dist.ProcessGroup | None) -> None:
    """Copy the parameters of global rank `src` (the core's rank at this coordinate) to every rank of `group`."""
    if group is None:
        return
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for p in params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n


def publish_parameters(transport: WeightTransport, params: Sequence[Tensor], version: int) -> None:
    """Core: expose this rank's parameters (its shards) as publication `version` of `transport`, for satellites
    joining the step; the weights do not change until the step's update, so any pull sees one snapshot."""
    transport.publish(flatten_state_dict({f"p{i}": p.detach() for i, p in enumerate(params)}), version)


def pull_parameters(transport: WeightTransport, params: Sequence[Tensor], version: int) -> None:
    """Satellite: copy publication `version` (the core's parameters at this rank's coordinate) into `params`."""
    nbytes = sum(p.numel() * p.element_size() for p in params) + 16 * len(params)  # 16-byte alignment padding
    weights, _ = transport.pull(torch.empty(nbytes, dtype=torch.uint8), version=version)
    tensors = unflatten(weights.buffer, weights.manifest)
    if len(tensors) != len(params):
        raise ValueError(f"publication {version} holds {len(tensors)} tensors, this rank has {len(params)}")
    with torch.no_grad():
        for i, p in enumerate(params):
            source = tensors[f"p{i}"]
            if source.shape != p.shape or source.dtype != p.dtype:
                raise ValueError(
                    f"publication {version}: tensor {i} is {source.dtype} {tuple(source.shape)}, this rank's is "
                    f"{p.dtype} {tuple(p.shape)} (another layout or model?)"
                )
            p.copy_(source)


def train_step(
    model: Trainable,
    *,
    claim: Callable[[], tuple[int, Sequence[MicroStep]] | None],
    cells: Callable[[], int],
    prefix_group: Callable[[int], dist.ProcessGroup | None],
    is_core: bool,
    core_rank: int,
    final: bool,
    config: LossConfig,
    pipeline=None,
) -> StepResult:
    """One optimizer step on one rank of a training cell.

    claim: the next (unit index, claim unit) for this cell, or None once the stream is closed and drained.
    cells: the number of cells that trained this step (asked after the stream is drained).
    prefix_group: the process group of the first k cells at this rank's in-cell coordinate (None for k = 1).
    is_core: this rank belongs to the core cell (it owns the optimizer). core_rank: the core's global rank at this
    rank's coordinate (the source of the parameter broadcast). final: the last step of the burst (no broadcast:
    satellites return to rollout and the core publishes to engines instead). pipeline: a cell with PP > 1 passes
    its `gyre.trainer.pipeline.StreamingPipeline`, which runs the claim loop as one continuous 1F1B pipeline (one
    warm-up and one drain per step); at PP = 1 the units are accumulated one after another here.
    """
    if pipeline is not None:
        started = time.perf_counter()
        result = pipeline.run(claim)
        result.compute_s = time.perf_counter() - started  # the pipeline's claims inside it
    else:
        result = StepResult()
        while (claimed := claim()) is not None:  # the stream: claim whenever compute frees up
            index, unit = claimed
            started = time.perf_counter()
            result.loss += accumulate_unit(model, unit, config, result.metrics)
            result.compute_s += time.perf_counter() - started
            result.units.append(index)
            result.micro_steps += len(unit)
            result.tokens += sum(step.num_tokens for step in unit)
    result.cells = cells()
    closed = time.perf_counter()
    params = model.parameters()
    group = prefix_group(result.cells)
    if group is not None:
        reduce_gradients(model.gradients(), core_rank, group)
    try:
        if is_core:
            result.update = model.update()
        else:
            model.drop_gradients()
    finally:  # satellites wait in this broadcast: it happens even when the core's update raised (unchanged weights)
        if not final:
            broadcast_parameters(params, core_rank, group)
        result.update_s = time.perf_counter() - closed
    return result


def train_claimed_step(
    model: Trainable,
    *,
    store: dist.Store,
    step: int,
    groups: ProcessGroups,
    transport: WeightTransport,
    version: int,
    training: bool,
    final: bool,
    config: LossConfig,
    timeout_s: float = 24 * 3600.0,
) -> StepResult | None:
    """One optimizer step of this rank's cell, claimed from step `step`'s board in the job's `store`.

    Every rank of every cell calls it for each step of a burst, in order, on its main thread, with its own store
    client. The core (cell 0) first publishes its parameters as `version` on `transport` (a one-sided transport,
    `one_sided_transport`), for satellites joining mid-step. A satellite not yet `training` waits for the
    controller's decision on this step (`StepClaimer.admitted`): None when the step closed without it (it asks
    again at the next step), else it pulls `version` into its parameters and trains from then on. Then
    `train_step`: the cell leader claims and the cell's other ranks follow (`claim_in_cell`), the number of cells
    comes from the board, gradients are summed over the prefix group onto the core's rank at this coordinate.

    A cell of several pipeline stages (a `MegatronTrainable` whose `pipeline` is its `StreamingPipeline`) streams
    the step through it: only the first stage claims (its TP ranks alike, over `pipeline.claim_group`), the other
    stages follow their upstream neighbour. A wait on the store that runs past `timeout_s` raises TimeoutError
    naming the step."""
    cell, coordinate = groups.cell, groups.coordinate
    if cell is None or coordinate is None:
        raise ValueError(f"train_claimed_step runs on cell ranks; {groups.layout.describe(groups.rank)} has no cell")
    params = model.parameters()
    claimer = StepClaimer(store, step, timeout_s=timeout_s)
    pull_s = 0.0
    if cell == 0:  # weights are frozen until the update: one snapshot for every joiner of the step
        publish_parameters(transport, params, version=version)
    elif not training:
        if not claimer.admitted(cell):
            return None
        started = time.perf_counter()
        pull_parameters(transport, params, version=version)
        pull_s = time.perf_counter() - started
        log.info("step %d: cell %d joined with weights version %d (pulled in %.3f s)", step, cell, version, pull_s)
    cell_size = groups.layout.cell_size
    cell_group = groups.cell_group if cell_size > 1 else None
    pipeline = getattr(model, "pipeline", None)  # None: no pipeline stages (every trainable but Megatron at PP > 1)
    if pipeline is not None:
        cell_group = pipeline.claim_group
    result = train_step(
        model,
        claim=lambda: claim_in_cell(claimer, cell_group=cell_group, leader_rank=cell * cell_size),
        cells=claimer.cells,
        prefix_group=groups.prefix_group,
        is_core=cell == 0,
        core_rank=coordinate,
        final=final,
        config=config,
        pipeline=pipeline,
    )
    result.pull_s = pull_s
    return result
