"""Per-token log-probs of a packed micro-step from a Megatron `GPTModel` (`gyre.trainer.model`).

Contract (the conventions of `gyre.data.microstep`)
- Input: one packed row of U tokens `ids_U` holding R rows back to back, `row_offsets_R1` (R + 1 offsets, first 0,
  last U). Positions restart at 0 at every row (they set the RoPE angles), and no token attends across rows.
- One forward per micro-step over the packed tokens in THD form: `PackedSeqParams(qkv_format="thd")` with
  `cu_seqlens` = the row offsets, no attention mask. Megatron rotates each token by its own position (the model's
  RoPE table has one entry per packed token: megatron's offset-based THD mapping) and the core attention is
  causal within each row: TransformerEngine's varlen kernels under its layer spec, gyre's
  `SDPACoreAttention` (`gyre.trainer.attention`) under the local one. Nothing is `U x U`: no mask is built, and
  attention memory is linear in each row's length.
- Log-probs from the final hidden states a chunk of tokens at a time (`gyre.trainer.chunked`): the `[U, vocab]`
  logits never exist whole (`chunk_tokens` per chunk, fp32 inside it, recomputed chunk by chunk in the backward).
- Output: `logp_U[u] = log p(ids_U[u] | the tokens of its row before u)`, from the hidden state at u - 1, in fp32;
  0.0 at each row's first token (it has no context in its row). With `temperature != 1` the logits are divided by
  it first (the distribution a sampler at that temperature drew from; no top-k/top-p).
- Tensor parallel: the logits stay vocab-parallel and the log-prob is minus megatron's
  `vocab_parallel_cross_entropy` (an autograd function: gradients flow to the model). Every TP rank gets the
  same `logp_U`. Pipeline parallel forwards go through `gyre.trainer.pipeline` (the same THD forward per stage and
  `logprobs_from_hidden` on the last), not this function (ValueError).
- Mixture of experts, routing replay: `routed_experts_ULK` (integer `[U, num_hidden_layers, top_k]`, aligned with
  `ids_U`: the experts the engine chose for each token at each layer, entries of dense layers ignored, all -1 for a
  token it did not route) makes every MoE layer use those experts (`gyre.trainer.moe.set_routing_replay`); None:
  the routers choose. Either way the choice holds for this forward and its backward's recompute.
- `block_causal_mask` builds the dense mask the old path used; tests compare against it on short rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from gyre.data.microstep import MicroStep
from gyre.trainer.chunked import DEFAULT_CHUNK_TOKENS, chunked_token_logprobs
from gyre.trainer.cpu_patch import apply_cpu_patches
from gyre.trainer.moe import set_routing_replay

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


def gpt_model_of(model: torch.nn.Module) -> torch.nn.Module:
    """The `PositionIdGPTModel` inside megatron's wrappers (`DistributedDataParallel`, `Float16Module`: each holds
    it as `.module`). Its parameters are the wrapper's, so gradient hooks still fire."""
    inner = model
    while not hasattr(inner, "final_hidden") and isinstance(getattr(inner, "module", None), torch.nn.Module):
        inner = inner.module
    if not hasattr(inner, "final_hidden"):
        raise TypeError(f"{type(model).__name__}: expected gyre.trainer.model.PositionIdGPTModel (or a wrapper of it)")
    return inner


def thd_params(row_offsets: Sequence[int], device: torch.device | str) -> PackedSeqParams:
    """Megatron's THD description of packed rows: `cu_seqlens` (int32) = the row offsets, for queries and keys."""
    cu_R1 = torch.tensor(list(row_offsets), dtype=torch.int32, device=device)
    longest = int(cu_R1.diff().max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_R1, cu_seqlens_kv=cu_R1, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def packed_logprobs(
    model: torch.nn.Module,
    ids_U: Sequence[int] | np.ndarray | torch.Tensor,
    row_offsets_R1: Sequence[int] | np.ndarray | torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    routed_experts_ULK: torch.Tensor | np.ndarray | None = None,
) -> torch.Tensor:
    """fp32 `[U]`: log-prob of every token given its row before it (0.0 at row starts); see the module docstring."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError(
            "pipeline_model_parallel_size > 1: run the forward through gyre.trainer.pipeline; "
            "packed_logprobs handles PP = 1 only"
        )
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} is not supported: expected > 0")
    device = next(model.parameters()).device
    ids = torch.as_tensor(np.asarray(ids_U) if not isinstance(ids_U, torch.Tensor) else ids_U, dtype=torch.int64)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"ids_U must be a non-empty 1-D sequence of token ids, got shape {tuple(ids.shape)}")
    U = ids.numel()
    positions_U = packed_positions(row_offsets_R1, U).to(device)  # checks the offsets
    offsets = torch.as_tensor(np.asarray(row_offsets_R1), dtype=torch.int64).tolist()
    ids = ids.to(device)
    model = gpt_model_of(model)
    set_model_routing(model, routed_experts_ULK, U)
    hidden_U1C = model.final_hidden(ids[None], positions_U[None], packed_seq_params=thd_params(offsets, device))
    return logprobs_from_hidden(
        model, hidden_U1C[:, 0], ids, positions_U, temperature=temperature, chunk_tokens=chunk_tokens
    )


def set_model_routing(model: torch.nn.Module, routed_experts_ULK, num_tokens: int) -> None:
    """Routing replay for the next forward of `model` (a `PositionIdGPTModel` or a wrapper; its `decoder_config`):
    `routed_experts_ULK` for `num_tokens` tokens, or None (the routers choose). Every forward of a MoE model sets it,
    so no earlier micro-step's routes are replayed."""
    gpt = gpt_model_of(model)
    routes = None if routed_experts_ULK is None else torch.as_tensor(np.asarray(routed_experts_ULK))
    if routes is not None and (routes.dim() == 0 or routes.shape[0] != num_tokens):
        raise ValueError(
            f"routed_experts_ULK has {tuple(routes.shape)}: expected [U={num_tokens}, num_hidden_layers, top_k], one "
            "row per packed token"
        )
    if routes is not None or gpt.decoder_config.num_experts:
        set_routing_replay(gpt, routes, gpt.decoder_config)


def logprobs_from_hidden(
    model: torch.nn.Module,
    hidden_UC: torch.Tensor,
    ids_U: torch.Tensor,
    positions_U: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """fp32 `[U]` from the final hidden states of a packed row (`model.final_hidden`, the last pipeline stage's
    too): token u's log-prob from the hidden state at u - 1, 0.0 where a row starts (`positions_U == 0`); the
    logits through `model.output_logits`, vocab-parallel, a chunk at a time."""
    targets_N = torch.nonzero(positions_U != 0)[:, 0]  # never 0: a packed row starts at position 0
    logp_N = chunked_token_logprobs(
        hidden_UC[targets_N - 1],
        ids_U[targets_N],
        gpt_model_of(model).output_logits,
        chunk_tokens=chunk_tokens,
        temperature=temperature,
        vocab_parallel=True,
    )
    return torch.zeros(ids_U.shape[0], dtype=torch.float32, device=logp_N.device).index_put((targets_N,), logp_N)


def microstep_logprobs(
    model: torch.nn.Module,
    step: MicroStep,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    routed_experts_ULK: torch.Tensor | np.ndarray | None = None,
) -> torch.Tensor:
    """`packed_logprobs` of a `MicroStep`'s packed rows: `logp_U[step.target_U]` feeds `gyre.rl.policy_loss`."""
    return packed_logprobs(
        model,
        step.ids_U,
        step.row_offsets_R1,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
        routed_experts_ULK=routed_experts_ULK,
    )
