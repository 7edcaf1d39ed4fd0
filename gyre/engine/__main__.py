"""Command line of gyre.engine: `python -m gyre.engine serve [overrides]`, one native engine on its HTTP endpoint.

What a separate rollout pool runs, and what a cell leader runs inside the SPMD job. Contract:
    * Configuration: `conf/engine.yaml` (schema `gyre.config.EngineServeConfig`, registered as
      `base_engine_serve`) and Hydra overrides only, e.g.
      `python -m gyre.engine serve model_dir=/models/Qwen3-0.6B engine.device=cuda:0 engine.dtype=bfloat16 port=8701`.
      An empty `model_dir` serves the tiny default model (built on first use, no downloads).
    * Prints `engine endpoint: <url>` once it accepts connections, then serves until SIGINT or SIGTERM, which
      abort what is in flight and exit 0. Writes no files.
    * A config the user can fix (a bad value, an unknown key, an unusable model directory, an address that
      cannot be bound) prints ONE line `gyre.engine serve: config error: ...` to stderr, naming the field, the
      value and what is allowed, and exits 2; no traceback. So does an unknown command.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from gyre.config import ConfigError, EngineServeConfig, register_configs

EXIT_CONFIG_ERROR = 2
USAGE = "usage: python -m gyre.engine serve [key=value ...]   (fields: docs/configuration.md, conf/engine.yaml)"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if args[:1] != ["serve"]:
        command = args[0] if args else ""
        print(f"gyre.engine: config error: command={command!r} is not allowed: expected serve", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        cfg = load_config(args[1:])
    except ConfigError as exc:
        _exit(str(exc))
    serve(cfg)
    return 0


def load_config(overrides: Sequence[str]) -> EngineServeConfig:
    """Compose conf/engine.yaml with `overrides` and check it; `ConfigError` with the one line to print."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from gyre.config.hydra_errors import CONF_DIR, describe_config_error, to_config

    os.environ["HYDRA_FULL_ERROR"] = "1"
    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None, job_name="engine"):
            composed = compose(config_name="engine", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(describe_config_error(exc)) from None
    return to_config(composed, EngineServeConfig)


def serve(cfg: EngineServeConfig) -> None:
    """Load the model and serve it until SIGINT/SIGTERM; a model or address the user can fix exits 2."""
    import torch

    from gyre import eventloop
    from gyre.models.hf_weights import load_pretrained

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model_dir = cfg.model_dir
    try:
        if not model_dir:
            from gyre.models.tiny import tiny_model_dir

            model_dir = str(tiny_model_dir())
        model = load_pretrained(model_dir, dtype=getattr(torch, cfg.engine.dtype), device=cfg.engine.device)
    except (OSError, ValueError, RuntimeError) as error:
        _exit(f"model_dir={model_dir!r} is not allowed: {error}")
    try:
        eventloop.run(_serve(cfg, model))
    except OSError as error:  # the address is taken or not ours
        _exit(f"port={cfg.port!r} is not allowed: expected a free port on host {cfg.host} ({error})")


async def _serve(cfg: EngineServeConfig, model) -> None:
    from gyre.engine.endpoint import EngineServer
    from gyre.engine.native import NativeEngine

    engine = NativeEngine(
        model,
        max_running=cfg.engine.max_running,
        max_tokens_in_flight=cfg.engine.max_total_tokens or None,
        policy_version=cfg.engine.policy_version,
    )
    server = EngineServer(engine, host=cfg.host, port=cfg.port)
    try:
        url = await server.start()
        print(f"engine endpoint: {url}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        await server.stop()
    finally:
        await engine.close()


def _exit(message: str) -> NoReturn:
    print(f"gyre.engine serve: config error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_CONFIG_ERROR)


if __name__ == "__main__":
    sys.exit(main())
