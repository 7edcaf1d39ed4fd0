"""A cell's trainer as the runtime builds it, and the core's whole weights out of it (docs/runtime.md, "Megatron
cells").

`build_trainable(cfg, model_dir, core=)` is what every rank of a cell calls the first time its cell enters the training
role, on the thread that will train (rank 0: the core's trainer thread; every other rank: its main thread):

- `trainer.backend=native`: the starting checkpoint as a `DecoderLM` in a `NativeTrainable` (one rank per cell);
- `trainer.backend=megatron`: a Megatron-core `GPTModel` for this rank's tensor-parallel shard of its pipeline
  stage (`gyre.trainer.model.build_gpt_model`; Megatron's `parallel_state` was initialized by `open_job`), this
  rank's shard of the starting checkpoint read straight from its files (`gyre.trainer.shard_loading.
  load_hf_checkpoint`: no rank holds the whole model), in a `MegatronTrainable`; at PP > 1 with the stage's
  `StreamingPipeline` (the step's 1F1B schedule over the cell's stages, `cfg.loss`).

The core's whole model in HF names is `gyre.trainer.publish.engine_weights(trainable, config)`: local for a native
trainer, a collective over the core cell's tensor- and pipeline-parallel groups for a Megatron one, so every rank
of the core calls it at the same point of its work; the controller tells the core's other ranks with a `gather`
decision.
`policy_model(weights, config)` makes a `DecoderLM` of them for what needs a whole model on rank 0 (the
held-out evaluation, `<run dir>/policy/`).

A checkpoint keeps the optimizer state of every rank of the core (docs/runtime.md, "Checkpoints and resume"): each
writes its own with `save_optimizer` (rank 0 on its trainer thread, the core's other ranks at a `save_optimizer`
decision) into the checkpoint's staging directory, one file per in-cell coordinate, and a resumed run's core ranks
load theirs with `restore_optimizer` right after `build_trainable`. The files are laid out for the trainer that
wrote them (`trainer_layout`: backend, TP, PP); a run resumes only with the same layout.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import torch

from gyre.config import TrainConfig
from gyre.models.decoder import DecoderLM
from gyre.models.decoder_config import DecoderConfig, read_config
from gyre.models.flat_weights import FlatWeights, unflatten_weights
from gyre.models.hf_weights import load_pretrained, without_tolerated
from gyre.runtime.job.checkpoint import optimizer_file

log = logging.getLogger(__name__)

__all__ = [
    "GATHER",
    "SAVE_OPTIMIZER",
    "build_trainable",
    "optimizer_state",
    "policy_model",
    "restore_optimizer",
    "save_optimizer",
    "state_digest",
    "uses_megatron",
]

GATHER = "gather"  # the control decision: the core's ranks gather its whole weights now (a collective)
SAVE_OPTIMIZER = "save_optimizer"  # the control decision: the core's ranks write their optimizer state (`path`)


def uses_megatron(cfg: TrainConfig) -> bool:
    return cfg.trainer.backend == "megatron"


def build_trainable(cfg: TrainConfig, model_dir: Path, *, core: bool = True):
    """This rank's trainer on the starting checkpoint (module docstring), seeded with `cfg.seed`. `core=False`: a
    satellite's, which never steps (no optimizer, no fp32 main weights: it accumulates fp32 gradients only)."""
    t = cfg.trainer
    torch.manual_seed(cfg.seed)
    dtype = getattr(torch, t.dtype)  # bf16: the model computes in it, the update is fp32 (gyre.trainer.precision)
    if not uses_megatron(cfg):
        from gyre.trainer.native_trainable import NativeTrainable

        return NativeTrainable(
            load_pretrained(model_dir, dtype, t.device),
            lr=t.lr,
            weight_decay=t.weight_decay,
            max_grad_norm=t.max_grad_norm,
            chunk_tokens=t.logprob_chunk_tokens,
            recompute=t.recompute,
            routing_replay=t.routing_replay,
            steps=core,
        )
    from gyre.trainer.megatron_trainable import MegatronTrainable
    from gyre.trainer.model import build_gpt_model
    from gyre.trainer.shard_loading import load_hf_checkpoint

    config = read_config(model_dir)
    # No random init: every parameter is then read from the checkpoint, this rank's shard only.
    model = build_gpt_model(config, dtype=dtype, recompute=t.recompute, perform_initialization=False)
    load_hf_checkpoint(model, model_dir, config)
    if t.device != "cpu":
        model = model.to(t.device)
    pipeline = None
    if t.pipeline_parallel_size > 1:
        from gyre.trainer.pipeline import StreamingPipeline

        pipeline = StreamingPipeline(model, config=cfg.loss, chunk_tokens=t.logprob_chunk_tokens)
    return MegatronTrainable(
        model,
        lr=t.lr,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        chunk_tokens=t.logprob_chunk_tokens,
        pipeline=pipeline,
        routing_replay=t.routing_replay,
        steps=core,
        offload_fraction=t.optimizer_offload_fraction,
    )


