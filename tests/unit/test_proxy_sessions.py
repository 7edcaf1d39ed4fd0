"""Execution keys and sessions: one key per execution, its own tree and record file, closed keys stop working."""

from __future__ import annotations

import pytest

from gyre.proxy.sessions import ExecutionIdConflict, RecordError, SessionRegistry, key_from_headers, thread_key
from gyre.traj.record import CallMeta, Provenance, Segment
from gyre.traj.store import load_tree


class Builder:
    def __init__(self, payload):
        self.payload = payload


def registry(tmp_path=None) -> SessionRegistry:
    return SessionRegistry(vocab_size=100, make_builder=Builder, make_payload_cache=dict, records_dir=tmp_path)


def test_each_execution_gets_its_own_random_key_and_tree():
    reg = registry()
    a, b = reg.issue(), reg.issue("task-7.run_2")
    assert a.execution == "exec-00000" and b.execution == "task-7.run_2"
    assert a.key != b.key and a.key.startswith("gyre-") and len(a.key) > 30
    assert reg.by_key(a.key) is a and reg.by_key(b.key) is b and reg.by_key("gyre-nope") is None
    assert reg.by_key(None) is None and reg.by_key("") is None
    assert a.tree is not b.tree and a.payload is not b.payload
    assert reg.issue().execution == "exec-00001"
    with pytest.raises(ValueError, match="already has a key"):
        reg.issue("task-7.run_2")
    for bad in ["", "../escape", "a/b", "x" * 200, ".hidden"]:
        with pytest.raises(ValueError, match="execution="):
            reg.issue(bad)


def test_an_execution_id_is_matched_whole_and_never_a_reserved_device_name():
    reg = registry()
    for bad in ["a\n", "a\r", "a\x00", "a b", "con", "CON", "aux", "nul.jsonl", "Com1", "lpt9.x", 5]:
        with pytest.raises(ValueError, match="execution="):
            reg.issue(bad)
    for fine in ["console", "com10", "lpt0", "aux-1", "a", "x" * 128]:
        assert reg.issue(fine).execution == fine


def test_a_closed_execution_id_is_never_issued_again(tmp_path):
    reg = registry(tmp_path)
    first = reg.issue("reuse-1")
    reg.close("reuse-1")
    with pytest.raises(ExecutionIdConflict, match=r"reuse-1.*closed"):
        reg.issue("reuse-1")
    assert reg.by_key(first.key) is None and reg.by_execution("reuse-1") is None
    with pytest.raises(ExecutionIdConflict, match="already has a key"):
        reg.issue(reg.issue("open-1").execution)
    # automatic names skip closed ids as well as open ones
    auto = reg.issue()
    reg.close(auto.execution)
    later = {reg.issue().execution for _ in range(3)}
    assert auto.execution not in later


def test_calls_are_recorded_to_the_execution_file_and_a_closed_key_stops_working(tmp_path):
    reg = registry(tmp_path)
    session = reg.issue("e1")
    segments = [Segment(Provenance.SYSTEM, [1, 2, 3]), Segment(Provenance.USER, [4, 5])]
    meta = CallMeta(execution="e1", request_id="r1", role_signals={"agent_id": ""})
    record = session.record(segments, [7, 8], [-0.5, -0.25], "stop", meta)
    assert session.last_node["main"] == record.response_node
    with pytest.raises(ValueError, match="vocab"):
        session.record(segments, [700], [-0.1], "stop", CallMeta(execution="e1", request_id="r2"))
    assert len(session.tree.calls) == 1  # the bad call recorded nothing
    reg.close("e1")
    assert reg.by_key(session.key) is None and session.tree.closed
    tree = load_tree(tmp_path / "e1.jsonl")
    assert len(tree.calls) == 1 and list(tree.calls[0].response.ids) == [7, 8]


