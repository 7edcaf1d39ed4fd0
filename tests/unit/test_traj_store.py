"""The record format: append as calls complete, replay into an identical tree, reject bad lines."""

from __future__ import annotations

import json
import re

import pytest

from gyre.traj import (
    FORMAT_VERSION,
    CallMeta,
    Provenance,
    RecordWriter,
    Response,
    Segment,
    TrajectoryTree,
    dump_tree,
    load_tree,
)
from gyre.traj.synthetic import synthetic_execution

SYS, USR, TOOL, OUT = Provenance.SYSTEM, Provenance.USER, Provenance.TOOL, Provenance.SAMPLED


def write_small(path) -> TrajectoryTree:
    tree = TrajectoryTree("ex", 100)
    meta = CallMeta(
        "ex", "r0", policy_version=3, engine="cell-1", timings={"total_s": 0.5}, role_signals={"a": 1},
        usage={"prompt_tokens": 3, "cached_tokens": 0},
    )  # fmt: skip
    with RecordWriter(path, "ex", 100) as writer:
        writer.append(tree.insert([Segment(SYS, [1, 2]), Segment(USR, [10])], Response.build([20], [-0.25], "x"), meta))
        full = [Segment(SYS, [1, 2]), Segment(USR, [10]), Segment(OUT, [20]), Segment(TOOL, [30, 31])]
        writer.append(tree.insert(full, Response.build([40, 41], [-1.5, -0.125], "stop"), CallMeta("ex", "r1")))
    return tree


def test_each_line_holds_only_what_is_new(tmp_path):
    path = tmp_path / "ex.jsonl"
    write_small(path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"v": FORMAT_VERSION, "kind": "execution", "execution": "ex", "vocab_size": 100}
    assert lines[1]["parent"] == 0 and [s["p"] for s in lines[1]["segments"]] == ["system", "user"]
    assert lines[1]["policy_version"] == 3 and lines[1]["role_signals"] == {"a": 1}
    assert lines[2] == {
        "v": 1,
        "kind": "call",
        "execution": "ex",
        "call": 1,
        "parent": 3,
        "segments": [{"p": "tool", "ids": [30, 31]}],
        "response": {"ids": [40, 41], "logprobs": [-1.5, -0.125], "finish": "stop"},
        "request_id": "r1",
        "policy_version": 0,
        "engine": "",
        "timings": {},
        "role_signals": {},
    }


def test_replay_rebuilds_an_identical_tree(tmp_path):
    path = tmp_path / "ex.jsonl"
    tree = write_small(path)
    loaded = load_tree(path)
    assert dump_tree(loaded) == dump_tree(tree)
    assert [loaded.call_tokens(i) for i in range(2)] == [tree.call_tokens(i) for i in range(2)]
    assert loaded.calls[0].meta == tree.calls[0].meta
    assert loaded.calls[0].meta.usage == {"prompt_tokens": 3, "cached_tokens": 0}
    assert loaded.calls[1].meta.usage == {}  # absent: unknown
    assert loaded.calls[1].response == tree.calls[1].response


def test_synthetic_execution_round_trip(tmp_path):
    execution = synthetic_execution(seed=3)
    tree = TrajectoryTree(execution.execution, execution.vocab_size)
    path = tmp_path / "synthetic.jsonl"
    with RecordWriter(path, execution.execution, execution.vocab_size) as writer:
        for call in execution.calls:
            writer.append(tree.insert(call.context, call.response, call.meta))
    loaded = load_tree(path)
    assert dump_tree(loaded) == dump_tree(tree)
    assert loaded.stats() == tree.stats()
    for index in (0, 100, 635):
        assert loaded.call_tokens(index) == tree.call_tokens(index)
        assert loaded.calls[index].meta == tree.calls[index].meta
        assert loaded.calls[index].response == tree.calls[index].response
    leaf = loaded.leaves()[0]
    for a, b in zip(loaded.path_tokens(leaf).__dict__.values(), tree.path_tokens(leaf).__dict__.values(), strict=True):
        assert a.tobytes() == b.tobytes()


