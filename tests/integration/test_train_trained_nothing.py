"""A run whose steps trained nothing does not end "run completed" with exit 0 (issue 29; seen with Claude Code whose
executions all timed out): `python -m gyre.train` whose every execution hits its overall timeout (1 s: the harness
is a command that sleeps 30 s) runs its 2 steps, says on the console and in `summary.json` that it trained nothing,
and exits 3 with one line naming how the executions ended and where to look."""

from __future__ import annotations

import json

from test_train_program import PAIRS, SMALL, finish, train, wait_until_gone


def test_a_run_that_trained_nothing_exits_3_saying_so(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # Groups of 2 (PAIRS): every execution times out whatever the group's size (half the harness processes). The
    # harness is a command that sleeps past its 1 s budget, so every execution times out however fast a harness
    # starts (the builtin one without an SDK to import sometimes answered within 1 s).
    args = [*SMALL, *PAIRS, "steps=2", "limits.overall_timeout_s=1", "limits.harness_timeout_s=1", "tasks.eval_every=0"]
    args += ["harness.name=command", "harness.argv=[sleep,30]", "harness.isolate_user=false"]
    process = train([*args, "logging.wandb=disabled"], run_dir)
    code, out, err = finish(process, 300)
    assert wait_until_gone(process) == []
    assert code == 3, (code, err[-2000:])
    (line,) = [line for line in err.splitlines() if line.startswith("gyre.train: run error:")]
    assert "the run trained nothing: its 2 steps had no target token" in line and "overall_timeout" in line, line
    assert str(run_dir / "executions.jsonl") in line
    assert "run trained nothing: 2 steps" in out
    assert json.loads(out.strip().splitlines()[-1])["end"] == "trained_nothing"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["training"] == {"trained_steps": 0, "train_tokens": 0, "nothing": True}
