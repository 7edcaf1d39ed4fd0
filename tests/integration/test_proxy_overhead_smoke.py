"""`benchmarks/proxy_overhead.py --quick` as a user runs it: one subprocess, bounded; the JSON's shape, no timings.

The benchmark starts its own engine endpoint, proxy and pass-through processes (stopped by PID in its `finally`)
on 127.0.0.1 and prints one JSON object last; the figures depend on the machine, so only their presence is checked.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "proxy_overhead.py"
TIMEOUT_S = 240


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def test_proxy_overhead_quick_reports_all_four_sections():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["benchmark"] == "proxy_overhead" and report["mode"] == "quick"

    a = report["a_one_session"]
    for side in ("direct_total_ms", "proxy_total_ms", "direct_ttft_ms", "proxy_ttft_ms"):
        assert all(_number(a[side][q]) for q in ("p50", "p90", "p99")), a[side]
    assert _number(a["added_p50_ms"]) and isinstance(a["met"], bool)

    b = report["b_agent_sessions"]
    assert b["sessions"] == 64  # --quick; 512 in a full run
    for side in ("direct", "proxy"):
        assert b[side]["calls"] > 0 and _number(b[side]["total_ms"]["p99"]), b[side]
        assert b[side]["errors"] == [], b[side]["errors"]
    assert _number(b["added_p50_ms"]) and _number(b["added_p99_ms"]) and _number(b["load_over_saturation"])

    c = report["c_saturation"]
    for key in ("passthrough_requests_per_s", "proxy_requests_per_s", "throughput_ratio", "proxy_cpu_ms_per_request"):
        assert _number(c[key]) and c[key] > 0, (key, c[key])

    d = report["d_long_history_cpu"]
    assert d["history_tokens"] >= 700_000
    for key in ("proxy_cpu_ms_per_request", "json_parse_ms", "cpu_over_parse"):
        assert _number(d[key]) and d[key] > 0, (key, d[key])
    assert all(_number(v) for v in d["breakdown"]["stages_ms"].values())

    assert set(report["summary"]["met"]) == {"a", "b", "c", "d"}
