"""The run plan (docs/runtime.md, "The run plan"): everything the program decides from the config and the
filesystem, built once, before any worker starts, with one error type.

A `RunPlan` holds the checked `TrainConfig` and what follows from it here: the job's layout (cells, their parallel
sizes, the separate rollout pool), the starting checkpoint's directory and its model config (family, sizes, context
limit), the checkpoint the run resumes from and the weights every rank starts on, the task sets, the harness's files,
the proxy's settings as served. Every rank receives the plan, not the raw config (`config.yaml` is still written beside
it by the app); nothing after the plan checks the config again.

`plan_layout(cfg, world_size)` is the first part: the job's size fits the cells (`layout_fields`), the launcher's secret
can be sent, a backend that runs here, no context parallelism, the trainer can shard the starting model, and every
rank's memory fits the device (`check_memory`, `gyre.trainer.memory_plan`), from the starting model's config alone
(`starting_model_config`: `model.model_dir`'s config.json, or the tiny model's spec, which the recipes start from when
it is empty). Under torchrun or srun every rank makes it before its process group exists (so a layout that cannot fit
is refused by every rank alike, with nothing begun) and rank 0 builds the rest and sends the plan to the others; run
plainly, the launching process builds the whole plan once and hands it to its workers. `build_plan(cfg, recipe,
run_dir, layout=...)` is the rest, in this order: the run directory can be written, the proxy's port is free, the
checkpoint `resume` names can be resumed, the recipe's task sets (and the held-out task directory's), the harness and
its sandbox run here, then the starting model (`model.model_dir` or the recipe's: its config.json, its context limit,
the recipe's own rules).
Each check runs once (`CHECKS`, counted by tests/unit/test_run_plan.py) and raises `PlanError`, one line naming the
field; the app prints it and exits 2. Building the plan imports no torch; a recipe that must build its starting model
(the demo's warm start, cached after its first run) does so with torch in `starting_model`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gyre.config import ConfigError, TrainConfig
from gyre.config.proxy import ProxyConfig
from gyre.config.train import check_context_limit, layout_fields
from gyre.config.trainer import device_kind
from gyre.distributed.layout import Layout
from gyre.engine.sglang_standin import PATH as STANDIN_PATH  # gyre's stand-in for SGLang in tests (docs/sglang.md)
from gyre.models.decoder_config import DecoderConfig, read_config
from gyre.obs.logging import FILE_ONLY
from gyre.runtime.job.checkpoint import Checkpoint, StartingPoint
from gyre.runtime.job.harness_setup import (
    HarnessSetupError,
    Provisioning,
    check_harness,
    harness_provisioning,
    make_runner,
    make_sandbox,
)
from gyre.runtime.job.launch import job_secret
from gyre.runtime.job.resume import ResumeError, checkpoint_to_resume, starting_point
from gyre.runtime.job.run_shape import run_shape, trainer_layout
from gyre.runtime.recipe import Recipe, RecipeError, TaskSets
from gyre.runtime.task_sets import TaskSetError

log = logging.getLogger(__name__)

__all__ = [
    "CHECKS",
    "EXECUTIONS_DIR",
    "RECORDS_DIR",
    "PlanError",
    "RunPlan",
    "build_plan",
    "plan_layout",
    "run_sandbox",
]

RECORDS_DIR = "records"  # <run dir>/records/: the proxy's record of every model call, one file per execution
EXECUTIONS_DIR = "executions"  # <run dir>/executions/: the executions' workspaces


class PlanError(ValueError):
    """The run cannot start as configured: one line naming the field, the value and what to do."""


@dataclass(frozen=True)
class RunPlan:
    """What the program decided before any worker started (module docstring); every rank receives it."""

    cfg: TrainConfig  # the checked config (its sections; serve `proxy` below, not cfg.proxy)
    run_dir: Path
    layout: Layout  # the job's ranks: K cells of cell_size (TP x PP x EP of the trainer), the separate pool's ranks
    model_dir: Path  # the starting checkpoint (HF layout)
    model: DecoderConfig  # its config.json: the model's family (`model_type`) and sizes
    context_limit: int  # a model call's longest context (proxy.context_limit, or the model's)
    checkpoint: Checkpoint | None  # the checkpoint the run resumes from
    start: StartingPoint  # the weights the trainers and the engines start from, and the engines' policy version
    task_sets: TaskSets  # the training tasks, the held-out set, whether the tasks are the recipe's own
    provisioning: Provisioning  # the harness's files (settings, instructions) read once
    proxy: ProxyConfig  # the proxy as served: records routed experts when the trainer replays them

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def records_dir(self) -> Path:
        return self.run_dir / RECORDS_DIR

    @property
    def executions_dir(self) -> Path:
        return self.run_dir / EXECUTIONS_DIR


# Every check of the plan, in the order it runs: each runs once per plan (tests/unit/test_run_plan.py counts them).
CHECKS = (
    "check_job_size",
    "check_job_secret",
    "check_engine_backend",
    "check_context_parallel",
    "check_model_layout",
    "check_memory",
    "check_run_dir",
    "check_proxy_port",
    "resolve_checkpoint",
    "load_task_sets",
    "check_harness_here",
    "resolve_model",
    "check_recipe",
)


def plan_layout(cfg: TrainConfig, world_size: int, *, echo: Callable[[str], None] | None = None) -> Layout:
    """The job's layout for `world_size` processes, and what this runtime runs on it, the memory of its ranks among
    it (PlanError). `echo` gets the memory plan's line and the log its table; None: neither (a rank under a launcher
    other than rank 0, which says them)."""
    layout = check_job_size(cfg, world_size)
    check_job_secret()
    check_engine_backend(cfg)
    check_context_parallel(cfg)
    model = starting_model_config(cfg)
    check_model_layout(cfg, model)
    check_memory(cfg, model, echo)
    return layout


def starting_model_config(cfg: TrainConfig) -> DecoderConfig:
    """The starting model's config without building it: `model.model_dir`'s config.json, or, with it empty, the tiny
    model's spec (what the recipes start from: `gyre.models.tiny`)."""
    if cfg.model.model_dir:
        return _read_model_config(Path(cfg.model.model_dir), "model.model_dir")
    from gyre.models.tiny import decoder_config

    spec = cfg.model.tiny
    return decoder_config(spec, vocab_size=spec.vocab_size, bos_token_id=0, eos_token_id=1)


