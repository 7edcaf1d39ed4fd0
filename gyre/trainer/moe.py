"""Mixture of experts in the Megatron trainer: Qwen3-MoE / Qwen2-MoE layers as megatron-core MoE layers, expert
parallelism (EP) inside a cell, and routing replay.

Contract
- `moe_overrides(config)`: megatron's `TransformerConfig` fields for a `DecoderConfig` with experts. Qwen's router
  (softmax in fp32, top-k, renormalized when `norm_topk_prob`) is megatron's softmax router with
  `moe_router_pre_softmax = not norm_topk_prob` (top-k of the logits then a softmax over those k equals the
  renormalized top-k of the full softmax; without renormalization, the top-k of the full softmax), router dtype
  fp32, no load-balancing loss, no token dropping (`moe_expert_capacity_factor=None`), the alltoall dispatcher,
  `SequentialMLP` experts (`moe_grouped_gemm=False`: one `linear_fc1` = [gate; up] and one `linear_fc2` per local
  expert, the dense MLP's layout), `moe_layer_freq` = the per-layer pattern of `DecoderConfig.is_moe_layer`
  (`mlp_only_layers`, `decoder_sparse_step`), qwen2_moe's shared expert with its sigmoid gate.
- Expert parallelism folds over the ranks of a cell, which all see the same tokens (no sequence parallelism): EP
  rank e holds experts [e E/ep, (e+1) E/ep) (expert tensor parallelism 1). `TokenSplitMoELayer` splits the tokens
  of a forward evenly over the EP group before the router and gathers the layer's output after it, so every
  token is routed, dispatched (alltoall over the EP group) and computed by its experts exactly once, and every
  rank ends with the whole output. Gradients: each expert's are complete on its rank; the router's are this
  rank's tokens' share, summed over the EP group by `gyre.trainer.megatron_trainable` (as megatron sums the
  replicated norms' under sequence parallelism). qwen2_moe's shared expert runs on all tokens (it is
  tensor-parallel like the dense MLP).
- Routing replay: `set_routing_replay(model, routed_experts_ULK)` hands every MoE layer of `model` its column of
  `routed_experts_ULK`, integer `[U, num_hidden_layers, top_k]` expert ids of the U tokens of the next forward,
  in the shared model's and SGLang's layout (entries of dense layers ignored). Each layer feeds its tokens' ids to
  megatron's own `RouterReplay` (`moe_enable_routing_replay`, action `REPLAY_FORWARD`): the router's probabilities
  are taken at those experts, so the choice is replayed and the weights stay differentiable in the router. A
  token whose ids at a layer are all -1 (never routed by the engine: a row's last token) takes the router's own
  top-k. The routes stay set until the next call (None clears them), so megatron's activation recompute in the
  backward replays the same experts.
- `apply_moe_patches()` (run on import): megatron-core 0.16.1's `RouterGatingLinearFunction` reads a
  `te_general_gemm` that is only defined when TransformerEngine imports (NameError without TE, on any device):
  set to None there, its own fallback (`torch.mm`). On a CPU-only torch, `MoEAlltoAllTokenDispatcher` creates a
  CUDA stream for its device-to-host copies and passes its split sizes as tensors, which gloo's
  `all_to_all_single` refuses: the copies are made synchronously and the split sizes become numpy arrays, as the
  CUDA path makes them. gloo's `all_to_all_single` with uneven split sizes works (measured, torch 2.13).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe import token_dispatcher as megatron_dispatcher
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from gyre.models.decoder_config import DecoderConfig
from gyre.trainer.routing import NO_ROUTE

__all__ = [
    "TokenSplitMoELayer",
    "apply_moe_patches",
    "check_routed_experts",
    "is_expert_param",
    "is_router_param",
    "moe_layers",
    "moe_overrides",
    "set_routing_replay",
]


def moe_overrides(config: DecoderConfig) -> dict:
    """Megatron `TransformerConfig` fields of `config`'s experts (module docstring); {} for a dense model."""
    if config.num_experts == 0:
        return {}
    overrides = {
        "num_moe_experts": config.num_experts,
        "moe_router_topk": config.num_experts_per_tok,
        "moe_ffn_hidden_size": config.moe_intermediate_size,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not config.norm_topk_prob,
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_expert_capacity_factor": None,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "moe_layer_freq": [int(config.is_moe_layer(i)) for i in range(config.num_hidden_layers)],
        "moe_enable_routing_replay": True,  # a RouterReplay per router; idle unless set_routing_replay gives routes
        "expert_tensor_parallel_size": 1,
    }
    if config.shared_expert_intermediate_size:
        overrides["moe_shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
        overrides["moe_shared_expert_gate"] = True
    return overrides


def is_expert_param(name: str) -> bool:
    """A routed expert's weight (`...mlp.experts.local_experts.k.linear_fc{1,2}.weight`): held by one EP rank."""
    return ".mlp.experts." in name


def is_router_param(name: str) -> bool:
    """A router weight: replicated, each EP rank's gradient is its own tokens' share (module docstring)."""
    return ".mlp.router." in name


def _row_bounds(num_rows: int, parts: int) -> list[tuple[int, int]]:
    """`[start, stop)` of each of `parts` near-equal consecutive shares of `num_rows` (the first ones larger)."""
    base, extra = divmod(num_rows, parts)
    starts = [i * base + min(i, extra) for i in range(parts + 1)]
    return list(itertools.pairwise(starts))


def _gather_rows(x: torch.Tensor, group: dist.ProcessGroup, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Every rank's rows of the whole `[sum of shares, ...]` tensor, from this rank's share `x` (padded to the
    largest share for gloo's equal-size all_gather)."""
    largest = max(stop - start for start, stop in bounds)
    padded = x.new_zeros((largest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in bounds]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[: stop - start] for part, (start, stop) in zip(parts, bounds, strict=True)])


class _TakeRows(torch.autograd.Function):
    """Forward: this rank's share of the rows. Backward: the gradients of every share, gathered: each rank's input
    is a replica, whose gradient through the layer is the sum over all shares (megatron's scatter to the
    sequence-parallel region, with uneven shares)."""

    @staticmethod
    def forward(ctx, x, group, bounds):
        ctx.group, ctx.bounds = group, bounds
        start, stop = bounds[group.rank()]
        return x[start:stop].clone()

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad.contiguous(), ctx.group, ctx.bounds), None, None


class _GatherRows(torch.autograd.Function):
    """Forward: every rank's share gathered into the whole. Backward: this rank's share of the gradient (every
    rank computes the same downstream loss from the whole, so each share's gradient counts once, on its rank)."""

    @staticmethod
    def forward(ctx, x, group, bounds):
        ctx.group, ctx.bounds = group, bounds
        return _gather_rows(x, group, bounds)

    @staticmethod
    def backward(ctx, grad):
        start, stop = ctx.bounds[ctx.group.rank()]
        return grad[start:stop].contiguous(), None, None


class TokenSplitMoELayer(MoELayer):
    """Megatron's `MoELayer` with the tokens split over the expert-parallel group, a whole-token shared expert and
    routing replay (module docstring). State dict names are `MoELayer`'s."""

    replay_routes_NK: torch.Tensor | None = None  # this layer's expert ids of the next forward's tokens (replay)
    _local_routes_nK: torch.Tensor | None = None  # this rank's share of them, during a forward

    def route(self, hidden_states, padding_mask=None):
        routes = self._local_routes_nK
        if routes is None:
            return super().route(hidden_states, padding_mask)
        replay = self.router.router_replay
        if replay is None:
            raise ValueError("routing replay needs moe_enable_routing_replay=True in the TransformerConfig")
        routes = routes.to(hidden_states.device)
        unrouted = routes[:, 0] == NO_ROUTE
        if bool(unrouted.any()):
            with torch.no_grad():
                logits = self.router.gating(hidden_states).view(-1, self.config.num_moe_experts)
                own = torch.topk(logits, self.config.moe_router_topk, dim=-1).indices  # = top-k of the softmax
            routes = torch.where(unrouted[:, None], own, routes)
        replay.clear_indices()
        replay.set_target_indices(routes)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            return super().route(hidden_states, padding_mask)
        finally:
            replay.clear_router_replay_action()
            replay.clear_indices()

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        if intermediate_tensors is not None or padding_mask is not None:
            raise ValueError("TokenSplitMoELayer: intermediate_tensors and padding_mask are not supported")
        group = self.ep_group
        routes = self.replay_routes_NK
        num_tokens = hidden_states.shape[0] * hidden_states.shape[1]  # [S, B, H]
        if routes is not None and routes.shape[0] != num_tokens:
            raise ValueError(
                f"routing replay: layer {self.layer_number} has routes for {routes.shape[0]} tokens, the forward "
                f"has {num_tokens} (set_routing_replay before each forward)"
            )
        if group.size() == 1:
            self._local_routes_nK = routes
            try:
                output, bias = self._routed_forward(hidden_states)
            finally:
                self._local_routes_nK = None
        else:
            shape = hidden_states.shape
            bounds = _row_bounds(num_tokens, group.size())
            start, stop = bounds[group.rank()]
            local_nH = _TakeRows.apply(hidden_states.reshape(num_tokens, shape[-1]), group, bounds)
            if stop == start:  # fewer tokens than EP ranks: a zero stand-in token (megatron's router needs one; its
                # output is dropped, so it adds no gradient) keeps this rank in the layer's collectives
                local_nH = torch.cat((local_nH, local_nH.new_zeros((1, shape[-1]))))
            if routes is not None:
                self._local_routes_nK = (
                    routes[start:stop] if stop > start else routes.new_full((1, routes.shape[1]), -1)
                )
            try:
                local_out, bias = self._routed_forward(local_nH[:, None])
            finally:
                self._local_routes_nK = None
            local_out = local_out.reshape(-1, shape[-1])[: stop - start]
            output = _GatherRows.apply(local_out, group, bounds).reshape(shape)
        if self.use_shared_expert:
            output = output + self.shared_experts(hidden_states)
        return output, bias

    def _routed_forward(self, hidden_states):
        """`MoELayer.forward`'s route, dispatch, experts and combine on this rank's tokens. Not `MoELayer.forward`
        itself: in training mode it refuses TP > 1 without sequence parallelism, whose point (no token handled
        twice by the experts) the split over the EP group makes here."""
        probs, routing_map = self.route(hidden_states)
        hidden_states, probs = self.preprocess(hidden_states, probs, routing_map)
        dispatched, probs = self.dispatch(hidden_states, probs)
        output, bias = self.routed_experts_compute(dispatched, probs)
        return self.postprocess(self.combine(output), None), bias


def moe_layers(model: torch.nn.Module) -> list[TokenSplitMoELayer]:
    """The model's MoE layers (this pipeline stage's), in order."""
    return [module for module in model.modules() if isinstance(module, TokenSplitMoELayer)]


def check_routed_experts(routed_ULK: torch.Tensor, config: DecoderConfig, num_tokens: int) -> None:
    """ValueError unless `routed_ULK` is integer `[num_tokens, num_hidden_layers, top_k]` whose entries at every MoE
    layer are, per token, `top_k` distinct ids in [0, num_experts) or all `NO_ROUTE`."""
    expected = (num_tokens, config.num_hidden_layers, config.num_experts_per_tok)
    if tuple(routed_ULK.shape) != expected or routed_ULK.is_floating_point() or routed_ULK.dtype == torch.bool:
        raise ValueError(
            f"routed experts must be an integer [U, num_hidden_layers, num_experts_per_tok] = {list(expected)} "
            f"tensor, got {routed_ULK.dtype} {list(routed_ULK.shape)}"
        )
    moe_ids = list(config.moe_layer_ids())
    sorted_UMK = routed_ULK[:, moe_ids].long().sort(dim=-1).values
    unrouted_UM = (sorted_UMK == NO_ROUTE).all(dim=-1)
    bad_UM = (sorted_UMK[..., 0] < 0) | (sorted_UMK[..., -1] >= config.num_experts)
    if config.num_experts_per_tok > 1:
        bad_UM |= (sorted_UMK[..., 1:] == sorted_UMK[..., :-1]).any(dim=-1)
    bad_UM &= ~unrouted_UM
    if bool(bad_UM.any()):
        token, m = (int(i) for i in bad_UM.nonzero()[0])
        raise ValueError(
            f"routed experts {routed_ULK[token, moe_ids[m]].tolist()} (token {token}, layer {moe_ids[m]}): expected "
            f"{config.num_experts_per_tok} distinct expert ids in [0, {config.num_experts}), or all {NO_ROUTE} "
            "(not routed: the router's own choice)"
        )


def set_routing_replay(
    model: torch.nn.Module, routed_ULK: torch.Tensor | np.ndarray | None, config: DecoderConfig
) -> None:
    """Replay `routed_ULK` (module docstring; checked by `check_routed_experts`) in the next forwards of `model`'s
    MoE layers; None: every router chooses its own experts again."""
    layers = moe_layers(model)
    if routed_ULK is None:
        for layer in layers:
            layer.replay_routes_NK = None
        return
    if config.num_experts == 0:
        raise ValueError("routed experts are given but the model is dense (num_experts=0): nothing to replay")
    routed = torch.as_tensor(routed_ULK)
    check_routed_experts(routed, config, routed.shape[0] if routed.dim() else 0)
    for layer in layers:
        layer.replay_routes_NK = routed[:, layer.layer_number - 1].long()  # megatron's layer_number: global, from 1


def _cpu_maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert: torch.Tensor | None = None):
    """`MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize` on a CPU-only torch: the split sizes become numpy
    arrays at the copy point (as the CUDA path makes them), synchronously, without CUDA streams."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.numpy())
    return tokens_per_expert


class _NoStream:
    """Stands in for the dispatcher's class-level CUDA stream on a CPU-only torch (never used there)."""


_patched = False


def apply_moe_patches() -> None:
    """Install the MoE patches once (module docstring); idempotent."""
    global _patched
    if _patched:
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not torch.cuda.is_available():
        dispatcher = megatron_dispatcher.MoEAlltoAllTokenDispatcher
        if dispatcher.cuda_dtoh_stream is None:
            dispatcher.cuda_dtoh_stream = _NoStream()
        dispatcher._maybe_dtoh_and_synchronize = _cpu_maybe_dtoh_and_synchronize
    _patched = True


apply_moe_patches()
