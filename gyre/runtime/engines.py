"""A cell's rollout engine as the runtime builds it (`engine.backend`; docs/sglang.md, "In the training program").

`engine_factory(cfg, model_dir, version, cell_size=)` is what a cell's leader (rank 0 for the core) hands to its
endpoint's `ServerThread`, which calls it on the endpoint's event loop:

- `native`: gyre's `NativeEngine` on the checkpoint, loaded here (on the caller's thread) in `engine.dtype` on this
  rank's `engine.device`;
- `sglang`: `SGLangEngine.from_pretrained`, one `sglang.Engine` per cell with `tp_size` = the cell's size on the
  cell's GPUs (`cell_engine_gpus`), built on the endpoint's loop (SGLang installs no signal handler off the main
  thread). SGLang loads the checkpoint itself; its start takes minutes on a GPU (`start_timeout_s`).

`check_backend(cfg)` is the program's check before anything starts: a message for the user where the backend cannot
run here (SGLang not installed; SGLang on a CPU, which only gyre's stand-in serves).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from gyre.config import TrainConfig
from gyre.config.trainer import device_kind

if TYPE_CHECKING:
    from gyre.engine.protocol import Engine

__all__ = ["SGLANG_START_S", "backend_problem", "engine_factory", "start_timeout_s"]

NATIVE_START_S = 30.0
SGLANG_START_S = 1800.0  # SGLang loads the checkpoint, profiles memory and captures CUDA graphs before it serves


def _is_standin(origin: str | None) -> bool:
    from gyre.engine.sglang_standin import PATH

    return origin is not None and Path(origin).resolve().parent.parent == PATH


def backend_problem(cfg: TrainConfig) -> str | None:
    """Why `engine.backend` cannot run here (one line for the user), or None."""
    if cfg.engine.backend != "sglang":
        return None
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        return (
            "engine.backend=sglang: the sglang package is not installed here; install gyre's gpu extra on a machine "
            "with CUDA GPUs (pip install -e '.[gpu]'), or run engine.backend=native (docs/sglang.md)"
        )
    if device_kind(cfg.engine.device) != "cuda" and not _is_standin(spec.origin):
        return (
            f"engine.backend=sglang with engine.device={cfg.engine.device}: SGLang serves on CUDA GPUs; set "
            "engine.device=cuda trainer.device=cuda (docs/sglang.md)"
        )
    return None


def start_timeout_s(cfg: TrainConfig) -> float:
    return SGLANG_START_S if cfg.engine.backend == "sglang" else NATIVE_START_S


def engine_factory(cfg: TrainConfig, model_dir: Path, version: int, *, cell_size: int) -> Callable[[], Engine]:
    """The factory of this cell's engine on `model_dir` serving `version` (module docstring)."""
    e = cfg.engine
    if e.backend == "sglang":
        from gyre.engine.sglang_engine import SGLangEngine, sglang_engine_args

        args = sglang_engine_args(
            tp_size=cell_size,
            base_gpu_id=_first_gpu(cfg, cell_size),
            dtype=e.dtype,
            max_running=e.max_running,
            max_total_tokens=e.max_total_tokens,
            seed=cfg.seed,
            extra=e.sglang_args,
        )
        options = {"policy_version": version}
        return lambda: SGLangEngine.from_pretrained(str(model_dir), adapter_options=options, **args)

    import torch

    from gyre.engine.native import NativeEngine
    from gyre.models.hf_weights import load_pretrained

    model = load_pretrained(model_dir, getattr(torch, e.dtype), e.device)
    return lambda: NativeEngine(
        model,
        max_running=e.max_running,
        max_tokens_in_flight=e.max_total_tokens or None,
        policy_version=version,
    )


def _first_gpu(cfg: TrainConfig, cell_size: int) -> int:
    """The first of the cell's GPUs for its SGLang engine: this rank's current CUDA device (the job made it so:
    `gyre.runtime.job.open_job`); 0 on the stand-in's CPU."""
    if device_kind(cfg.engine.device) != "cuda":
        return 0
    import torch

    from gyre.distributed.backends import cell_engine_gpus

    return cell_engine_gpus(torch.cuda.current_device(), cell_size, torch.cuda.device_count())