def test_appending_to_an_existing_file_continues_it(tmp_path):
    path = tmp_path / "ex.jsonl"
    tree = write_small(path)
    with RecordWriter(path, "ex", 100) as writer:
        writer.append(tree.insert([Segment(TOOL, [32])], Response.build([42], [-0.5], "stop"), CallMeta("ex", "r2"), 3))
    assert dump_tree(load_tree(path)) == dump_tree(tree)
    with pytest.raises(ValueError, match="records execution 'ex'"):
        RecordWriter(path, "other", 100)


def corrupt(path, lineno, edit) -> None:
    lines = path.read_text().splitlines(keepends=True)
    lines[lineno - 1] = edit(lines[lineno - 1])
    path.write_text("".join(lines))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda line: line[:40] + "\n", ":3: not valid JSON"),
        (lambda line: line.replace('"call":1', '"call":2'), ":3: call index 2, expected 1 (a record is lost"),
        (lambda line: line.replace('"execution":"ex"', '"execution":"zz"'), ":3: meta.execution 'zz' is unknown"),
        (lambda line: line.replace('"parent":3', '"parent":77'), ":3: parent node 77 is unknown"),
        (lambda line: line.replace("-0.125", "0.5"), ":3: response.logprobs[1] = 0.5"),
        (lambda line: line.replace('"p":"tool"', '"p":"robot"'), ":3: unknown provenance 'robot'"),
        (lambda line: line.replace('"v":1', '"v":2'), ":3: record format version 2"),
        (lambda line: line.replace('"ids":[30,31]', '"ids":[30,3.5]'), ":3: tool segment: token ids must be integers"),
        (lambda line: line.replace('"request_id":"r1"', '"request_id":7'), ":3: field 'request_id' = 7"),
        (
            lambda line: line.replace('"role_signals":{}', '"role_signals":{},"usage":{"cached_tokens":-1}'),
            ":3: field 'usage'",
        ),
        (lambda line: line.replace('"role_signals":{}', '"role_signals":{},"usage":[1]'), ":3: field 'usage' = [1]"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, edit, message):
    path = tmp_path / "ex.jsonl"
    write_small(path)
    corrupt(path, 3, edit)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_tree(path)


def test_torn_final_line_is_skipped_and_the_rest_kept(tmp_path, caplog):
    path = tmp_path / "ex.jsonl"
    write_small(path)
    complete = path.read_text().splitlines(keepends=True)
    path.write_text("".join(complete[:-1]) + complete[-1][:40])  # the writer died mid-line
    tree = load_tree(path)
    assert len(tree.calls) == len(complete) - 2  # header and the torn call are not calls
    assert "torn final line skipped" in caplog.text
    path.write_text("".join(complete[:-1]))
    assert dump_tree(tree) == dump_tree(load_tree(path))


def test_missing_header_and_empty_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty file"):
        load_tree(empty)
    path = tmp_path / "ex.jsonl"
    write_small(path)
    path.write_text("".join(path.read_text().splitlines(keepends=True)[1:]))
    with pytest.raises(ValueError, match="first line must be the execution header"):
        load_tree(path)


def test_reopening_after_a_torn_line_truncates_it_before_appending(tmp_path, caplog):
    path = tmp_path / "ex.jsonl"
    write_small(path)
    complete = path.read_bytes()
    last_line = complete.splitlines(keepends=True)[-1]
    path.write_bytes(complete[: -len(last_line)] + last_line[:40])  # call 1 torn: the writer died mid-line
    # Replay what the file holds (call 0), then the controller resumes and records a new call 1.
    resumed = load_tree(path)
    assert len(resumed.calls) == 1
    caplog.clear()
    with RecordWriter(path, "ex", 100) as writer:
        assert writer.next_call == 1
        writer.append(
            resumed.insert([Segment(TOOL, [33])], Response.build([43], [-0.5], "stop"), CallMeta("ex", "r9"), 3)
        )
    assert f"{path}: truncated a torn final line (40 bytes dropped)" in caplog.text
    loaded = load_tree(path)
    assert [call.meta.request_id for call in loaded.calls] == ["r0", "r9"]
    assert loaded.call_tokens(1) == ([1, 2, 10, 20, 33], [43])
    assert dump_tree(loaded) == dump_tree(resumed)
    assert path.read_bytes().startswith(complete[: -len(last_line)]) and path.read_bytes().endswith(b"\n")


