"""A run's checkpoints on disk: written whole or not at all, and the latest complete one found again (docs/runtime.md,
"Checkpoints and resume").

A checkpoint is a directory `<run dir>/checkpoints/step-<n>/`, n the trainer version it holds (steps done):

- `trainer/`: the core's weights in the HF layout (`config.json`, `model.safetensors`, the starting checkpoint's
  tokenizer and chat template) and the optimizer's state with torch's RNG state (`gyre.runtime.cell.trainers.
  save_optimizer`): `optimizer.pt` for a core of one rank, `optimizer-<j>.pt` per in-cell coordinate j for a core
  of several (a Megatron cell: each rank's shard, written by that rank into the staging directory);
- `engine/`: the weights the engines served, when they are not `trainer/`'s (a checkpoint inside a burst: the
  version published last; absent when that is the starting checkpoint, version 0);
- `state.json`: the controller's state (the scheduler's, every group's task and outcomes, the executions' reruns,
  the task sampler's RNG, the step records, the packer's batch;
  `gyre.runtime.controller.checkpoints.state`);
  the finished executions' calls are their record files (`<run dir>/records/`), which it names;
- `complete.json`, written last: the size of every file above.

It is written as `checkpoints/.step-<n>.tmp/` (`stage_checkpoint` makes it, the core's ranks write their optimizer
files there, then `write_checkpoint(..., staged=True)` adds the rest), every file fsynced, `complete.json` last
(listing the ranks' files too), then renamed into place: a crash leaves a `.tmp` directory, never a `step-<n>/`
without `complete.json`. A reader (`latest_checkpoint`) takes the highest `step-<n>/` whose `complete.json` reads
and whose files have the sizes it lists, and skips any other with a warning. A write that fails (a full disk)
removes its `.tmp` directory and raises `CheckpointError`; the previous checkpoints are untouched. Once a checkpoint
is complete, all but the newest `keep` are removed (and the one the run resumed from, which its ranks read their
weights from, is kept until the run ends).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre.runtime.job.policy_dir import copy_side_files

log = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINTS_DIR",
    "Checkpoint",
    "CheckpointError",
    "StartingPoint",
    "discard_staging",
    "latest_checkpoint",
    "optimizer_file",
    "read_checkpoint",
    "stage_checkpoint",
    "write_checkpoint",
]

CHECKPOINTS_DIR = "checkpoints"
STATE_FILE = "state.json"
COMPLETE_FILE = "complete.json"
OPTIMIZER_FILE = "optimizer.pt"  # a core of one rank's; a core of several ranks has one per rank (`optimizer_file`)
TRAINER_DIR = "trainer"
ENGINE_DIR = "engine"
_NAME = re.compile(r"step-(\d{6,})")


class CheckpointError(OSError):
    """A checkpoint could not be written (the run directory is full or unwritable); nothing of it is left."""


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint directory and its `state.json`."""

    path: Path
    step: int
    state: dict[str, Any]

    @property
    def trainer_dir(self) -> Path:
        return self.path / TRAINER_DIR

    @property
    def engine_dir(self) -> Path | None:
        """Where the engines' weights are: `engine/`, `trainer/` (published at this step), None (the starting
        checkpoint)."""
        if (self.path / ENGINE_DIR).is_dir():
            return self.path / ENGINE_DIR
        sched = self.state["scheduler"]
        return self.trainer_dir if sched["published_version"] == sched["trainer_version"] else None


@dataclass(frozen=True)
class StartingPoint:
    """What every rank of a run starts from: the trainers' and the engines' weights (a directory in the HF layout)
    and the engines' policy version; `checkpoint` when the run resumes."""

    trainer_dir: Path
    engine_dir: Path
    engine_version: int = 0
    checkpoint: Path | None = None


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def _staging_dir(root: Path, step: int) -> Path:
    return root / f".step-{step:06d}.tmp"


def optimizer_file(coordinate: int, cell_size: int) -> str:
    """The name, in a checkpoint's `trainer/`, of the optimizer state of the core's rank at in-cell `coordinate`."""
    return OPTIMIZER_FILE if cell_size == 1 else f"optimizer-{coordinate}.pt"


def _not_written(root: Path, step: int, error: OSError) -> CheckpointError:
    return CheckpointError(
        f"checkpoint of step {step} not written under {root}: {error.strerror or error} (the earlier checkpoints "
        "are kept; free space or fix the run directory's permissions, then resume=auto)"
    )


def stage_checkpoint(run_dir: Path, step: int) -> Path:
    """The staging directory of checkpoint `step` made afresh (a crashed write's removed), with an empty `trainer/`
    for the core's ranks' optimizer files: that `trainer/`. `discard_staging` removes it again after a failure;
    `write_checkpoint(..., staged=True)` completes it. CheckpointError when it cannot be made."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    staging = _staging_dir(root, step)
    try:
        shutil.rmtree(staging, ignore_errors=True)
        (staging / TRAINER_DIR).mkdir(parents=True)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise _not_written(root, step, error) from error
    return staging / TRAINER_DIR


def discard_staging(run_dir: Path, step: int) -> None:
    """Checkpoint `step`'s staging directory removed (its write failed or the run stopped during it)."""
    shutil.rmtree(_staging_dir(Path(run_dir) / CHECKPOINTS_DIR, step), ignore_errors=True)


