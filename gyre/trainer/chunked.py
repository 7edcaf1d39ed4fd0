"""Per-token log-probs from final hidden states, a chunk of tokens at a time: the `[tokens, vocab]` logits never
exist whole, in the forward or the backward.

Contract
- `chunked_token_logprobs(hidden_NC, targets_N, logits_of, chunk_tokens=, temperature=, vocab_parallel=)` returns
  fp32 `[N]`: `log softmax(logits_of(hidden_NC[n]) / temperature)[targets_N[n]]`, the same per-token value as
  computing all logits at once (cross entropy is per token; only the matmul's blocking differs, ~1e-7).
- `logits_of(h_nC)` gives the chunk's logits `[n, V]`, or `[n, V / TP]` with `vocab_parallel=True`, where the
  log-prob is minus megatron's `vocab_parallel_cross_entropy` (each TP rank holds a slice of the vocabulary; one
  all-reduce of the max and one of the sum per chunk). Logits are cast to fp32 inside the chunk.
- Memory: with gradients on, each chunk runs under `torch.utils.checkpoint` (non-reentrant): the forward keeps the
  chunk's `[n]` log-probs only, and the backward recomputes one chunk's logits at a time, so the peak is about
  three fp32 copies of `[chunk_tokens, V / TP]` (logits, their softmax, its gradient) on top of the hidden states,
  whatever N is. At V = 151,936 and 1,024 tokens a copy is 0.62 GB (docs/training.md, "Long rows").
- Every rank of a TP group must call it with the same N and `chunk_tokens` (the collectives run per chunk, and
  again in the backward).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = ["DEFAULT_CHUNK_TOKENS", "chunked_token_logprobs"]

DEFAULT_CHUNK_TOKENS = 1024


def chunked_token_logprobs(
    hidden_NC: Tensor,
    targets_N: Tensor,
    logits_of: Callable[[Tensor], Tensor],
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    temperature: float = 1.0,
    vocab_parallel: bool = False,
) -> Tensor:
    """fp32 `[N]` log-probs of `targets_N` under the logits of `hidden_NC` (see the module docstring)."""
    if not (isinstance(chunk_tokens, int) and chunk_tokens >= 1):
        raise ValueError(f"chunk_tokens={chunk_tokens!r} is not supported: expected a positive integer")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} is not supported: expected > 0")
    if hidden_NC.dim() != 2 or targets_N.shape != hidden_NC.shape[:1]:
        raise ValueError(
            f"hidden_NC {tuple(hidden_NC.shape)} and targets_N {tuple(targets_N.shape)}: expected [N, C] and [N]"
        )
    recompute = torch.is_grad_enabled() and hidden_NC.requires_grad
    parts = []
    for start in range(0, hidden_NC.shape[0], chunk_tokens):
        h_nC, t_n = hidden_NC[start : start + chunk_tokens], targets_N[start : start + chunk_tokens]
        if recompute:
            parts.append(
                checkpoint(_chunk_logprobs, h_nC, t_n, logits_of, temperature, vocab_parallel, use_reentrant=False)
            )
        else:
            parts.append(_chunk_logprobs(h_nC, t_n, logits_of, temperature, vocab_parallel))
    if not parts:
        return hidden_NC.new_zeros(0, dtype=torch.float32)
    return torch.cat(parts)


def _chunk_logprobs(
    h_nC: Tensor, t_n: Tensor, logits_of: Callable[[Tensor], Tensor], temperature: float, vocab_parallel: bool
) -> Tensor:
    logits_nV = logits_of(h_nC).float() / temperature  # a tensor of its own: megatron's CE works in place
    if vocab_parallel:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        return -vocab_parallel_cross_entropy(logits_nV[:, None].contiguous(), t_n[:, None])[:, 0]
    return -F.cross_entropy(logits_nV, t_n, reduction="none")
