"""The native engine's inference path over the shared decoder: stacked projections and the batched decode step.

The model (`gyre.models.decoder.DecoderLM`) is plain: separate HF-named linears. What only inference wants is
applied to it here, by the engine:
- `stack_projections(model)` makes q|k|v and gate|up one matmul each (`StackedLinear`) wherever the model computes
  them (`Attention.project_qkv`, `MLP.project_gate_up`), with the named parameters re-pointed into the stack, so
  updates by name, `state_dict` and checkpoints are unchanged (see `StackedLinear`). `NativeEngine` applies it to
  the model it serves.
- `decode_weights(model, device)` collects the tensors (`DecodeWeights`: parameters and stacks, no copies) that
  `decode_forward` reads; `decode_forward` is one decode token per row over a batch KV buffer as a pure function,
  the step `NativeEngine(compile_decode=True)` runs through `torch.compile`.
See docs/native-model.md and docs/engine.md ("Throughput").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gyre.models.decoder import DecoderLM, apply_rope, rms_norm, rms_normalize, rope_cos_sin


class StackedLinear:
    """Several `nn.Linear` of the same input computed as one matmul, over their weights stacked by rows.

    Called in place of `Attention.project_qkv` / `MLP.project_gate_up`: the linears' outputs side by side.

    At this model's sizes a decode step is bound by per-op overhead, so q|k|v in one matmul (and gate|up in one)
    is cheaper than three (two). The HF-named parameters stay the parameters (names, `state_dict`, checkpoints,
    updates by name are unchanged); without autograd the stacked matrix *is* their storage: each `linear.weight`
    (and bias) is re-pointed (`param.data = row block`) into it, so an in-place update of a named parameter
    (`update_weights`, `load_state_dict`, an optimizer step) is seen by the stacked matmul with nothing to refresh.
    A parameter replaced by another tensor (`model.to`, `load_state_dict(assign=True)`, `resume_memory` on an
    accelerator) no longer lies at its address in the stack; the next call notices (one pointer compare per
    parameter) and re-stacks (one copy). With autograd on (training) the separate linears run, so gradients reach
    the named parameters; their outputs are concatenated to the same layout.
    """

    def __init__(self, *linears: nn.Linear):
        self.linears = linears
        self.sizes = [linear.out_features for linear in linears]
        self.weight: torch.Tensor | None = None  # [sum(sizes), in_features], storage of every linear.weight
        self.bias: torch.Tensor | None = None
        self._addresses: list[int] = []  # expected data_ptr of each linear's weight (and bias) inside the stack

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and any(p.requires_grad for lin in self.linears for p in lin.parameters()):
            return torch.cat([linear(x) for linear in self.linears], dim=-1)
        self.refresh()
        return F.linear(x, self.weight, self.bias)

    def refresh(self) -> None:
        """Re-stack if a parameter no longer lies at its address in the stack (one pointer compare each)."""
        if self._addresses != self._current_addresses():
            self._restack()

    def _current_addresses(self) -> list[int]:
        return [p.data_ptr() for linear in self.linears for p in (linear.weight, linear.bias) if p is not None]

    def _restack(self) -> None:
        # inference_mode(False): the stack becomes the parameters' storage, so it must be a normal tensor even if
        # the first call comes from inside inference mode (a later training step would reject an inference tensor).
        with torch.no_grad(), torch.inference_mode(False):
            self.weight = torch.cat([linear.weight.detach() for linear in self.linears])
            for linear, block in zip(self.linears, self.weight.split(self.sizes), strict=True):
                linear.weight.data = block
            self.bias = None
            if self.linears[0].bias is not None:
                self.bias = torch.cat([linear.bias.detach() for linear in self.linears])
                for linear, block in zip(self.linears, self.bias.split(self.sizes), strict=True):
                    linear.bias.data = block
        self._addresses = self._current_addresses()


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors for `decode_forward` (the parameters themselves or their stacks; no copies)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor  # q|k|v stacked by rows (`StackedLinear.weight`)
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # gate|up stacked by rows
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


@dataclass(frozen=True)
class DecodeWeights:
    """What `decode_forward` reads of a `DecoderLM`: its weights and the shape constants; see `decode_weights`."""

    embed: torch.Tensor
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor
    output: torch.Tensor
    inv_freq_D: torch.Tensor
    sign_D: torch.Tensor
    rope_scale: float  # RopeScaling.attention_scaling(): 1.0 but for YaRN
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float


def stack_projections(model: DecoderLM) -> DecoderLM:
    """Install the engine's stacked projections on `model`, in place: every layer's `project_qkv` and
    `project_gate_up` become a `StackedLinear` over its linears (idempotent; returns `model`).

    Names, `state_dict` and the forward's outputs keep their layout; without autograd each becomes one matmul.
    """
    for layer in model.model.layers:
        attn = layer.self_attn
        if not isinstance(attn.__dict__.get("project_qkv"), StackedLinear):
            attn.project_qkv = StackedLinear(attn.q_proj, attn.k_proj, attn.v_proj)
        mlp = layer.mlp
        mlps = [mlp] if not hasattr(mlp, "experts") else [*mlp.experts, mlp.shared_expert]  # MoE: each expert
        for expert in filter(None, mlps):
            if not isinstance(expert.__dict__.get("project_gate_up"), StackedLinear):
                expert.project_gate_up = StackedLinear(expert.gate_proj, expert.up_proj)
    return model


def decode_weights(model: DecoderLM, device: torch.device) -> DecodeWeights:
    """The tensors `decode_forward` reads of `model`, collected now (cheap: attribute reads, no copies); stacks
    `model`'s projections first if the engine has not yet (`stack_projections`).

    Collect them again after a parameter was replaced (release/resume, `load_state_dict(assign=True)`): the stacks
    are refreshed here, and the RoPE tables follow the device.
    """
    stack_projections(model)
    inv_freq_D, sign_D = model.rope_tables(device)
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = attn.project_qkv, mlp.project_gate_up
        qkv.refresh()
        gate_up.refresh()
        layers.append(
            LayerWeights(
                input_norm=layer.input_layernorm.weight,
                qkv=qkv.weight,
                qkv_bias=qkv.bias,
                q_norm=attn.q_norm.weight if attn.q_norm is not None else None,
                k_norm=attn.k_norm.weight if attn.k_norm is not None else None,
                o_proj=attn.o_proj.weight,
                o_bias=attn.o_proj.bias,
                post_norm=layer.post_attention_layernorm.weight,
                gate_up=gate_up.weight,
                gate_up_bias=gate_up.bias,
                down=mlp.down_proj.weight,
                down_bias=mlp.down_proj.bias,
            )
        )
    config = model.config
    return DecodeWeights(
        embed=model.model.embed_tokens.weight,
        layers=tuple(layers),
        final_norm=model.model.norm.weight,
        output=model.output_weight,
        inv_freq_D=inv_freq_D,
        sign_D=sign_D,
        rope_scale=config.rope_scaling.attention_scaling(),
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        eps=config.rms_norm_eps,
    )


def decode_forward(
    ids_B1: torch.Tensor,
    positions_B1: torch.Tensor,
    keys_LBKSD: torch.Tensor,
    values_LBKSD: torch.Tensor,
    mask_BS: torch.Tensor,
    weights: DecodeWeights,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode token per row over a batch KV buffer, as one pure function (meant for `torch.compile`).

    Row b's token attends to the buffer columns where `mask_BS[b]` is True and to itself; the buffers are only
    read. Returns parameter-dtype logits `[B, V]` and this token's keys (RoPE applied) and values
    `[L, B, K, 1, D]`, for the caller to write into its buffer. The same math as `DecoderLM.forward` with T = 1
    (its `attend_one_query`), except that the new key's score is computed beside the buffer's instead of after
    writing it in: no graph input is mutated, so inductor neither copies the buffer nor guards on the write column.
    """
    H, K, D, eps = weights.num_heads, weights.num_kv_heads, weights.head_dim, weights.eps
    x_B1C = F.embedding(ids_B1, weights.embed)
    cos, signed_sin = rope_cos_sin(positions_B1, weights.inv_freq_D, weights.sign_D, weights.rope_scale, x_B1C.dtype)
    B = x_B1C.shape[0]
    S = keys_LBKSD.shape[3]
    bias_B11S = torch.zeros(mask_BS.shape, dtype=torch.float32, device=mask_BS.device)
    bias_B11S = bias_B11S.masked_fill(~mask_BS, float("-inf"))[:, None, None, :]
    new_keys, new_values = [], []
    for i, layer in enumerate(weights.layers):
        h_B1C = rms_norm(x_B1C, layer.input_norm, eps)
        qkv_B1ND = F.linear(h_B1C, layer.qkv, layer.qkv_bias).view(B, 1, H + 2 * K, D)
        qk_B1ND = qkv_B1ND[:, :, : H + K]
        if layer.q_norm is not None:
            normed_B1ND = rms_normalize(qk_B1ND, eps)
            qk_B1ND = torch.cat((layer.q_norm * normed_B1ND[:, :, :H], layer.k_norm * normed_B1ND[:, :, H:]), 2)
        qk_B1ND = apply_rope(qk_B1ND, cos, signed_sin)
        k_BK1D = qk_B1ND[:, :, H:].transpose(1, 2)
        v_BK1D = qkv_B1ND[:, :, H + K :].transpose(1, 2)
        new_keys.append(k_BK1D)
        new_values.append(v_BK1D)
        q_BKGD = qk_B1ND[:, :, :H].reshape(B, K, H // K, D) * (1.0 / math.sqrt(D))
        # Products and sums, not matmuls: inductor fuses them into one loop each (no [B, K, G, S, D] tensor is
        # materialized); ~10-20% faster per step than its batched-matmul calls at this size (S = 192 and 1024).
        old_BKGS = (q_BKGD[:, :, :, None, :] * keys_LBKSD[i][:, :, None]).sum(-1).float() + bias_B11S
        own_BKG1 = (q_BKGD * k_BK1D).sum(-1, keepdim=True).float()
        probs_BKGT = torch.cat((old_BKGS, own_BKG1), -1).softmax(dim=-1).to(x_B1C.dtype)
        out_BKGD = (probs_BKGT[..., :S, None] * values_LBKSD[i][:, :, None]).sum(-2) + probs_BKGT[..., S:] * v_BK1D
        x_B1C = x_B1C + F.linear(out_BKGD.reshape(B, 1, H * D), layer.o_proj, layer.o_bias)
        h_B1C = rms_norm(x_B1C, layer.post_norm, eps)
        gate, up = F.linear(h_B1C, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
        x_B1C = x_B1C + F.linear(F.silu(gate) * up, layer.down, layer.down_bias)
    logits_BV = F.linear(rms_norm(x_B1C, weights.final_norm, eps), weights.output)[:, 0]
    return logits_BV, torch.stack(new_keys), torch.stack(new_values)
