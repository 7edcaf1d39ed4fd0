"""Megatron's core-attention slot on torch's `scaled_dot_product_attention`: memory linear in the row's length.

Megatron's local layer spec computes attention as `softmax(QK^T) V` with the full `[b, heads, s, s]` score matrix
(`megatron.core.transformer.dot_product_attention.DotProductAttention`), and refuses packed (THD) input.
`SDPACoreAttention` takes its place in the spec (`gyre.trainer.model.build_gpt_model`): same constructor and
`forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)`, same output.

Contract
- THD (`packed_seq_params.qkv_format == "thd"`): query `[T, heads / tp, d]`, key and value `[T, groups / tp, d]`,
  `cu_seqlens_q` the row offsets; each row attends causally to itself only (one SDPA call per row, `is_causal`).
  Output `[T, heads / tp * d]` (megatron's attention reshapes it to `[T, 1, hidden / tp]`).
- SBHD (no packed params): `[s, b, heads / tp, d]`; causal when `attention_mask` is None, else the mask in
  megatron's convention (True = masked out), as the local spec's module. Output `[s, b, heads / tp * d]`.
- GQA: each key/value head serves `heads / groups` query heads in megatron's (and HF's) order.
- Scale `softmax_scale`, else `1 / sqrt(d)` (megatron's default); no dropout (gyre trains with 0); no attention
  bias, no context parallelism (TransformerEngine's attention does that: `gyre.trainer.model`).
- Memory: without a mask SDPA runs a fused kernel (flash attention on CPU and CUDA) that never forms the score
  matrix; measured by `benchmarks/long_rows.py`.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

__all__ = ["SDPACoreAttention"]


class SDPACoreAttention(MegatronModule):
    """Causal attention per packed row (THD) or per sequence (SBHD) through SDPA; see the module docstring."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                f"context_parallel_size={config.context_parallel_size}: gyre's SDPA attention runs without context "
                "parallelism; expected 1 (context parallelism needs TransformerEngine's attention)"
            )
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout={dropout!r}: gyre's SDPA attention has no dropout; expected 0.0")
        if pg_collection is not None:
            tp = pg_collection.tp.size()
        else:
            tp = parallel_state.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = (config.num_query_groups or config.num_attention_heads) // tp
        self.softmax_scale = softmax_scale
        self.layer_number, self.attn_mask_type = layer_number, attn_mask_type

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by gyre's SDPA attention: expected None")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed_rows(query, key, value, packed_seq_params.cu_seqlens_q)
        if packed_seq_params is not None:
            raise ValueError(f"qkv_format={packed_seq_params.qkv_format!r}: expected 'thd' (or no packed params)")
        s, b = query.shape[:2]
        q_BHSD, k_BHSD, v_BHSD = (self._heads(x).permute(1, 2, 0, 3) for x in (query, key, value))
        # megatron's mask: True = masked out; SDPA's: True = may attend
        mask = None if attention_mask is None else ~attention_mask
        out = F.scaled_dot_product_attention(
            q_BHSD, k_BHSD, v_BHSD, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale
        )
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _packed_rows(self, q_THD: Tensor, k_TGD: Tensor, v_TGD: Tensor, cu_seqlens: Tensor) -> Tensor:
        k_THD, v_THD = self._heads(k_TGD), self._heads(v_TGD)
        outs = []
        for start, end in itertools.pairwise(cu_seqlens.tolist()):
            q, k, v = (x[start:end].transpose(0, 1)[None] for x in (q_THD, k_THD, v_THD))  # [1, H, L, D]
            outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)[0])
        return torch.cat([out.transpose(0, 1) for out in outs]).reshape(q_THD.shape[0], -1)

    def _heads(self, x: Tensor) -> Tensor:
        """Key or value heads repeated to one per query head (megatron's `repeat_interleave` order); a query as is."""
        repeat = self.heads // self.groups
        if x.shape[-2] == self.heads or repeat == 1:
            return x
        return x.repeat_interleave(repeat, dim=-2)
