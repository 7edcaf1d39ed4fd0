"""benchmarks/gpu_check.py, the one GPU check a lent device runs, kept working on machines without a GPU: on the
CPU (`--device cpu`, gloo) every step runs and passes; asked for CUDA where there is none, it says why and exits 0.
On a GPU, tests/gpu/test_gpu_check_cuda.py runs it on CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def run(*args: str) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1])


def test_every_step_runs_and_passes_on_the_cpu():
    code, result = run("--device", "cpu")
    assert code == 0 and result["passed"], result
    assert set(result["checks"]) == {
        "process_group",
        "engine_logprobs_exact",
        "engine_vs_trainer_fp32",
        "bf16_step",
        "engine_memory_released",
        "trainer_memory_released",
    }
    assert result["trainer"]["engine_vs_trainer_bf16"]["mean"] > result["trainer"]["engine_vs_trainer_fp32"]["mean"]


def test_without_a_gpu_it_says_why_and_exits_0():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: tests/gpu/test_gpu_check_cuda.py runs the check")
    code, result = run()
    assert code == 0 and "needs a CUDA device" in result["skipped"], result
