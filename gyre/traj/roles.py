"""Role classes of candidate trajectories (paper: "Trajectory sampling", Eq. 4) and their classifiers.

Role: decide, per leaf of a trajectory tree, which of the four classes its trajectory belongs to,
from the role signals the proxy recorded with the call(s) whose response is the leaf
(`CallMeta.role_signals`). Admission (`gyre.traj.admission`) draws classes in priority order.

Contract:
- `Role` has four members; `PRIORITY` lists them in the order of Eq. 4, highest first:
  main > main-summary > sub-agent > sub-agent-summary. `Role.rank` is the position there (0 first).
- A classifier is a callable `(tree, leaf) -> Role` (`RoleClassifier`). One is chosen per execution
  with `classifier_for(harness)`; an unknown harness gets `generic`.
- Role signals are a flat mapping of strings and bools that the proxy fills from request headers
  and bodies. The keys each classifier reads (others are ignored):

  | classifier    | key               | type | meaning                                                  |
  |---------------|-------------------|------|----------------------------------------------------------|
  | `claude_code` | `agent_id`        | str  | header `x-claude-code-agent-id`; non-empty -> sub-agent   |
  |               | `summary_request` | bool | the proxy saw the compaction block; wins over the text    |
  |               | `last_user_text`  | str  | text of the last user message's last text block           |
  | `codex`       | `request_kind`    | str  | `x-codex-turn-metadata.request_kind`; `compaction` -> summary |
  |               | `thread_source`   | str  | `x-codex-turn-metadata.thread_source`; `subagent` -> sub-agent |
  | `builtin`     | `gyre_role`       | str  | one of the four role labels, required on every call       |
  | `generic`     | `gyre_role`       | str  | if present, taken as is                                   |
  |               | `summary_request` | bool | true -> summary                                           |
  |               | `request_kind`    | str  | `compaction` -> summary                                   |
  |               | (the path)        |      | root segment != the execution's first root segment -> sub-agent |

- A leaf whose node several calls produced (a retry with an identical output) takes the
  highest-priority role among its calls' roles. A leaf without calls (not produced by the
  recorders) is classified from empty signals.
- Malformed signals a classifier depends on (a wrong type, an unknown `gyre_role`, a missing
  `gyre_role` for `builtin`) raise ValueError naming the request: the proxy is then broken.

Pure: stdlib only; no IO.
"""

from __future__ import annotations

import enum
import logging
import weakref
from collections.abc import Mapping
from typing import Any, Protocol

from gyre.traj.tree import ROOT, TrajectoryTree

logger = logging.getLogger(__name__)

# Claude Code's compaction request appends a text block to the last user message that asks for a
# detailed summary in `<analysis>...</analysis><summary>...</summary>` (docs/harness.md).
CLAUDE_CODE_SUMMARY_PHRASE = "detailed summary"
CLAUDE_CODE_SUMMARY_TAGS = ("<analysis>", "<summary>")
CODEX_COMPACTION_KIND = "compaction"
CODEX_SUBAGENT_SOURCE = "subagent"


class Role(str, enum.Enum):
    """The class of a candidate trajectory; the value is its label (as in `AdmittedTrajectory.role`)."""

    MAIN = "main"
    MAIN_SUMMARY = "main-summary"
    SUB_AGENT = "sub-agent"
    SUB_AGENT_SUMMARY = "sub-agent-summary"

    @property
    def rank(self) -> int:
        """Position in `PRIORITY` (Eq. 4): 0 is drawn first."""
        return PRIORITY.index(self)

    @property
    def is_summary(self) -> bool:
        return self in (Role.MAIN_SUMMARY, Role.SUB_AGENT_SUMMARY)

    @property
    def is_sub_agent(self) -> bool:
        return self in (Role.SUB_AGENT, Role.SUB_AGENT_SUMMARY)

    @classmethod
    def of(cls, *, sub_agent: bool, summary: bool) -> Role:
        if sub_agent:
            return cls.SUB_AGENT_SUMMARY if summary else cls.SUB_AGENT
        return cls.MAIN_SUMMARY if summary else cls.MAIN

    @classmethod
    def from_label(cls, label: str) -> Role:
        try:
            return cls(label)
        except ValueError:
            known = ", ".join(role.value for role in PRIORITY)
            raise ValueError(f"unknown role {label!r}; expected one of: {known}") from None