def _read_model_config(model_dir: Path, field: str) -> DecoderConfig:
    """`model_dir`'s config.json (PlanError naming `field` when it is missing or unreadable)."""
    if not (model_dir / "config.json").is_file():
        raise PlanError(
            f"{field}={str(model_dir)!r}: no config.json there (expected an HF-layout checkpoint directory: "
            "config.json, safetensors, tokenizer files with a chat template)"
        )
    try:
        return read_config(model_dir)
    except (OSError, ValueError) as error:
        raise PlanError(f"{field}: {model_dir / 'config.json'} cannot be read as a model config ({error})") from None


def build_plan(
    cfg: TrainConfig, recipe: Recipe, run_dir: Path, *, layout: Layout, echo: Callable[[str], None] = print
) -> RunPlan:
    """The rest of the plan on `layout` (module docstring); PlanError before anything runs."""
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    check_proxy_port(cfg.proxy.host, cfg.proxy.port)
    checkpoint = resolve_checkpoint(cfg, run_dir, echo)
    task_sets, held_out_dir_tasks = load_task_sets(cfg, recipe, run_dir)
    # The harness before the starting model: a harness that cannot run is one line now, not after a warm start.
    provisioning = check_harness_here(cfg, run_dir, task_sets, held_out_dir_tasks)
    model_dir, model = resolve_model(cfg, recipe, echo)
    if cfg.model.uses_tiny and model.max_position_embeddings == cfg.model.tiny.max_position_embeddings:
        # the tiny model's context limit was checked with the config (TrainConfig), with these very numbers
        context_limit = cfg.proxy.context_limit or model.max_position_embeddings
    else:
        context_limit = _plan_call(check_context_limit, cfg, model.max_position_embeddings)
    check_recipe(recipe, cfg, model_dir, context_limit)
    if held_out_dir_tasks:
        from gyre.runtime.held_out_tasks import held_out_tasks

        task_sets = replace(task_sets, held_out=held_out_tasks(held_out_dir_tasks))
    proxy = cfg.proxy
    if cfg.trainer.routing_replay and not proxy.record_routed_experts:
        proxy = replace(proxy, record_routed_experts=True)
    return RunPlan(
        cfg=cfg,
        run_dir=run_dir,
        layout=layout,
        model_dir=model_dir,
        model=model,
        context_limit=context_limit,
        checkpoint=checkpoint,
        start=starting_point(model_dir, checkpoint),
        task_sets=task_sets,
        provisioning=provisioning,
        proxy=proxy,
    )


