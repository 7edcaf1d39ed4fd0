"""A cell's trainer as the runtime builds it, and the core's whole weights out of it (docs/runtime.md, "Megatron
cells").

`build_trainable(cfg, model_dir)` is what every rank of a cell calls the first time its cell enters the training
role, on the thread that will train (rank 0: the core's trainer thread; every other rank: its main thread):

- `trainer.backend=native`: the starting checkpoint as a `DecoderLM` in a `NativeTrainable` (one rank per cell);
- `trainer.backend=megatron`: a Megatron-core `GPTModel` for this rank's tensor-parallel shard
  (`gyre.train.model.build_gpt_model`; Megatron's `parallel_state` was initialized by `open_job`), this rank's
  shard of the starting checkpoint read straight from its files (`gyre.train.shard_loading.load_hf_checkpoint`:
  no rank holds the whole model), in a `MegatronTrainable`.

The core's whole model in HF names is `gyre.train.publish.engine_weights(trainable, config)`: local for a native
trainer, a collective over the core cell's tensor-parallel group for a Megatron one, so every rank of the core
calls it at the same point of its work; the controller tells the core's other ranks with a `gather` decision.
`policy_model(weights, config)` makes a `DecoderLM` of them for what needs a whole model on rank 0 (the
held-out evaluation, `<run dir>/policy/`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from gyre.config import TrainConfig
from gyre.models.decoder import DecoderLM
from gyre.models.decoder_config import DecoderConfig
from gyre.models.flat_weights import FlatWeights, unflatten_weights
from gyre.models.hf_weights import load_pretrained, read_config, without_tolerated

__all__ = ["GATHER", "build_trainable", "optimizer_state", "policy_model", "restore_optimizer", "uses_megatron"]

GATHER = "gather"  # the control decision: the core's ranks gather its whole weights now (a collective)


def uses_megatron(cfg: TrainConfig) -> bool:
    return cfg.trainer.backend == "megatron"


def build_trainable(cfg: TrainConfig, model_dir: Path):
    """This rank's trainer on the starting checkpoint (module docstring), seeded with `cfg.seed`."""
    t = cfg.trainer
    torch.manual_seed(cfg.seed)
    dtype = getattr(torch, t.dtype)  # bf16: the model computes in it, the update is fp32 (gyre.train.precision)
    if not uses_megatron(cfg):
        from gyre.train.native_trainable import NativeTrainable

        return NativeTrainable(
            load_pretrained(model_dir, dtype, t.device),
            lr=t.lr,
            weight_decay=t.weight_decay,
            max_grad_norm=t.max_grad_norm,
            chunk_tokens=t.logprob_chunk_tokens,
            recompute=t.recompute,
        )
    from gyre.train.megatron_trainable import MegatronTrainable
    from gyre.train.model import build_gpt_model
    from gyre.train.shard_loading import load_hf_checkpoint

    config = read_config(model_dir)
    # No random init: every parameter is then read from the checkpoint, this rank's shard only.
    model = build_gpt_model(config, dtype=dtype, recompute=t.recompute, perform_initialization=False)
    load_hf_checkpoint(model, model_dir, config)
    if t.device != "cpu":
        model = model.to(t.device)
    return MegatronTrainable(
        model, lr=t.lr, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm, chunk_tokens=t.logprob_chunk_tokens
    )


def optimizer_state(trainer) -> dict | None:
    """What a checkpoint keeps of the core's trainer besides its weights: the optimizer's state (a copy) and torch's
    RNG state; None for a Megatron core of several ranks, whose optimizer state is sharded over them (not kept:
    docs/runtime.md, "Checkpoints and resume")."""
    import copy

    if uses_megatron_sharded(trainer):
        return None
    return {"optimizer": copy.deepcopy(trainer.optimizer.state_dict()), "rng": torch.get_rng_state()}


def uses_megatron_sharded(trainer) -> bool:
    from torch import distributed as dist

    if isinstance(trainer.model, DecoderLM):
        return False
    from megatron.core import parallel_state

    return dist.is_initialized() and parallel_state.get_tensor_model_parallel_world_size() > 1


def restore_optimizer(trainer, path: Path) -> None:
    """Load `optimizer_state`'s file into `trainer` (its optimizer built on the checkpoint's weights)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    trainer.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])


def policy_model(weights: FlatWeights, config: DecoderConfig) -> DecoderLM:
    """A `DecoderLM` (CPU, fp32, eval mode) holding `weights` (a copy: the flat buffer may be reused)."""
    state = {name: tensor.clone().float() for name, tensor in unflatten_weights(weights).items()}
    state = without_tolerated(state, config, where="the core's weights")
    with torch.device("meta"):
        model = DecoderLM(config)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
