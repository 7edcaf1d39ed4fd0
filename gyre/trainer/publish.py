"""The core's whole model as one flat buffer and manifest, in the engines' own parameter names (HF layout).

`engine_weights(trainable)` is the one call for both trainables (docs/training.md, "Publishing to the engines"):
- a native trainable (`gyre.trainer.native_trainable.NativeTrainable`, or its `DecoderLM`): the model's own
  `state_dict`, whose names are the HF names the engines take (the shared decoder, `gyre.models.decoder`); local,
  no collective, and Megatron is never imported;
- a Megatron trainable (`gyre.trainer.megatron_trainable.MegatronTrainable`, or its `GPTModel`), with the model's
  `DecoderConfig`: collective over the core cell (it gathers TP shards and PP stages, `gather_hf_state_dict`, imported
  on this first call): every rank of the core calls it; all get the same `FlatWeights`.
The result is a copy (one contiguous buffer): later updates of the trainer do not reach what was published.

A publication no longer takes this path: it streams the weights in buckets (`gyre.trainer.weight_stream`). The
runtime gathers the whole model only for a checkpoint's `trainer/` and the demo's in-process held-out evaluation;
`gyre.runtime.controller.transitions.publish_to_engines` hands whole weights to engines (tests, tools).
Importing this module loads neither Megatron nor any gyre.engine module (tests/unit/test_train_publish.py
checks it in a fresh interpreter).
"""

from __future__ import annotations

from typing import Protocol

import torch

from gyre.models.decoder import DecoderLM
from gyre.models.decoder_config import DecoderConfig
from gyre.models.flat_weights import FlatWeights, flatten_weights

__all__ = ["engine_weights"]


class HasModel(Protocol):
    """A trainable (`NativeTrainable`, `MegatronTrainable`): its module is `model`."""

    model: torch.nn.Module


def engine_weights(
    trainable: HasModel | torch.nn.Module, config: DecoderConfig | None = None, *, dtype: torch.dtype | None = None
) -> FlatWeights:
    """The whole model in HF names as one flat buffer: a native model's state dict as it is, a Megatron model's
    gathered over the core's TP and PP groups (collective; needs `config`, the model's `DecoderConfig`).
    `dtype`: cast floating tensors (e.g. the engines serve bf16 while the trainer keeps fp32)."""
    model = trainable if isinstance(trainable, torch.nn.Module) else getattr(trainable, "model", None)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"engine_weights: got a {type(trainable).__name__}, expected a trainable with a `model` module "
            "(NativeTrainable, MegatronTrainable) or the module itself"
        )
    if isinstance(model, DecoderLM):  # the shared decoder: its names are the engines' (HF) names
        if config is not None and config != model.config:
            raise ValueError(f"engine_weights: config={config!r} is not the native model's config {model.config!r}")
        tensors = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    else:
        if not isinstance(config, DecoderConfig):
            raise TypeError(
                f"engine_weights: config={config!r} is not allowed for a {type(model).__name__}: a Megatron model "
                "needs its DecoderConfig (the HF layout it is gathered into)"
            )
        from gyre.trainer.convert import gather_hf_state_dict  # Megatron, only on this path

        tensors = gather_hf_state_dict(model, config)
    if dtype is not None:
        tensors = {n: t.to(dtype) if t.is_floating_point() else t for n, t in tensors.items()}
    return flatten_weights(tensors)
