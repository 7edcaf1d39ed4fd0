"""The GPU check (benchmarks/gpu_check.py) on CUDA: NCCL process group, the native engine, engine-vs-trainer
log-probs, a bf16 Megatron step and the role swap's memory release all pass. Skipped without a CUDA device
(tests/gpu/conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.mark.gpu
def test_the_gpu_check_passes_on_cuda():
    command = [sys.executable, str(SCRIPT), "--device", "cuda"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=480)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=1))
    assert done.returncode == 0 and result["passed"], (result, done.stderr[-3000:])
