"""Command line of the demo family: `python -m gyre.tasks.demo warm-start OUT_DIR [--seed N] [--minutes M]`.

`warm-start` trains (or reuses, when OUT_DIR holds the same warm start) the supervised warm start of the tiny
model on demo episodes (`gyre.tasks.demo.warm_start.warm_start`), then prints the directory on one line and a
one-line JSON summary on the next: key, seed, steps, losses, seconds, whether it was reused.
Exit codes: 0 trained or reused; 2 bad arguments or an unusable OUT_DIR (one line on stderr, no traceback).
See docs/warm-start.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre.tasks.demo", description="gyre's demo task family")
    commands = parser.add_subparsers(dest="command", required=True)
    warm = commands.add_parser("warm-start", help="supervised warm start of the tiny model on demo episodes")
    warm.add_argument("out_dir", help="absent, empty, or an earlier warm-start output")
    warm.add_argument("--seed", type=int, default=0, help="data, order and init seed (default 0)")
    warm.add_argument("--minutes", type=float, default=5.0, help="wall-clock training budget (default 5)")
    args = parser.parse_args(argv)
    return _warm_start(args)


def _warm_start(args: argparse.Namespace) -> int:
    from gyre.tasks.demo import warm_start as module  # the module's names at call time (tests replace its config)

    try:
        if args.seed < 0:
            raise ValueError(f"--seed {args.seed}: expected an int >= 0")
        if not args.minutes > 0:
            raise ValueError(f"--minutes {args.minutes}: expected a number > 0")
        config = module.WarmStartConfig(max_minutes=args.minutes)
    except ValueError as err:
        print(f"warm-start: error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    try:
        earlier = module.read_meta(args.out_dir) if Path(args.out_dir).is_dir() else None
        out, meta = module.warm_start(args.out_dir, config, args.seed)
    except (ValueError, OSError) as err:  # bad arguments, an unwritable or full OUT_DIR
        print(f"warm-start: error: {err}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    keys = ("key", "seed", "steps_done", "complete", "first_loss", "final_loss", "train_seconds", "train_cpu_seconds")
    summary = {
        **{k: meta.get(k) for k in keys},
        "reused": earlier is not None and earlier == meta,
        "seconds": round(seconds, 3),
    }
    print(Path(out).resolve())
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
