"""Per-token log-probs of a packed micro-step from a Megatron `GPTModel` (`gyre.train.model`).

Contract (the conventions of `gyre.data.microstep`)
- Input: one packed row of U tokens `ids_U` holding R rows back to back, `row_offsets_R1` (R + 1 offsets, first 0,
  last U). Positions restart at 0 at every row (they set the RoPE angles), and no token attends across rows. Each
  row runs its own forward with a causal mask (megatron's local attention is dense: one forward over the packed
  tokens under a block-diagonal mask costs U^2 instead of the sum of the rows' squared lengths). The mask is
  always passed explicitly (megatron's default causal mask is built on "cuda"; on CPU it must come from the
  caller). Megatron's mask convention is True = masked out.
- Output: `logp_U[u] = log p(ids_U[u] | the tokens of its row before u)`, from the logits at u - 1, in fp32;
  0.0 at each row's first token (it has no context in its row). With `temperature != 1` the logits are divided by
  it first (the distribution a sampler at that temperature drew from; no top-k/top-p).
- Tensor parallel: the logits stay vocab-parallel and the log-prob is minus megatron's
  `vocab_parallel_cross_entropy` (an autograd function: gradients flow to the model). Every TP rank gets the
  same `logp_U`. Pipeline parallel forwards go through megatron's schedules, not this function (ValueError).
- Verified with megatron's local layer spec (CPU). Under TransformerEngine's spec the packed tokens should go in
  one forward as THD with `cu_seqlens = row_offsets_R1` (varlen attention, no U^2 term): not done or run here (no
  GPU). The pipeline path (`gyre.train.pipeline`) still sends one packed forward with the block mask per stage.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from gyre.data.microstep import MicroStep
from gyre.train.cpu_patch import apply_cpu_patches

apply_cpu_patches()  # before megatron runs anything (CPU-only torch; no-op with CUDA)


def packed_positions(row_offsets_R1: Sequence[int] | np.ndarray | torch.Tensor, num_tokens: int) -> torch.Tensor:
    """int64 `[U]`: each token's position within its row (0 at every row start)."""
    offsets = torch.as_tensor(np.asarray(row_offsets_R1), dtype=torch.int64)
    if offsets.dim() != 1 or offsets.numel() < 2 or offsets[0] != 0 or offsets[-1] != num_tokens:
        raise ValueError(
            f"row_offsets_R1={offsets.tolist()} is not valid: expected [0, ..., U={num_tokens}] (R + 1 offsets)"
        )
    lengths = offsets.diff()
    if (lengths <= 0).any():
        raise ValueError(f"row_offsets_R1={offsets.tolist()} is not valid: expected strictly increasing offsets")
    starts_U = torch.repeat_interleave(offsets[:-1], lengths)
    return torch.arange(num_tokens, dtype=torch.int64) - starts_U


def block_causal_mask(positions_U: torch.Tensor) -> torch.Tensor:
    """Bool `[1, 1, U, U]` in megatron's convention (True = may NOT attend): causal within each row, nothing across."""
    segment_U = (positions_U == 0).long().cumsum(0)
    U = positions_U.shape[0]
    same_UU = segment_U[:, None] == segment_U[None, :]
    causal_UU = torch.ones(U, U, dtype=torch.bool, device=positions_U.device).tril()
    return ~(same_UU & causal_UU)[None, None]


def packed_logprobs(
    model: torch.nn.Module,
    ids_U: Sequence[int] | np.ndarray | torch.Tensor,
    row_offsets_R1: Sequence[int] | np.ndarray | torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """fp32 `[U]`: log-prob of every token given its row before it (0.0 at row starts); see the module docstring."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError(
            "pipeline_model_parallel_size > 1: run the forward through megatron's get_forward_backward_func; "
            "packed_logprobs handles PP = 1 only"
        )
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} is not supported: expected > 0")
    device = next(model.parameters()).device
    ids = torch.as_tensor(np.asarray(ids_U) if not isinstance(ids_U, torch.Tensor) else ids_U, dtype=torch.int64)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"ids_U must be a non-empty 1-D sequence of token ids, got shape {tuple(ids.shape)}")
    U = ids.numel()
    positions_U = packed_positions(row_offsets_R1, U)  # checks the offsets
    offsets = torch.as_tensor(np.asarray(row_offsets_R1), dtype=torch.int64).tolist()
    # One forward per row: the local spec computes attention densely, so one forward of the packed U tokens under a
    # block mask would cost U^2 per layer instead of sum L_r^2 (4.2x slower at 4096-token micro-steps of ~400-token
    # rows, benchmarks/train_throughput.py). Rows never attend across each other, so the result is the same.
    parts = []
    for start, end in itertools.pairwise(offsets):
        if end - start == 1:  # a one-token row has no target
            parts.append(torch.zeros(1, dtype=torch.float32, device=device))
            continue
        row_positions = positions_U[start:end].to(device)
        ids_1L = ids[start:end].to(device)[None]
        logits_1LV = model(ids_1L, row_positions[None], block_causal_mask(row_positions))  # [1, L, V / tp]
        parts.append(logprobs_from_logits(logits_1LV, ids_1L, row_positions, temperature=temperature))
    return torch.cat(parts)


def logprobs_from_logits(
    logits_1UV: torch.Tensor, ids_1U: torch.Tensor, positions_U: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """fp32 `[U]` from the (vocab-parallel) logits of a packed row: token u's log-prob from the logits at u - 1,
    0.0 where a row starts (`positions_U == 0`). Also the last pipeline stage's step (`gyre.train.pipeline`)."""
    # Megatron's CE is [S, B]-shaped and subtracts the max in place: give it its own fp32 tensor.
    logits_S1V = (logits_1UV[:, :-1].float() / temperature).transpose(0, 1).contiguous()
    nll_S1 = vocab_parallel_cross_entropy(logits_S1V, ids_1U[:, 1:].transpose(0, 1).contiguous())
    logp_U = torch.cat((torch.zeros(1, dtype=torch.float32, device=logits_1UV.device), -nll_S1[:, 0]))
    return torch.where(positions_U == 0, torch.zeros_like(logp_U), logp_U)


def microstep_logprobs(model: torch.nn.Module, step: MicroStep, *, temperature: float = 1.0) -> torch.Tensor:
    """`packed_logprobs` of a `MicroStep`'s packed rows: `logp_U[step.target_U]` feeds `gyre.rl.policy_loss`."""
    return packed_logprobs(model, step.ids_U, step.row_offsets_R1, temperature=temperature)
