"""Pure TITO records and trajectory trees (stdlib + numpy only; no IO beyond reading/writing records).

- `record`: provenance, segments (keyed by a blake2b digest), responses, call metadata, validation.
- `tree`: the per-execution trie over segments; insertion cost grows with new content only.
- `store`: the append-only JSONL record format (one file per execution) and replay.
- `dump`: the human-readable tree dump.
- `synthetic`: a seeded execution shaped like the paper's Appendix C case, with its plan.
- `inspect`: `python -m gyre.traj.inspect PATH...` summary of recorded executions.
"""

from gyre.traj.dump import dump_tree
from gyre.traj.record import CallMeta, CallRecord, Provenance, Response, Segment, segment_key
from gyre.traj.store import FORMAT_VERSION, RecordWriter, load_tree
from gyre.traj.tree import ROOT, PathTokens, TrajectoryTree, TreeStats

__all__ = [
    "FORMAT_VERSION",
    "ROOT",
    "CallMeta",
    "CallRecord",
    "PathTokens",
    "Provenance",
    "RecordWriter",
    "Response",
    "Segment",
    "TrajectoryTree",
    "TreeStats",
    "dump_tree",
    "load_tree",
    "segment_key",
]
