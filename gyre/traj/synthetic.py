"""A seeded synthetic execution shaped like the paper's Appendix C case (execution f3ad38e5).

Role: test and benchmark input for the trajectory tree, the store and `inspect`, with a `plan`
from which tests derive node counts without the tree.

Shape (defaults): 636 model calls; a main agent and a sub-agent with separate roots (different
system prompts); each compacts once (a summary request extends its history by the tool result
and an injected summary instruction; the context then restarts from the same system prompt, a
user message carrying the summary and a harness-written assistant tail); six harness retries that
rewind a stretch of turns and re-send an earlier context (the abandoned stretch ends in a leaf);
four retries whose output is identical (the node is reused, the call is still recorded); one
evaluator critique fed back to the main agent. Result: 10 candidate trajectories of 53-293 nodes.

Every turn's new context is the tool result of the previous answer (one TOOL segment); our answers
are echoed back as SAMPLED segments, as the proxy restores them. Token ids are random in the
vocabulary, so distinct segments never collide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gyre.traj.record import CallMeta, Provenance, Response, Segment
from gyre.traj.tree import TrajectoryTree

# (name, agent, system prompt shared with, prefix provenances, live turns, compacts)
STREAMS = (
    ("main-a", "main", None, ("system", "system", "user"), 144, True),
    ("main-b", "main", "main-a", ("system", "user", "harness_assistant"), 120, False),
    ("sub-a", "sub", None, ("system", "user"), 90, True),
    ("sub-b", "sub", "sub-a", ("system", "user", "harness_assistant"), 100, False),
)
REWIND_STREAMS = ("main-a", "main-a", "main-b", "sub-a", "sub-a", "sub-b")
DUPLICATE_STREAMS = ("main-a", "main-b", "sub-a", "sub-b")
MIN_LEAF_NODES, MAX_LEAF_NODES = 53, 293
TOKENS = {  # (low, high) token counts per segment kind
    "system": (1200, 2000),
    "user": (100, 400),
    "harness_assistant": (100, 300),
    "tool": (10, 600),
    "evaluator": (50, 200),
    "sampled": (10, 400),
    "instruction": (60, 61),
    "summary": (600, 1200),
}


@dataclass(frozen=True)
class PlannedCall:
    """What the generator did, in terms a test can count without the tree."""

    index: int
    stream: str
    role: str  # ground truth: main, main-summary, sub-agent, sub-agent-summary
    after: int | None  # context = that call's context + its response + new_segments (None: a stream start)
    same_context_as: int | None  # a retry: exactly that call's context, no new segments
    new_segments: tuple[str, ...]  # provenance labels of the context segments this call adds
    shared_segments: int  # leading new_segments already stored by an earlier stream (its system prompt)
    duplicate_of: int | None  # the output equals that call's output (its node is reused)
    new_tokens: int  # tokens of the new, not shared, context segments
    output_tokens: int


@dataclass(frozen=True)
class SyntheticCall:
    plan: PlannedCall
    context: tuple[Segment, ...]  # the full context (Segment objects are shared, keys computed once)
    response: Response
    meta: CallMeta


@dataclass
class SyntheticExecution:
    execution: str
    vocab_size: int
    calls: list[SyntheticCall] = field(default_factory=list)

    @property
    def plan(self) -> list[PlannedCall]:
        return [call.plan for call in self.calls]

    def build_tree(self) -> TrajectoryTree:
        """Insert every call with its full context from the root (exercises matching)."""
        tree = TrajectoryTree(self.execution, self.vocab_size)
        for call in self.calls:
            tree.insert(call.context, call.response, call.meta)
        return tree


class _Tokens:
    def __init__(self, seed: int, vocab_size: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.vocab_size = vocab_size

    def segment(self, kind: str, provenance: Provenance) -> Segment:
        low, high = TOKENS[kind]
        count = int(self.rng.integers(low, high))
        return Segment(provenance, self.rng.integers(0, self.vocab_size, count, dtype=np.int32).tolist())

    def response(self, kind: str = "sampled") -> Response:
        low, high = TOKENS[kind]
        count = int(self.rng.integers(low, high))
        ids = self.rng.integers(0, self.vocab_size, count, dtype=np.int32).tolist()
        return Response.build(ids, (-self.rng.exponential(0.5, count)).tolist(), "tool_use")


def _split(total: int, parts: int, low: int, high: int, rng: np.random.Generator) -> list[int]:
    sizes = [low] * parts
    for _ in range(total - low * parts):
        open_parts = [i for i in range(parts) if sizes[i] < high]
        sizes[open_parts[int(rng.integers(len(open_parts)))]] += 1
    return sizes


def synthetic_execution(
    seed: int = 0, execution: str = "synthetic-f3ad38e5", vocab_size: int = 151_936, num_calls: int = 636
) -> SyntheticExecution:
    """Generate the execution. `num_calls` sets how many turns the six rewinds abandon in total."""
    tokens = _Tokens(seed, vocab_size)
    rng = np.random.default_rng(seed + 1)
    live_calls = sum(turns + compacts for *_, turns, compacts in STREAMS)
    abandoned = num_calls - live_calls - len(DUPLICATE_STREAMS)
    if not len(REWIND_STREAMS) <= abandoned <= 50 * len(REWIND_STREAMS):
        raise ValueError(f"num_calls={num_calls} leaves {abandoned} abandoned calls for 6 rewinds; expected 6..300")
    rewind_sizes = _split(abandoned, len(REWIND_STREAMS), 5 if abandoned >= 30 else 1, 50, rng)
    system_of: dict[str, Segment] = {}
    streams: dict[str, list[dict[str, Any]]] = {}
    for name, agent, shares, prefix_kinds, turns, compacts in STREAMS:
        prefix = []
        for position, kind in enumerate(prefix_kinds):
            provenance = Provenance.from_label(kind)
            if position == 0 and shares is not None:
                prefix.append(system_of[shares])
            elif kind == "user" and shares is not None:
                prefix.append(tokens.segment("summary", provenance))  # "continued from ..." + the summary
            else:
                prefix.append(tokens.segment(kind, provenance))
        system_of[name] = prefix[0]
        rewinds = [size for stream, size in zip(REWIND_STREAMS, rewind_sizes, strict=True) if stream == name]
        streams[name] = _stream_calls(
            name, agent, prefix, int(shares is not None), turns, compacts, rewinds, tokens, rng
        )
    # Delegation: the sub-agent runs while the main agent waits, between two main-agent calls.
    main_a, delegated_at = streams["main-a"], int(rng.integers(1, len(streams["main-a"])))
    order = main_a[:delegated_at] + streams["sub-a"] + streams["sub-b"] + main_a[delegated_at:] + streams["main-b"]
    return _number(order, execution, vocab_size)


def _stream_calls(
    name: str,
    agent: str,
    prefix: list[Segment],
    shared: int,
    turns: int,
    compacts: bool,
    rewinds: Sequence[int],
    tokens: _Tokens,
    rng: np.random.Generator,
) -> list[dict[str, Any]]:
    role = "main" if agent == "main" else "sub-agent"
    evaluator_turn = turns // 2 if name == "main-b" else -1
    # Live context depth (nodes) per turn, to place rewinds so that abandoned leaves stay in range.
    depth = {1: len(prefix)}
    for turn in range(2, turns + 1):
        depth[turn] = depth[turn - 1] + 2 + (turn == evaluator_turn)
    rewind_at: dict[int, int] = {}
    for size in rewinds:
        leaf_nodes = {k: depth[k] + 2 * (size - 1) + 1 for k in range(1, turns + 1) if k not in rewind_at}
        fits = [k for k, nodes in leaf_nodes.items() if MIN_LEAF_NODES <= nodes <= MAX_LEAF_NODES]
        rewind_at[fits[int(rng.integers(len(fits)))]] = size
    free = [k for k in range(1, turns + 1) if k not in rewind_at]
    duplicate_turn = free[int(rng.integers(len(free)))]
    calls: list[dict[str, Any]] = []

    def emit(context: list[Segment], new: list[Segment], response: Response, **plan: Any) -> dict[str, Any]:
        defaults = {"shared": 0, "after": None, "same": None, "dup": None, "role": role}
        call = {"stream": name, "agent": agent, "context": tuple(context), "new": new, "response": response}
        call.update(defaults | plan)
        calls.append(call)
        return call

    context, previous = list(prefix), None
    for turn in range(1, turns + 1):
        new = list(prefix) if turn == 1 else [previous["output"], tokens.segment("tool", Provenance.TOOL)]
        if turn == evaluator_turn:
            new.append(tokens.segment("evaluator", Provenance.EVALUATOR))
        if turn > 1:
            context = context + new
        shared_here = shared if turn == 1 else 0
        retried = None
        if turn in rewind_at:  # the abandoned stretch first, then the harness re-sends this context
            old_context, old = context, None
            for step in range(rewind_at[turn]):
                old_new = new if step == 0 else [old["output"], tokens.segment("tool", Provenance.TOOL)]
                old_context = old_context if step == 0 else old_context + old_new
                first = step == 0
                old = emit(
                    old_context,
                    old_new,
                    tokens.response(),
                    after=previous if first else old,
                    shared=shared_here if first else 0,
                )
                old["output"] = Segment(Provenance.SAMPLED, old["response"].ids)
                retried = retried or old
            live = emit(context, [], tokens.response(), same=retried)
        else:
            live = emit(context, new, tokens.response(), after=previous, shared=shared_here)
        live["output"] = Segment(Provenance.SAMPLED, live["response"].ids)
        if turn == duplicate_turn:
            emit(context, [], live["response"], same=live, dup=live)
        previous = live
    if compacts:
        new = [
            previous["output"],
            tokens.segment("tool", Provenance.TOOL),
            tokens.segment("instruction", Provenance.USER),
        ]
        summary = emit(context + new, new, tokens.response("summary"), after=previous, role=f"{role}-summary")
        summary["output"] = Segment(Provenance.SAMPLED, summary["response"].ids)
    return calls


def _number(order: list[dict[str, Any]], execution: str, vocab_size: int) -> SyntheticExecution:
    index_of = {id(call): index for index, call in enumerate(order)}
    out = SyntheticExecution(execution, vocab_size)
    for index, call in enumerate(order):
        ref = {key: None if call[key] is None else index_of[id(call[key])] for key in ("after", "same", "dup")}
        # An echoed output is part of the previous call's path, not a new segment of this call.
        new = call["new"][1:] if call["after"] is not None else call["new"]
        plan = PlannedCall(
            index=index,
            stream=call["stream"],
            role=call["role"],
            after=ref["after"],
            same_context_as=ref["same"],
            new_segments=tuple(segment.provenance.label for segment in new),
            shared_segments=call["shared"],
            duplicate_of=ref["dup"],
            new_tokens=sum(len(segment) for segment in new[call["shared"] :]),
            output_tokens=len(call["response"].ids),
        )
        kind = "compaction" if call["role"].endswith("summary") else "turn"
        signals = {"agent": call["agent"], "request_kind": kind, "stream": call["stream"]}
        timings = {"queued_s": 0.01 * (index % 7), "first_token_s": 0.2, "total_s": 1.0 + 0.01 * index}
        meta = CallMeta(execution, f"req-{index:04d}", index // 40, f"cell-{index % 4}", timings, signals)
        out.calls.append(SyntheticCall(plan, call["context"], call["response"], meta))
    return out
