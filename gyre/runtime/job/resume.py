"""Where a run starts (`resume=never|auto|<checkpoint>`) and the run directory made ready to resume (docs/runtime.md,
"Checkpoints and resume").

- `checkpoint_to_resume(resume, run_dir)`: None to start afresh, or the checkpoint to resume from; `ResumeError`
  (one line) for a run directory that holds checkpoints under `resume=never` or a path that is no complete
  checkpoint.
- `starting_point(model_dir, checkpoint)`: the weights every rank starts from (`StartingPoint`).
- `prepare_run_dir(run_dir, checkpoint)`: what the run wrote after its checkpoint is set aside, so that nothing is
  counted twice: `metrics.jsonl` keeps the steps before it, `held_out.jsonl` the evaluations of versions it holds;
  the record files and execution directories (workspace, home, logs) of the executions that were running (they are
  dispatched again under new ids) and of those dispatched after it (dispatched again under the same ids) move to
  `superseded/step-<n>/records/` and `superseded/step-<n>/executions/` (kept for inspection, not read by the run).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

from gyre.runtime.job.checkpoint import (
    Checkpoint,
    StartingPoint,
    has_checkpoints,
    latest_checkpoint,
    read_checkpoint,
)

log = logging.getLogger(__name__)

__all__ = ["ResumeError", "checkpoint_to_resume", "prepare_run_dir", "starting_point"]

SUPERSEDED_DIR = "superseded"
_EXECUTION = re.compile(r"g(\d{6,})-e(\d{7,})(?:-r([1-9]\d*))?")


class ResumeError(ValueError):
    """The run cannot start from what `resume` names (one line naming what to do)."""


def checkpoint_to_resume(resume: str, run_dir: Path) -> Checkpoint | None:
    """The checkpoint `resume` names for `run_dir` (module docstring)."""
    run_dir = Path(run_dir)
    if resume == "never":
        if has_checkpoints(run_dir):
            raise ResumeError(
                f"resume=never: the run directory {run_dir} holds checkpoints of an earlier run; resume=auto continues "
                "it, or choose another hydra.run.dir"
            )
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    try:
        return read_checkpoint(Path(resume))
    except ValueError as error:
        raise ResumeError(f"resume={resume!r}: {error}") from None


def starting_point(model_dir: Path, checkpoint: Checkpoint | None) -> StartingPoint:
    """The trainers start from the checkpoint's `trainer/` (else the starting checkpoint), the engines from the
    weights it says they served, at that policy version."""
    if checkpoint is None:
        return StartingPoint(trainer_dir=Path(model_dir), engine_dir=Path(model_dir))
    engine_dir = checkpoint.engine_dir or Path(model_dir)
    return StartingPoint(
        trainer_dir=checkpoint.trainer_dir,
        engine_dir=engine_dir,
        engine_version=checkpoint.state["scheduler"]["published_version"],
        checkpoint=checkpoint.path,
    )


def _keep_lines(path: Path, keep) -> list[dict]:
    """Rewrite the JSONL file `path` with the lines `keep(line)` takes (a torn last line is dropped); those lines."""
    if not path.is_file():
        return []
    kept, text = [], []
    for raw in path.read_text(encoding="utf-8").splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if keep(line):
            kept.append(line)
            text.append(raw)
    staging = path.with_name(path.name + ".tmp")
    staging.write_text("".join(t + "\n" for t in text), encoding="utf-8")
    os.replace(staging, path)
    return kept


def prepare_run_dir(run_dir: Path, checkpoint: Checkpoint, *, records_dir: Path, executions_dir: Path) -> dict:
    """Set aside what the run wrote after `checkpoint` (module docstring); returns the held-out lines kept and the
    executions set aside."""
    run_dir, step = Path(run_dir), checkpoint.step
    _keep_lines(run_dir / "metrics.jsonl", lambda line: line.get("step", step) < step)
    held_out = _keep_lines(run_dir / "held_out.jsonl", lambda line: line.get("version", step + 1) <= step)
    sched = checkpoint.state["scheduler"]
    per = checkpoint.state["executions_per_group"]
    groups = len(sched["groups"])
    closed = set(sched["closed"])
    reruns = {int(e): k for e, k in checkpoint.state["reruns"].items()}

    def after_the_checkpoint(name: str) -> bool:
        match = _EXECUTION.fullmatch(name)
        if match is None:
            return False
        group, execution, rerun = int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)
        lost = execution not in closed and rerun == reruns.get(execution, 0)
        return group >= groups or execution >= groups * per or lost

    target = run_dir / SUPERSEDED_DIR / f"step-{step:06d}"
    moved: set[str] = set()
    for kind, directory, suffix in (("records", Path(records_dir), ".jsonl"), ("executions", Path(executions_dir), "")):
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            name = path.name.removesuffix(suffix) if suffix else path.name
            if (suffix and not path.name.endswith(suffix)) or not after_the_checkpoint(name):
                continue
            (target / kind).mkdir(parents=True, exist_ok=True)
            destination = target / kind / path.name
            if destination.is_dir():  # the same checkpoint resumed twice: the later copy wins
                shutil.rmtree(destination)
            elif destination.exists():
                destination.unlink()
            shutil.move(str(path), str(destination))
            moved.add(name)
    if moved:
        log.info("resume: %d executions after the checkpoint set aside in %s", len(moved), target)
    return {"held_out": held_out, "superseded": len(moved)}
