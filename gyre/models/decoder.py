"""The decoder both sides run: a pure-torch Llama/Qwen2/Qwen3-style causal LM (dense, or Qwen3-MoE / Qwen2-MoE
sparse) with an explicit KV cache.

The trainer (`gyre.trainer`) and the native engine (`gyre.engine`) import this one module; it imports neither.

Contract
- `DecoderLM(config)(input_ids_BT, positions_BT, kv_cache=None, attention_mask=None)` returns
  `(logits_BTV, kv_cache)`. Positions are explicit (RoPE angle = position * frequency), so a row may hold
  several packed sequences whose positions restart at 0, or continue a request from any offset.
- `kv_cache` holds, per layer, the keys (RoPE already applied) and values of every earlier token of each row:
  `[B, num_key_value_heads, S_past, head_dim]`. The returned cache is a new object holding past + these
  tokens; the input cache is not modified, so a caller can keep, fork or drop it per request. Exception, for
  callers that preallocate: with `kv_cache_length=n` the cache tensors are buffers of which the first n
  positions are past tokens; the call writes its keys and values in place after them (no copy of the past).
- Without `attention_mask`, token t of the call attends to every cached token and to the call's tokens up to t
  (causal in cache order). With it, `attention_mask` is a bool `[B, T, S_past + T]` (or `[B, 1, T, S]`),
  True = may attend; `block_causal_mask(segment_ids_BT)` builds the block-diagonal mask for packed rows.
  A query row with no True entry has no defined output (softmax over nothing): give every query a key.
- Parameter names equal HF's (`model.layers.0.self_attn.q_proj.weight`, ...), so checkpoints and weight updates
  by name need no translation. With tied embeddings there is no `lm_head` parameter.
- The projections are plain `nn.Linear`s; q|k|v and gate|up are computed through the seams
  `Attention.project_qkv` and `MLP.project_gate_up` (the linears' outputs side by side). An inference engine may
  replace them per instance by one matmul over stacked weights (`gyre.engine.decode.stack_projections`, whose
  stack becomes the storage of the named parameters: copy them before writing them to safetensors); the model
  itself carries no inference trick.
- Training: `DecoderLM.final_hidden(input_ids_BT, positions_BT, recompute=)` is the causal forward without a
  cache up to the final norm (`[B, T, hidden]`; `output_weight` projects it to logits), so a trainer can take
  log-probs a chunk of tokens at a time (`gyre.trainer.chunked`). `recompute` (`RECOMPUTE`): none; selective (each
  layer's attention block runs under `torch.utils.checkpoint`: its activations are recomputed in the backward);
  full (each whole layer).
- Mixture of experts (`config.num_experts > 0`): layer i carries a `SparseMoeBlock` where `config.is_moe_layer(i)`
  (transformers' Qwen3MoeSparseMoeBlock / Qwen2MoeSparseMoeBlock math, HF names `mlp.gate.weight`,
  `mlp.experts.{j}.{gate,up,down}_proj.weight`, qwen2_moe's `mlp.shared_expert.*` and `mlp.shared_expert_gate`).
  Routing replay: `forward` and `final_hidden` take `routed_experts_BTLK`, integer `[B, T, num_hidden_layers, top_k]`
  expert ids (entries of the layers that are not MoE are ignored; SGLang writes -1 there); each MoE layer then uses
  those experts instead of its router's top-k, weighted by the router's softmax probabilities at those ids
  (renormalized when `norm_topk_prob`), so the choice is replayed and the weights stay differentiable; a token whose
  ids at a layer are all -1 (not routed by the engine) takes the router's own top-k there.
  `forward(..., return_routed_experts=True)` returns a third value, the experts the routers chose (or replayed):
  int32 `[B, T, num_hidden_layers, top_k]`, -1 at layers that are not MoE. A dense model takes neither (ValueError);
  its path is unchanged. See docs/moe.md.
- Device-agnostic: everything follows the device of the parameters and inputs; no CUDA calls. Token ids are
  not range-checked here (that costs a device sync); the engine validates requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, overload

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gyre.models.decoder_config import DecoderConfig, RopeScaling

RECOMPUTE = ("none", "selective", "full")  # activation recompute in `DecoderLM.final_hidden`


@dataclass(frozen=True)
class KVCache:
    """Keys (RoPE applied) and values per layer, each `[B, num_key_value_heads, S, head_dim]`."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def length(self) -> int:
        """Tokens cached per row (S)."""
        return self.keys[0].shape[2] if self.keys else 0


