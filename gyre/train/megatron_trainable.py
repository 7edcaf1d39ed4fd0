"""A Megatron-core `GPTModel` as a `gyre.train.streaming.Trainable`: packed-row log-probs, TP-aware clipping, AdamW.

The streaming step reduces gradients over prefix groups of cells that change from step to step, which Megatron's
DDP (one fixed data-parallel group, set at start-up) cannot do; so the model is used without DDP and the update is
plain: gradients are in `param.grad`; the gradients of the query and key norms (Qwen3's qk-norm: Megatron's
`q_layernorm` / `k_layernorm`, replicated on every tensor-parallel rank but applied to that rank's heads only, so
each rank holds its heads' share) are summed over the tensor-parallel group, as Megatron's `finalize_model_grads`
does; the global norm counts each tensor-parallel shard once and each replicated tensor (norms, qkv biases) once
and a tied embedding's pipeline copy not at all (as Megatron's own `clip_grads` does), summed over the cell's
model-parallel group; then clip and `torch.optim.AdamW`. Only the core's ranks call `update`.

At PP > 1 the model is one stage and a step streams through the cell's `pipeline` (`gyre.train.pipeline.
StreamingPipeline`, which `gyre.train.streaming.train_claimed_step` runs); `logprobs` is then not the whole
model's and is refused.
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
from gyre.train.chunked import DEFAULT_CHUNK_TOKENS
from gyre.train.logprobs import microstep_logprobs
from gyre.train.precision import MainWeights

__all__ = ["MegatronTrainable", "global_grad_norm", "sum_head_shares"]


def global_grad_norm(params: list[Tensor]) -> Tensor:
    """The L2 norm of the whole model's gradient from this rank's shards (fp32), summed over the model-parallel
    group (TP x PP), each tensor counted once: TP-replicated tensors on TP rank 0 only, the copy of tied embeddings
    on the last pipeline stage not at all (as Megatron's own `clip_grads` counts)."""
    squares = torch.zeros(1, dtype=torch.float32)
    for p in params:
        if p.grad is not None and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
            squares += p.grad.detach().float().pow(2).sum().cpu()
    group = parallel_state.get_model_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(squares, group=group)
    return squares.sqrt()[0]


def _is_head_norm(name: str) -> bool:
    return ".q_layernorm." in name or ".k_layernorm." in name


def sum_head_shares(params: list[Tensor]) -> None:
    """Sum the gradients of `params` (the query and key norms) over the tensor-parallel group, in place: each rank
    computed its heads' share (module docstring)."""
    group = parallel_state.get_tensor_model_parallel_group()
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


class MegatronTrainable:
    """AdamW on a (TP-sharded) GPTModel; `update` clips the global gradient norm to `max_grad_norm` (0: off).
    `chunk_tokens`: log-probs a chunk of tokens at a time (`gyre.train.logprobs`). `pipeline`: the stage's
    `StreamingPipeline` when the model is one pipeline stage of several (module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        pipeline=None,
    ):
        self.model = model
        self.pipeline = pipeline
        self.chunk_tokens = chunk_tokens
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self._params = [p for _, p in named]
        self._head_shares = [i for i, (name, _) in enumerate(named) if _is_head_norm(name)]  # summed over TP
        self.weights = MainWeights(self._params)  # fp32 main weights when the model computes in bf16
        self.optimizer = torch.optim.AdamW(self.weights.main, lr=lr, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm

    def logprobs(self, step: MicroStep) -> Tensor:
        if self.pipeline is not None:
            raise RuntimeError("a pipeline stage has no whole-model log-probs: run the step through its `pipeline`")
        return microstep_logprobs(self.model, step, chunk_tokens=self.chunk_tokens)

    def parameters(self) -> list[Tensor]:
        return self._params

    def gradients(self) -> list[Tensor]:
        return self.weights.gradients()

    def drop_gradients(self) -> None:
        self.weights.drop_gradients()

    def update(self) -> dict[str, float]:
        main = self.weights.main
        sum_head_shares([main[i] for i in self._head_shares])
        norm = float(global_grad_norm(main))
        if not math.isfinite(norm):
            self.weights.drop_gradients()
            raise FloatingPointError(f"gradient norm is {norm}: the step is skipped, parameters unchanged")
        if self.max_grad_norm > 0:
            scale = self.max_grad_norm / (norm + 1e-6)  # the coefficient torch.nn.utils.clip_grad_norm_ uses
            if scale < 1.0:
                for p in main:
                    if p.grad is not None:
                        p.grad.mul_(scale)
        self.optimizer.step()
        self.weights.copy_to_model()
        self.weights.drop_gradients()
        return {"grad_norm": norm}
