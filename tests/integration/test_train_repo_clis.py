"""Claude Code and Codex in `python -m gyre.train` (issue 29, deliverable 3; docs/recipes.md, "repo"): the repo
recipe's repository tasks run through the real CLIs (installed with npm as tests/integration/test_harness_clis.py
installs them; skipped with npm's reason where node or npm are missing, or bwrap is) in the bubblewrap sandbox, on
the tiny long-context model biased toward ending its turn. The run exits 0, every model call is recorded exactly
once with nothing refused, failed or hung up, no harness printed an API error, every step trained tokens, and the
first call of a session is the CLI's whole system prompt (Claude Code ~48K tokens of the tiny tokenizer, Codex
~23K) in a row that was trained.

Time on 2 cores: Codex ~75 s (1 step of one group, beside other tests); Claude Code ~10 minutes for 2 steps (its
rows of ~48K tokens cost the trainer L^2 attention on a CPU). Both run only with GYRE_LONG_TESTS=1: the README's
test command stays within its 15 minutes (docs/testing.md), and the runs' figures are in docs/testing.md. The real CLIs
through the runners (the task on stdin, the instructions file) are in the suite:
tests/integration/test_harness_execution.py."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
from test_harness_clis import CLAUDE_CODE, CODEX, _install_cli
from test_train_program import finish, train, wait_until_gone

pytestmark = [
    pytest.mark.harness,
    pytest.mark.slow,  # minutes: the CLIs' long prompts are prefilled and trained on a CPU
    pytest.mark.skipif(os.environ.get("GYRE_SKIP_HARNESS_TESTS") == "1", reason="GYRE_SKIP_HARNESS_TESTS=1"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed (apt-get install bubblewrap)"),
]
LONG = {"codex": "~75 s", "claude_code": "~10 minutes (48K-token rows trained on a CPU)"}
CASES = {
    "codex": (CODEX, 1, 15_000),
    "claude_code": (CLAUDE_CODE, 2, 40_000),
}


@pytest.mark.parametrize("harness", sorted(CASES))
def test_the_repo_recipe_trains_on_the_real_cli(tmp_path, harness):
    from gyre.runtime.audit import audit_run
    from gyre.traj.store import load_tree

    (package, version, bin_name), steps, first_prompt_tokens = CASES[harness]
    if os.environ.get("GYRE_LONG_TESTS") != "1":
        pytest.skip(f"{LONG[harness]} on 2 cores, past the suite's 15-minute budget; GYRE_LONG_TESTS=1 runs it")
    binary = _install_cli(package, version, bin_name)
    run_dir = tmp_path / "run"
    args = ["recipe=repo", f"harness={harness}", f"harness.binary={binary}", f"steps={steps}", "logging.wandb=disabled"]
    if steps == 1:  # one group dispatched, not the recipe's (phi + mu) B = 4: what one step trains, no more
        args += ["algo.phi=0", "algo.mu=1"]
    process = train(args, run_dir)
    code, _, err = finish(process, 1500)
    assert code == 0, err[-3000:]
    assert wait_until_gone(process) == []
    audit = audit_run(run_dir)
    proxy = audit["proxy"]
    assert audit["calls_recorded"] == proxy["recorded"] == proxy["requests"] > 0, audit
    assert proxy["refused"] == proxy["failed"] == proxy["hung_up"] == 0 and audit["duplicate_request_ids"] == 0
    logs = [p.read_text(errors="replace") for p in (run_dir / "executions").glob("*/logs/std*.log")]
    assert logs and not [log for log in logs if "API Error" in log or "Incomplete response" in log]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["training"]["trained_steps"] == steps and summary["training"]["train_tokens"] > 0
    firsts = []
    for path in sorted((run_dir / "records").glob("*.jsonl")):
        tree = load_tree(path)
        if tree.calls:
            context, _ = tree.call_tokens(0)
            firsts.append(len(context))
    assert firsts and min(firsts) > first_prompt_tokens, firsts
    trained = [json.loads(line)["train_tokens"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(trained) == steps and min(trained) > first_prompt_tokens, trained  # whole rows of that length
    print(f"{harness}: {len(firsts)} executions, first prompts {min(firsts)}-{max(firsts)} tokens", file=sys.stderr)
