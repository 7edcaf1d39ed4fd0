"""A Megatron-core `GPTModel` as a `gyre.trainer.streaming.Trainable`: packed-row log-probs, TP-aware clipping, AdamW.

The streaming step reduces gradients over prefix groups of cells that change from step to step, which Megatron's
DDP (one fixed data-parallel group, set at start-up) cannot do; so the model is used without DDP and the update is
plain: gradients are in `param.grad`; the gradients of the query and key norms (Qwen3's qk-norm: Megatron's
`q_layernorm` / `k_layernorm`, replicated on every tensor-parallel rank but applied to that rank's heads only, so
each rank holds its heads' share) are summed over the tensor-parallel group, as Megatron's `finalize_model_grads`
does; the global norm counts each tensor-parallel shard once and each replicated tensor (norms, qkv biases) once
and a tied embedding's pipeline copy not at all (as Megatron's own `clip_grads` does), summed over the cell's
model-parallel group; then clip and `torch.optim.AdamW`. Only the core's ranks call `update`.

At PP > 1 the model is one stage and a step streams through the cell's `pipeline` (`gyre.trainer.pipeline.
StreamingPipeline`, which `gyre.trainer.streaming.train_claimed_step` runs); `logprobs` is then not the whole
model's and is refused.

Mixture of experts (`gyre.trainer.moe`, docs/moe.md): every rank of a cell sees the micro-step's tokens and the MoE
layers split them over the expert-parallel (EP) group, so a routed expert's gradient is complete on the one rank
that holds it, and a router's gradient is this rank's tokens' share: summed over the EP group in `update`. The
global norm adds the experts' squares over megatron's expert model-parallel group (EP x PP, each expert once) to
the dense squares over the model-parallel group (as megatron's chained optimizer does for its expert and dense
optimizers). A cell with R = EP / TP > 1 copies of the dense model averages each dense gradient over its copies
(`gyre.trainer.model.dense_replica_group`) before the update, so the copies stay identical. With `routing_replay`,
`logprobs(step)` replays the micro-step's recorded routing (`step.routed_experts_ULK`, integer `[U,
num_hidden_layers, top_k]` aligned with `step.ids_U`; `gyre.trainer.routing`) in the forward and in its
backward's recompute.

Optimizer offload (`offload_fraction` > 0, CUDA only; docs/training.md, "Optimizer offload"): the optimizer is
megatron-core's `HybridDeviceOptimizer` (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py, called as
megatron's own `get_megatron_optimizer` calls it, with torch's AdamW on both sides) over the model's parameters: the
first parameters, up to that share of the numbers, get their fp32 main weights, AdamW moments and a pinned gradient
buffer in host memory and step there (copied back to the device after); the rest step on the device. It keeps the
fp32 main weights itself (`param_update_in_fp32` for a bf16 model), so `MainWeights` keeps only the fp32 gradient
accumulators, handed to it as each parameter's `decoupled_grad`. Written against megatron-core 0.16's source; run
on CPU: the contract (its keywords, tests/unit/test_train_optimizer_offload.py); not run here: a step on a GPU
(tests/gpu/test_optimizer_offload_cuda.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared
from torch import Tensor

from gyre.data.microstep import MicroStep
from gyre.trainer.chunked import DEFAULT_CHUNK_TOKENS
from gyre.trainer.logprobs import gpt_model_of, microstep_logprobs
from gyre.trainer.model import dense_replica_group
from gyre.trainer.moe import is_expert_param, is_router_param
from gyre.trainer.precision import MainWeights
from gyre.trainer.routing import step_routes

__all__ = [
    "MegatronTrainable",
    "all_reduce_tensors",
    "global_grad_norm",
    "hybrid_optimizer",
]


def global_grad_norm(
    params: list[Tensor],
    expert_params: list[Tensor] = (),
    *,
    grads: list[Tensor | None] | None = None,
    expert_grads: list[Tensor | None] | None = None,
) -> Tensor:
    """The L2 norm of the whole model's gradient from this rank's shards (fp32), each tensor counted once: `params`
    (dense) summed over the model-parallel group (TP x PP), TP-replicated tensors on TP rank 0 only, the copy of
    tied embeddings on the last pipeline stage not at all (as Megatron's own `clip_grads` counts); `expert_params`
    (routed experts, whole on their EP rank) summed over the expert model-parallel group (EP x PP). The gradients
    are each parameter's `.grad`, or `grads` / `expert_grads` in the same order (fp32 accumulators kept apart)."""
    grads = [p.grad for p in params] if grads is None else grads
    squares = torch.zeros(1, dtype=torch.float32)
    for p, grad in zip(params, grads, strict=True):
        if grad is not None and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
            squares += grad.detach().float().pow(2).sum().cpu()
    group = parallel_state.get_model_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(squares, group=group)
    if expert_params:
        expert_grads = [p.grad for p in expert_params] if expert_grads is None else expert_grads
        expert_squares = torch.zeros(1, dtype=torch.float32)
        for grad in expert_grads:
            if grad is not None:
                expert_squares += grad.detach().float().pow(2).sum().cpu()
        group = parallel_state.get_expert_tensor_model_pipeline_parallel_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(expert_squares, group=group)
        squares += expert_squares
    return squares.sqrt()[0]


def all_reduce_tensors(grads: list[Tensor], group: dist.ProcessGroup | None, *, average: bool = False) -> None:
    """Sum (or average) `grads` over `group`, in place, through one flat buffer; nothing for a group of one."""
    if not grads or group is None or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    if average:
        flat /= dist.get_world_size(group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def _is_head_norm(name: str) -> bool:
    return ".q_layernorm." in name or ".k_layernorm." in name


def hybrid_optimizer(params: list[Tensor], *, offload_fraction: float, lr: float, weight_decay: float):
    """Megatron-core's `HybridDeviceOptimizer` over `params` (CUDA tensors) as `get_megatron_optimizer` builds it
    with `optimizer_cpu_offload` (module docstring): torch's AdamW on the host and on the device, fp32 main weights
    of its own for low-precision parameters, the host's gradients in pinned buffers, no side streams."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    return HybridDeviceOptimizer(
        params,
        offload_fraction=offload_fraction,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW,
        param_update_in_fp32=any(p.dtype != torch.float32 for p in params),
        pin_cpu_grads=True,
        pin_cpu_params=True,
        overlap_cpu_optimizer_d2h_h2d=False,
        lr=lr,
        weight_decay=weight_decay,
    )


class MegatronTrainable:
    """AdamW on a (TP-sharded) GPTModel; `update` clips the global gradient norm to `max_grad_norm` (0: off).
    `chunk_tokens`: log-probs a chunk of tokens at a time (`gyre.trainer.logprobs`). `pipeline`: the stage's
    `StreamingPipeline` when the model is one pipeline stage of several (module docstring). `steps=False`: a
    satellite's, which never steps: no AdamW and no fp32 main weights (`gyre.trainer.precision`); `update` raises.
    `offload_fraction` > 0: megatron's `HybridDeviceOptimizer` steps that share of the parameters in host memory
    (module docstring; CUDA parameters)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        pipeline=None,
        routing_replay: bool = False,
        steps: bool = True,
        offload_fraction: float = 0.0,
    ):
        self.model = model
        self.pipeline = pipeline
        self.chunk_tokens = chunk_tokens
        self.routing_replay = routing_replay
        if routing_replay:
            if not gpt_model_of(model).decoder_config.num_experts:
                raise ValueError("routing_replay=True needs a mixture-of-experts model: this one is dense")
            if pipeline is not None:
                pipeline.routing_replay = True
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self._params = [p for _, p in named]
        self._head_shares = [i for i, (name, _) in enumerate(named) if _is_head_norm(name)]  # summed over TP
        self._experts = [i for i, (name, _) in enumerate(named) if is_expert_param(name)]  # whole on their EP rank
        self._routers = [i for i, (name, _) in enumerate(named) if is_router_param(name)]  # summed over EP
        # fp32 main weights when the model computes in bf16; a satellite (steps=False) has neither them nor AdamW;
        # with offload the optimizer keeps its own (a share of them in host memory)
        offload = steps and offload_fraction > 0
        self.weights = MainWeights(self._params, steps=steps, main_copy=not offload)
        self.optimizer = None
        if offload:
            self.optimizer = hybrid_optimizer(
                self._params, offload_fraction=offload_fraction, lr=lr, weight_decay=weight_decay
            )
        elif steps:
            self.optimizer = torch.optim.AdamW(self.weights.main, lr=lr, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm

    def logprobs(self, step: MicroStep) -> Tensor:
        if self.pipeline is not None:
            raise RuntimeError("a pipeline stage has no whole-model log-probs: run the step through its `pipeline`")
        routes = step_routes(step, self.model.decoder_config) if self.routing_replay else None
        return microstep_logprobs(self.model, step, chunk_tokens=self.chunk_tokens, routed_experts_ULK=routes)

    def parameters(self) -> list[Tensor]:
        return self._params

    def gradients(self) -> list[Tensor]:
        return self.weights.gradients()

    def drop_gradients(self) -> None:
        self.weights.drop_gradients()

    def reduce_cell_gradients(self) -> list[Tensor | None]:
        """The in-cell sums `update` starts with (module docstring): the query and key norms over TP, the routers
        over EP, each dense gradient averaged over the cell's copies of the dense model. Collective over the cell.
        Returns the gradients (None where none came and no reduction needed one), reduced in place."""
        grads = self.weights.gradients(dense=False)

        def reduce(indices: list[int], group, *, average: bool = False) -> None:
            if not indices or group is None or dist.get_world_size(group) == 1:
                return
            for i in indices:  # a missing gradient counts as zeros: every rank sends the same tensors
                grads[i] = self.weights.dense_gradient(i)
            all_reduce_tensors([grads[i] for i in indices], group, average=average)

        reduce(self._head_shares, parallel_state.get_tensor_model_parallel_group())
        if self._routers:
            reduce(self._routers, parallel_state.get_expert_model_parallel_group())
        experts = set(self._experts)
        reduce([i for i in range(len(grads)) if i not in experts], dense_replica_group(), average=True)
        return grads

    def update(self) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("a satellite does not step: only the core's trainer updates the weights")
        grads = self.reduce_cell_gradients()
        experts = set(self._experts)
        dense = [i for i in range(len(grads)) if i not in experts]
        norm = float(
            global_grad_norm(
                [self._params[i] for i in dense],
                [self._params[i] for i in self._experts],
                grads=[grads[i] for i in dense],
                expert_grads=[grads[i] for i in self._experts],
            )
        )
        if not math.isfinite(norm):
            self.weights.drop_gradients()
            raise FloatingPointError(f"gradient norm is {norm}: the step is skipped, parameters unchanged")
        if self.max_grad_norm > 0:
            scale = self.max_grad_norm / (norm + 1e-6)  # the coefficient torch.nn.utils.clip_grad_norm_ uses
            if scale < 1.0:
                for grad in grads:
                    if grad is not None:
                        grad.mul_(scale)
        if self.weights.main is None:  # the hybrid optimizer keeps the main weights: it reads the fp32 gradients
            self._step_hybrid(grads)
        else:
            self.optimizer.step()
            self.weights.copy_to_model()
        self.weights.drop_gradients()
        return {"grad_norm": norm}

    def _step_hybrid(self, grads: list[Tensor | None]) -> None:
        """One step of megatron's `HybridDeviceOptimizer`: the fp32 gradients as each parameter's `decoupled_grad`
        (what it reads before `.grad`); it writes the updated weights into the model itself. Then no gradient is
        left referenced: neither the parameters' nor its device-side fp32 copies' (its host buffers stay)."""
        for p, grad in zip(self._params, grads, strict=True):
            p.decoupled_grad = grad
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # the parameters' .grad and decoupled_grad
        if self.optimizer.gpu_optimizer is not None:
            self.optimizer.gpu_optimizer.zero_grad(set_to_none=True)
