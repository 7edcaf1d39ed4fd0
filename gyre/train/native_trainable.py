"""The native torch decoder (`gyre.engine.model.DecoderLM`) as a `Trainable`: packed rows, AdamW, clipping.

For CPU runs, tests of the streaming step and a reference the Megatron trainable is compared with. Parameters are
the module's own tensors (no tensor parallelism).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from gyre.data.microstep import MicroStep
from gyre.engine.model import DecoderLM, block_causal_mask, segments_from_positions

__all__ = ["NativeTrainable", "packed_logprobs"]


def packed_logprobs(model: DecoderLM, step: MicroStep) -> Tensor:
    """`[U]` log-probs of every token given the tokens before it in its row (0 at each row's first token)."""
    device = model.output_weight.device
    ids_1U = torch.from_numpy(step.ids_U).to(device)[None]
    positions_1U = torch.from_numpy(step.positions_U()).to(device)[None]
    mask_1UU = block_causal_mask(segments_from_positions(positions_1U))
    logits_1UV, _ = model(ids_1U, positions_1U, attention_mask=mask_1UU)
    logp_UV = F.log_softmax(logits_1UV[0, :-1].float(), dim=-1)
    next_logp = logp_UV.gather(1, ids_1U[0, 1:, None])[:, 0]
    row_start_U = positions_1U[0] == 0
    return torch.cat((next_logp.new_zeros(1), next_logp)).masked_fill(row_start_U, 0.0)


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