PRIORITY: tuple[Role, ...] = (Role.MAIN, Role.MAIN_SUMMARY, Role.SUB_AGENT, Role.SUB_AGENT_SUMMARY)  # Eq. 4


class RoleClassifier(Protocol):
    """Classify one leaf of `tree` (a node id from `tree.leaves()`)."""

    name: str

    def __call__(self, tree: TrajectoryTree, leaf: int) -> Role: ...


def leaf_signals(tree: TrajectoryTree, leaf: int) -> list[tuple[str, Mapping[str, Any]]]:
    """(request id, role signals) of every call whose response is `leaf`, in call order."""
    return [(tree.calls[c].meta.request_id, tree.calls[c].meta.role_signals) for c in tree.nodes[leaf].calls]


def _string(signals: Mapping[str, Any], key: str, request: str) -> str | None:
    value = signals.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"role signal {key!r} of request {request!r} has type {type(value).__name__}; expected str")
    return value


def _flag(signals: Mapping[str, Any], key: str, request: str) -> bool | None:
    value = signals.get(key)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"role signal {key!r} of request {request!r} has type {type(value).__name__}; expected bool")
    return value


def _explicit_role(signals: Mapping[str, Any], request: str) -> Role | None:
    label = _string(signals, "gyre_role", request)
    if label is None:
        return None
    try:
        return Role.from_label(label)
    except ValueError as err:
        raise ValueError(f"role signal 'gyre_role' of request {request!r}: {err}") from None


def is_claude_code_summary_request(text: str) -> bool:
    """True if `text` (the last user text block) is Claude Code's compaction instruction."""
    lowered = text.lower()
    return CLAUDE_CODE_SUMMARY_PHRASE in lowered and all(tag in lowered for tag in CLAUDE_CODE_SUMMARY_TAGS)


class _PerCallClassifier:
    """A classifier that decides from each call's signals alone; the leaf takes the best call role."""

    name = "per-call"

    def call_role(self, signals: Mapping[str, Any], request: str) -> Role:
        raise NotImplementedError

    def __call__(self, tree: TrajectoryTree, leaf: int) -> Role:
        calls = leaf_signals(tree, leaf)
        roles = [self.call_role(signals, request) for request, signals in calls] or [self.call_role({}, "")]
        return min(roles, key=lambda role: role.rank)

    def __repr__(self) -> str:
        return f"<role classifier {self.name}>"


class ClaudeCodeClassifier(_PerCallClassifier):
    """Claude Code: `agent_id` (header `x-claude-code-agent-id`) marks a sub-agent stream; a summary
    request is flagged by `summary_request`, or else recognized in `last_user_text`."""

    name = "claude_code"

    def call_role(self, signals: Mapping[str, Any], request: str) -> Role:
        summary = _flag(signals, "summary_request", request)
        if summary is None:
            text = _string(signals, "last_user_text", request)
            summary = text is not None and is_claude_code_summary_request(text)
        return Role.of(sub_agent=bool(_string(signals, "agent_id", request)), summary=summary)


class CodexClassifier(_PerCallClassifier):
    """Codex: the fields of header `x-codex-turn-metadata`, flattened by the proxy: `request_kind`
    `compaction` is a summary, `thread_source` `subagent` a sub-agent."""

    name = "codex"

    def call_role(self, signals: Mapping[str, Any], request: str) -> Role:
        summary = _string(signals, "request_kind", request) == CODEX_COMPACTION_KIND
        sub_agent = _string(signals, "thread_source", request) == CODEX_SUBAGENT_SOURCE
        return Role.of(sub_agent=sub_agent, summary=summary)


