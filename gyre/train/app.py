"""The training app, `python -m gyre.train [overrides]`: a Hydra app over `conf/train.yaml` (docs/runtime.md,
"The program"; every field: docs/configuration.md).

Contract
    * Configuration comes from `conf/` and Hydra overrides only, checked by converting it to
      `gyre.config.TrainConfig` (the dataclasses' checks) and then by the run plan (`gyre.runtime.job.plan`).
    * `recipe.name` (the Hydra group `recipe=demo|repo`) picks the recipe (`gyre.recipes.load_recipe`): where the
      starting model and the tasks come from when the config leaves them empty. The runtime imports no recipe.
    * A config the user can fix (a bad value, an unknown field, a world size this runtime does not run, a missing
      model or task directory, a harness or sandbox missing here, a run directory that cannot be written) prints
      ONE line `gyre.train: config error: ...` to stderr and exits 2. A run that fails prints
      `gyre.train: run error: ...` and exits 3; Ctrl-C or SIGTERM ends the run within seconds with its outputs
      written and exits 130. None prints a traceback (the run's log has it).
    * Under torchrun or srun every rank gets the same run directory (`gyre.runtime.job.launch.fixed_run_dir_overrides`).
    * Each run writes into its Hydra run directory: `config.yaml` (resolved), `train.log`, `metrics.jsonl`,
      `held_out.jsonl`, `summary.json`, `role_timeline.png`, `policy/`, `records/`, `wandb/` (docs/runtime.md,
      "Outputs"). The last line of stdout is a compact JSON line: the run's end, its held-out pass rates (first,
      last) and the run directory.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gyre.config import ConfigError, TrainConfig, register_configs
from gyre.config.hydra_errors import CONF_DIR, describe_config_error, to_config
from gyre.obs.logging import setup_logging
from gyre.recipes import load_recipe
from gyre.runtime.job.launch import LaunchError, LaunchStopped, WorkerFailed, fixed_run_dir_overrides, job_env

log = logging.getLogger(__name__)

EXIT_CONFIG_ERROR = 2
EXIT_RUN_ERROR = 3
EXIT_STOPPED = 130
RUNS_ROOT = "outputs/train"  # under a launcher: outputs/train/<job id>


def main() -> None:
    """Fix the run directory under a launcher, register the schemas, run the Hydra app."""
    os.environ["HYDRA_FULL_ERROR"] = "1"  # composition errors reach us as exceptions (one line below)
    if not CONF_DIR.is_dir():
        _exit("setup error", f"no conf/ at {CONF_DIR}: install gyre editable from its repository (pip install -e .)", 2)
    try:
        job = job_env(os.environ)
        sys.argv[1:] = fixed_run_dir_overrides(sys.argv[1:], job, root=RUNS_ROOT)
    except LaunchError as error:
        _exit("config error", str(error), EXIT_CONFIG_ERROR)
    setup_logging(rank=job.rank if job else 0)
    register_configs()
    try:
        _hydra_main()
    except (HydraException, OmegaConfBaseException) as exc:
        _exit("config error", describe_config_error(exc), EXIT_CONFIG_ERROR)
    except OSError as exc:  # Hydra creates the run directory before `run` sees it
        _exit("config error", f"cannot write the run directory (hydra.run.dir): {exc}", EXIT_CONFIG_ERROR)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    status = run(cfg, Path(HydraConfig.get().runtime.output_dir))
    if status:
        raise SystemExit(status)


def run(cfg: DictConfig, run_dir: Path) -> int:
    """Check `cfg`, run it, print the end; the exit status (0, 2, 3 or 130)."""
    try:
        train_cfg = to_config(cfg, TrainConfig)
    except ConfigError as exc:
        _exit("config error", str(exc), EXIT_CONFIG_ERROR)  # before torch is imported: at once
    try:
        recipe = load_recipe(train_cfg.recipe.name)
    except ValueError as exc:
        _exit("config error", str(exc), EXIT_CONFIG_ERROR)
    from gyre.runtime.job.program import PlanError, RunResult, run_training

    job = job_env(os.environ)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        setup_logging(rank=job.rank if job else 0, log_file=run_dir / "train.log")
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    except OSError as exc:
        _exit("config error", f"hydra.run.dir={str(run_dir)!r}: expected a writable directory ({exc})", 2)
    log.info("training -> %s", run_dir)
    try:
        result = run_training(train_cfg, run_dir, recipe, echo=_echo)
    except PlanError as exc:
        _exit("config error", str(exc), EXIT_CONFIG_ERROR)
    except WorkerFailed as exc:  # a worker of a plainly launched job failed: the job was stopped
        _exit("run error", f"{exc} (traceback in {run_dir / 'train.log'})", EXIT_RUN_ERROR)
    except LaunchStopped as exc:  # Ctrl-C or SIGTERM: rank 0 wrote the outputs before it ended
        _echo(f"run {exc}: outputs in {run_dir}")
        return EXIT_STOPPED
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            _exit("config error", f"a port is busy: {exc} (choose another: proxy.port=...)", EXIT_CONFIG_ERROR)
        _run_error(exc, run_dir)
    except Exception as exc:
        _run_error(exc, run_dir)
    if not isinstance(result, RunResult):  # a satellite rank under torchrun or srun: rank 0 reports
        return EXIT_STOPPED if result.get("stop_reason") == "stopped" else 0
    trained_nothing = result.end.reason == "completed" and result.summary.get("training", {}).get("nothing", False)
    end = "trained_nothing" if trained_nothing else result.end.reason
    _echo(ending_report(result, end))
    passes = [line["pass_rate"] for line in result.held_out]
    print(
        json.dumps(
            {
                "end": end,
                "steps": result.summary["steps"],
                "held_out_pass_rate": {"first": passes[0] if passes else None, "last": passes[-1] if passes else None},
                "run_dir": str(run_dir),
            }
        ),
        flush=True,
    )
    if result.end.reason == "error":
        _run_error(result.end.error, run_dir)
    if trained_nothing:
        _exit("run error", nothing_trained_reason(result.summary, run_dir), EXIT_RUN_ERROR)
    return EXIT_STOPPED if result.end.reason == "stopped" else 0


def nothing_trained_reason(summary: dict, run_dir: Path) -> str:
    """One line: the run's steps trained no token, and how its executions ended (the scheduler's outcomes)."""
    outcomes = ", ".join(f"{count} {name}" for name, count in sorted(summary.get("outcomes", {}).items()) if count)
    return (
        f"the run trained nothing: its {summary['steps']} steps had no target token (executions: {outcomes or 'none'});"
        f" each execution's end is in {run_dir / 'executions.jsonl'}, the harnesses' output under "
        f"{run_dir / 'executions'}"
    )


def ending_report(result, end: str | None = None) -> str:
    """A few lines: the reward and held-out curves, and where the outputs are (`end`: the end to name, by default
    the run's)."""
    from gyre.obs.progress import format_duration

    records = [line for line in _read_jsonl(result.run_dir / "metrics.jsonl")]
    rewards = " ".join("--" if r.get("reward_mean") is None else f"{r['reward_mean']:.2f}" for r in records)
    held = " ".join(f"v{line['version']}:{100 * line['pass_rate']:.0f}%" for line in result.held_out)
    lines = [
        f"run {(end or result.end.reason).replace('_', ' ')}: {result.summary['steps']} steps in "
        f"{format_duration(result.end.wall_time_s)}",
        f"  reward per step: {rewards or '--'}",
        f"  held-out greedy pass rate: {held or '--'}",
        f"  outputs: {result.run_dir} (metrics.jsonl, held_out.jsonl, summary.json, role_timeline.png, policy/)",
    ]
    return "\n".join(lines)


def _read_jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def _echo(line: str) -> None:
    print(line, flush=True)


def _run_error(error: BaseException, run_dir: Path) -> NoReturn:
    """The run failed: its traceback into train.log only, one line on stderr, exit 3."""
    log_file = run_dir / "train.log"
    try:
        with open(log_file, "a", encoding="utf-8") as out:
            out.write("the run failed:\n" + "".join(traceback.format_exception(error)))
    except OSError:
        pass
    _exit("run error", f"{type(error).__name__}: {error} (traceback in {log_file})", EXIT_RUN_ERROR)


def _exit(kind: str, message: str, status: int) -> NoReturn:
    print(f"gyre.train: {kind}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)
