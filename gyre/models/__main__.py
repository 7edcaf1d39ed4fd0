"""Command line of gyre.models.

- `python -m gyre.models build OUT_DIR --family tiny|qwen3|qwen3_moe|llama3 [--seed N]` builds a random-init model
  of that family into OUT_DIR (HF layout; `gyre.models.families`, docs/models.md).
- `python -m gyre.models build-tiny OUT_DIR [--seed N]` is `build OUT_DIR --family tiny`.
Both print the directory on one line and a one-line JSON summary on the next: family, parameters, vocabulary,
seed, files, bytes on disk, build seconds.
The warm start of the tiny model on the demo family is the demo family's command:
`python -m gyre.tasks.demo warm-start OUT_DIR` (docs/warm-start.md).
Exit codes: 0 built; 2 bad arguments, an unusable OUT_DIR or a missing vocabulary package: one line on stderr
(`build: error: ...` or `build-tiny: error: ...`; argparse's own errors `python -m gyre.models ...: error: ...`), no
usage block, no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

PROG = "python -m gyre.models"


class _OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    from gyre.models.families import FAMILIES, build_family_model

    parser = _OneLineParser(prog=PROG, description="build gyre's test models (HF layout, no downloads)")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    build = commands.add_parser("build", help="build a random-init model of a family")
    build.add_argument("out_dir", help="absent, empty, or an earlier build's output")
    build.add_argument(
        "--family",
        required=True,
        choices=sorted(FAMILIES),
        help="; ".join(f"{name}: {family.summary}" for name, family in sorted(FAMILIES.items())),
    )
    build.add_argument("--seed", type=int, default=0, help="weight-init seed (default 0)")
    tiny = commands.add_parser("build-tiny", help="build the tiny default model (= build --family tiny)")
    tiny.add_argument("out_dir", help="absent, empty, or an earlier build's output")
    tiny.add_argument("--seed", type=int, default=0, help="weight-init seed (default 0)")
    args = parser.parse_args(argv)
    family = "tiny" if args.command == "build-tiny" else args.family

    start = time.perf_counter()
    try:
        out = build_family_model(family, args.out_dir, seed=args.seed)
    except ValueError as err:
        print(f"{args.command}: error: {err}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start

    from gyre.models.tiny import count_parameters

    config = json.loads((out / "config.json").read_text())
    files = sorted(out.iterdir())
    summary = {
        "family": family,
        "params": count_parameters(out),
        "vocab": config["vocab_size"],
        "seed": args.seed,
        "files": [p.name for p in files],
        "bytes": sum(p.stat().st_size for p in files),
        "build_seconds": round(seconds, 3),
    }
    print(out.resolve())
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