def test_a_call_whose_line_cannot_be_written_is_in_neither_the_tree_nor_the_file(tmp_path, monkeypatch):
    """Issue 13 finding 1: the call entered the tree, its line failed to serialize, and every later call of the
    execution failed. Now the line is written first; a failure is a RecordError and the execution goes on."""
    reg = registry(tmp_path)
    session = reg.issue("e1")
    segments = [Segment(Provenance.SYSTEM, [1, 2, 3]), Segment(Provenance.USER, [4, 5])]
    deep: dict = {}
    node = deep
    for _ in range(5000):  # deeper than json.dumps can go
        node["a"] = {}
        node = node["a"]
    for signals in ({"request_kind": deep}, {"not json": {1, 2}}):
        with pytest.raises(RecordError, match=r"could not be recorded \(\w+\)") as info:
            session.record(
                segments, [7], [-0.5], "stop", CallMeta(execution="e1", request_id="bad", role_signals=signals)
            )
        assert str(tmp_path) not in str(info.value)  # the client is not told where records live
        assert len(session.tree.calls) == 0
    real_write = session.writer._file.write
    monkeypatch.setattr(session.writer._file, "write", lambda text: real_write(text[:10]) and _raise_full_disk())
    with pytest.raises(RecordError, match="OSError"):
        session.record(segments, [7], [-0.5], "stop", CallMeta(execution="e1", request_id="full"))
    monkeypatch.undo()
    ok = session.record(segments, [8], [-0.25], "stop", CallMeta(execution="e1", request_id="ok"))
    assert ok.index == 0 and len(session.tree.calls) == 1
    reg.close("e1")
    tree = load_tree(tmp_path / "e1.jsonl")  # the torn write was cut back: the file reads whole
    assert [list(call.response.ids) for call in tree.calls] == [[8]]


def _raise_full_disk():
    raise OSError(28, "No space left on device")


def test_keys_come_from_x_api_key_or_a_bearer_token():
    assert key_from_headers({"x-api-key": " k1 "}) == "k1"
    assert key_from_headers({"authorization": "Bearer k2"}) == "k2"
    assert key_from_headers({"authorization": "bearer  k3 "}) == "k3"
    assert key_from_headers({"authorization": "Basic abc"}) is None
    assert key_from_headers({"authorization": "Bearer "}) is None
    assert key_from_headers({}) is None


def test_sub_agents_and_codex_threads_get_their_own_prompt_builder():
    assert thread_key({}) == "main"
    assert thread_key({"x-claude-code-agent-id": "a7"}) == "x-claude-code-agent-id=a7"
    assert thread_key({"thread-id": "t1"}) == "thread-id=t1"
    session = registry().issue()
    assert session.builder("main") is session.builder("main")
    assert session.builder("x") is not session.builder("main")
    assert session.builder("x").payload is session.payload


def test_a_call_extending_the_threads_last_call_records_exactly_what_a_full_walk_records(tmp_path):
    fast, slow = registry(tmp_path / "fast").issue("e"), registry(tmp_path / "slow").issue("e")
    context = [Segment(Provenance.SYSTEM, [1, 2]), Segment(Provenance.USER, [3, 4])]
    for step in range(4):
        output = [10 + step, 11 + step]
        meta = CallMeta(execution="e", request_id=f"r{step}")
        a = fast.record(context, output, [-0.5, -0.5], "stop", meta)
        copies = [Segment(s.provenance, list(s.ids)) for s in context]  # same content, new objects: full walk
        b = slow.record(copies, output, [-0.5, -0.5], "stop", meta)
        assert (a.parent, a.context_node, a.response_node, len(a.segments)) == (
            b.parent,
            b.context_node,
            b.response_node,
            len(b.segments),
        )
        context = [*context, Segment(Provenance.SAMPLED, output), Segment(Provenance.TOOL, [20 + step])]
    assert fast.tree.stats() == slow.tree.stats()
    # a call that does not extend the last one (an edited history) still lands where it belongs
    edited = [context[0], Segment(Provenance.USER, [3, 5])]
    record = fast.record(edited, [7], [-1.0], "stop", CallMeta(execution="e", request_id="edit"))
    assert record.parent == fast.tree.calls[0].parent + 1  # forks right after the shared system segment
