"""The payload cache: our exact output tokens, found again when a harness echoes an assistant turn.

Role: after each call the proxy serves, `PayloadCache.remember(output, output_ids)` keeps the output token ids
under every tool-call id of the output (the ids are ours, so they are unique per execution) and, for an answer
without tool calls, under its canonical content (text + thinking): harnesses echo our answers verbatim.
`PromptBuilder` (gyre.proxy.render) calls `restore(turn)` for every echoed assistant turn BEFORE matching the
trajectory tree, so a harness that reformats what it echoes (arguments re-serialized, whitespace, key order)
still yields our exact ids, and the tree walks through the recorded response instead of forking.

Contract:
- a turn with tool calls is restored only through its tool-call ids, and only if the echoed call ids are
  exactly the ids of one remembered output (in order); its text and arguments are not compared;
- a turn without tool calls is restored only if an output without tool calls had the same text and thinking (or
  the same text, when the turn carries no thinking: harnesses and templates drop earlier thinking from the history
  they send, docs/proxy.md "Thinking in the history"), and no other output (other ids) had them too: the output
  parser strips whitespace around the text
  (gyre.proxy.output), so two different outputs can read the same to the harness, and an echo of such text is
  ambiguous. An ambiguous content key restores nothing (the turn is rendered by the template and the tree forks
  there) rather than another output's ids: a restore is never wrong;
- the stored value is a SAMPLED `Segment` whose key was computed once at `remember`; it equals the key the
  trajectory tree computes for the recorded response, so a restored segment never needs rehashing;
- bounded: at most `max_entries` keys, least recently used evicted first. Pure, per execution; thread-safe, as a
  big prompt is built on a worker thread while the event loop remembers other calls' outputs (gyre.proxy.server).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from gyre.config.checks import is_int
from gyre.proxy.conversation import AssistantOutput, Turn
from gyre.traj.record import Provenance, Segment

DEFAULT_MAX_ENTRIES = 100_000


@dataclass(frozen=True, eq=False)
class _Payload:
    segment: Segment | None  # SAMPLED, our exact output ids; None: several outputs had this content (ambiguous)
    call_ids: tuple[str, ...]  # the output's tool-call ids in order ((): a plain answer)


_AMBIGUOUS = _Payload(None, ())


class PayloadCache:
    """Output ids of the calls served in one execution, keyed by tool-call id or by canonical content."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if not is_int(max_entries) or max_entries < 1:
            raise ValueError(f"max_entries={max_entries!r}: expected an int >= 1")
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, ...], _Payload] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, output: AssistantOutput, output_ids: Sequence[int]) -> Segment:
        """Keep `output_ids` (the exact tokens the engine produced for `output`); returns their SAMPLED segment."""
        if len(output_ids) == 0:
            raise ValueError("output_ids is empty: a served call produced at least one token")
        payload = _Payload(Segment(Provenance.SAMPLED, output_ids), tuple(call.id for call in output.tool_calls))
        with self._lock:
            self._remember(payload, self._keys_of_output(output), output_ids)
        return payload.segment

    def _remember(self, payload: _Payload, keys: list[tuple[str, ...]], output_ids: Sequence[int]) -> None:
        for key in keys:
            known = self._entries.get(key)
            same = known is not None and known.segment is not None and tuple(known.segment.ids) == tuple(output_ids)
            self._entries[key] = payload if known is None or same else _AMBIGUOUS
            self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def restore_segment(self, turn: Turn) -> Segment | None:
        """Our SAMPLED segment for an echoed assistant turn, or None if it is not one of our outputs."""
        if turn.role != "assistant":
            return None
        with self._lock:
            return self._restore_segment(turn)

    def _restore_segment(self, turn: Turn) -> Segment | None:
        if turn.tool_calls:
            key: tuple[str, ...] = ("call", turn.tool_calls[0].id)
            payload = self._entries.get(key)
            if payload is None or payload.call_ids != tuple(call.id for call in turn.tool_calls):
                return None
        else:
            key = ("content", turn.text, turn.thinking)
            payload = self._entries.get(key)
            if payload is None or payload.segment is None:
                return None
        self._entries.move_to_end(key)
        return payload.segment

    def restore(self, turn: Turn) -> tuple[int, ...] | None:
        """Our exact output ids for an echoed assistant turn, or None."""
        segment = self.restore_segment(turn)
        return None if segment is None else tuple(segment.ids)

    @staticmethod
    def _keys_of_output(output: AssistantOutput) -> list[tuple[str, ...]]:
        if output.tool_calls:
            return [("call", call.id) for call in output.tool_calls]
        if output.thinking:  # also found when the echo dropped the thinking
            return [("content", output.text, output.thinking), ("content", output.text, "")]
        return [("content", output.text, "")]
