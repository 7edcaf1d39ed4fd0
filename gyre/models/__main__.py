"""Command line of gyre.models.

- `python -m gyre.models build-tiny OUT_DIR [--seed N]` builds the tiny default model into OUT_DIR (see
  `gyre.models.tiny.build_tiny_model`), then prints the directory on one line and a one-line JSON summary on the
  next: parameters, vocabulary, files, build seconds.
The warm start of the tiny model on the demo family is the demo family's command:
`python -m gyre.tasks.demo warm-start OUT_DIR` (docs/warm-start.md).
Exit codes: 0 built; 2 bad arguments or an unusable OUT_DIR (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre.models", description="gyre's tiny default model")
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build-tiny", help="build the tokenizer and a random-init tiny decoder (HF layout)")
    build.add_argument("out_dir", help="absent, empty, or an earlier build-tiny output")
    build.add_argument("--seed", type=int, default=0, help="weight-init seed (default 0)")
    args = parser.parse_args(argv)

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


if __name__ == "__main__":
    sys.exit(main())
