"""Command line of gyre.engine: `python -m gyre.engine serve [--model-dir DIR] [--host H] [--port P] ...`.

Serves a native engine on the endpoint of `gyre.engine.endpoint` (what a separate rollout pool runs, and what a
cell leader runs inside the SPMD job). Without `--model-dir` it serves the tiny default model (built on first
use, no downloads). Prints `engine endpoint: <url>` once it accepts connections, then serves until SIGINT or
SIGTERM, which abort what is in flight and exit 0. Exit 2: bad arguments or an unusable model directory (one
line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gyre.engine", description="gyre's rollout engine")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a native engine over HTTP")
    serve.add_argument("--model-dir", help="HF-layout directory (config.json + safetensors); default: the tiny model")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default)")
    serve.add_argument("--max-running", type=int, default=16, help="requests decoded concurrently (default 16)")
    serve.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0 (default cpu)")
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    serve.add_argument("--policy-version", type=int, default=0, help="version of the served weights (default 0)")
    return parser


async def _serve(args: argparse.Namespace, model) -> None:
    from gyre.engine.endpoint import EngineServer
    from gyre.engine.native import NativeEngine

    engine = NativeEngine(model, max_running=args.max_running, policy_version=args.policy_version)
    server = EngineServer(engine, host=args.host, port=args.port)
    url = await server.start()
    print(f"engine endpoint: {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop()
    await engine.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    from gyre import eventloop
    from gyre.models.hf_weights import load_pretrained

    if args.max_running < 1 or not 0 <= args.port <= 65535:
        print("gyre.engine serve: error: --max-running must be >= 1 and --port in [0, 65535]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        if args.model_dir is None:
            from gyre.models.tiny import tiny_model_dir

            args.model_dir = str(tiny_model_dir())
        model = load_pretrained(args.model_dir, dtype=getattr(torch, args.dtype), device=args.device)
    except (OSError, ValueError, RuntimeError) as error:
        print(f"gyre.engine serve: error: cannot load --model-dir {args.model_dir}: {error}", file=sys.stderr)
        return 2
    try:
        eventloop.run(_serve(args, model))
    except OSError as error:  # the address is taken or not ours
        print(f"gyre.engine serve: error: cannot serve on {args.host}:{args.port}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