def optimizer_state(trainer) -> dict[str, Any]:
    """What a checkpoint keeps of a core rank's trainer besides the core's weights: this rank's optimizer state (of
    its shard of the model), torch's RNG state, and for a mixed-precision trainer (bf16) its fp32 main weights, in the
    order of its parameters (`gyre.trainer.precision`): the weights the optimizer steps, which the checkpoint's bf16
    weights only round (docs/runtime.md, "Checkpoints and resume")."""
    state: dict[str, Any] = {"optimizer": trainer.optimizer.state_dict(), "rng": torch.get_rng_state()}
    weights = getattr(trainer, "weights", None)
    if weights is not None and weights.mixed and weights.main is not None:  # offload: in the optimizer's state
        state["main"] = [main.detach().cpu().clone() for main in weights.main]
    return state


def _restore_main(trainer, saved: list | None, path: Path) -> None:
    """The fp32 main weights of a mixed-precision trainer, bit for bit, then the model rounded from them."""
    weights = getattr(trainer, "weights", None)
    if weights is None or not weights.mixed or weights.main is None:  # offload: the optimizer's state held them
        return
    if saved is None:
        log.warning("%s: no fp32 main weights kept (an older checkpoint): rebuilt from the bf16 weights", path)
        return
    if len(saved) != len(weights.main) or any(
        s.shape != m.shape or s.dtype != m.dtype for s, m in zip(saved, weights.main, strict=False)
    ):
        raise ValueError(f"{path}: its main weights do not match this rank's parameters (another model or layout)")
    with torch.no_grad():
        for main, value in zip(weights.main, saved, strict=True):
            main.copy_(value)
    weights.copy_to_model()


def save_optimizer(trainer, trainer_dir: Path, *, coordinate: int, cell_size: int, layout: dict[str, Any]) -> Path:
    """This core rank's `optimizer_state`, with its in-cell coordinate and `layout` (`trainer_layout`), as its file of
    `trainer_dir` (the `trainer/` of a checkpoint being written, `gyre.runtime.job.checkpoint.optimizer_file`), on disk
    (fsynced: another host's rank 0 marks the checkpoint complete) when it returns; its path. OSError as it
    comes."""
    state = {**optimizer_state(trainer), "coordinate": coordinate, "layout": layout}
    path = Path(trainer_dir) / optimizer_file(coordinate, cell_size)
    with open(path, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    return path


def restore_optimizer(
    trainer, trainer_dir: Path, *, coordinate: int, cell_size: int, layout: dict[str, Any]
) -> str | None:
    """Load this core rank's file of a checkpoint's `trainer_dir` (`save_optimizer`) into `trainer` (built on
    the checkpoint's weights): its optimizer state, its fp32 main weights (bf16) and torch's RNG state. The
    digest of what the rank holds then (`state_digest`; logged), or None, with a warning, when the checkpoint
    kept none (one of a Megatron core of several ranks written before they were kept: AdamW starts afresh).
    ValueError for a file of another rank or layout."""
    path = Path(trainer_dir) / optimizer_file(coordinate, cell_size)
    if not path.is_file():
        log.warning("%s: no optimizer state kept for this rank: AdamW starts afresh", path)
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    saved = {key: state[key] for key in ("coordinate", "layout") if key in state}  # a single rank's of before: none
    if saved and saved != {"coordinate": coordinate, "layout": layout}:
        raise ValueError(
            f"{path}: the optimizer state of in-cell coordinate {saved['coordinate']} of {saved['layout']}, loaded at "
            f"coordinate {coordinate} of {layout}: resume with the checkpoint's trainer layout"
        )
    trainer.optimizer.load_state_dict(state["optimizer"])
    _restore_main(trainer, state.get("main"), path)
    torch.set_rng_state(state["rng"])
    digest = state_digest(optimizer_state(trainer))
    log.info("optimizer state of in-cell coordinate %d restored from %s (digest %s)", coordinate, path, digest)
    return digest


def state_digest(state: Any) -> str:
    """A sha256 of `state` (nested dicts, lists and tensors): equal exactly when every tensor has the same dtype,
    shape and bytes and everything else the same value; how a resumed rank says what it loaded."""
    digest = hashlib.sha256()

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            digest.update(f"tensor {tensor.dtype} {tuple(tensor.shape)};".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            digest.update(f"dict {len(value)};".encode())
            for key in sorted(value, key=str):
                digest.update(f"{key!r}:".encode())
                walk(value[key])
        elif isinstance(value, list | tuple):
            digest.update(f"list {len(value)};".encode())
            for item in value:
                walk(item)
        else:
            digest.update(f"{value!r};".encode())

    walk(state)
    return digest.hexdigest()


def policy_model(weights: FlatWeights, config: DecoderConfig) -> DecoderLM:
    """A `DecoderLM` (CPU, fp32, eval mode) holding `weights` (a copy: the flat buffer may be reused)."""
    state = {name: tensor.clone().float() for name, tensor in unflatten_weights(weights).items()}
    state = without_tolerated(state, config, where="the core's weights")
    with torch.device("meta"):
        model = DecoderLM(config)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
