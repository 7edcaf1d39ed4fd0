"""Streaming one-forward-one-backward (1F1B) pipeline schedule for one training cell with pipeline parallelism.

Paper ("Streaming training relies on two buffers"): each cell processes micro-steps with a continuous 1F1B
pipeline; when data is momentarily missing every stage stops at a consistent scheduling point while keeping its
pipeline state; once the stream is closed and the queue drained the pipeline flushes, so each cell pays exactly one
warm-up and one drain per batch. Megatron's `forward_backward_pipelining_without_interleaving` needs the number of
micro-batches and one activation shape up front; a stream has neither, so this module runs its own schedule with
megatron's order of operations (warm-up of up to pp - 1 - rank forwards, steady 1F1B, cool-down) and a header in
front of every forward message.

Who sends what (all point-to-point over megatron's pipeline group, between neighbouring stages, global ranks):
- The first stage calls `claim()`: a claim unit `(index, micro_steps)`, `WAIT` (nothing yet, the stream is open) or
  None (closed and drained). Downstream, stage r sends stage r + 1, in order, for every message a fixed int64 header
  `[kind, unit index, U, payload bytes]` and then, for micro-steps, the `MicroStep` (uint8, as
  `gyre.distributed.claims.encode_unit` writes it) and the activation `[U, 1, hidden]` (`pipeline_dtype`). U differs
  between micro-steps, so the receiver learns it from the header before it posts the activation's receive.
  Kinds: TRAIN (forward now, backward later), SCORE (no-grad forward for the s_i pass of a unit with split
  executions, Eq. 5), WAIT (a pause), END (the stream is done).
- Upstream, stage r + 1 sends stage r the gradient of each TRAIN activation, in forward order; its shape is the
  one stage r sent, so it needs no header.
- Sends are asynchronous (`isend`, waited at the end of the batch); receives block. The order of the blocking
  receives is megatron's, so no stage waits on a peer that waits on it.
- Tied embeddings at PP > 1: after the drain the first and last stages all-reduce the shared weight's gradient over
  megatron's embedding group (as megatron's `finalize_model_grads` does), so both copies take the same update.

Pauses: a WAIT from `claim` is forwarded down the pipeline and counted; every stage then waits for the next header
in a blocking receive, with its in-flight activations kept: nothing is drained or re-warmed. WAIT messages keep the
downstream receives inside the process group's timeout during long pauses; a `claim` that blocks instead works too.

Contract: the gradients accumulated in `.grad` equal those of `gyre.trainer.streaming.accumulate_unit` over the same
claim units at PP = 1 (up to summation order): the last stage computes per-token log-probs with megatron's
vocab-parallel cross entropy (as `gyre.trainer.logprobs`) and `gyre.rl.policy_loss` with the micro-step's
`loss_inputs`, and backpropagates the loss unscaled. A unit with split executions first sends all its micro-steps
as SCORE messages; the last stage accumulates `sequence_log_ratio_sums` and finalizes s_i before the unit's TRAIN
micro-steps reach it (they follow the SCOREs in the same FIFO).

The loss and its metrics are the last stage's: after the drain it broadcasts them over the pipeline group, so every
stage's `StepResult` has them (the cell leader, on the first stage, reports the cell's share of a step).

Tensor parallelism: each TP rank of the first stage must get the same units from `claim` (the cell's leader
claims and broadcasts over `claim_group`, the first stage's TP group, as `gyre.trainer.streaming.train_claimed_step`
does); headers and activations then travel along each TP rank's own pipeline group. Sequence parallelism is
rejected (the activation would be `[U / tp, 1, hidden]`). Run here at PP 2, PP 3 and TP 2 x PP 2
(tests/integration/test_train_pipeline.py), and in the program at PP 2 (cells of 2 stages, a satellite beside the
core: tests/integration/test_train_program_pipeline.py).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor

from gyre.config.loss import LossConfig
from gyre.data.microstep import MicroStep
from gyre.distributed.claims import decode_unit, encode_unit
from gyre.rl import finalize_sequence_ratio, policy_loss
from gyre.rl.loss_metrics import LossMetricSums
from gyre.trainer.chunked import DEFAULT_CHUNK_TOKENS
from gyre.trainer.cpu_patch import apply_cpu_patches
from gyre.trainer.logprobs import logprobs_from_hidden, packed_positions, set_model_routing, thd_params
from gyre.trainer.routing import step_routes
from gyre.trainer.streaming import StepResult, add_sequence_sums, loss_inputs_on

apply_cpu_patches()  # before megatron runs anything (CPU-only torch; no-op with CUDA)

log = logging.getLogger(__name__)

__all__ = ["WAIT", "PipelineCounters", "StreamingPipeline"]


class _Wait:
    def __repr__(self) -> str:
        return "WAIT"


WAIT: Final = _Wait()  # what `claim` returns when the stream is open but has nothing yet

# Header kinds (int64 header: [kind, unit index, U, payload bytes]).
END, PAUSE, TRAIN, SCORE = 0, 1, 2, 3
HEADER_LEN = 4
FORWARD_TAG, BACKWARD_TAG = 71, 72  # forward messages (header, payload, activation) and activation gradients

Claim = Callable[[], "tuple[int, Sequence[MicroStep]] | _Wait | None"]


@dataclass
class PipelineCounters:
    """What this stage's schedule did since it was built (cumulative over batches)."""

    warmups: int = 0  # pipeline fills: one per batch
    drains: int = 0  # pipeline flushes: one per batch
    pauses: int = 0  # WAIT messages seen (stream momentarily empty); no fill or flush
    forwards: int = 0  # TRAIN forwards
    backwards: int = 0
    score_forwards: int = 0  # no-grad forwards of the s_i pass