def run_sandbox(plan: RunPlan):
    """The run's sandbox for harnesses and evaluators: workspaces under `executions/`, `records/` protected (made
    here, not checked again: the plan checked it; a sandbox prepares itself at its first execution)."""
    return _sandbox(plan.cfg, plan.run_dir, trusted_tasks=plan.task_sets.trusted)


def _sandbox(cfg: TrainConfig, run_dir: Path, *, trusted_tasks: bool):
    """The sandbox of `run_sandbox`, made from the config (the plan's harness check makes one before the plan)."""
    (run_dir / RECORDS_DIR).mkdir(parents=True, exist_ok=True)
    return make_sandbox(
        cfg.harness,
        cfg.limits,
        root=run_dir / EXECUTIONS_DIR,
        trusted_tasks=trusted_tasks,
        protected=(run_dir / RECORDS_DIR,),
        run_dir=run_dir,
    )


def _plan_call(check: Callable[..., Any], *args: Any) -> Any:
    """A config check of `gyre.config` whose ConfigError becomes the plan's one error type."""
    try:
        return check(*args)
    except ConfigError as error:
        raise PlanError(str(error)) from None


# -- the checks, in the order they run -----------------------------------------------------------------------------
def check_job_size(cfg: TrainConfig, world_size: int) -> Layout:
    """The job's size fits the cells and the separate rollout pool's ranks; no device index in a job of several."""
    return Layout(**_plan_call(layout_fields, cfg, world_size))


def check_job_secret() -> None:
    """A `$GYRE_JOB_SECRET` the launcher set can be sent as a bearer token (one line here, not a failed worker)."""
    try:
        job_secret(os.environ)
    except ValueError as error:
        raise PlanError(str(error)) from None


def check_engine_backend(cfg: TrainConfig) -> None:
    """`engine.backend` can run here: SGLang installed, and on CUDA (gyre's stand-in for SGLang aside)."""
    if cfg.engine.backend != "sglang":
        return
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        raise PlanError(
            "engine.backend=sglang: the sglang package is not installed here; install gyre's gpu extra on a machine "
            "with CUDA GPUs (pip install -e '.[gpu]'), or run engine.backend=native (docs/sglang.md)"
        )
    is_standin = spec.origin is not None and Path(spec.origin).resolve().parent.parent == STANDIN_PATH
    if device_kind(cfg.engine.device) != "cuda" and not is_standin:
        raise PlanError(
            f"engine.backend=sglang with engine.device={cfg.engine.device}: SGLang serves on CUDA GPUs; set "
            "engine.device=cuda trainer.device=cuda (docs/sglang.md)"
        )


