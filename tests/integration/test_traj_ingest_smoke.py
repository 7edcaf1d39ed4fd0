"""`benchmarks/traj_ingest.py` runs and reports what its docs say (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_ingest_benchmark_smoke():
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "traj_ingest.py"
    done = subprocess.run(
        [sys.executable, str(script), "--reps", "20"], capture_output=True, text=True, timeout=120, check=True
    )
    report = json.loads(done.stdout)
    assert report["ingest"]["stored_over_unique_tokens_700k"] == 1.0
    assert report["ingest"]["history_tokens"] == {"7000": 7000, "700000": 700000}
    assert report["synthetic_636"]["requests"] == 636 and report["synthetic_636"]["stored_over_unique_tokens"] == 1.0
    admission = report["synthetic_636"]["admission_j_max_5"]
    assert admission["admitted"] == 5 and admission["admit_ms"] > 0 and admission["materialize_ms"] > 0
