"""`benchmarks/train_throughput.py --quick` as a user runs it: one subprocess, bounded; the JSON's shape, no timings.

The figures depend on the machine (and the machine is shared), so only their presence and the exact invariants are
checked: both sides train the same non-pad tokens, the streaming micro-steps feed no padding, and step 0 (same
starting weights, same rows, same `gyre.rl.policy_loss`) gives the same loss on both sides.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # megatron import and two tiny models: ~6 s

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_throughput.py"
TIMEOUT_S = 60


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def test_train_throughput_quick_reports_both_sides():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["benchmark"] == "train_throughput" and report["mode"] == "quick"
    assert report["measured_steps"] == 1 and report["warmup_steps"] == 1
    for side in ("streaming", "plain"):
        s = report[side]
        for key in ("tokens_per_s", "wall_s", "median_step_s", "warmup_step_s", "packing_efficiency"):
            assert _number(s[key]) and s[key] > 0, (side, key, s[key])
        assert len(s["step_s"]) == 1 and len(s["loss_per_step"]) == 2, s
        assert s["fed_tokens_per_step"] >= report["non_pad_tokens_per_step"] > 0
    streaming, plain = report["streaming"], report["plain"]
    assert streaming["packing_efficiency"] == 1.0  # a packed micro-step feeds exactly its rows' tokens
    assert 0 < plain["packing_efficiency"] <= 1.0
    assert 0 < streaming["budget_fill"] <= 1.0 and streaming["micro_steps_per_step"] >= 1
    assert plain["micro_batches_per_step"] >= 1
    assert report["step0_loss_abs_diff"] < 1e-5, report["step0_loss_abs_diff"]
    assert _number(report["ratio_streaming_over_plain"])
    assert set(report["met"]) == {"ratio", "packing_efficiency", "budget_fill"}
    assert all(isinstance(v, bool) for v in report["met"].values())
    assert report["pinned"]["torch_threads"] == 1 and "machine" in report