def _fsync_path(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_tree(directory: Path) -> None:
    """Every file and directory under `directory`, and itself, on disk."""
    for path in sorted(directory.rglob("*")):
        _fsync_path(path)
    _fsync_path(directory)


def _copy_weights_dir(source: Path, target: Path) -> None:
    """`source`'s files into `target`: hard links where the filesystem allows (a policy directory's files are never
    rewritten in place), else copies."""
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if not path.is_file():
            continue
        try:
            os.link(path, target / path.name)
        except OSError:
            shutil.copy2(path, target / path.name)


def write_checkpoint(
    run_dir: Path,
    step: int,
    state: dict[str, Any],
    *,
    trainer_model,
    engine_model=None,
    source_dir: Path,
    keep: int,
    protect: Path | None = None,
    staged: bool = False,
) -> Path:
    """Write checkpoint `step` (module docstring): `trainer_model` and `engine_model` are `DecoderLM`s (`engine_model`
    may also be an HF-layout directory, whose files are linked or copied; None: the engines serve `trainer_model`'s
    weights or the starting checkpoint's, as `state` says). `staged`: into the staging directory `stage_checkpoint`
    made, keeping the optimizer files written there (else a fresh one, with no optimizer state). `protect`: a
    checkpoint the pruning keeps (the one the run resumed from: its ranks may still load their trainers from it).
    Its path."""
    from gyre.models.hf_weights import save_pretrained

    root = Path(run_dir) / CHECKPOINTS_DIR
    staging = _staging_dir(root, step)
    target = _step_dir(root, step)
    try:
        if not staged:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
        elif not (staging / TRAINER_DIR).is_dir():
            raise FileNotFoundError(f"{staging / TRAINER_DIR}: the staged checkpoint is gone")
        save_pretrained(trainer_model, staging / TRAINER_DIR)
        copy_side_files(Path(source_dir), staging / TRAINER_DIR)
        if isinstance(engine_model, (str, Path)):  # a directory in HF layout (a policy directory): its files
            _copy_weights_dir(Path(engine_model), staging / ENGINE_DIR)
        elif engine_model is not None:
            save_pretrained(engine_model, staging / ENGINE_DIR)
            copy_side_files(Path(source_dir), staging / ENGINE_DIR)
        (staging / STATE_FILE).write_text(json.dumps(state) + "\n")
        sizes = {str(p.relative_to(staging)): p.stat().st_size for p in sorted(staging.rglob("*")) if p.is_file()}
        _fsync_tree(staging)
        (staging / COMPLETE_FILE).write_text(json.dumps({"step": step, "files": sizes}) + "\n")
        _fsync_path(staging / COMPLETE_FILE)
        _fsync_path(staging)
        if target.exists():  # the same step again (a resumed run redoing it): the new one replaces it
            shutil.rmtree(target)
        staging.rename(target)
        _fsync_path(root)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise _not_written(root, step, error) from error
    _prune(root, keep, protect)
    return target


def _prune(root: Path, keep: int, protect: Path | None = None) -> None:
    complete = [c for c in _candidates(root) if _complete(c[1]) is None]
    for _, path in complete[keep:]:
        if protect is None or path.resolve() != Path(protect).resolve():
            shutil.rmtree(path, ignore_errors=True)


def _candidates(root: Path) -> list[tuple[int, Path]]:
    """`step-<n>` directories of `root`, newest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _NAME.fullmatch(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


def _complete(path: Path) -> str | None:
    """None when `path` is a complete checkpoint, else why not."""
    try:
        listing = json.loads((path / COMPLETE_FILE).read_text())
        for name, size in listing["files"].items():
            actual = (path / name).stat().st_size
            if actual != size:
                return f"{name} has {actual} bytes, {size} were written"
        json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def read_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint at `path`; ValueError naming what is wrong when it is not complete."""
    path = Path(path)
    match = _NAME.fullmatch(path.name)
    why = "not a step-<n> checkpoint directory" if match is None else _complete(path)
    if why is not None:
        raise ValueError(f"{path}: not a complete checkpoint ({why})")
    state = json.loads((path / STATE_FILE).read_text())
    return Checkpoint(path=path, step=int(match.group(1)), state=state)


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The newest complete checkpoint of `run_dir` (module docstring); None when there is none."""
    for _, path in _candidates(Path(run_dir) / CHECKPOINTS_DIR):
        why = _complete(path)
        if why is None:
            return read_checkpoint(path)
        log.warning("checkpoint %s skipped: it is not complete (%s)", path, why)
    return None


def has_checkpoints(run_dir: Path) -> bool:
    """Whether `run_dir` holds any checkpoint directory (complete or not)."""
    return bool(_candidates(Path(run_dir) / CHECKPOINTS_DIR))