def test_reopening_a_line_missing_only_its_newline_keeps_it(tmp_path):
    path = tmp_path / "ex.jsonl"
    tree = write_small(path)
    path.write_bytes(path.read_bytes()[:-1])  # complete JSON, no newline: the reader accepts it
    with RecordWriter(path, "ex", 100) as writer:
        assert writer.next_call == 2
        writer.append(tree.insert([Segment(TOOL, [32])], Response.build([42], [-0.5], "stop"), CallMeta("ex", "r2"), 3))
    assert dump_tree(load_tree(path)) == dump_tree(tree)


def test_append_checks_execution_and_call_index(tmp_path):
    path = tmp_path / "ex.jsonl"
    tree = write_small(path)
    other = TrajectoryTree("zz", 100)
    foreign = other.insert([Segment(SYS, [1])], Response.build([20], [-0.5], "stop"), CallMeta("zz", "z0"))
    size = path.stat().st_size
    with RecordWriter(path, "ex", 100) as writer:
        assert writer.next_call == 2  # counted on reopen
        with pytest.raises(ValueError, match=r"ex\.jsonl: record of execution 'zz' .* \(expected 'ex', got 'zz'\)"):
            writer.append(foreign)
        with pytest.raises(ValueError, match=r"ex\.jsonl: call index 1 appended, expected 2"):
            writer.append(tree.calls[1])  # a duplicate
        ahead = tree.insert([Segment(TOOL, [32])], Response.build([42], [-0.5], "stop"), CallMeta("ex", "r2"), 3)
        tree.insert([Segment(TOOL, [34])], Response.build([44], [-0.5], "stop"), CallMeta("ex", "r3"), 3)
        with pytest.raises(ValueError, match=r"call index 3 appended, expected 2"):
            writer.append(tree.calls[3])  # a gap
        assert path.stat().st_size == size  # nothing written
        writer.append(ahead)
        writer.append(tree.calls[3])
    assert dump_tree(load_tree(path)) == dump_tree(tree)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\n  \n", "holds only whitespace, no header line"),
        (b"   ", "holds only whitespace, no header line"),
        (b'{"v":1,"kind":"exec', "no complete header line (19 bytes without a newline)"),
        (b"not json\n", ":1: not valid JSON"),
        (b"\x89PNG\r\n\x1a\n", ":1: not UTF-8 text"),
    ],
)
def test_reopening_a_file_without_a_header_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "ex.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(message)) as raised:
        RecordWriter(path, "ex", 100)
    assert str(path) in str(raised.value)
    assert path.read_bytes() == content  # left untouched


def test_reopening_a_zero_byte_file_starts_it(tmp_path):
    path = tmp_path / "ex.jsonl"
    path.write_bytes(b"")
    with RecordWriter(path, "ex", 100) as writer:
        assert writer.next_call == 0
    assert load_tree(path).execution == "ex"


def test_a_binary_file_names_file_and_line(tmp_path):
    path = tmp_path / "blob.jsonl"
    path.write_bytes(b'{"v":1,"kind":"execution","execution":"ex","vocab_size":100}\n\xff\xfe\x00\n')
    with pytest.raises(ValueError, match=r"blob\.jsonl:2: not UTF-8 text"):
        load_tree(path)


def test_load_tree_returns_an_open_tree(tmp_path):
    path = tmp_path / "ex.jsonl"
    write_small(path)
    assert not load_tree(path).closed


def test_reopening_with_another_execution_leaves_a_torn_file_untouched(tmp_path):
    path = tmp_path / "ex.jsonl"
    write_small(path)
    complete = path.read_bytes()
    for content in (complete[:-40], complete[:-1]):  # torn, and complete JSON missing only its newline
        path.write_bytes(content)
        with pytest.raises(ValueError, match="records execution 'ex'"):
            RecordWriter(path, "other", 100)
        assert path.read_bytes() == content
