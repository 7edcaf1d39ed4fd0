"""`python -m gyre.traj.inspect PATH [PATH...] [--dump] [--harness H] [--j-max J] [--seed S]`.

Reads one record file per execution (`docs/record-format.md`), rebuilds each trajectory tree and
prints one JSON object to stdout:

    {"executions": [{"path", "execution", "requests", "unique_nodes", "node_occurrences_expanded",
                     "tokens_stored", "tokens_expanded", "target_tokens_stored", "leaves",
                     "leaves_by_role", "leaf_path_nodes", "admitted", "admitted_targets"}, ...],
     "total": {...the counts summed, "leaves_by_role", "admitted_trajectories", "admitted_targets"}}

"leaves_by_role" counts leaves per role (all four, in the priority order of Eq. 4) as the
`--harness` classifier (`gyre.traj.roles.classifier_for`; default generic) decides. "admitted"
lists the trajectories `gyre.traj.admission.admit` draws with `--j-max` (default 5), in draw
order: {"leaf", "role", "num_targets"}; each execution draws with `execution_seed(--seed,
execution)` (default 0), so its result depends neither on the other files listed nor on their
order. `--dump` prints the readable tree of each execution (`gyre.traj.dump`) to stdout before
the JSON object. A missing path, a directory, a malformed or binary file, or role signals the
classifier rejects print one line `error: ...` naming the file to stderr and exit with status 2.
A closed stdout (piped into `head`) ends the command quietly with status 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gyre.traj.admission import DEFAULT_J_MAX, admit, execution_seed
from gyre.traj.dump import dump_tree
from gyre.traj.roles import PRIORITY, RoleClassifier, classifier_for, classify_leaves, count_by_role
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


def summarize(
    tree: TrajectoryTree, path: str, classify: RoleClassifier, j_max: int = DEFAULT_J_MAX, seed: int = 0
) -> dict[str, Any]:
    stats = tree.stats().as_dict()
    leaves = tree.leaves()
    admitted = admit(tree, classify, j_max, rng=execution_seed(seed, tree.execution))
    return {
        "path": path,
        "execution": tree.execution,
        **stats,
        "leaves_by_role": count_by_role(classify_leaves(tree, classify)),
        "leaf_path_nodes": sorted(tree.nodes[leaf].depth for leaf in leaves),
        "admitted": [{"leaf": t.leaf, "role": t.role, "num_targets": t.num_targets} for t in admitted],
        "admitted_targets": sum(t.num_targets for t in admitted),
    }


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre.traj.inspect", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", metavar="PATH", help="record file of one execution (JSONL)")
    parser.add_argument("--dump", action="store_true", help="print the readable tree of each execution first")
    parser.add_argument(
        "--harness", default="generic", help="role classifier: claude_code, codex, builtin or generic (default)"
    )
    parser.add_argument(
        "--j-max", type=positive_int, default=DEFAULT_J_MAX, help="admitted trajectories per execution at most"
    )
    parser.add_argument("--seed", type=int, default=0, help="run seed (per execution: execution_seed)")
    args = parser.parse_args(argv)
    classify = classifier_for(args.harness)
    trees = []
    for raw in args.paths:  # load everything first: a bad file prints nothing but its error
        path = Path(raw)
        if path.is_dir():
            print(f"error: {raw}: is a directory, expected a record file", file=sys.stderr)
            return 2
        if not path.is_file():
            print(f"error: {raw}: no such record file", file=sys.stderr)
            return 2
        try:
            trees.append(load_tree(path))
        except (ValueError, OSError) as err:  # ValueError includes UnicodeDecodeError
            message = " ".join(str(err).split())
            print(f"error: {message if raw in message else f'{raw}: {message}'}", file=sys.stderr)
            return 2
    summaries = []
    for raw, tree in zip(args.paths, trees, strict=True):
        try:
            summaries.append(summarize(tree, raw, classify, args.j_max, args.seed))
        except ValueError as err:  # role signals the classifier rejects
            print(f"error: {raw}: {' '.join(str(err).split())}", file=sys.stderr)
            return 2
    if args.dump:
        for tree in trees:
            sys.stdout.write(dump_tree(tree))
    total: dict[str, Any] = {key: sum(s[key] for s in summaries) for key in SUMMED}
    total["leaves_by_role"] = {role.value: sum(s["leaves_by_role"][role.value] for s in summaries) for role in PRIORITY}
    total["admitted_trajectories"] = sum(len(s["admitted"]) for s in summaries)
    total["admitted_targets"] = sum(s["admitted_targets"] for s in summaries)
    print(json.dumps({"executions": summaries, "total": total}))
    return 0


def run() -> int:
    """`main` for the command line: a reader that closes the pipe early (`| head`) is not an error."""
    try:
        status = main()
        sys.stdout.flush()  # surface a broken pipe here rather than at interpreter exit
    except BrokenPipeError:
        # The standard handling (Python docs, "Note on SIGPIPE"): point stdout at devnull so the
        # interpreter's final flush does not raise again, and exit quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    return status


if __name__ == "__main__":
    sys.exit(run())
