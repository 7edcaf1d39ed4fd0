"""What is checked before any worker starts (docs/runtime.md, "The program"): every mistake a user can fix, one line
naming the field, raised as `ProgramError`.

`prepare(cfg, recipe, run_dir)` runs once, on the launching process (a plain run of several ranks) or on rank 0: the
run directory can be written, the proxy's port is free, the checkpoint `resume` names can be resumed, the recipe's
task sets (and the held-out task directory's), the harness and its sandbox can run here, then the starting
checkpoint (`model.model_dir` or the recipe's starting model: its context limit, the trainer's layout, the recipe's
own rules). `check_supported(cfg, world_size)` is checked first of all: the job's size fits the cells, an engine
backend that can run here, no context parallelism. The app (`gyre.train.app`) prints the line and exits 2.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from gyre.config import ConfigError, TrainConfig
from gyre.config.proxy import ProxyConfig
from gyre.config.train import check_context_limit, layout_fields
from gyre.runtime.job.checkpoint import Checkpoint
from gyre.runtime.recipe import Recipe, RecipeError, TaskSets
from gyre.runtime.task_sets import TaskSetError

__all__ = ["EXECUTIONS_DIR", "RECORDS_DIR", "Prepared", "ProgramError", "check_supported", "prepare", "run_sandbox"]

RECORDS_DIR = "records"  # <run dir>/records/: the proxy's record of every model call, one file per execution
EXECUTIONS_DIR = "executions"  # <run dir>/executions/: the executions' workspaces


class ProgramError(ValueError):
    """The run cannot start as configured (one line naming the field and what to do)."""


@dataclass
class Prepared:
    model_dir: Path
    task_sets: TaskSets
    checkpoint: Checkpoint | None = None  # the checkpoint the run resumes from (`resume`)


def check_supported(cfg: TrainConfig, world_size: int) -> None:
    """What this runtime runs: the job's size fits the cells and the separate rollout pool's ranks; native cells of
    one rank or Megatron cells of TP x PP ranks."""
    try:
        layout_fields(cfg, world_size)
    except ConfigError as error:
        raise ProgramError(str(error)) from None
    from gyre.runtime.cell.engines import backend_problem

    if problem := backend_problem(cfg):
        raise ProgramError(problem)
    if cfg.trainer.context_parallel_size != 1:
        import importlib.util

        import torch

        has_te = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
        why = (
            "this runtime does not split rows over ranks yet"
            if has_te
            else "context parallelism needs TransformerEngine's attention on CUDA, absent here"
        )
        raise ProgramError(
            f"trainer.context_parallel_size={cfg.trainer.context_parallel_size}: {why} (expected 1; long rows train "
            "with trainer.recompute=full and chunked log-probs instead: docs/training.md, 'Long rows')"
        )


def proxy_config(cfg: TrainConfig) -> ProxyConfig:
    """The proxy's config: `cfg.proxy`, recording each call's routed experts when the trainer replays them."""
    if cfg.trainer.routing_replay and not cfg.proxy.record_routed_experts:
        return replace(cfg.proxy, record_routed_experts=True)
    return cfg.proxy


def check_model_layout(cfg: TrainConfig, config) -> None:
    """A Megatron trainer can shard the model over the cell's ranks (heads, KV heads, vocabulary divisible by TP;
    layers by PP)."""
    if cfg.trainer.routing_replay and not config.num_experts:
        raise ProgramError(
            f"trainer.routing_replay=true: the model ({config.model_type}) has no experts to route; leave it false"
        )
    if cfg.trainer.backend != "megatron":
        return
    from gyre.trainer.model import validate_layout

    t = cfg.trainer
    tp, pp, ep = t.tensor_parallel_size, t.pipeline_parallel_size, t.expert_parallel_size
    try:
        validate_layout(config, tp, pp, ep)
    except ValueError as error:
        fields = f"trainer.tensor_parallel_size={tp}" + (f" trainer.pipeline_parallel_size={pp}" if pp > 1 else "")
        fields += f" trainer.expert_parallel_size={ep}" if ep > 1 else ""
        raise ProgramError(f"{fields}: {error}") from None


def resolve_model_dir(cfg: TrainConfig, recipe: Recipe, echo: Callable[[str], None] = print) -> Path:
    """The starting checkpoint: `model.model_dir`, or the recipe's starting model; checked against the config's
    context limit, the trainer's layout and the recipe's own rules."""
    from gyre.models.decoder_config import read_config

    if cfg.model.model_dir:
        model_dir = Path(cfg.model.model_dir)
        if not (model_dir / "config.json").is_file():
            raise ProgramError(
                f"model.model_dir={cfg.model.model_dir!r}: no config.json there (expected an HF-layout checkpoint "
                "directory: config.json, safetensors, tokenizer files with a chat template)"
            )
    else:
        try:
            model_dir = Path(recipe.starting_model(cfg, echo))
        except RecipeError as error:
            raise ProgramError(str(error)) from None
    config = read_config(model_dir)
    try:
        limit = check_context_limit(cfg, config.max_position_embeddings)
    except ConfigError as error:
        raise ProgramError(str(error)) from None
    check_model_layout(cfg, config)
    try:
        recipe.check(cfg, model_dir, limit)
    except RecipeError as error:
        raise ProgramError(str(error)) from None
    return model_dir


def check_proxy_port(host: str, port: int) -> None:
    """A fixed `proxy.port` is free on `proxy.host` now (0 picks a free one at start and is not checked)."""
    if port == 0:
        return
    probe = socket.socket()
    try:
        probe.bind((host, port))
    except OSError as error:
        raise ProgramError(
            f"proxy.port={port}: cannot listen on {host}:{port} ({error.strerror}); choose another port, or 0 for a "
            "free one"
        ) from None
    finally:
        probe.close()


def check_run_dir(run_dir: Path) -> None:
    """The run directory can be written (a file is created, synced and removed there)."""
    probe = Path(run_dir) / f".write-probe-{os.getpid()}"
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        with open(probe, "w") as handle:
            handle.write("gyre\n")
            handle.flush()
            os.fsync(handle.fileno())
        probe.unlink()
    except OSError as error:
        raise ProgramError(
            f"hydra.run.dir={str(run_dir)!r}: cannot write there ({error.strerror or error}); free space or choose a "
            "writable directory"
        ) from None


def resolve_checkpoint(cfg: TrainConfig, run_dir: Path, echo: Callable[[str], None]) -> Checkpoint | None:
    """The checkpoint `resume` names (docs/runtime.md, "Checkpoints and resume"); ProgramError for one that cannot
    be resumed here."""
    from gyre.runtime.job.resume import ResumeError, checkpoint_to_resume

    try:
        checkpoint = checkpoint_to_resume(cfg.resume, run_dir)
    except ResumeError as error:
        raise ProgramError(str(error)) from None
    if checkpoint is None:
        if cfg.resume == "auto":
            echo("resume=auto: no complete checkpoint in the run directory, starting afresh")
        return None
    from gyre.runtime.cell.trainers import trainer_layout
    from gyre.runtime.controller.checkpoints import run_shape

    saved = checkpoint.state.get("shape", {})
    changed = [f"{k}={v!r} (the checkpoint's: {saved[k]!r})" for k, v in run_shape(cfg).items() if saved.get(k, v) != v]
    if changed:
        raise ProgramError(
            f"resume: {', '.join(changed)}: a run resumes with the schedule of its checkpoint ({checkpoint.path})"
        )
    layout = trainer_layout(cfg)
    saved = checkpoint.state.get("trainer_layout", layout)  # a checkpoint of before it was kept: its files say
    changed = [f"{k}={v!r} (the checkpoint's: {saved[k]!r})" for k, v in layout.items() if saved.get(k, v) != v]
    if changed:
        raise ProgramError(
            f"resume: {', '.join(changed)}: the checkpoint's optimizer state is laid out for its trainer; resume "
            f"with its layout, or start a new run from its weights alone with model.model_dir={checkpoint.trainer_dir} "
            "(AdamW afresh)"
        )
    if checkpoint.step >= cfg.steps:
        raise ProgramError(
            f"steps={cfg.steps}: the checkpoint {checkpoint.path} has {checkpoint.step} steps done already; raise "
            "steps to train on from it"
        )
    echo(f"resuming from {checkpoint.path} (step {checkpoint.step} of {cfg.steps})")
    return checkpoint


def prepare(cfg: TrainConfig, recipe: Recipe, run_dir: Path, echo: Callable[[str], None]) -> Prepared:
    """The checks that need no process group, the checkpoint to resume, the recipe's task sets, the harness
    preflight, then the starting checkpoint (ProgramError)."""
    from gyre.runtime.job.harness_setup import HarnessSetupError, check_harness, harness_provisioning, make_runner

    check_run_dir(run_dir)
    check_proxy_port(cfg.proxy.host, cfg.proxy.port)
    checkpoint = resolve_checkpoint(cfg, run_dir, echo)
    try:
        task_sets = recipe.task_sets(cfg, run_dir)
    except (RecipeError, TaskSetError) as error:
        raise ProgramError(str(error)) from None
    if not task_sets.train:
        raise ProgramError(f"recipe.name={recipe.name!r}: the recipe gave no training task")
    held_out_dir_tasks = []
    if cfg.tasks.held_out_dir and cfg.tasks.eval_every > 0 and task_sets.held_out is None:
        from gyre.runtime.held_out_tasks import load_held_out_tasks

        try:
            held_out_dir_tasks = load_held_out_tasks(cfg, task_sets.train)
        except TaskSetError as error:
            raise ProgramError(str(error)) from None
    # The harness before the starting model: a harness that cannot run is one line now, not after a warm start.
    try:
        sandbox = run_sandbox(cfg, run_dir, trusted_tasks=task_sets.trusted)
        held_out = task_sets.held_out.tasks if task_sets.held_out is not None else held_out_dir_tasks
        provisioning = harness_provisioning(cfg.harness)
        runner = make_runner(cfg.harness, task_sets.train[0], provisioning)
        check_harness(runner, sandbox, [*task_sets.train, *held_out])
    except HarnessSetupError as error:
        raise ProgramError(str(error)) from None
    model_dir = resolve_model_dir(cfg, recipe, echo)
    if held_out_dir_tasks:
        from gyre.runtime.held_out_tasks import held_out_tasks

        task_sets = replace(task_sets, held_out=held_out_tasks(cfg, run_dir, held_out_dir_tasks, model_dir))
    return Prepared(model_dir=model_dir, task_sets=task_sets, checkpoint=checkpoint)


def run_sandbox(cfg: TrainConfig, run_dir: Path, *, trusted_tasks: bool):
    """The run's sandbox for harnesses and evaluators: workspaces under `executions/`, `records/` protected."""
    from gyre.runtime.job.harness_setup import make_sandbox

    (run_dir / RECORDS_DIR).mkdir(parents=True, exist_ok=True)
    return make_sandbox(
        cfg.harness,
        cfg.limits,
        root=run_dir / EXECUTIONS_DIR,
        trusted_tasks=trusted_tasks,
        protected=(run_dir / RECORDS_DIR,),
    )