def check_context_parallel(cfg: TrainConfig) -> None:
    """This runtime does not split rows over ranks: trainer.context_parallel_size is 1."""
    size = cfg.trainer.context_parallel_size
    if size == 1:
        return
    has_te = importlib.util.find_spec("transformer_engine") is not None
    why = (
        "this runtime does not split rows over ranks yet"
        if has_te
        else "context parallelism needs TransformerEngine's attention on CUDA, absent here"
    )
    raise PlanError(
        f"trainer.context_parallel_size={size}: {why} (expected 1; long rows train with trainer.recompute=full and "
        "chunked log-probs instead: docs/training.md, 'Long rows')"
    )


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
        raise PlanError(
            f"hydra.run.dir={str(run_dir)!r}: cannot write there ({error.strerror or error}); free space or choose a "
            "writable directory"
        ) from None


def check_proxy_port(host: str, port: int) -> None:
    """A fixed `proxy.port` is free on `proxy.host` now (0 picks a free one at start and is not checked)."""
    if port == 0:
        return
    probe = socket.socket()
    try:
        probe.bind((host, port))
    except OSError as error:
        raise PlanError(
            f"proxy.port={port}: cannot listen on {host}:{port} ({error.strerror}); choose another port, or 0 for a "
            "free one"
        ) from None
    finally:
        probe.close()


def resolve_checkpoint(cfg: TrainConfig, run_dir: Path, echo: Callable[[str], None]) -> Checkpoint | None:
    """The checkpoint `resume` names (docs/runtime.md, "Checkpoints and resume"), of this run's schedule, trainer
    layout and fewer steps than `steps`; None to start afresh."""
    try:
        checkpoint = checkpoint_to_resume(cfg.resume, run_dir)
    except ResumeError as error:
        raise PlanError(str(error)) from None
    if checkpoint is None:
        if cfg.resume == "auto":
            echo("resume=auto: no complete checkpoint in the run directory, starting afresh")
        return None
    saved = checkpoint.state.get("shape", {})
    changed = [f"{k}={v!r} (the checkpoint's: {saved[k]!r})" for k, v in run_shape(cfg).items() if saved.get(k, v) != v]
    if changed:
        raise PlanError(
            f"resume: {', '.join(changed)}: a run resumes with the schedule of its checkpoint ({checkpoint.path})"
        )
    layout = trainer_layout(cfg)
    saved = checkpoint.state.get("trainer_layout", layout)  # a checkpoint of before it was kept: its files say
    changed = [f"{k}={v!r} (the checkpoint's: {saved[k]!r})" for k, v in layout.items() if saved.get(k, v) != v]
    if changed:
        raise PlanError(
            f"resume: {', '.join(changed)}: the checkpoint's optimizer state is laid out for its trainer; resume "
            f"with its layout, or start a new run from its weights alone with model.model_dir={checkpoint.trainer_dir} "
            "(AdamW afresh)"
        )
    if checkpoint.step >= cfg.steps:
        raise PlanError(
            f"steps={cfg.steps}: the checkpoint {checkpoint.path} has {checkpoint.step} steps done already; raise "
            "steps to train on from it"
        )
    echo(f"resuming from {checkpoint.path} (step {checkpoint.step} of {cfg.steps})")
    return checkpoint


def load_task_sets(cfg: TrainConfig, recipe: Recipe, run_dir: Path) -> tuple[TaskSets, list]:
    """The recipe's task sets, and the held-out task directory's tasks (played once the starting model is known)."""
    try:
        task_sets = recipe.task_sets(cfg, run_dir)
    except (RecipeError, TaskSetError) as error:
        raise PlanError(str(error)) from None
    if not task_sets.train:
        raise PlanError(f"recipe.name={recipe.name!r}: the recipe gave no training task")
    held_out_dir_tasks = []
    if cfg.tasks.held_out_dir and cfg.tasks.eval_every > 0 and task_sets.held_out is None:
        from gyre.runtime.held_out_tasks import load_held_out_tasks

        try:
            held_out_dir_tasks = load_held_out_tasks(cfg, task_sets.train)
        except TaskSetError as error:
            raise PlanError(str(error)) from None
    return task_sets, held_out_dir_tasks


