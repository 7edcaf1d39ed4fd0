"""Mixed precision for a trainable: the model computes in its own dtype (bf16), the update happens in fp32.

`MainWeights(params)` sits between a model's parameters and the optimizer (docs/training.md, "Precision"):

- fp32 parameters: nothing changes; `main` is the parameters themselves and gradients live in their `.grad`.
- low-precision parameters (bf16): `main` holds an fp32 leaf copy of each (with the parameter's attributes, so
  Megatron's `param_is_not_shared` and `param_is_not_tensor_parallel_duplicate` read them alike). Each
  parameter's gradient is added into its main copy's fp32 `.grad` as soon as backward has accumulated it (a
  post-accumulate-grad hook) and the parameter's own `.grad` dropped, so micro-steps accumulate in fp32, the
  cross-cell reduction sums fp32 (`gradients`), the optimizer's state is fp32 (it steps `main`), and
  `copy_to_model` rounds the updated main weights into the model once per step.

The model's parameters stay what a step broadcasts and what satellites pull (`Trainable.parameters`): they are the
weights every rank computes with, and half the bytes.

`MainWeights(params, steps=False)` is a satellite's (docs/training.md, "Precision"): it never steps, so it keeps no
fp32 copy of the weights, only each parameter's fp32 gradient accumulator (`gradients`), which the step sums onto
the core: 4 bytes a parameter instead of 8 beside the bf16 weights. `main` is None then and `copy_to_model` raises.

`MainWeights(params, main_copy=False)` is a core's whose optimizer keeps the fp32 main weights itself (megatron's
`HybridDeviceOptimizer` with optimizer offload, `gyre.trainer.megatron_trainable`): the same fp32 accumulators as a
satellite's, and `main` None; the optimizer writes the updated weights into the model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["MainWeights"]


class MainWeights:
    """The fp32 weights an optimizer steps for `params` (module docstring)."""

    def __init__(self, params: Sequence[Tensor], *, steps: bool = True, main_copy: bool = True):
        self.params = list(params)
        self.steps = steps
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        self.grads: list[Tensor | None] = []  # fp32 accumulators without main weights (mixed, no main copy)
        if not self.mixed:
            self.main = self.params
            return
        if not steps or not main_copy:
            self.main = None
            self.grads = [None] * len(self.params)
            for i, p in enumerate(self.params):
                p.register_post_accumulate_grad_hook(_into_accumulator(self.grads, i))
            return
        self.main = []
        for p in self.params:
            main = p.detach().float().clone().requires_grad_(True)
            # Megatron's tensor_model_parallel, shared, ... (not torch's own private slots, hooks among them)
            main.__dict__.update({k: v for k, v in vars(p).items() if not k.startswith("_")})
            p.register_post_accumulate_grad_hook(_into_main(main))
            self.main.append(main)

    def gradients(self, *, dense: bool = True) -> list[Tensor | None]:
        """The accumulated gradient of each parameter, dense (zeros where none came; None there with `dense`
        False), fp32 when mixed, in the order of `params`: the tensors themselves, so summing into them in place is
        the step's reduction."""
        if not dense:
            return list(self.grads) if self.main is None else [main.grad for main in self.main]
        if self.main is None:
            for i, p in enumerate(self.params):
                if self.grads[i] is None:
                    self.grads[i] = torch.zeros_like(p, dtype=torch.float32)
            return list(self.grads)
        for main in self.main:
            if main.grad is None:
                main.grad = torch.zeros_like(main)
        return [main.grad for main in self.main]

    def dense_gradient(self, index: int) -> Tensor:
        """Parameter `index`'s accumulated gradient, zeros kept first where none came."""
        if self.main is None:
            if self.grads[index] is None:
                self.grads[index] = torch.zeros_like(self.params[index], dtype=torch.float32)
            return self.grads[index]
        main = self.main[index]
        if main.grad is None:
            main.grad = torch.zeros_like(main)
        return main.grad

    def drop_gradients(self) -> None:
        for tensor in (*(self.main or ()), *self.params):
            tensor.grad = None
        for i in range(len(self.grads)):  # in place: the hooks add into this very list
            self.grads[i] = None

    def copy_to_model(self) -> None:
        """After the optimizer stepped `main`: the model's parameters become the main weights, rounded."""
        if not self.steps:
            raise RuntimeError("a satellite's weights do not step: only the core's optimizer updates them")
        if self.main is None:
            raise RuntimeError("no main weights here: the optimizer keeps them and updates the model itself")
        if self.mixed:
            with torch.no_grad():
                for p, main in zip(self.params, self.main, strict=True):
                    p.copy_(main)


def _into_main(main: Tensor):
    def hook(param: Tensor) -> None:
        grad = param.grad
        if main.grad is None:
            main.grad = grad.float()
        else:
            main.grad.add_(grad)
        param.grad = None

    return hook


def _into_accumulator(grads: list[Tensor | None], index: int):
    def hook(param: Tensor) -> None:
        grad = param.grad
        if grads[index] is None:
            grads[index] = grad.float()
        else:
            grads[index].add_(grad)
        param.grad = None

    return hook
