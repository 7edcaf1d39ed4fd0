"""The model calls the proxy is serving now, for progress lines: which wait for their first token (queued or in
prefill) and which are decoding (docs/proxy.md, "Long prefills").

Role: `gyre.proxy.server` adds a call when it is admitted, marks its first token, and removes it when it ends;
the runtime's progress line reads `InFlight.summary(now)` on the same event loop. Pure: no IO, no clock (the
caller passes monotonic seconds).

Contract
- `summary(now)` counts the calls waiting for a first token (`waiting`: queued or in prefill) and those past it
  (`decoding`), and names the one that has waited longest for its first token: its wait and its prompt length
  (0 and 0 when none waits). A call rerouted after its first token stays `decoding`.
- `add` of a call id already present, `first_token` or `remove` of an unknown one: `KeyError` / no-op as named.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CallsSummary", "InFlight"]


@dataclass(slots=True)
class _Call:
    execution: str
    prompt_tokens: int
    started_s: float
    first_token_s: float | None = None


@dataclass(frozen=True, slots=True)
class CallsSummary:
    waiting: int = 0
    decoding: int = 0
    longest_wait_s: float = 0.0  # of the call waiting longest for its first token
    longest_wait_prompt_tokens: int = 0  # that call's prompt length
    longest_wait_execution: str = ""

    @property
    def running(self) -> int:
        return self.waiting + self.decoding


class InFlight:
    """Calls by id (module docstring)."""

    def __init__(self) -> None:
        self._calls: dict[str, _Call] = {}

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, call_id: str, *, execution: str, prompt_tokens: int, now: float) -> None:
        if call_id in self._calls:
            raise KeyError(f"call {call_id!r} is in flight already")
        self._calls[call_id] = _Call(execution, prompt_tokens, now)

    def first_token(self, call_id: str, now: float) -> None:
        """Mark the call's first token (the first mark counts; an unknown id is ignored)."""
        call = self._calls.get(call_id)
        if call is not None and call.first_token_s is None:
            call.first_token_s = now

    def remove(self, call_id: str) -> None:
        self._calls.pop(call_id, None)

    def summary(self, now: float) -> CallsSummary:
        waiting = decoding = 0
        longest: _Call | None = None
        for call in self._calls.values():
            if call.first_token_s is not None:
                decoding += 1
                continue
            waiting += 1
            if longest is None or call.started_s < longest.started_s:
                longest = call
        if longest is None:
            return CallsSummary(decoding=decoding)
        return CallsSummary(
            waiting=waiting,
            decoding=decoding,
            longest_wait_s=max(0.0, now - longest.started_s),
            longest_wait_prompt_tokens=longest.prompt_tokens,
            longest_wait_execution=longest.execution,
        )
