"""The proxy's calls in flight (gyre/proxy/in_flight.py): awaiting a first token, decoding, the longest wait."""

import pytest

from gyre.proxy.in_flight import CallsSummary, InFlight


def test_calls_wait_for_their_first_token_then_decode():
    calls = InFlight()
    assert calls.summary(now=5.0) == CallsSummary()
    calls.add("a", execution="e1", prompt_tokens=48042, now=10.0)
    calls.add("b", execution="e2", prompt_tokens=900, now=12.0)
    calls.add("c", execution="e3", prompt_tokens=100, now=13.0)
    calls.first_token("c", now=14.0)
    assert calls.summary(now=20.0) == CallsSummary(
        waiting=2, decoding=1, longest_wait_s=10.0, longest_wait_prompt_tokens=48042, longest_wait_execution="e1"
    )
    calls.first_token("a", now=21.0)
    calls.first_token("a", now=99.0)  # the first mark counts
    summary = calls.summary(now=22.0)
    assert (summary.waiting, summary.decoding, summary.running) == (1, 2, 3)
    assert (summary.longest_wait_s, summary.longest_wait_execution) == (10.0, "e2")
    for call in ("a", "b", "c", "c"):  # removing twice is a no-op
        calls.remove(call)
    assert len(calls) == 0 and calls.summary(now=30.0) == CallsSummary()
    calls.first_token("gone", now=31.0)  # an unknown id: ignored


def test_a_call_id_in_flight_twice_is_refused():
    calls = InFlight()
    calls.add("a", execution="e", prompt_tokens=1, now=0.0)
    with pytest.raises(KeyError, match="in flight already"):
        calls.add("a", execution="e", prompt_tokens=1, now=1.0)
