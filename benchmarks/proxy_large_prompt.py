"""A 10 MB prompt against `python -m gyre.serve`: how fast it is refused, what it costs everyone else, what it keeps.

Starts `python -m gyre.serve` (tiny default model, CPU, two execution keys) from this tree and, with `--baseline`,
from another (a git revision, checked out into a temporary worktree, or a directory). Against each:

1. the normal time of a small call (`/v1/messages`, one output token) on key B: the median of `--small` calls;
2. `--big` times, a `--megabytes` MB user message on key A (one line of words, beyond any context limit), while key
   B keeps sending small calls back to back: the big call's status and seconds, the small calls' latencies while it
   was in flight;
3. the server's resident memory (VmRSS) after the warm-up calls and after the big calls (and a 2 s settle).

Issue 13's acceptance (`--route messages`): a 400 within 2 s, a concurrent small call within 100 ms of its normal
time, RSS after 20 big calls within 200 MB of the start. Issue 30's (`--route count_tokens`, the big calls go to
`/v1/messages/count_tokens`): an answer within 1 s, < 50 ms added to the small calls, < 100 MB of RSS growth.
Prints one JSON object (last line).

    python benchmarks/proxy_large_prompt.py [--route messages|count_tokens] [--baseline REV_OR_DIR] [--big 20]
        [--megabytes 10] [--out results/...]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from report import emit
from serve_startup import _head, baseline_tree

ROUTES = {"messages": "/v1/messages", "count_tokens": "/v1/messages/count_tokens"}
READY_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 600.0


class Served:
    """`python -m gyre.serve` from `tree` with two keys; stopped by its process group."""

    def __init__(self, tree: Path, run_dir: str):
        env = {**os.environ, "PYTHONPATH": str(tree)}
        command = [sys.executable, "-m", "gyre.serve", f"hydra.run.dir={run_dir}", "executions=2"]
        self.process = subprocess.Popen(
            command, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.keys: list[str] = []
        started = time.monotonic()
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("anthropic: "):
                self.port = int(line.rsplit(":", 1)[1])
            elif line.startswith("key: "):
                self.keys.append(line.split()[1])
            elif line.strip() == "ready":
                return
            if time.monotonic() - started > READY_TIMEOUT_S:
                break
        self.stop()
        raise RuntimeError(f"gyre.serve from {tree} exited or timed out before printing ready")

    def post(self, key: str, body: bytes, path: str = "/v1/messages") -> tuple[int, float]:
        started = time.perf_counter()
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=CALL_TIMEOUT_S)
        connection.request("POST", path, body=body, headers={"content-type": "application/json", "x-api-key": key})
        response = connection.getresponse()
        response.read()
        connection.close()
        return response.status, time.perf_counter() - started

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


def small_body(i: int) -> bytes:
    return json.dumps({"model": "gyre", "max_tokens": 1, "messages": [{"role": "user", "content": f"hi {i}"}]}).encode()


def big_body(megabytes: float, i: int) -> bytes:
    words = "lorem ipsum dolor sit amet consectetur adipiscing elit "
    text = f"{i} " + words * int(megabytes * 1e6 / len(words))
    return json.dumps({"model": "gyre", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}).encode()


def measure(tree: Path, big: int, small: int, megabytes: float, route: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="gyre-bench-large-") as run_dir:
        served = Served(tree, run_dir)
        try:
            key_big, key_small = served.keys
            for i in range(5):  # warm up both keys and the engine
                served.post(key_small, small_body(i))
            normal = [served.post(key_small, small_body(100 + i))[1] for i in range(small)]
            rss_start = served.rss_mb()
            big_calls, during = [], []
            for i in range(big):
                body = big_body(megabytes, i)
                result: dict = {}
                thread = threading.Thread(
                    target=lambda b=body, r=result: r.update(answer=served.post(key_big, b, ROUTES[route]))
                )
                thread.start()
                n = 0
                while thread.is_alive():
                    during.append(served.post(key_small, small_body(1000 * (i + 1) + n))[1])
                    n += 1
                thread.join()
                big_calls.append(result["answer"])
                print(f"big call {i + 1}/{big}: {result['answer'][0]} in {result['answer'][1]:.2f} s", file=sys.stderr)
            time.sleep(2.0)
            rss_end = served.rss_mb()
        finally:
            served.stop()
    seconds = [s for _, s in big_calls]
    return {
        "big_call_statuses": sorted({status for status, _ in big_calls}),
        "big_call_seconds": {"median": statistics.median(seconds), "max": max(seconds)},
        "small_call_ms_normal_median": 1e3 * statistics.median(normal),
        "small_call_ms_during_big": {
            "count": len(during),
            "median": 1e3 * statistics.median(during) if during else None,
            "max": 1e3 * max(during) if during else None,
        },
        "small_call_ms_during_minus_normal_max": 1e3 * (max(during) - statistics.median(normal)) if during else None,
        "rss_mb": {"start": rss_start, "end": rss_end, "growth": rss_end - rss_start},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git revision or directory of the tree to compare with")
    parser.add_argument("--big", type=int, default=20, help="big calls per tree")
    parser.add_argument("--small", type=int, default=20, help="small calls for the normal time")
    parser.add_argument("--megabytes", type=float, default=10.0)
    parser.add_argument("--route", choices=sorted(ROUTES), default="messages", help="where the big calls go")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.big < 1 or args.small < 1 or args.megabytes <= 0:
        raise SystemExit("proxy_large_prompt: --big and --small must be >= 1 and --megabytes > 0")
    results = {}
    with tempfile.TemporaryDirectory(prefix="gyre-bench-") as scratch:
        trees = {"this": (Path(__file__).resolve().parents[1], f"git {_head()}")}
        try:
            if args.baseline:
                trees["baseline"] = baseline_tree(args.baseline, Path(scratch))
            for name, (tree, source) in trees.items():
                results[name] = {"source": source, **measure(tree, args.big, args.small, args.megabytes, args.route)}
        finally:
            if "baseline" in trees and trees["baseline"][1].startswith("git "):
                root = Path(__file__).resolve().parents[1]
                subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(trees["baseline"][0])])
    emit(
        {
            "benchmark": "proxy_large_prompt",
            "route": ROUTES[args.route],
            "what": f"{args.megabytes:g} MB user message x {args.big} to {ROUTES[args.route]} on key A of gyre.serve "
            "(tiny model, CPU) "
            "while key B sends small calls back to back",
            "trees": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