def block_causal_mask(segment_ids_BT: torch.Tensor) -> torch.Tensor:
    """Bool `[B, T, T]`: token i may attend to token j iff j <= i and both belong to the same segment."""
    if segment_ids_BT.dim() != 2:
        raise ValueError(f"segment_ids_BT must be [B, T], got shape {tuple(segment_ids_BT.shape)}")
    T = segment_ids_BT.shape[1]
    same_BTT = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=segment_ids_BT.device).tril()
    return same_BTT & causal_TT


def segments_from_positions(positions_BT: torch.Tensor) -> torch.Tensor:
    """Segment ids `[B, T]` of packed rows: a new segment starts wherever the position is 0."""
    return (positions_BT == 0).long().cumsum(dim=1)


def rope_inv_freq(config: DecoderConfig, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies `[head_dim / 2]` in fp32 (HF: theta ** -(2i / head_dim), then rope scaling)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    scaling = config.rope_scaling
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor  # same as dividing positions by factor
    elif scaling.rope_type == "llama3":
        # transformers `_compute_llama3_parameters`: long wavelengths slowed by `factor`, short ones kept,
        # the band between interpolated smoothly.
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif scaling.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(config.rope_theta, dim, scaling, device)
    return inv_freq


def _yarn_inv_freq(theta: float, dim: int, scaling: RopeScaling, device: torch.device | None) -> torch.Tensor:
    """YaRN (transformers `_compute_yarn_parameters`): frequencies that turn more than `beta_fast` times over the
    original context are kept, those under `beta_slow` divided by `factor`, a linear ramp over the dimensions
    between; cos and sin are then multiplied by `scaling.attention_scaling()` (`DecoderLM.rope_tables`)."""

    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: extrapolated (frequency kept), 0: interpolated (divided by factor)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)
    return 1.0 / (scaling.factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept


def rope_cos_sin(
    positions_BT: torch.Tensor, inv_freq_D: torch.Tensor, sign_D: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin `[B, T, 1, head_dim]` in `dtype` for `apply_rope`, from `DecoderLM.rope_tables`; both
    multiplied by `scale` in fp32 first (YaRN's attention factor, `RopeScaling.attention_scaling`; 1.0 otherwise)."""
    emb_BT1D = positions_BT.float()[:, :, None, None] * inv_freq_D
    cos, signed_sin = emb_BT1D.cos(), emb_BT1D.sin() * sign_D
    if scale != 1.0:
        cos, signed_sin = cos * scale, signed_sin * scale
    return cos.to(dtype), signed_sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE in HF's convention (the pairs rotated together are (i, i + head_dim/2)): `x * cos + rotate_half(x) *
    sin` with rotate_half(x) = cat(-x2, x1), computed as `x * cos + roll(x, half) * signed_sin` where `signed_sin` is
    sin with its first half negated: the same products exactly (only signs move), in fewer ops per call.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, normalized in fp32 and cast back before the weight (HF order)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without its weight: normalized in fp32, cast back to x's dtype (the weight is applied after, in HF)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def attend_one_query(q_BHTD, k_BKSD, v_BKSD, bias_B11S: torch.Tensor | None) -> torch.Tensor:
    """Attention of one query token per row (T = 1) as plain matmuls; `bias_B11S` is 0 / -inf (or None: no mask).

    With a single query the `groups` query heads of a KV head stack into a `[groups, D]` matrix against that head's
    keys (GQA without copying keys), and the mask row broadcasts over them. For decode at small head_dim this is
    ~2x cheaper on CPU than `F.scaled_dot_product_attention`'s kernel; the softmax runs in fp32.
    """
    B, H, T, D = q_BHTD.shape
    K = k_BKSD.shape[1]
    q_BKGD = q_BHTD.reshape(B, K, H // K * T, D) * (1.0 / math.sqrt(D))
    scores_BKGS = torch.matmul(q_BKGD, k_BKSD.transpose(-1, -2)).float()
    if bias_B11S is not None:
        scores_BKGS = scores_BKGS + bias_B11S
    probs_BKGS = scores_BKGS.softmax(dim=-1).to(v_BKSD.dtype)
    return torch.matmul(probs_BKGS, v_BKSD).reshape(B, H, T, D)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm.forward` with its weight given."""
    if x.dtype == torch.float32 == weight.dtype:  # no cast to order around: one call, the same products
        return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)
    return weight * rms_normalize(x, eps)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        qkv_bias = config.attention_qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_out_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project_qkv(self, x_BTC: torch.Tensor) -> torch.Tensor:
        """q|k|v side by side `[B, T, (H + 2K) * D]`. A seam: an engine may replace it per instance by one matmul
        over the stacked weights (`gyre.engine.decode.stack_projections`); the output is the same layout."""
        return torch.cat((self.q_proj(x_BTC), self.k_proj(x_BTC), self.v_proj(x_BTC)), dim=-1)

    def forward(
        self,
        x_BTC: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
        write_at: int | None = None,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """`cos`/`signed_sin` are `[B, T, 1, D]`; `bias` is `mask` as 0 / -inf, used by the one-query path."""
        B, T, _ = x_BTC.shape
        H, K, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv_BTND = self.project_qkv(x_BTC).view(B, T, H + 2 * K, D)
        # q and k heads side by side ([B, T, H + K, D]): normalized and rotated in one call each, not two.
        qk_BTND = qkv_BTND[:, :, : H + K]
        if self.q_norm is not None:  # qwen3: per-head RMSNorm before RoPE
            normed_BTND = rms_normalize(qk_BTND, self.q_norm.eps)
            qk_BTND = torch.cat(
                (self.q_norm.weight * normed_BTND[:, :, :H], self.k_norm.weight * normed_BTND[:, :, H:]), 2
            )
        qk_BTND = apply_rope(qk_BTND, cos, signed_sin)
        q_BHTD = qk_BTND[:, :, :H].transpose(1, 2)
        k_BKTD = qk_BTND[:, :, H:].transpose(1, 2)
        v_BKTD = qkv_BTND[:, :, H + K :].transpose(1, 2)
        if write_at is not None:  # buffers with room: write this call's keys/values in place, no copy of the past
            end = write_at + T
            past[0][:, :, write_at:end] = k_BKTD
            past[1][:, :, write_at:end] = v_BKTD
            k_BKSD, v_BKSD = past[0][:, :, :end], past[1][:, :, :end]
        elif past is not None:
            k_BKSD = torch.cat((past[0], k_BKTD), dim=2)
            v_BKSD = torch.cat((past[1], v_BKTD), dim=2)
        else:
            k_BKSD, v_BKSD = k_BKTD, v_BKTD
        if T == 1:  # decode: plain matmuls beat the fused attention kernel at this size
            out_BHTD = attend_one_query(q_BHTD, k_BKSD, v_BKSD, bias)
        else:
            # No mask and no past (or an empty buffer with room): causal over this call's tokens.
            is_causal = mask is None and (past is None or write_at == 0)
            out_BHTD = self._attend(q_BHTD, k_BKSD, v_BKSD, mask, is_causal=is_causal)
        out_BTC = out_BHTD.transpose(1, 2).reshape(B, T, H * D)
        return self.o_proj(out_BTC), (k_BKSD, v_BKSD)

    def _attend(self, q_BHTD, k_BKSD, v_BKSD, mask, *, is_causal: bool) -> torch.Tensor:
        """GQA attention: query head h reads key/value head h // groups (HF repeat_kv order)."""
        groups = self.num_heads // self.num_kv_heads
        if groups == 1:
            return F.scaled_dot_product_attention(q_BHTD, k_BKSD, v_BKSD, attn_mask=mask, is_causal=is_causal)
        if is_causal:
            return F.scaled_dot_product_attention(q_BHTD, k_BKSD, v_BKSD, is_causal=True, enable_gqa=True)
        # Without a causal flag each query attends independently, so the `groups` query heads sharing a KV head
        # can be stacked along the query axis: one attention per KV head, no copy of the keys and values.
        B, H, T, D = q_BHTD.shape
        q_BKQD = q_BHTD.reshape(B, self.num_kv_heads, groups * T, D)
        if mask is not None:
            mask = mask[:, :, None].expand(B, mask.shape[1], groups, T, mask.shape[-1]).flatten(2, 3)
        out_BKQD = F.scaled_dot_product_attention(q_BKQD, k_BKSD, v_BKSD, attn_mask=mask)
        return out_BKQD.reshape(B, H, T, D)  # reshape: some attention kernels return non-contiguous outputs


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), `intermediate_size` wide (default: the config's dense width)."""

    def __init__(self, config: DecoderConfig, intermediate_size: int | None = None):
        super().__init__()
        bias = config.mlp_bias
        width = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=bias)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=bias)

    def project_gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """gate|up side by side `[..., 2 * intermediate_size]`; a seam like `Attention.project_qkv`."""
        return torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project_gate_up(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def route_tokens(
    router_logits_NE: torch.Tensor, top_k: int, norm_topk_prob: bool, routed_NK: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights `[N, top_k]` (in the logits' dtype) and expert ids `[N, top_k]` (int64) of N tokens.

    Transformers' Qwen3MoeTopKRouter: softmax of the router logits in fp32, the top-k probabilities, divided by
    their sum when `norm_topk_prob`, cast back to the logits' dtype. With `routed_NK` (replay) the experts are
    those ids and the weights the softmax probabilities at them, normalized alike: differentiable in the logits. A
    token whose ids are all -1 (`NO_ROUTE`: the engine did not route it) takes the router's own top-k.
    """
    probs_NE = F.softmax(router_logits_NE, dim=-1, dtype=torch.float32)
    if routed_NK is None:
        weights_NK, experts_NK = torch.topk(probs_NE, top_k, dim=-1)
    else:
        experts_NK = routed_NK.long()
        unrouted_N1 = (experts_NK == -1).all(dim=-1, keepdim=True)  # NO_ROUTE (gyre.trainer.routing)
        if bool(unrouted_N1.any()):
            experts_NK = torch.where(unrouted_N1, torch.topk(probs_NE, top_k, dim=-1).indices, experts_NK)
        weights_NK = probs_NE.gather(-1, experts_NK)
    if norm_topk_prob:
        weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
    return weights_NK.to(router_logits_NE.dtype), experts_NK


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's sparse block (and Qwen2-MoE's, with its sigmoid-gated shared expert): a router `gate`
    (hidden -> num_experts, no bias) picks `num_experts_per_tok` SwiGLU experts per token (`route_tokens`); the
    output is their outputs weighted by the routing weights, summed, plus `sigmoid(shared_expert_gate(x)) *
    shared_expert(x)` for qwen2_moe.

    Each expert runs once over the tokens routed to it (gathered by index, added back with `index_add_`), in
    transformers' order: experts ascending, within one the top-k slot, then the token. No `[N, E, C]` tensor.
    """

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config, config.moe_intermediate_size) for _ in range(config.num_experts))
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x_BTC: torch.Tensor, routed_NK: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output `[B, T, C]` and the experts used `[B * T, top_k]` (int64); `routed_NK` replays
        expert ids `[B * T, top_k]` (distinct per token, in [0, num_experts)) instead of the router's top-k."""
        B, T, C = x_BTC.shape
        x_NC = x_BTC.reshape(B * T, C)
        if routed_NK is not None:
            self._check_routed(routed_NK, B * T)
        weights_NK, experts_NK = route_tokens(self.gate(x_NC), self.top_k, self.norm_topk_prob, routed_NK)
        out_NC = torch.zeros_like(x_NC)
        # Entries (slot k, token n) flattened slot-major and sorted by expert (stable): each expert's entries are
        # contiguous and in transformers' order. One host sync for the counts, as transformers' nonzero.
        flat_M = experts_NK.t().reshape(-1)
        order_M = flat_M.argsort(stable=True)
        counts = torch.bincount(flat_M, minlength=self.num_experts).tolist()
        N = B * T
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            entries = order_M[start : start + count]
            start += count
            tokens, slots = entries % N, entries // N
            y_nC = self.experts[expert](x_NC[tokens]) * weights_NK[tokens, slots, None]
            out_NC.index_add_(0, tokens, y_nC.to(out_NC.dtype))
        if self.shared_expert is not None:
            out_NC = out_NC + F.sigmoid(self.shared_expert_gate(x_NC)) * self.shared_expert(x_NC)
        return out_NC.reshape(B, T, C), experts_NK

    def _check_routed(self, routed_NK: torch.Tensor, N: int) -> None:
        if routed_NK.shape != (N, self.top_k) or routed_NK.is_floating_point():
            raise ValueError(
                f"routed experts of a layer must be integer [{N}, top_k={self.top_k}], "
                f"got {routed_NK.dtype} {tuple(routed_NK.shape)}"
            )
        sorted_NK = routed_NK.sort(dim=-1).values
        routed_N = ~(routed_NK == -1).all(dim=-1)  # a row of all -1 is not routed: the router chooses (route_tokens)
        bad = (sorted_NK[:, 0] < 0) | (sorted_NK[:, -1] >= self.num_experts)
        if self.top_k > 1:
            bad |= (sorted_NK[:, 1:] == sorted_NK[:, :-1]).any(dim=-1)
        bad &= routed_N
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"routed experts {routed_NK[row].tolist()} (token {row} of the layer): expected {self.top_k} "
                f"distinct expert ids in [0, {self.num_experts}), or all -1 (not routed: the router chooses)"
            )


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); `mlp` is a `SparseMoeBlock` where
    `config.is_moe_layer(index)`, else the dense `MLP`."""

    def __init__(self, config: DecoderConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.is_moe = config.is_moe_layer(index)
        self.mlp = SparseMoeBlock(config) if self.is_moe else MLP(config)

    def forward(self, x, cos, signed_sin, past, mask, write_at=None, bias=None, routed_NK=None):
        """`(x, (keys, values), experts_NK)`; `experts_NK` is None for a dense layer."""
        attn_out, kv = self.self_attn(self.input_layernorm(x), cos, signed_sin, past, mask, write_at, bias)
        x = x + attn_out
        mlp_out, experts_NK = self.feed_forward(x, routed_NK)
        return x + mlp_out, kv, experts_NK

    def feed_forward(
        self, x: torch.Tensor, routed_NK: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`mlp(norm(x))` and the experts used (None for a dense layer)."""
        if self.is_moe:
            return self.mlp(self.post_attention_layernorm(x), routed_NK)
        return self.mlp(self.post_attention_layernorm(x)), None

    def attention_block(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """`attn(norm(x))`, causal, without a cache (training)."""
        return self.self_attn(self.input_layernorm(x), cos, signed_sin, None, None)[0]

    def train_forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        recompute: str,
        routed_NK: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's causal forward without a cache (training), with `recompute` (`RECOMPUTE`); `routed_NK`
        replays a MoE layer's experts (`SparseMoeBlock.forward`)."""
        if recompute == "full":
            return checkpoint(self._train_forward, x, cos, signed_sin, routed_NK, use_reentrant=False)
        if recompute == "selective":
            x = x + checkpoint(self.attention_block, x, cos, signed_sin, use_reentrant=False)
        else:
            x = x + self.attention_block(x, cos, signed_sin)
        return x + self.feed_forward(x, routed_NK)[0]

    def _train_forward(self, x, cos, signed_sin, routed_NK=None):
        x = x + self.attention_block(x, cos, signed_sin)
        return x + self.feed_forward(x, routed_NK)[0]


class DecoderStack(nn.Module):
    """Embedding, layers and final norm; named `model` inside `DecoderLM` so parameter names equal HF's."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        # Not initialized here: every builder sets all weights (`build_model`) or loads them onto the meta-device
        # model (`load_pretrained`). nn.Embedding's own normal_ init on the meta device runs through torch's Python
        # refs, which import torch._dynamo: ~1 s of every `gyre.serve` / engine start-up for numbers never read.
        weight = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderLM(nn.Module):
    """Causal LM over `DecoderStack`; see the module docstring for the forward contract.

    `DecoderLM(config)` leaves the embedding uninitialized (see `DecoderStack`): build a model with `build_model`
    (random init) or `gyre.models.hf_weights.load_pretrained` (a checkpoint), which set every weight."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        # Tied: logits use model.embed_tokens.weight; no separate parameter exists (nor in state_dict).
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, False)
        self._rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None  # (inv_freq twice, sign) on one device

    def rope_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`(inv_freq_D, sign_D)` on `device`: the inverse frequencies twice (`[head_dim]`, fp32) and the sign
        pattern of `apply_rope`'s signed sin (first half -1). Computed once per device and kept (not buffers: not
        in `state_dict`)."""
        if self._rope_tables is None or self._rope_tables[0].device != device:
            with torch.inference_mode(False):  # kept across calls: a normal tensor even if made in inference mode
                inv_freq = rope_inv_freq(self.config, device=device)
                half = inv_freq.shape[0]
                sign = torch.cat((-torch.ones(half, device=device), torch.ones(half, device=device)))
                self._rope_tables = (torch.cat((inv_freq, inv_freq)), sign)
        return self._rope_tables

    def _rope(self, positions_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (first half negated, for `apply_rope`) `[B, T, 1, head_dim]` in `dtype`.

        The same fp32 products as HF's cos/sin; with the kept `rope_tables` a forward costs a multiply, cos and sin.
        """
        inv_freq_D, sign_D = self.rope_tables(positions_BT.device)
        return rope_cos_sin(positions_BT, inv_freq_D, sign_D, self.config.rope_scaling.attention_scaling(), dtype)

    def final_hidden(
        self,
        input_ids_BT: torch.Tensor,
        positions_BT: torch.Tensor,
        *,
        recompute: str = "none",
        routed_experts_BTLK: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`[B, T, hidden]`: the causal forward without a cache, up to the final norm (what `forward` projects
        to logits with `output_weight`). `recompute`: `RECOMPUTE` (module docstring); it acts only while
        gradients are recorded. `routed_experts_BTLK`: routing replay (module docstring; MoE models only)."""
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute={recompute!r} is not supported: expected one of {', '.join(RECOMPUTE)}")
        self._check_inputs(input_ids_BT, positions_BT, None, None)
        routed = self._routed_per_layer(routed_experts_BTLK, input_ids_BT.shape)
        if not torch.is_grad_enabled():
            recompute = "none"
        x_BTC = self.model.embed_tokens(input_ids_BT)
        cos, signed_sin = self._rope(positions_BT.to(x_BTC.device), x_BTC.dtype)
        for i, layer in enumerate(self.model.layers):
            x_BTC = layer.train_forward(x_BTC, cos, signed_sin, recompute, routed[i] if routed else None)
        return self.model.norm(x_BTC)

    def _routed_per_layer(
        self, routed_experts_BTLK: torch.Tensor | None, shape_BT: torch.Size
    ) -> list[torch.Tensor | None] | None:
        """Per layer, the `[B * T, top_k]` expert ids to replay (None at dense layers); None without replay."""
        if routed_experts_BTLK is None:
            return None
        config = self.config
        if config.num_experts == 0:
            raise ValueError("routed_experts_BTLK is given but the model is dense (num_experts=0): nothing to route")
        expected = (*shape_BT, config.num_hidden_layers, config.num_experts_per_tok)
        if tuple(routed_experts_BTLK.shape) != expected or routed_experts_BTLK.is_floating_point():
            raise ValueError(
                f"routed_experts_BTLK must be an integer [B, T, num_hidden_layers, num_experts_per_tok] = "
                f"{list(expected)} tensor, got {routed_experts_BTLK.dtype} {list(routed_experts_BTLK.shape)}"
            )
        B, T = shape_BT
        device = self.model.embed_tokens.weight.device
        return [
            routed_experts_BTLK[:, :, i].reshape(B * T, -1).to(device) if layer.is_moe else None
            for i, layer in enumerate(self.model.layers)
        ]

    @property
    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @overload
    def forward(
        self,
        input_ids_BT: torch.Tensor,
        positions_BT: torch.Tensor,
        kv_cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
        num_logits_to_keep: int = 0,
        kv_cache_length: int | None = None,
        *,
        routed_experts_BTLK: torch.Tensor | None = None,
        return_routed_experts: Literal[False] = False,
    ) -> tuple[torch.Tensor, KVCache]: ...

    @overload
    def forward(
        self,
        input_ids_BT: torch.Tensor,
        positions_BT: torch.Tensor,
        kv_cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
        num_logits_to_keep: int = 0,
        kv_cache_length: int | None = None,
        *,
        routed_experts_BTLK: torch.Tensor | None = None,
        return_routed_experts: Literal[True],
    ) -> tuple[torch.Tensor, KVCache, torch.Tensor]: ...

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        positions_BT: torch.Tensor,
        kv_cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
        num_logits_to_keep: int = 0,
        kv_cache_length: int | None = None,
        *,
        routed_experts_BTLK: torch.Tensor | None = None,
        return_routed_experts: bool = False,
    ) -> tuple[torch.Tensor, KVCache] | tuple[torch.Tensor, KVCache, torch.Tensor]:
        """Logits `[B, T, V]` (or of the last `num_logits_to_keep` tokens) in the parameter dtype, and the cache.

        With `kv_cache_length`, `kv_cache` holds buffers with room: only its first `kv_cache_length` positions
        (dim 2) are past tokens, this call's keys and values are written in place at the next T positions (the
        buffers are modified), and the returned cache is views of the first `kv_cache_length + T` positions.
        MoE models: `routed_experts_BTLK` replays experts; `return_routed_experts=True` adds a third value, the
        experts used, int32 `[B, T, num_hidden_layers, top_k]` with -1 at dense layers (module docstring).
        """
        self._check_inputs(input_ids_BT, positions_BT, kv_cache, attention_mask, kv_cache_length)
        routed = self._routed_per_layer(routed_experts_BTLK, input_ids_BT.shape)
        if return_routed_experts and self.config.num_experts == 0:
            raise ValueError("return_routed_experts=True but the model is dense (num_experts=0): it routes nothing")
        T = input_ids_BT.shape[1]
        past_len = kv_cache_length if kv_cache_length is not None else kv_cache.length if kv_cache is not None else 0
        x_BTC = self.model.embed_tokens(input_ids_BT)
        cos, signed_sin = self._rope(positions_BT.to(x_BTC.device), x_BTC.dtype)
        mask = bias = None
        if attention_mask is not None:
            mask = attention_mask if attention_mask.dim() == 4 else attention_mask[:, None]
        elif past_len > 0 and T > 1:  # chunk on top of a cache: causal in cache order
            keys = torch.arange(past_len + T, device=x_BTC.device)
            queries = torch.arange(T, device=x_BTC.device) + past_len
            mask = (keys[None, :] <= queries[:, None])[None, None]
        if mask is not None and T == 1:  # the one-query attention path adds the mask: convert once, not per layer
            bias = torch.zeros(mask.shape, dtype=torch.float32, device=x_BTC.device).masked_fill_(~mask, float("-inf"))
        keys_out, values_out, experts_out = [], [], []
        for i, layer in enumerate(self.model.layers):
            in_place = kv_cache_length is not None
            past = (kv_cache.keys[i], kv_cache.values[i]) if kv_cache is not None and (past_len or in_place) else None
            write_at = past_len if in_place else None
            routed_NK = routed[i] if routed else None
            x_BTC, (k, v), experts_NK = layer(x_BTC, cos, signed_sin, past, mask, write_at, bias, routed_NK)
            keys_out.append(k)
            values_out.append(v)
            experts_out.append(experts_NK)
        if num_logits_to_keep > 0:
            x_BTC = x_BTC[:, -num_logits_to_keep:]
        logits_BTV = F.linear(self.model.norm(x_BTC), self.output_weight)
        cache = KVCache(tuple(keys_out), tuple(values_out))
        if not return_routed_experts:
            return logits_BTV, cache
        return logits_BTV, cache, self._stack_experts(experts_out, input_ids_BT.shape)

    def _stack_experts(self, experts: list[torch.Tensor | None], shape_BT: torch.Size) -> torch.Tensor:
        """int32 `[B, T, num_hidden_layers, top_k]` from each layer's `[B * T, top_k]` ids (None: dense, -1)."""
        B, T = shape_BT
        k = self.config.num_experts_per_tok
        device = self.model.embed_tokens.weight.device
        out_BTLK = torch.full((B, T, len(experts), k), -1, dtype=torch.int32, device=device)
        for i, experts_NK in enumerate(experts):
            if experts_NK is not None:
                out_BTLK[:, :, i] = experts_NK.view(B, T, k)
        return out_BTLK

    def _check_inputs(self, input_ids_BT, positions_BT, kv_cache, attention_mask, kv_cache_length=None) -> None:
        if input_ids_BT.dim() != 2 or input_ids_BT.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"input_ids_BT must be an integer [B, T] tensor, got {input_ids_BT.dtype} {tuple(input_ids_BT.shape)}"
            )
        B, T = input_ids_BT.shape
        if T == 0:
            raise ValueError("input_ids_BT has no tokens (T = 0)")
        if positions_BT.shape != input_ids_BT.shape or positions_BT.is_floating_point():
            raise ValueError(
                f"positions_BT must be an integer tensor shaped like input_ids_BT {tuple(input_ids_BT.shape)}, "
                f"got {positions_BT.dtype} {tuple(positions_BT.shape)}"
            )
        past_len = 0
        if kv_cache_length is not None and kv_cache is None:
            raise ValueError("kv_cache_length is given but kv_cache is None: it counts the tokens in kv_cache")
        if kv_cache is not None:
            if len(kv_cache.keys) != self.config.num_hidden_layers or len(kv_cache.values) != len(kv_cache.keys):
                raise ValueError(
                    f"kv_cache has {len(kv_cache.keys)} key / {len(kv_cache.values)} value layers, "
                    f"expected {self.config.num_hidden_layers}"
                )
            past_len = kv_cache.length
            if kv_cache_length is not None:
                if not 0 <= kv_cache_length <= past_len - T:
                    raise ValueError(
                        f"kv_cache_length={kv_cache_length}: expected 0 <= it <= {past_len - T} "
                        f"(buffers of {past_len} positions, {T} new tokens)"
                    )
                past_len = kv_cache_length
            if kv_cache.length > 0 and kv_cache.keys[0].shape[0] != B:
                raise ValueError(f"kv_cache holds {kv_cache.keys[0].shape[0]} rows, input_ids_BT has {B}")
        if attention_mask is not None:
            expected = (B, T, past_len + T)
            shape = tuple(attention_mask.shape)
            ok = shape == expected or (
                len(shape) == 4 and shape[0] == B and shape[1] == 1 and shape[2:] == expected[1:]
            )
            if attention_mask.dtype != torch.bool or not ok:
                raise ValueError(
                    f"attention_mask must be bool [B, T, S_past + T] = {list(expected)} (True = may attend), "
                    f"got {attention_mask.dtype} {list(shape)}"
                )


def build_model(
    config: DecoderConfig, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", seed: int = 0
) -> DecoderLM:
    """A randomly initialized model (normal(0, 0.02) matrices, unit norms, zero biases); deterministic in `seed`."""
    generator = torch.Generator().manual_seed(seed)
    model = DecoderLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model.to(device=device, dtype=dtype)
