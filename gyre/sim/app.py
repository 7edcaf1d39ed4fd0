"""The simulator app, `python -m gyre.sim [overrides]`: a Hydra app over `conf/sim.yaml`.

Contract
    * Configuration comes from `conf/` (groups `cluster`, `workload`, `algo`, `experiment`) and Hydra
      overrides only. It is checked by converting it to `gyre.config.SimConfig`, which runs the
      dataclasses' `__post_init__` checks.
    * A config the user can fix (a bad value, a wrong type, a missing required value, an unknown
      field or group option, an unreadable replay CSV) prints ONE line `gyre.sim: config error: ...` to
      stderr and exits with status 2; a run that cannot finish prints `gyre.sim: simulation error:
      ...` and exits with status 3. Neither prints a traceback. In a `-m` sweep the first failing
      job stops the sweep with its status.
    * Each run writes into its Hydra run directory: `config.yaml` (resolved), `summary.json`,
      `role_timeline.png` (when `timeline` is true) and `sim.log`.
    * Progress is logged to stderr (`gyre.obs.logging`); the last line of stdout is the summary as one
      compact JSON line. Non-finite numbers in the summary (e.g. staleness of a run too short to
      leave the warm-up burst) are written as null, so the line is strict JSON.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gyre.config import ConfigError, SimConfig, register_configs
from gyre.config.hydra_errors import describe_config_error, to_config
from gyre.obs.logging import setup_logging
from gyre.obs.record import json_ready
from gyre.sim.presets import CONF_DIR
from gyre.sim.simulator import SimulationError, simulate
from gyre.sim.timeline import write_timeline
from gyre.sim.workload import read_replay_csv

log = logging.getLogger(__name__)

EXIT_CONFIG_ERROR = 2
EXIT_SIMULATION_ERROR = 3


# -- entry point ------------------------------------------------------------------------------------
def main() -> None:
    """Register the config schemas, then run the Hydra app; errors in composing the config exit 2."""
    # Let composition errors reach us as exceptions instead of Hydra's multi-line report (exit 1).
    os.environ["HYDRA_FULL_ERROR"] = "1"
    if not CONF_DIR.is_dir():
        _exit("setup error", f"no conf/ at {CONF_DIR}: install gyre editable from its repository (pip install -e .)", 2)
    setup_logging(rank=_rank())
    register_configs()
    try:
        _hydra_main()
    except (HydraException, OmegaConfBaseException) as exc:
        _exit("config error", describe_config_error(exc), EXIT_CONFIG_ERROR)
    except OSError as exc:  # Hydra creates the run directory before `run` sees it
        _exit("config error", f"cannot write the run directory (hydra.run.dir): {exc}", EXIT_CONFIG_ERROR)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="sim")
def _hydra_main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    run(cfg, Path(hydra_cfg.runtime.output_dir), experiment_choice=hydra_cfg.runtime.choices.get("experiment"))


def run(cfg: DictConfig, run_dir: Path, *, experiment_choice: str | None = None) -> dict[str, Any]:
    """Check `cfg`, simulate it, write the run directory and print the summary line; returns the summary."""
    if not cfg.get("experiment") and experiment_choice:
        cfg.experiment = experiment_choice  # label the run by the preset it came from
    try:
        sim_cfg = to_config(cfg, SimConfig)
    except ConfigError as exc:
        _exit("config error", str(exc), EXIT_CONFIG_ERROR)
    if sim_cfg.workload.distribution == "replay":
        try:  # read once up front so a bad CSV stops the run before it logs anything
            read_replay_csv(sim_cfg.workload.replay_csv)
        except ConfigError as exc:
            _exit("config error", str(exc), EXIT_CONFIG_ERROR)

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        setup_logging(rank=_rank(), log_file=run_dir / "sim.log")
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    except OSError as exc:
        message = f"hydra.run.dir={str(run_dir)!r} is not allowed: expected a writable directory ({exc})"
        _exit("config error", message, EXIT_CONFIG_ERROR)
    log.info("simulating %s -> %s", config_label(sim_cfg), run_dir)
    started = time.perf_counter()
    try:
        summary, sim = simulate(sim_cfg)
    except SimulationError as exc:
        _exit("simulation error", str(exc), EXIT_SIMULATION_ERROR)
    summary = json_ready(summary)

    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if sim_cfg.timeline:
        write_timeline(sim, summary, run_dir / "role_timeline.png")
    log.info(
        "done: %d steps in %.2f simulated hours (wall %.1f s), outputs in %s",
        summary["steps"],
        summary["total_time_h"],
        time.perf_counter() - started,
        run_dir,
    )
    print(json.dumps(summary), flush=True)
    return summary


# -- errors -----------------------------------------------------------------------------------------
def _exit(kind: str, message: str, status: int) -> NoReturn:
    print(f"gyre.sim: {kind}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


# -- summary and labels -----------------------------------------------------------------------------
def config_label(cfg: SimConfig) -> str:
    cl, al = cfg.cluster, cfg.algo
    pool = f" + pool C_s={cl.separate_capacity}" if cl.separate_capacity else ""
    return (
        f"experiment={cfg.experiment or '-'} mode={al.mode} phi={al.phi:g} mu={al.mu} N={al.group_size} "
        f"B={al.batch_groups} cells={cl.num_cells}x{cl.cell_size} C_e={cl.cell_capacity}{pool} "
        f"workload={cfg.workload.name} steps={cfg.steps} seed={cfg.seed}"
    )


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))
