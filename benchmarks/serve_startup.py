"""Start-up time of `python -m gyre.serve`: from spawning the process to its `ready` line, this tree against another.

Each repetition starts `python -m gyre.serve` (tiny default model, proxy on a free port of 127.0.0.1, a temporary
run directory) once per tree, alternating the trees so that a change in the machine's load hits both alike, and
kills it by its process group as soon as it prints `ready`. A first round warms the caches (the tiny model is built
once per source version, `.pyc` files are written) and is not counted. `--baseline` names the other tree: a git
revision of this repository (checked out into a temporary worktree, removed at the end) or a directory holding a
gyre checkout. Both run with this interpreter, each with its own tree first on `PYTHONPATH`.
Reports seconds (median, min, max) per tree and the ratio of medians (this tree / baseline). Prints one JSON object
(last line).

    python benchmarks/serve_startup.py [--baseline REV_OR_DIR] [--repeats 6] [--out results/serve_startup.json]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import emit

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 300.0  # a cold start builds the tiny model first (~1 s); a hang must not stall the benchmark


def time_to_ready(tree: Path) -> float:
    """Seconds from spawn to the `ready` line of one `python -m gyre.serve` run from `tree`."""
    with tempfile.TemporaryDirectory(prefix="gyre-serve-startup-") as run_dir:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        command = [sys.executable, "-m", "gyre.serve", f"hydra.run.dir={run_dir}", "proxy.host=127.0.0.1"]
        start = time.perf_counter()
        process = subprocess.Popen(
            command,
            cwd=tree,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,  # its own process group: the kill below reaches the engine thread's helpers
        )
        try:
            assert process.stdout is not None
            for line in process.stdout:
                if line.strip() == "ready":
                    return time.perf_counter() - start
                if time.perf_counter() - start > READY_TIMEOUT_S:
                    break
            raise RuntimeError(f"gyre.serve from {tree} exited or timed out before printing ready")
        finally:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def baseline_tree(spec: str, scratch: Path) -> tuple[Path, str]:
    """The baseline's directory and a description: `spec` is a directory or a git revision of this repository."""
    path = Path(spec)
    if path.is_dir():
        return path.resolve(), str(path.resolve())
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", f"{spec}^{{commit}}"], capture_output=True, text=True
    )
    if commit.returncode != 0:
        raise SystemExit(f"serve_startup: --baseline={spec!r} is neither a directory nor a git revision")
    tree = scratch / "baseline"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), spec], check=True, capture_output=True
    )
    return tree, f"git {commit.stdout.strip()}"


def summary(times: list[float]) -> dict[str, float]:
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git revision or directory of the tree to compare with")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"serve_startup: --repeats={args.repeats} is not allowed: expected an integer >= 1")
    with tempfile.TemporaryDirectory(prefix="gyre-bench-") as scratch:
        trees = {"this": (REPO, f"git {_head()}")}
        try:
            if args.baseline:
                trees["baseline"] = baseline_tree(args.baseline, Path(scratch))
            times: dict[str, list[float]] = {name: [] for name in trees}
            for repetition in range(args.repeats + 1):  # round 0 warms the caches and is dropped
                for name, (tree, _) in trees.items():
                    seconds = time_to_ready(tree)
                    if repetition:
                        times[name].append(seconds)
                print(f"round {repetition}/{args.repeats}", file=sys.stderr, flush=True)
        finally:
            if "baseline" in trees and trees["baseline"][1].startswith("git "):
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(trees["baseline"][0])])
    result = {
        "benchmark": "serve_startup",
        "what": "python -m gyre.serve (tiny default model, CPU) from spawn to its ready line",
        "repeats": args.repeats,
        "trees": {name: {"source": source, "seconds": summary(times[name])} for name, (_, source) in trees.items()},
    }
    if "baseline" in times:
        result["ratio_of_medians"] = statistics.median(times["this"]) / statistics.median(times["baseline"])
    emit(result, args.out)


def _head() -> str:
    """This tree's commit, with `+changes` when the working tree differs from it."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    status = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return (head.stdout.strip() or "unknown") + ("+changes" if status.stdout.strip() else "")


if __name__ == "__main__":
    main()
