"""`python -m gyre.traj.inspect PATH [PATH...] [--dump]`: summarize recorded executions.

Reads one record file per execution (`docs/record-format.md`), rebuilds each trajectory tree and
prints one JSON object to stdout:

    {"executions": [{"path", "execution", "requests", "unique_nodes", "node_occurrences_expanded",
                     "tokens_stored", "tokens_expanded", "target_tokens_stored", "leaves",
                     "leaves_by_role", "leaf_path_nodes"}, ...],
     "total": {...the same counts summed...}}

Role classification is not built yet, so every leaf is counted under "unclassified"; admission
is not built yet either, so no admitted trajectories are reported. `--dump` prints the readable
tree of each execution (`gyre.traj.dump`) to stdout before the JSON object. A missing or
malformed file prints one line `error: ...` to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gyre.traj.dump import dump_tree
from gyre.traj.store import load_tree
from gyre.traj.tree import TrajectoryTree

SUMMED = (
    "requests",
    "unique_nodes",
    "node_occurrences_expanded",
    "tokens_stored",
    "tokens_expanded",
    "target_tokens_stored",
    "leaves",
)


def summarize(tree: TrajectoryTree, path: str) -> dict[str, Any]:
    stats = tree.stats().as_dict()
    leaves = tree.leaves()
    return {
        "path": path,
        "execution": tree.execution,
        **stats,
        "leaves_by_role": {"unclassified": len(leaves)},
        "leaf_path_nodes": sorted(tree.nodes[leaf].depth for leaf in leaves),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre.traj.inspect", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", metavar="PATH", help="record file of one execution (JSONL)")
    parser.add_argument("--dump", action="store_true", help="print the readable tree of each execution first")
    args = parser.parse_args(argv)
    trees = []
    for raw in args.paths:  # load everything first: a bad file prints nothing but its error
        path = Path(raw)
        if not path.is_file():
            print(f"error: {raw}: no such record file", file=sys.stderr)
            return 2
        try:
            trees.append(load_tree(path))
        except (ValueError, OSError, UnicodeDecodeError) as err:
            print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
            return 2
    summaries = []
    for raw, tree in zip(args.paths, trees, strict=True):
        if args.dump:
            sys.stdout.write(dump_tree(tree))
        summaries.append(summarize(tree, raw))
    total: dict[str, Any] = {key: sum(s[key] for s in summaries) for key in SUMMED}
    total["leaves_by_role"] = {"unclassified": total["leaves"]}
    print(json.dumps({"executions": summaries, "total": total}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
