"""Command line of gyre.models.

- `python -m gyre.models build-tiny OUT_DIR [--seed N]` builds the tiny default model into OUT_DIR (see
  `gyre.models.tiny.build_tiny_model`), then prints the directory on one line and a one-line JSON summary on the
  next: parameters, vocabulary, files, build seconds.
- `python -m gyre.models warm-start OUT_DIR [--seed N] [--minutes M]` trains (or reuses, when OUT_DIR holds the
  same warm start) the supervised warm start of the tiny model (`gyre.models.warm_start.warm_start`), then prints
  the directory and a one-line JSON summary: key, seed, steps, losses, seconds, whether it was reused.
Exit codes: 0 built; 2 bad arguments or an unusable OUT_DIR (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre.models", description="gyre's tiny default model")
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build-tiny", help="build the tokenizer and a random-init tiny decoder (HF layout)")
    build.add_argument("out_dir", help="absent, empty, or an earlier build-tiny output")
    build.add_argument("--seed", type=int, default=0, help="weight-init seed (default 0)")
    warm = commands.add_parser("warm-start", help="supervised warm start of the tiny model on demo episodes")
    warm.add_argument("out_dir", help="absent, empty, or an earlier warm-start output")
    warm.add_argument("--seed", type=int, default=0, help="data, order and init seed (default 0)")
    warm.add_argument("--minutes", type=float, default=5.0, help="wall-clock training budget (default 5)")
    args = parser.parse_args(argv)
    if args.command == "warm-start":
        return _warm_start(args)

    from gyre.models.tiny import build_tiny_model, count_parameters

    start = time.perf_counter()
    try:
        out = build_tiny_model(args.out_dir, seed=args.seed)
    except ValueError as err:
        print(f"build-tiny: error: {err}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    config = json.loads((out / "config.json").read_text())
    summary = {
        "params": count_parameters(out),
        "vocab": config["vocab_size"],
        "seed": args.seed,
        "files": sorted(p.name for p in out.iterdir()),
        "build_seconds": round(seconds, 3),
    }
    print(out.resolve())
    print(json.dumps(summary))
    return 0


def _warm_start(args: argparse.Namespace) -> int:
    import logging

    from gyre.models.warm_start import WarmStartConfig, read_meta, warm_start

    try:
        if args.seed < 0:
            raise ValueError(f"--seed {args.seed}: expected an int >= 0")
        if not args.minutes > 0:
            raise ValueError(f"--minutes {args.minutes}: expected a number > 0")
        config = WarmStartConfig(max_minutes=args.minutes)
    except ValueError as err:
        print(f"warm-start: error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    try:
        earlier = read_meta(args.out_dir) if Path(args.out_dir).is_dir() else None
        out, meta = warm_start(args.out_dir, config, args.seed)
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
