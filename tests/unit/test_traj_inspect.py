"""`python -m gyre.traj.inspect`: one JSON object, `--dump`, and a one-line error with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.traj import CallMeta, Provenance, RecordWriter, Response, Segment, TrajectoryTree
from gyre.traj.inspect import main
from gyre.traj.synthetic import synthetic_execution


def write_small(path, execution="ex") -> None:
    tree = TrajectoryTree(execution, 100)
    with RecordWriter(path, execution, 100) as writer:
        context = [Segment(Provenance.SYSTEM, [1, 2]), Segment(Provenance.USER, [10])]
        writer.append(tree.insert(context, Response.build([20], [-0.5], "stop"), CallMeta(execution, "r0")))
        writer.append(tree.insert(context, Response.build([21, 22], [-0.5, -1.0], "stop"), CallMeta(execution, "r1")))


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
    assert first["leaves_by_role"] == {"unclassified": 2}
    assert report["total"]["requests"] == 4 and report["total"]["leaves_by_role"] == {"unclassified": 4}


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


def test_traj_imports_only_stdlib_and_numpy():
    forbidden = ("torch", "aiohttp", "megatron", "sglang", "hydra", "omegaconf", "requests", "httpx")
    code = (
        "import sys\n"
        "import gyre.traj, gyre.traj.synthetic, gyre.traj.inspect\n"
        f"print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in {forbidden!r})))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == ""


def test_ingest_benchmark_smoke():
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "traj_ingest.py"
    done = subprocess.run(
        [sys.executable, str(script), "--reps", "20"], capture_output=True, text=True, timeout=120, check=True
    )
    report = json.loads(done.stdout)
    assert report["ingest"]["stored_over_unique_tokens_700k"] == 1.0
    assert report["ingest"]["history_tokens"] == {"7000": 7000, "700000": 700000}
    assert report["synthetic_636"]["requests"] == 636 and report["synthetic_636"]["stored_over_unique_tokens"] == 1.0