@dataclass
class _InFlight:
    """A TRAIN forward awaiting its backward."""

    input_BSH: Tensor | None  # the received activation (None on the first stage)
    output: Tensor  # the activation sent on (non-last stage) or the loss (last stage)


class StreamingPipeline:
    """The streaming 1F1B schedule of one pipeline stage; `run(claim)` accumulates one batch's gradients.

    model: this rank's stage of a megatron `GPTModel` (`gyre.trainer.model.build_gpt_model`, `parallel_state`
    initialized with PP > 1). config: the loss. temperature: logits are divided by it before the log-softmax.
    chunk_tokens: the last stage's log-probs a chunk of tokens at a time (`gyre.trainer.chunked`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        config: LossConfig,
        temperature: float = 1.0,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ):
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r} is not supported: expected > 0")
        megatron_config = model.config
        if megatron_config.sequence_parallel:
            raise ValueError("sequence_parallel=True is not supported by the streaming pipeline: expected False")
        self.model = model
        self.config = config
        self.temperature = temperature
        self.chunk_tokens = chunk_tokens
        self.counters = PipelineCounters()
        self.rank = parallel_state.get_pipeline_model_parallel_rank()
        self.size = parallel_state.get_pipeline_model_parallel_world_size()
        self.first = parallel_state.is_pipeline_first_stage()
        self.last = parallel_state.is_pipeline_last_stage()
        self.group = parallel_state.get_pipeline_model_parallel_group()
        self.last_rank = parallel_state.get_pipeline_model_parallel_last_rank()  # global: the loss's source
        tp = parallel_state.get_tensor_model_parallel_world_size()
        # The group a cell's claims are broadcast over: the first stage's TP ranks (the other stages do not claim).
        self.claim_group = parallel_state.get_tensor_model_parallel_group() if self.first and tp > 1 else None
        self.next_rank = None if self.last else parallel_state.get_pipeline_model_parallel_next_rank()
        self.prev_rank = None if self.first else parallel_state.get_pipeline_model_parallel_prev_rank()
        self.hidden_size = megatron_config.hidden_size
        self.dtype = megatron_config.pipeline_dtype or megatron_config.params_dtype
        self.device = next(model.parameters()).device
        self._sends: list[tuple[dist.Work, Tensor]] = []  # pending isends and their buffers
        self._pending: deque[tuple[int, int, MicroStep]] = deque()  # first stage: (kind, unit, step) to send
        self._score_unit = -1  # last stage: the unit whose s_i sums are in `_sums`
        self._sums: Tensor | None = None
        self._seq_ratio: Tensor | None = None
        self.routing_replay = False  # MoE: replay each micro-step's recorded routes (set by MegatronTrainable)

    # --- the schedule -------------------------------------------------------------------------------------------

    def run(self, claim: Claim) -> StepResult:
        """Forward and backward every micro-step of the stream through the pipeline; gradients add into `.grad`.

        claim: used on the first stage only (other stages learn everything from their upstream neighbour).
        Returns what this stage saw: units, micro-steps and tokens on every stage, the summed loss on the last."""
        result = StepResult()
        in_flight: deque[_InFlight] = deque()
        self._score_unit, self._sums, self._seq_ratio = -1, None, None  # unit indices restart every batch
        self.counters.warmups += 1
        ended = False
        while len(in_flight) < self.size - 1 - self.rank:  # warm-up: fill the pipeline
            step = self._next_train(claim, result)
            if step is None:
                ended = True
                break
            in_flight.append(self._forward(step, result))
        if not ended:  # steady state: one forward, one backward
            while (step := self._next_train(claim, result)) is not None:
                in_flight.append(self._forward(step, result))
                self._backward(in_flight.popleft())
        self.counters.drains += 1  # the stream is done: flush
        while in_flight:
            self._backward(in_flight.popleft())
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        self._reduce_tied_embedding()
        self._share_loss(result)
        return result

    def _next_train(self, claim: Claim, result: StepResult) -> tuple[Tensor | None, MicroStep, int] | None:
        """The next TRAIN micro-step's (input activation, step, unit), or None at END. SCORE and WAIT messages on
        the way are handled here (forwarded downstream) and do not count as pipeline forwards."""
        while True:
            kind, unit, step, input_BSH = self._receive() if not self.first else self._claimed(claim)
            if kind == END:
                self._send_header(END, unit)
                return None
            if kind == PAUSE:
                self.counters.pauses += 1
                self._send_header(PAUSE, unit)
                continue
            assert step is not None
            if not result.units or result.units[-1] != unit:
                result.units.append(unit)
            if kind == SCORE:
                self._score(step, unit, input_BSH)
                continue
            result.micro_steps += 1
            result.tokens += step.num_tokens
            return input_BSH, step, unit

    def _claimed(self, claim: Claim) -> tuple[int, int, MicroStep | None, None]:
        """First stage: the next message from the claimed units (claiming a new one when none is left)."""
        if not self._pending:
            claimed = claim()
            if claimed is None:
                return END, -1, None, None
            if claimed is WAIT:
                return PAUSE, -1, None, None
            index, unit = claimed
            if not unit:
                raise ValueError(f"claim unit {index} is empty: expected at least one micro-step")
            if any(step.has_split for step in unit):  # s_i over the whole unit first (Eq. 5)
                self._pending.extend((SCORE, index, step) for step in unit)
            self._pending.extend((TRAIN, index, step) for step in unit)
        kind, index, step = self._pending.popleft()
        return kind, index, step, None

    # --- compute ------------------------------------------------------------------------------------------------

    def _stage_forward(self, step: MicroStep, input_BSH: Tensor | None) -> Tensor:
        """This stage's forward over the packed rows in THD form (as `gyre.trainer.logprobs.packed_logprobs`):
        hidden states `[U, 1, hidden]`, the final-normed ones on the last stage."""
        U = step.num_tokens
        positions_U = packed_positions(step.row_offsets_R1, U).to(self.device)
        ids_1U = torch.from_numpy(step.ids_U).to(self.device)[None]
        if not self.first:
            self.model.set_input_tensor(input_BSH)
        routes = step_routes(step, self.model.decoder_config) if self.routing_replay else None
        set_model_routing(self.model, routes, U)
        params = thd_params(step.row_offsets_R1.tolist(), self.device)
        return self.model.final_hidden(ids_1U, positions_U[None], packed_seq_params=params)

    def _logprobs(self, step: MicroStep, hidden_U1C: Tensor) -> Tensor:
        """fp32 `[U]` log-probs from the last stage's hidden states (`gyre.trainer.logprobs.logprobs_from_hidden`)."""
        ids_U = torch.from_numpy(step.ids_U).to(self.device)
        positions_U = packed_positions(step.row_offsets_R1, step.num_tokens).to(self.device)
        return logprobs_from_hidden(
            self.model,
            hidden_U1C[:, 0],
            ids_U,
            positions_U,
            temperature=self.temperature,
            chunk_tokens=self.chunk_tokens,
        )

    def _score(self, step: MicroStep, unit: int, input_BSH: Tensor | None) -> None:
        """No-grad forward of the s_i pass; the last stage accumulates the sums of Eq. 5 by batch execution slot."""
        self.counters.score_forwards += 1
        with torch.no_grad():
            output = self._stage_forward(step, input_BSH)
            if not self.last:
                self._send_step(SCORE, unit, step, output)
                return
            if unit != self._score_unit:
                self._score_unit, self._seq_ratio = unit, None
                self._sums = torch.zeros(2, step.num_executions, dtype=torch.float64)
            assert self._sums is not None and self._seq_ratio is None, "SCORE after TRAIN of the same unit"
            add_sequence_sums(self._sums, step, self._logprobs(step, output).cpu())

    def _forward(self, train: tuple[Tensor | None, MicroStep, int], result: StepResult) -> _InFlight:
        input_BSH, step, unit = train
        self.counters.forwards += 1
        output = self._stage_forward(step, input_BSH)
        if not self.last:
            self._send_step(TRAIN, unit, step, output)
            return _InFlight(input_BSH, output)
        ratio_E = None
        if step.has_split:
            if self._score_unit != unit or self._sums is None:
                raise RuntimeError(f"unit {unit}: a micro-step with split executions arrived without its s_i pass")
            if self._seq_ratio is None:
                self._seq_ratio = finalize_sequence_ratio(self._sums[0], self._sums[1])
            ratio_E = self._seq_ratio[torch.from_numpy(step.batch_execution_E)]
        target = torch.from_numpy(step.target_U).to(self.device)
        logp_T = self._logprobs(step, output)[target].float()
        loss, metrics = policy_loss(logp_T, **loss_inputs_on(step, logp_T.device, ratio_E), config=self.config)
        result.loss += float(loss.detach())
        result.metrics.add(metrics)
        return _InFlight(input_BSH, loss)

    def _backward(self, item: _InFlight) -> None:
        """Backward of the oldest in-flight forward: receive its output gradient (non-last stage), backpropagate,
        send its input gradient upstream (non-first stage)."""
        self.counters.backwards += 1
        if self.last:
            torch.autograd.backward(item.output)
        else:
            grad = torch.empty_like(item.output)
            dist.recv(grad, src=self.next_rank, group=self.group, tag=BACKWARD_TAG)
            torch.autograd.backward(item.output, grad_tensors=grad)
        if not self.first:
            assert item.input_BSH is not None and item.input_BSH.grad is not None
            self._isend(item.input_BSH.grad.contiguous(), self.prev_rank, BACKWARD_TAG)

    def _reduce_tied_embedding(self) -> None:
        """Sum the tied embedding's gradient over its first-stage and last-stage copies (megatron's embedding group)."""
        if self.size == 1 or not getattr(self.model, "share_embeddings_and_output_weights", False):
            return
        if not parallel_state.is_rank_in_embedding_group():
            return
        weight = self.model.shared_embedding_or_output_weight()
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())

    def _share_loss(self, result: StepResult) -> None:
        """Every stage's `result` gets the last stage's loss and loss metrics (a broadcast over the pipeline group)."""
        shared = [result.loss, result.metrics.to_dict()] if self.last else [None, None]
        dist.broadcast_object_list(shared, src=self.last_rank, group=self.group, device=self._object_device())
        result.loss, result.metrics = float(shared[0]), LossMetricSums.from_dict(shared[1])

    def _object_device(self) -> torch.device | None:
        """Where `broadcast_object_list` stages its bytes: the GPU for an NCCL group, else the CPU."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return None

    # --- point-to-point -----------------------------------------------------------------------------------------

    def _isend(self, tensor: Tensor, dst: int | None, tag: int) -> None:
        assert dst is not None
        self._sends.append((dist.isend(tensor, dst=dst, group=self.group, tag=tag), tensor))
        self._sends = [(work, t) for work, t in self._sends if not work.is_completed()]

    def _send_header(self, kind: int, unit: int, num_tokens: int = 0, payload_bytes: int = 0) -> None:
        if not self.last:
            header = torch.tensor([kind, unit, num_tokens, payload_bytes], dtype=torch.int64)
            self._isend(header, self.next_rank, FORWARD_TAG)

    def _send_step(self, kind: int, unit: int, step: MicroStep, output_BSH: Tensor) -> None:
        payload = torch.frombuffer(bytearray(encode_unit((step,))), dtype=torch.uint8)
        self._send_header(kind, unit, step.num_tokens, payload.numel())
        self._isend(payload, self.next_rank, FORWARD_TAG)
        self._isend(output_BSH.detach().contiguous(), self.next_rank, FORWARD_TAG)

    def _receive(self) -> tuple[int, int, MicroStep | None, Tensor | None]:
        """Non-first stage: the next forward message from upstream (kind, unit, step, activation)."""
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        dist.recv(header, src=self.prev_rank, group=self.group, tag=FORWARD_TAG)
        kind, unit, num_tokens, payload_bytes = header.tolist()
        if kind in (END, PAUSE):
            return kind, unit, None, None
        payload = torch.empty(payload_bytes, dtype=torch.uint8)
        dist.recv(payload, src=self.prev_rank, group=self.group, tag=FORWARD_TAG)
        (step,) = decode_unit(payload.numpy().tobytes())
        input_BSH = torch.empty(num_tokens, 1, self.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(input_BSH, src=self.prev_rank, group=self.group, tag=FORWARD_TAG)
        return kind, unit, step, input_BSH.requires_grad_(kind == TRAIN)
