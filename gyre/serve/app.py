"""`python -m gyre.serve [overrides]`: the proxy plus an embedded native engine, recording every call.

This is how a user records and evaluates harness runs without training, and how the tests drive real SDKs and
CLIs. Contract:
    * Configuration: `conf/serve.yaml` (schema `gyre.config.ServeConfig`) and Hydra overrides. A config the user
      can fix prints ONE line `gyre.serve: config error: ...` to stderr and exits 2 (also an unusable model
      directory or an address that cannot be bound); no traceback.
    * Start-up prints to stdout, one per line: `anthropic: <url>` (ANTHROPIC_BASE_URL), `openai: <url>/v1`
      (OPENAI_BASE_URL), `admin key: <key>` (POST /gyre/executions with it as Bearer token issues more keys),
      `records: <dir>`, then `key: <key> execution=<id>` for each execution issued, and finally `ready`.
    * Every call of execution X is recorded to `<run dir>/records/X.jsonl` (docs/record-format.md), which
      `python -m gyre.traj.inspect` reads.
    * SIGINT/SIGTERM (or `duration_s`) stop it: calls in flight are aborted, record files closed, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gyre import eventloop
from gyre.config import ConfigError, ServeConfig, register_configs
from gyre.config.hydra_errors import CONF_DIR, describe_config_error, to_config
from gyre.obs.logging import setup_logging

log = logging.getLogger(__name__)

EXIT_CONFIG_ERROR = 2


def main() -> None:
    os.environ["HYDRA_FULL_ERROR"] = "1"
    setup_logging()
    register_configs()
    try:
        _hydra_main()
    except (HydraException, OmegaConfBaseException) as exc:
        _exit(describe_config_error(exc))
    except OSError as exc:
        _exit(f"cannot write the run directory (hydra.run.dir): {exc}")


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="serve")
def _hydra_main(cfg: DictConfig) -> None:
    run(cfg, Path(HydraConfig.get().runtime.output_dir))


def run(cfg: DictConfig, run_dir: Path) -> None:
    try:
        serve_cfg = to_config(cfg, ServeConfig)
    except ConfigError as exc:
        _exit(str(exc))
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(log_file=run_dir / "serve.log")
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    try:
        eventloop.run(_serve(serve_cfg, run_dir))
    except _StartupError as exc:
        _exit(str(exc))


class _StartupError(Exception):
    """Something the user can fix stopped the start (model directory, address)."""


async def _serve(cfg: ServeConfig, run_dir: Path) -> None:
    from gyre.serve.stack import build_stack

    try:
        stack = await build_stack(cfg, records_dir=run_dir / "records")
    except (OSError, ValueError) as exc:
        raise _StartupError(str(exc)) from exc
    try:
        print(f"anthropic: {stack.proxy.url}", flush=True)
        print(f"openai: {stack.proxy.openai_url}", flush=True)
        print(f"admin key: {stack.proxy.admin_key}", flush=True)
        print(f"records: {stack.registry.records_dir}", flush=True)
        for _ in range(cfg.executions):
            session = stack.registry.issue()
            print(f"key: {session.key} execution={session.execution}", flush=True)
        print("ready", flush=True)
        await _wait_for_stop(cfg.duration_s)
    finally:
        await stack.close()
    log.info("stopped; records in %s", stack.registry.records_dir)


async def _wait_for_stop(duration_s: float) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    if duration_s > 0:
        loop.call_later(duration_s, stop.set)
    await stop.wait()


def _exit(message: str) -> NoReturn:
    print(f"gyre.serve: config error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_CONFIG_ERROR)
