"""The trajectory tree of one execution: a trie over context segments (paper: "TITO and trajectory trees").

Role: store every recorded model call of an execution so that each shared prefix is stored once,
every call's exact context and output stay recoverable, and candidate trajectories (root-to-leaf
paths) can be materialized on demand.

Contract:
- A node is one segment: its token ids, its provenance, and for SAMPLED nodes created by a response
  the recorded calls (log-probs, metadata). Node 0 is the root (no tokens). Node ids are assigned
  in creation order, so replaying the same inserts in the same order gives the same ids.
- Children are keyed by the segment key (`gyre.traj.record.segment_key`). `insert` walks from the
  root (or from a `parent` the caller knows the context extends) matching keys, reuses matched
  nodes, creates the rest as a branch and hangs the response, a SAMPLED node, from the deepest
  context node. A request that matches nothing attaches to the root; a retry with a different
  output is a sibling; an identical output reuses its node but is still its own call record.
- Cost (docs/architecture.md, contract 4): O(#segments passed) dict lookups plus hashing of segments built
  without a key and of the response. With `parent` the caller passes only the new segments, so a
  700K-token history is neither walked nor rehashed.
- Keys are checked, not trusted: a passed segment whose key matches a stored child must equal that
  node (provenance, length, ids: one memcmp of the passed segment's tokens), otherwise ValueError
  "segment key collides with a stored node of different content" (a stale or forged cached key
  would otherwise silently record a context the engine never saw, docs/architecture.md contract 3). Only
  segments actually passed are compared, so the `parent` path stays flat in history length.
- `close()` freezes the tree when its execution closes: later inserts raise ValueError. A tree
  rebuilt by `gyre.traj.store.load_tree` is open (resume appends to it); close it if it is final.
- Everything is validated before any mutation: on ValueError the tree is unchanged. A request id
  already recorded is rejected: a call is recorded exactly once (docs/architecture.md, contract 3), so a proxy
  that retries a request transparently records only the attempt that answered the harness.
- Not thread-safe: the caller serializes inserts of one execution (and appends the record line
  in the same critical section, so the file order is the insertion order).
- A SAMPLED context segment that matches no recorded output (our earlier output echoed into a new
  context, e.g. a compaction tail) is stored as an unrecorded SAMPLED node: it has no behavior
  log-probs at that position, so it conditions only. If the call that produced it is inserted later
  (any order), the node is reused and becomes a target.

Routing (mixture-of-experts routing replay, docs/moe.md, docs/trajectories.md "Routing"):
- A call may carry `CallRouting`: the experts the engine chose for positions `[start, len(context) +
  len(output) - 1)` of its full sequence. `insert` checks that it ends exactly there and that every call of the
  tree has the same (num_hidden_layers, top_k), then copies it into the nodes its positions fall in (context nodes
  and the response node). Each such node keeps an int16 `[num_tokens, L, K]` array (-1 until routed) and which of
  its positions are routed. A position whose given experts are -1 at every layer stays unrouted (the engine did
  not know them). The first call that routed a position wins: a later call's experts there are compared as sets
  per layer and counted (`routing_compared_tokens`, `routing_mismatched_tokens`), not stored.
- `path_routing(node)` is the routing along a root-to-node path (-1 where no call routed a position; None when
  no call of the tree had routing). `routed_prefix_len(segments, parent)` is how many leading tokens of a context
  are routed at every position: the `start` a proxy asks the engine for, so a call's routing covers only what no
  earlier call routed. It walks only the passed segments (plus, above `parent`, the nodes since the first
  unrouted position, normally just the previous output, whose last token its own call never fed).
- Cost: `insert` adds O(routing given) (one copy of the call's experts into the nodes it spans); a routed token
  costs L * K * 2 bytes in its node, once, whatever the number of paths through it (the tree's records drop
  their routing, the record file keeps it per call).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from gyre.traj.record import (
    NO_ROUTE,
    CallMeta,
    CallRecord,
    CallRouting,
    Provenance,
    Response,
    Segment,
    segment_key,
    validate_ids,
    validate_response,
)

ROOT = 0
NOT_SAMPLED_LOGPROB = float("nan")


class Node:
    """One stored segment. `depth` counts nodes from the root (root 0); `prefix_tokens` counts tokens
    from the root through this node; `calls` lists the call records whose response is this node.

    Routing (module docstring): `routing` is int16 `[num_tokens, L, K]` (None until a call routes one of its
    positions), `routed` bool `[num_tokens]` marks the routed positions, `routed_leading` counts the leading
    routed ones, and `chain_routed` is True when every position from the root through this node is routed."""

    __slots__ = (
        "calls",
        "chain_routed",
        "children",
        "depth",
        "id",
        "ids",
        "key",
        "parent",
        "prefix_tokens",
        "provenance",
        "routed",
        "routed_leading",
        "routing",
    )

    def __init__(
        self,
        node_id: int,
        parent: int,
        provenance: Provenance | None,
        segment: Segment | None,
        depth: int,
        prefix_tokens: int,
    ) -> None:
        self.id = node_id
        self.parent = parent
        self.provenance = provenance
        self.ids = segment.ids if segment is not None else None
        self.key = segment.key if segment is not None else b""
        self.depth = depth
        self.prefix_tokens = prefix_tokens
        self.children: dict[bytes, int] = {}
        self.calls: list[int] = []
        self.routing: np.ndarray | None = None
        self.routed: np.ndarray | None = None
        self.routed_leading = 0
        self.chain_routed = segment is None  # the root (no tokens) is routed throughout

    @property
    def num_tokens(self) -> int:
        return 0 if self.ids is None else len(self.ids)

    @property
    def is_leaf(self) -> bool:
        return not self.children and self.provenance is Provenance.SAMPLED


@dataclass(frozen=True)
class PathTokens:
    """A root-to-node path flattened to tokens (all arrays have one entry per token).

    `target_mask` is True exactly on SAMPLED tokens that carry a recorded behavior log-prob at this
    position; system, user, tool, harness-assistant and evaluator tokens condition only.
    """

    ids: np.ndarray  # int32
    provenance: np.ndarray  # int8, `Provenance` codes
    behavior_logprobs: np.ndarray  # float64, NaN where not a target
    target_mask: np.ndarray  # bool


@dataclass(frozen=True)
class TreeStats:
    requests: int  # recorded model calls
    unique_nodes: int  # stored nodes, root excluded
    node_occurrences_expanded: int  # sum over leaves of path length (nodes), i.e. if every path were expanded
    tokens_stored: int
    tokens_expanded: int  # sum over leaves of path length (tokens)
    target_tokens_stored: int  # tokens of recorded SAMPLED nodes
    leaves: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class TrajectoryTree:
    """The trie of one execution. `vocab_size` bounds every token id."""

    def __init__(self, execution: str, vocab_size: int) -> None:
        if not execution:
            raise ValueError("execution must be a non-empty id")
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive; got {vocab_size}")
        self.execution = execution
        self.vocab_size = vocab_size
        self.nodes: list[Node] = [Node(ROOT, -1, None, None, 0, 0)]
        self.calls: list[CallRecord] = []
        self.call_of_request: dict[str, int] = {}
        self.tokens_stored = 0
        self._closed = False
        self.routing_layers_topk: tuple[int, int] | None = None  # (num_hidden_layers, top_k) once a call had routing
        self.routing_compared_tokens = 0  # routed positions a later call routed again
        self.routing_mismatched_tokens = 0  # of those, positions whose experts differed at some layer (as sets)

    # -- lifecycle ----------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True once `close()` was called: the committed records are frozen."""
        return self._closed

    def close(self) -> None:
        """Freeze the tree (the execution closed): every later `insert` raises ValueError. Idempotent;
        reading (paths, stats, admission) is unaffected."""
        self._closed = True

    # -- matching and insertion ---------------------------------------------------------------------
    def match(self, segments: Sequence[Segment], parent: int | None = None) -> tuple[int, int]:
        """Read-only walk: (deepest matched node, number of leading segments matched).

        ValueError if a segment's key matches a stored node whose content differs (a wrong key).
        """
        node = self._start(parent)
        matched = 0
        for segment in segments:
            child = self._matching_child(node, segment, matched)
            if child is None:
                break
            node = child
            matched += 1
        return node, matched

    def _matching_child(self, node: int, segment: Segment, position: int) -> int | None:
        """The child of `node` holding `segment`, or None; ValueError if its key matches a node of other content."""
        child = self.nodes[node].children.get(segment.key)
        if child is None:
            return None
        stored = self.nodes[child]
        # Cheap checks first; the ids comparison is a memcmp of the passed segment only.
        if stored.provenance is not segment.provenance or stored.ids != segment.ids:
            raise ValueError(
                f"segments[{position}] ({segment.provenance.label}): segment key collides with stored node "
                f"{child} of different content (stored: {stored.provenance.label}, {stored.num_tokens} "
                f"tokens; passed: {segment.provenance.label}, {len(segment)} tokens); "
                "a cached key must be the segment_key of its own ids"
            )
        return child

    def insert(
        self,
        segments: Sequence[Segment],
        response: Response,
        meta: CallMeta,
        parent: int | None = None,
        *,
        routing: CallRouting | None = None,
        before_commit: Callable[[CallRecord], None] | None = None,
    ) -> CallRecord:
        """Record one model call whose context is `path(parent)` (the root if None) + `segments`.

        Returns the call record; only the segments not already stored are kept in it. Raises
        ValueError (tree unchanged) on bad input or if the tree is closed.

        `routing`: the experts the engine chose for this call's positions `[routing.start, len(context) +
        len(output) - 1)` (module docstring); it must end exactly there and have the tree's (layers, top_k).
        The returned record (and the one `before_commit` gets) carries it; `self.calls` keeps the record
        without it, its experts being copied into the nodes.

        `before_commit(record)` runs with the record the call will get, after every check and before the tree
        changes (e.g. writing its line to the record file): whatever it raises propagates and the tree is unchanged,
        so a call is in the tree if and only if `before_commit` returned.
        """
        if self._closed:
            raise ValueError(f"execution {self.execution!r} is closed: its trajectory tree accepts no more calls")
        if meta.execution != self.execution:
            raise ValueError(f"meta.execution {meta.execution!r} is unknown here: this tree records {self.execution!r}")
        if meta.request_id in self.call_of_request:
            raise ValueError(
                f"meta.request_id {meta.request_id!r} is already recorded as call "
                f"{self.call_of_request[meta.request_id]} of execution {self.execution!r}"
            )
        segments = tuple(segments)
        for position, segment in enumerate(segments):
            if not isinstance(segment, Segment):
                raise TypeError(f"segments[{position}] is a {type(segment).__name__}; expected a Segment")
        if self._start(parent) == ROOT and not segments:
            raise ValueError("segments is empty and the parent is the root: a request needs a context")
        if not isinstance(response, Response):
            raise TypeError(f"response is a {type(response).__name__}; expected a Response")
        validate_response(response, self.vocab_size)
        if routing is not None:
            context_tokens = self.nodes[self._start(parent)].prefix_tokens + sum(len(s) for s in segments)
            self._check_routing(routing, context_tokens, len(response.ids))
        fork, matched = self.match(segments, parent)
        new_segments = segments[matched:]
        for position, segment in enumerate(new_segments, start=matched):
            what = f"segments[{position}] ({segment.provenance.label})"
            if len(segment) == 0:
                raise ValueError(f"{what} is empty: every segment needs at least one token")
            validate_ids(segment.ids, self.vocab_size, what)
        # Validated. The record's node ids are known before anything changes: new nodes are numbered in order.
        output = Segment(Provenance.SAMPLED, response.ids)  # hashes the new output once
        context_node = fork if not new_segments else len(self.nodes) + len(new_segments) - 1
        response_node = self.nodes[fork].children.get(output.key) if not new_segments else None
        if response_node is None:
            response_node = len(self.nodes) + len(new_segments)
        record = CallRecord(
            len(self.calls), fork, new_segments, response, meta, context_node, response_node, routing=routing
        )
        if before_commit is not None:
            before_commit(record)
        # Mutate from here on.
        node = fork
        for segment in new_segments:
            node = self._add_child(node, segment)
        if response_node == len(self.nodes):  # the output is new at this context
            self._add_child(node, output)
        assert node == context_node and self.nodes[response_node].parent == context_node, "node ids moved"
        self.calls.append(record if routing is None else replace(record, routing=None))
        self.call_of_request[meta.request_id] = record.index
        self.nodes[response_node].calls.append(record.index)
        if routing is not None:
            self._fill_routing(response_node, routing)
        return record

    def _start(self, parent: int | None) -> int:
        if parent is None:
            return ROOT
        if not isinstance(parent, int) or not 0 <= parent < len(self.nodes):
            raise ValueError(f"parent node {parent!r} is unknown in execution {self.execution!r}")
        return parent

    def _check_routing(self, routing: CallRouting, context_tokens: int, output_tokens: int) -> None:
        if not isinstance(routing, CallRouting):
            raise TypeError(f"routing is a {type(routing).__name__}; expected a CallRouting")
        fed = context_tokens + output_tokens - 1  # the last output token was never fed to the model
        if routing.end != fed:
            raise ValueError(
                f"routing covers positions [{routing.start}, {routing.end}) ({routing.num_tokens} tokens from start "
                f"{routing.start}); expected it to end at {fed} = {context_tokens} context + {output_tokens} output "
                "tokens - 1 (the last output token is never fed)"
            )
        known = self.routing_layers_topk
        if known is not None and routing.layers_topk != known:
            raise ValueError(
                f"routing has {routing.layers_topk[0]} layers x top-{routing.layers_topk[1]}; this tree's earlier "
                f"calls have {known[0]} layers x top-{known[1]} (one model per execution)"
            )

    def _fill_routing(self, response_node: int, routing: CallRouting) -> None:
        """Copy a call's experts into the nodes of its path, at positions no earlier call routed."""
        self.routing_layers_topk = routing.layers_topk
        start, end = routing.start, routing.end
        touched: list[Node] = []
        node = self.nodes[response_node]
        while node.id != ROOT and node.prefix_tokens > start:  # the nodes ending after `start`, bottom up
            node_start = node.prefix_tokens - node.num_tokens
            low, high = max(start, node_start), min(end, node.prefix_tokens)
            if low < high:
                self._fill_node(node, low - node_start, high - node_start, routing.experts[low - start : high - start])
                touched.append(node)
            node = self.nodes[node.parent]
        for node in reversed(touched):  # top down: a node's chain flag needs its parent's
            self._mark_chain_routed(node)

    def _fill_node(self, node: Node, low: int, high: int, experts: np.ndarray) -> None:
        if node.routing is None:
            layers, top_k = experts.shape[1:]
            node.routing = np.full((node.num_tokens, layers, top_k), NO_ROUTE, dtype=np.int16)
            node.routed = np.zeros(node.num_tokens, dtype=np.bool_)
        assert node.routed is not None
        given = (experts != NO_ROUTE).any(axis=(1, 2))  # a row of -1 only: the engine did not know that position
        known = node.routed[low:high]
        again = known & given
        if again.any():  # routed by an earlier call: keep its experts, count disagreements (sets per layer)
            differ = np.sort(node.routing[low:high][again], axis=-1) != np.sort(experts[again], axis=-1)
            self.routing_compared_tokens += int(again.sum())
            self.routing_mismatched_tokens += int(differ.any(axis=(1, 2)).sum())
        fresh = given & ~known
        if fresh.all():
            node.routing[low:high] = experts
        else:
            node.routing[low:high][fresh] = experts[fresh]
        node.routed[low:high] |= given
        if node.routed_leading >= low:  # the leading routed run may grow past `high`
            gaps = np.flatnonzero(~node.routed[node.routed_leading :])
            node.routed_leading = node.num_tokens if gaps.size == 0 else node.routed_leading + int(gaps[0])

    def _mark_chain_routed(self, node: Node) -> None:
        """Set `chain_routed` on `node` if it now holds, and on the descendants it now holds for (each node flips
        once: amortized O(nodes) over the tree's life)."""
        if node.chain_routed or node.routed_leading < node.num_tokens or not self.nodes[node.parent].chain_routed:
            return
        stack = [node]
        while stack:
            above = stack.pop()
            above.chain_routed = True
            for child_id in above.children.values():
                child = self.nodes[child_id]
                if not child.chain_routed and child.routed_leading == child.num_tokens:
                    stack.append(child)

    def _add_child(self, parent: int, segment: Segment) -> int:
        above = self.nodes[parent]
        node = Node(
            len(self.nodes), parent, segment.provenance, segment, above.depth + 1, above.prefix_tokens + len(segment)
        )
        self.nodes.append(node)
        above.children[segment.key] = node.id
        self.tokens_stored += len(segment)
        return node.id

    # -- reading ------------------------------------------------------------------------------------
    def path(self, node_id: int) -> list[int]:
        """Node ids from the root's child down to `node_id` (empty for the root)."""
        self._start(node_id)
        out: list[int] = []
        while node_id != ROOT:
            out.append(node_id)
            node_id = self.nodes[node_id].parent
        out.reverse()
        return out

    def leaves(self) -> list[int]:
        """Candidate trajectories: nodes without children that hold a response (creation order)."""
        return [node.id for node in self.nodes if node.is_leaf]

    def behavior_logprobs(self, node_id: int) -> Any:
        """The recorded log-probs of a SAMPLED node (its first call's), or None if it has no call."""
        node = self.nodes[node_id]
        return self.calls[node.calls[0]].response.logprobs if node.calls else None

    def path_tokens(self, node_id: int) -> PathTokens:
        """Flatten the root-to-`node_id` path: ids, provenance codes, behavior log-probs, target mask."""
        nodes = [self.nodes[i] for i in self.path(node_id)]
        if not nodes:
            empty = np.zeros(0)
            return PathTokens(empty.astype(np.int32), empty.astype(np.int8), empty, empty.astype(bool))
        ids = np.concatenate([np.frombuffer(node.ids, dtype=np.int32) for node in nodes])
        provenance = np.concatenate([np.full(node.num_tokens, int(node.provenance), np.int8) for node in nodes])
        logprobs = np.full(len(ids), NOT_SAMPLED_LOGPROB)
        start = 0
        for node in nodes:
            recorded = self.behavior_logprobs(node.id) if node.provenance is Provenance.SAMPLED else None
            if recorded is not None:
                logprobs[start : start + node.num_tokens] = recorded
            start += node.num_tokens
        return PathTokens(ids, provenance, logprobs, ~np.isnan(logprobs))

    def path_routing(self, node_id: int) -> np.ndarray | None:
        """The routing along the root-to-`node_id` path, int16 `[path tokens, L, K]`, -1 where no call routed a
        position; None when no call of this tree had routing. Row i goes with `path_tokens(node_id).ids[i]`."""
        if self.routing_layers_topk is None:
            return None
        layers, top_k = self.routing_layers_topk
        parts = [
            node.routing if node.routing is not None else np.full((node.num_tokens, layers, top_k), NO_ROUTE, np.int16)
            for node in (self.nodes[i] for i in self.path(node_id))
        ]
        if not parts:
            return np.full((0, layers, top_k), NO_ROUTE, dtype=np.int16)
        return np.concatenate(parts)

    def routed_prefix_len(self, segments: Sequence[Segment] = (), parent: int | None = None) -> int:
        """How many leading tokens of the context `path(parent)` (the root if None) + `segments` are routed at
        every position: the `start` to ask the engine for (`CallRouting`). 0 when the tree has no routing.

        Read-only; walks the passed segments (dict lookups, and a content check of those matching a stored node,
        as `match`) and, when a position above `parent` is not routed, the nodes from there down to `parent`
        (normally one: the previous output, whose last token its own call never fed). ValueError as `match`.
        """
        node = self.nodes[self._start(parent)]
        if self.routing_layers_topk is None:
            return 0
        if not node.chain_routed:  # the first unrouted position is on the path above: find its node
            while not self.nodes[node.parent].chain_routed:
                node = self.nodes[node.parent]
            return node.prefix_tokens - node.num_tokens + node.routed_leading
        for position, segment in enumerate(segments):
            child = self._matching_child(node.id, segment, position)
            if child is None:
                break
            below = self.nodes[child]
            if not below.chain_routed:
                return node.prefix_tokens + below.routed_leading
            node = below
        return node.prefix_tokens

    def call_tokens(self, call: int) -> tuple[list[int], list[int]]:
        """The exact (context ids, output ids) of recorded call `call`."""
        record = self.calls[call]
        context: list[int] = []
        for node_id in self.path(record.context_node):
            context.extend(self.nodes[node_id].ids)
        return context, list(record.response.ids)

    def stats(self) -> TreeStats:
        leaves = [self.nodes[i] for i in self.leaves()]
        return TreeStats(
            requests=len(self.calls),
            unique_nodes=len(self.nodes) - 1,
            node_occurrences_expanded=sum(leaf.depth for leaf in leaves),
            tokens_stored=self.tokens_stored,
            tokens_expanded=sum(leaf.prefix_tokens for leaf in leaves),
            target_tokens_stored=sum(node.num_tokens for node in self.nodes if node.calls),
            leaves=len(leaves),
        )

    def check_invariants(self) -> None:
        """Assert the trie invariants (tests call this): keys match content, depths and totals add up."""
        total = 0
        for node in self.nodes[1:]:
            above = self.nodes[node.parent]
            assert above.children[node.key] == node.id
            assert node.key == segment_key(node.provenance, node.ids)
            assert node.depth == above.depth + 1 and node.prefix_tokens == above.prefix_tokens + node.num_tokens
            assert node.children or node.provenance is Provenance.SAMPLED, "every branch ends in a response"
            total += node.num_tokens
            self._check_node_routing(node, above)
        assert total == self.tokens_stored

    def _check_node_routing(self, node: Node, above: Node) -> None:
        if node.routing is None:
            assert node.routed is None and node.routed_leading == 0 and not node.chain_routed
            return
        assert node.routed is not None and self.routing_layers_topk is not None
        assert node.routing.shape == (node.num_tokens, *self.routing_layers_topk) and node.routing.dtype == np.int16
        assert (node.routing[~node.routed] == NO_ROUTE).all(), "an unrouted position holds experts"
        gaps = np.flatnonzero(~node.routed)
        assert node.routed_leading == (int(gaps[0]) if gaps.size else node.num_tokens)
        assert node.chain_routed == (node.routed_leading == node.num_tokens and above.chain_routed)
