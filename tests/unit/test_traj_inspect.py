"""`python -m gyre.traj.inspect`: one JSON object (with roles and admission), `--dump`, and a one-line
error with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gyre.traj import CallMeta, Provenance, RecordWriter, Response, Segment, TrajectoryTree
from gyre.traj.inspect import main
from gyre.traj.synthetic import synthetic_execution


def write_small(path, execution="ex") -> None:
    """Two calls on one context: leaves 3 (output [20]) and 4 (output [21, 22]); r1 is a summary request."""
    tree = TrajectoryTree(execution, 100)
    with RecordWriter(path, execution, 100) as writer:
        context = [Segment(Provenance.SYSTEM, [1, 2]), Segment(Provenance.USER, [10])]
        writer.append(tree.insert(context, Response.build([20], [-0.5], "stop"), CallMeta(execution, "r0")))
        summary = CallMeta(execution, "r1", role_signals={"request_kind": "compaction"})
        writer.append(tree.insert(context, Response.build([21, 22], [-0.5, -1.0], "stop"), summary))


def test_summary_of_two_executions(tmp_path, capsys):
    write_small(tmp_path / "a.jsonl", "a")
    write_small(tmp_path / "b.jsonl", "b")
    assert main([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]) == 0
    report = json.loads(capsys.readouterr().out)
    first = report["executions"][0]
    assert first["execution"] == "a"
    assert {k: first[k] for k in ("requests", "unique_nodes", "node_occurrences_expanded", "leaves")} == {
        "requests": 2,
        "unique_nodes": 4,
        "node_occurrences_expanded": 6,
        "leaves": 2,
    }
    assert (first["tokens_stored"], first["tokens_expanded"]) == (6, 4 + 5)
    assert first["leaves_by_role"] == {"main": 1, "main-summary": 1, "sub-agent": 0, "sub-agent-summary": 0}
    assert first["admitted"] == [
        {"leaf": 3, "role": "main", "num_targets": 1},
        {"leaf": 4, "role": "main-summary", "num_targets": 2},
    ]
    assert first["admitted_targets"] == 3
    total = report["total"]
    assert total["requests"] == 4
    assert total["leaves_by_role"] == {"main": 2, "main-summary": 2, "sub-agent": 0, "sub-agent-summary": 0}
    assert (total["admitted_trajectories"], total["admitted_targets"]) == (4, 6)


def test_harness_j_max_and_seed_options(tmp_path, capsys):
    write_small(tmp_path / "a.jsonl", "a")
    assert main(["--harness", "claude_code", "--j-max", "1", "--seed", "3", str(tmp_path / "a.jsonl")]) == 0
    first = json.loads(capsys.readouterr().out)["executions"][0]
    # Claude Code reads no `request_kind`: both leaves are main; one is drawn.
    assert first["leaves_by_role"] == {"main": 2, "main-summary": 0, "sub-agent": 0, "sub-agent-summary": 0}
    assert len(first["admitted"]) == 1 and first["admitted"][0]["role"] == "main"


def test_signals_the_classifier_rejects_are_one_line_and_exit_2(tmp_path, capsys):
    write_small(tmp_path / "a.jsonl", "a")
    assert main(["--harness", "builtin", str(tmp_path / "a.jsonl")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"error: {tmp_path / 'a.jsonl'}: request 'r0' has no role signal 'gyre_role': " + (
        "the builtin harness sends one of main, main-summary, sub-agent, sub-agent-summary\n"
    )


def test_j_max_must_be_positive(tmp_path):
    write_small(tmp_path / "a.jsonl", "a")
    with pytest.raises(SystemExit) as raised:
        main(["--j-max", "0", str(tmp_path / "a.jsonl")])
    assert raised.value.code == 2


def test_dump_then_json(tmp_path, capsys):
    write_small(tmp_path / "a.jsonl", "a")
    assert main(["--dump", str(tmp_path / "a.jsonl")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:5] == [
        "execution a: 2 calls, 4 nodes, 6 tokens, 2 leaves",
        "#1 SYSTEM n=2 [1, 2]",
        "  #2 USER n=1 [10]",
        "    #3 SAMPLED n=1 [20] calls=0 finish=stop <- leaf 3 nodes",
        "    #4 SAMPLED n=2 [21, 22] calls=1 finish=stop <- leaf 3 nodes",
    ]
    assert json.loads(out[5])["total"]["unique_nodes"] == 4


def test_synthetic_execution_through_the_command_line(tmp_path):
    execution = synthetic_execution(seed=1)
    tree = TrajectoryTree(execution.execution, execution.vocab_size)
    path = tmp_path / "synthetic.jsonl"
    with RecordWriter(path, execution.execution, execution.vocab_size) as writer:
        for call in execution.calls:
            writer.append(tree.insert(call.context, call.response, call.meta))
    done = subprocess.run(
        [sys.executable, "-m", "gyre.traj.inspect", str(path)], capture_output=True, text=True, timeout=60, check=True
    )
    report = json.loads(done.stdout)["executions"][0]
    assert report["requests"] == 636 and report["leaves"] == 10
    assert report["unique_nodes"] == tree.stats().unique_nodes
    assert report["leaves_by_role"] == {"main": 4, "main-summary": 1, "sub-agent": 4, "sub-agent-summary": 1}
    assert [t["role"] for t in report["admitted"]] == ["main"] * 4 + ["main-summary"]
    assert report["admitted_targets"] == sum(t["num_targets"] for t in report["admitted"]) > 0


@pytest.mark.parametrize("content", [None, "not json\n", '{"v": 1, "kind": "call"}\n'])
def test_bad_path_or_file_is_one_line_and_exit_2(tmp_path, capsys, content):
    path = tmp_path / "bad.jsonl"
    if content is not None:
        path.write_text(content)
    good = tmp_path / "good.jsonl"
    write_small(good)
    assert main(["--dump", str(good), str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1


def test_a_directory_is_named_as_such(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"error: {tmp_path}: is a directory, expected a record file\n"


def test_a_binary_file_names_the_file(tmp_path, capsys):
    path = tmp_path / "blob.jsonl"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\n")
    assert main([str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: {path}:1: not UTF-8 text") and captured.err.count("\n") == 1


def test_a_closed_pipe_is_not_an_error(tmp_path):
    """`inspect ... | head -1`: the reader goes away mid-output; no traceback, status 0."""
    execution = synthetic_execution(seed=0)
    tree = TrajectoryTree(execution.execution, execution.vocab_size)
    path = tmp_path / "synthetic.jsonl"
    with RecordWriter(path, execution.execution, execution.vocab_size) as writer:
        for call in execution.calls[:40]:
            writer.append(tree.insert(call.context, call.response, call.meta))
    # More output than a pipe buffers (16 dumps of ~13 KB, three times 64 KiB): the writer is still writing when the
    # pipe closes. Each copy is loaded and summarized before anything is printed, so more copies only cost time.
    args = [sys.executable, "-m", "gyre.traj.inspect", "--dump", *[str(path)] * 16]
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        assert process.stdout is not None and process.stderr is not None
        first = process.stdout.readline()
        process.stdout.close()
        stderr = process.stderr.read().decode()
        status = process.wait(timeout=60)
    assert first.startswith(b"execution ")
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    assert stderr == "" and status == 0