def check_harness_here(cfg: TrainConfig, run_dir: Path, task_sets: TaskSets, held_out_dir_tasks: list) -> Provisioning:
    """The harness's files can be read, and the harness, its sandbox and the tasks' evaluators run here; the files."""
    try:
        sandbox = _sandbox(cfg, run_dir, trusted_tasks=task_sets.trusted)
        held_out = task_sets.held_out.tasks if task_sets.held_out is not None else held_out_dir_tasks
        provisioning = harness_provisioning(cfg.harness)
        runner = make_runner(cfg.harness, task_sets.train[0], provisioning)
        check_harness(runner, sandbox, [*task_sets.train, *held_out])
    except HarnessSetupError as error:
        raise PlanError(str(error)) from None
    return provisioning


def resolve_model(cfg: TrainConfig, recipe: Recipe, echo: Callable[[str], None]) -> tuple[Path, DecoderConfig]:
    """The starting checkpoint: `model.model_dir`, or the recipe's starting model; and its config.json."""
    if cfg.model.model_dir:
        model_dir = Path(cfg.model.model_dir)
        return model_dir, _read_model_config(model_dir, "model.model_dir")
    try:
        model_dir = Path(recipe.starting_model(cfg, echo))
    except RecipeError as error:
        raise PlanError(str(error)) from None
    return model_dir, _read_model_config(model_dir, f"recipe.name={recipe.name!r}: the starting model")


def check_model_layout(cfg: TrainConfig, model: DecoderConfig) -> None:
    """The trainer can use the model: routing replay needs experts; a Megatron trainer can shard it over the cell's
    ranks (heads, KV heads, vocabulary divisible by TP; layers by PP; experts by EP)."""
    if cfg.trainer.routing_replay and not model.num_experts:
        raise PlanError(
            f"trainer.routing_replay=true: the model ({model.model_type}) has no experts to route; leave it false"
        )
    if cfg.trainer.backend != "megatron":
        return
    from gyre.trainer.layout import validate_layout  # arithmetic on the config: no torch, no megatron

    t = cfg.trainer
    tp, pp, ep = t.tensor_parallel_size, t.pipeline_parallel_size, t.expert_parallel_size
    try:
        validate_layout(model, tp, pp, ep)
    except ValueError as error:
        fields = f"trainer.tensor_parallel_size={tp}" + (f" trainer.pipeline_parallel_size={pp}" if pp > 1 else "")
        fields += f" trainer.expert_parallel_size={ep}" if ep > 1 else ""
        raise PlanError(f"{fields}: {error}") from None


def check_memory(cfg: TrainConfig, model: DecoderConfig, echo: Callable[[str], None] | None) -> None:
    """Each rank's memory, planned (`gyre.trainer.memory_plan`): its peaks echoed, the whole table logged (neither
    with `echo` None); a layout that cannot fit `cluster.device_memory_gib` refused in one line naming the setting
    that makes it fit."""
    from gyre.trainer.memory_plan import GIB, memory_inputs, memory_plan  # arithmetic: no torch

    plan = memory_plan(memory_inputs(cfg, model))
    if echo is not None:
        log.info("memory plan:\n%s", plan.table(), extra=FILE_ONLY)  # train.log; the line below says enough
        peaks = ", ".join(f"{rank.name} {rank.peak(plan.inputs.device) / GIB:.2f} GiB" for rank in plan.ranks)
        budget = (
            f" of {plan.budget() / GIB:.2f}" if plan.budget() else " (cluster.device_memory_gib unset: not checked)"
        )
        shows = "python -m gyre.train.plan shows every term"
        echo(f"memory plan: peak per rank{budget}: {peaks}{plan.offload_note()} ({shows})")
    misfit = plan.misfit()
    if misfit is not None:
        raise PlanError(misfit)


def check_recipe(recipe: Recipe, cfg: TrainConfig, model_dir: Path, context_limit: int) -> None:
    """The recipe's own rules for this model (e.g. its episodes fit the context limit)."""
    try:
        recipe.check(cfg, model_dir, context_limit)
    except RecipeError as error:
        raise PlanError(str(error)) from None
