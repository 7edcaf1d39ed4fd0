"""Trajectory-tree ingest cost: a call at a 700K-token history vs a 7K-token history (contract 4).

Measured side by side in one run (calls alternate between the two trees):
- `parent` ingest (the proxy's path): build the new TOOL segment (hashing only it), build the
  response and insert under the node the context extends. Target: ratio 700K / 7K <= 2.
- full-context walk with cached segment keys (the proxy keeps its Segment objects): one dict lookup
  per history segment, nothing rehashed; informational.
- naive: rebuild every history segment from its ids (rehash the history) each call; what the
  design avoids, a few repetitions only.
Also: stored / unique tokens after ingest (target 1.0) at 700K and on the 636-call synthetic
execution, the time to load that execution from its record file, and admission on it:
- `admit_ms`: `gyre.traj.admission.admit` with J_max = 5 (generic roles), including the boolean
  `targets` mask of each admitted trajectory; median over repetitions with different seeds.
- `materialize_ms`: `TrajectoryTree.path_tokens` of the 5 admitted leaves (ids, provenance,
  behavior log-probs: the token rows the packing buffer consumes). Target for both: well under 100 ms.

    python benchmarks/traj_ingest.py [--reps 2000]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from report import emit

from gyre.traj import (
    CallMeta,
    Provenance,
    RecordWriter,
    Response,
    Segment,
    TrajectoryTree,
    admit,
    classifier_for,
    load_tree,
)
from gyre.traj.synthetic import synthetic_execution

VOCAB = 151_936
SEGMENT_TOKENS = 500  # history: a system prompt, then alternating responses and tool results of this size
NEW_TOOL_TOKENS, NEW_OUTPUT_TOKENS = 2_000, 500


def random_ids(rng: np.random.Generator, count: int) -> list[int]:
    return rng.integers(0, VOCAB, count, dtype=np.int32).tolist()


def history_tree(tokens: int, rng: np.random.Generator) -> tuple[TrajectoryTree, list[Segment], int]:
    """A linear execution whose last response ends at `tokens` tokens: (tree, its segments, last node)."""
    tree = TrajectoryTree(f"history-{tokens}", VOCAB)
    context = [Segment(Provenance.SYSTEM, random_ids(rng, SEGMENT_TOKENS))]
    parent, new = None, list(context)
    for _ in range(tokens // (2 * SEGMENT_TOKENS)):
        output = random_ids(rng, SEGMENT_TOKENS)
        response = Response.build(output, [-0.5] * len(output), "tool_use")
        record = tree.insert(new, response, CallMeta(tree.execution, f"h{len(tree.calls)}"), parent=parent)
        new = [Segment(Provenance.TOOL, random_ids(rng, SEGMENT_TOKENS))]
        context += [Segment(Provenance.SAMPLED, output), new[0]]
        parent = record.response_node
    return tree, context[:-1], parent


def median_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 2)


def ingest_benchmark(reps: int, rng: np.random.Generator) -> dict[str, object]:
    trees = {size: history_tree(size, rng) for size in (7_000, 700_000)}
    history_nodes = {str(size): len(tree.nodes) - 1 for size, (tree, _, _) in trees.items()}
    inputs = [(random_ids(rng, NEW_TOOL_TOKENS), random_ids(rng, NEW_OUTPUT_TOKENS)) for _ in range(reps)]
    logprobs = [-0.5] * NEW_OUTPUT_TOKENS
    parent_s: dict[int, list[float]] = {size: [] for size in trees}
    walk_s: dict[int, list[float]] = {size: [] for size in trees}
    new_tokens: dict[int, int] = {size: 0 for size in trees}
    for rep, (tool, output) in enumerate(inputs):
        for size, (tree, context, last) in trees.items():  # alternate: both sides see the same machine state
            meta = CallMeta(tree.execution, f"p{rep}")
            start = time.perf_counter()
            segment = Segment(Provenance.TOOL, tool)
            tree.insert([segment], Response.build(output, logprobs, "stop"), meta, parent=last)
            parent_s[size].append(time.perf_counter() - start)
            # Same context again from the root with cached keys: only the response differs.
            start = time.perf_counter()
            walk_meta = CallMeta(tree.execution, f"w{rep}")
            tree.insert([*context, segment], Response.build(output[1:], logprobs[1:], "stop"), walk_meta)
            walk_s[size].append(time.perf_counter() - start)
            new_tokens[size] += len(tool) + 2 * len(output) - 1
    naive_s: list[float] = []
    tree, context, _ = trees[700_000]
    raw_history = [(segment.provenance, segment.ids.tolist()) for segment in context]
    for rep in range(min(10, reps)):
        tool, output = inputs[rep]
        start = time.perf_counter()
        segments = [Segment(provenance, ids) for provenance, ids in raw_history] + [Segment(Provenance.TOOL, tool)]
        tree.insert(segments, Response.build(output, logprobs, "stop"), CallMeta(tree.execution, f"n{rep}"))
        naive_s.append(time.perf_counter() - start)
    large = trees[700_000][0]
    history_tokens = {size: sum(len(s) for s in trees[size][1]) for size in trees}
    unique_large = history_tokens[700_000] + new_tokens[700_000]  # naive calls repeat existing content only
    return {
        "history_tokens": {str(size): history_tokens[size] for size in trees},
        "new_tokens_per_call": NEW_TOOL_TOKENS + NEW_OUTPUT_TOKENS,
        "reps": reps,
        "parent_ingest_us": {"7k": median_us(parent_s[7_000]), "700k": median_us(parent_s[700_000])},
        "parent_ingest_ratio_700k_over_7k": round(
            statistics.median(parent_s[700_000]) / statistics.median(parent_s[7_000]), 3
        ),
        "cached_key_walk_us": {"7k": median_us(walk_s[7_000]), "700k": median_us(walk_s[700_000])},
        "cached_key_walk_ratio_700k_over_7k": round(
            statistics.median(walk_s[700_000]) / statistics.median(walk_s[7_000]), 3
        ),
        "naive_rehash_700k_us": median_us(naive_s),
        "stored_over_unique_tokens_700k": round(large.tokens_stored / unique_large, 6),
        "tokens_expanded_over_stored_700k": round(large.stats().tokens_expanded / large.tokens_stored, 2),
        "history_nodes": history_nodes,
    }


def synthetic_benchmark(seed: int) -> dict[str, object]:
    execution = synthetic_execution(seed=seed)
    start = time.perf_counter()
    tree = execution.build_tree()
    build_s = time.perf_counter() - start
    unique = sum(c.new_tokens + (c.output_tokens if c.duplicate_of is None else 0) for c in execution.plan)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "synthetic.jsonl"
        with RecordWriter(path, execution.execution, execution.vocab_size) as writer:
            replica = TrajectoryTree(execution.execution, execution.vocab_size)
            for call in execution.calls:
                writer.append(replica.insert(call.context, call.response, call.meta))
        load_s = []
        for _ in range(5):
            start = time.perf_counter()
            loaded = load_tree(path)
            load_s.append(time.perf_counter() - start)
        size = path.stat().st_size
    stats = loaded.stats()
    return {
        "requests": stats.requests,
        "unique_nodes": stats.unique_nodes,
        "node_occurrences_expanded": stats.node_occurrences_expanded,
        "leaves": stats.leaves,
        "tokens_stored": stats.tokens_stored,
        "tokens_expanded": stats.tokens_expanded,
        "stored_over_unique_tokens": round(tree.tokens_stored / unique, 6),
        "build_from_full_contexts_s": round(build_s, 4),
        "record_file_bytes": size,
        "load_from_disk_s": round(statistics.median(load_s), 4),
        "admission_j_max_5": admission_benchmark(loaded, seed),
    }


def admission_benchmark(tree: TrajectoryTree, seed: int, reps: int = 20) -> dict[str, object]:
    classify = classifier_for("generic")
    admit_s, materialize_s = [], []
    for rep in range(reps):
        start = time.perf_counter()
        admitted = admit(tree, classify, j_max=5, rng=seed + rep)
        admit_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        rows = [tree.path_tokens(trajectory.leaf) for trajectory in admitted]
        materialize_s.append(time.perf_counter() - start)
    return {
        "reps": reps,
        "admit_ms": round(statistics.median(admit_s) * 1e3, 3),
        "materialize_ms": round(statistics.median(materialize_s) * 1e3, 3),
        "admitted": len(admitted),
        "admitted_targets": sum(trajectory.num_targets for trajectory in admitted),
        "materialized_tokens": sum(len(row.ids) for row in rows),
        "target_tokens_stored": tree.stats().target_tokens_stored,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    report = {
        "benchmark": "traj_ingest",
        "ingest": ingest_benchmark(args.reps, rng),
        "synthetic_636": synthetic_benchmark(args.seed),
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
