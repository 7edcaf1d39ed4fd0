"""The native torch decoder (`gyre.models.decoder.DecoderLM`) as a `Trainable`: packed rows, AdamW, clipping.

For CPU runs, tests of the streaming step and a reference the Megatron trainable is compared with. Parameters are
the module's own tensors (no tensor parallelism).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from gyre.data.microstep import MicroStep
from gyre.models.decoder import DecoderLM

__all__ = ["NativeTrainable", "packed_logprobs"]


def packed_logprobs(model: DecoderLM, step: MicroStep) -> Tensor:
    """`[U]` log-probs of every token given the tokens before it in its row (0 at each row's first token).
    One forward per row (dense attention over the packed tokens would cost U^2, see gyre.train.logprobs)."""
    device = model.output_weight.device
    parts = []
    for start, end in itertools.pairwise(step.row_offsets_R1.tolist()):
        ids_1L = torch.from_numpy(step.ids_U[start:end]).to(device)[None]
        positions_1L = torch.arange(end - start, device=device)[None]
        logits_1LV, _ = model(ids_1L, positions_1L)  # causal within the row
        logp_LV = F.log_softmax(logits_1LV[0, :-1].float(), dim=-1)
        parts += [logp_LV.new_zeros(1), logp_LV.gather(1, ids_1L[0, 1:, None])[:, 0]]
    return torch.cat(parts)


class NativeTrainable:
    """AdamW on the native decoder; `update` clips the gradient norm to `max_grad_norm` (0 disables clipping)."""

    def __init__(self, model: DecoderLM, *, lr: float, weight_decay: float = 0.0, max_grad_norm: float = 1.0):
        self.model = model
        self._params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self._params, lr=lr, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm

    def logprobs(self, step: MicroStep) -> Tensor:
        return packed_logprobs(self.model, step)

    def parameters(self) -> list[Tensor]:
        return self._params

    def update(self) -> dict[str, float]:
        # max_norm=inf measures without clipping
        norm = torch.nn.utils.clip_grad_norm_(self._params, self.max_grad_norm if self.max_grad_norm > 0 else math.inf)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(norm)}