class BuiltinClassifier(_PerCallClassifier):
    """gyre's own harness sends `gyre_role` (a role label) on every call."""

    name = "builtin"

    def call_role(self, signals: Mapping[str, Any], request: str) -> Role:
        role = _explicit_role(signals, request)
        if role is None:
            raise ValueError(
                f"request {request!r} has no role signal 'gyre_role': the builtin harness sends one of "
                + ", ".join(r.value for r in PRIORITY)
            )
        return role


class GenericClassifier:
    """Unknown harnesses: main unless signals say otherwise.

    A leaf is a sub-agent's when its path starts at a different root segment than the execution's
    first one (the root child created first, i.e. the first recorded request's first segment, its
    system prompt): a sub-agent runs under its own system prompt, so it gets its own root. A summary
    is flagged by `summary_request` or `request_kind == "compaction"`. An explicit `gyre_role` wins.
    Limitation: a main agent whose system prompt changes mid-execution counts as a sub-agent.
    """

    name = "generic"

    def __init__(self) -> None:
        # Root segment of each node seen, for the last tree classified: a node's parent never changes,
        # so the cache stays valid while nodes are added, and classifying all leaves costs O(nodes).
        self._tree: weakref.ref[TrajectoryTree] | None = None
        self._root_of: dict[int, int] = {}

    def __call__(self, tree: TrajectoryTree, leaf: int) -> Role:
        sub_agent = self._root_segment(tree, leaf) != min(tree.nodes[ROOT].children.values())
        roles = []
        for request, signals in leaf_signals(tree, leaf):
            explicit = _explicit_role(signals, request)
            if explicit is not None:
                roles.append(explicit)
                continue
            summary = bool(_flag(signals, "summary_request", request)) or (
                _string(signals, "request_kind", request) == CODEX_COMPACTION_KIND
            )
            roles.append(Role.of(sub_agent=sub_agent, summary=summary))
        return min(roles or [Role.of(sub_agent=sub_agent, summary=False)], key=lambda role: role.rank)

    def _root_segment(self, tree: TrajectoryTree, node_id: int) -> int:
        """The root's child on the path to `node_id`."""
        if self._tree is None or self._tree() is not tree:
            self._tree, self._root_of = weakref.ref(tree), {}
        nodes, root_of = tree.nodes, self._root_of
        walked = []
        while node_id not in root_of and nodes[node_id].parent != ROOT:
            walked.append(node_id)
            node_id = nodes[node_id].parent
        root = root_of.get(node_id, node_id)
        root_of.update(dict.fromkeys(walked, root))
        root_of[node_id] = root
        return root

    def __repr__(self) -> str:
        return f"<role classifier {self.name}>"


CLASSIFIERS: dict[str, type] = {
    "claude_code": ClaudeCodeClassifier,
    "codex": CodexClassifier,
    "builtin": BuiltinClassifier,
    "generic": GenericClassifier,
}


def classifier_for(harness: str) -> RoleClassifier:
    """The classifier of `harness` (`claude_code`, `codex`, `builtin`, `generic`; `-` and case are
    ignored, so `Claude-Code` works); any other name gets `generic`, with a warning."""
    key = harness.strip().lower().replace("-", "_")
    if key not in CLASSIFIERS:
        logger.warning("unknown harness %r: using the generic role classifier", harness)
        key = "generic"
    return CLASSIFIERS[key]()


def classify_leaves(tree: TrajectoryTree, classify: RoleClassifier) -> dict[int, Role]:
    """{leaf: role} for every leaf of `tree`, in leaf order; TypeError if `classify` returns a non-Role."""
    roles: dict[int, Role] = {}
    for leaf in tree.leaves():
        role = classify(tree, leaf)
        if not isinstance(role, Role):
            raise TypeError(f"role classifier {classify!r} returned {role!r} for leaf {leaf}; expected a Role")
        roles[leaf] = role
    return roles


def count_by_role(roles: Mapping[int, Role]) -> dict[str, int]:
    """{label: number of leaves} for all four roles, in priority order (zeros included)."""
    counts = dict.fromkeys((role.value for role in PRIORITY), 0)
    for role in roles.values():
        counts[role.value] += 1
    return counts
