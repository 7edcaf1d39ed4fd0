"""What every test under tests/gpu shares: the `gpu` marker and a skip, with its reason, where no CUDA device is
visible.

`pytest -m gpu` selects these tests and `pytest -m "not gpu"` leaves them out; on a CPU machine `pytest tests/gpu`
reports each one skipped with the reason below. Tests that need more than CUDA (sglang) add their own `skipif`.
The tests reuse the unit tests' helpers (`engine_fixtures`, the decoder test's random models), so tests/unit goes on
sys.path here, as pytest does for the unit tests themselves.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
UNIT_TESTS = HERE.parent / "unit"
if str(UNIT_TESTS) not in sys.path:
    sys.path.insert(0, str(UNIT_TESTS))


def cuda_skip_reason() -> str | None:
    """Why the GPU tests cannot run here, or None where a CUDA device is visible."""
    try:
        import torch
    except ImportError:
        return "torch does not import here"
    if not torch.cuda.is_available():
        return "needs a CUDA device: torch.cuda.is_available() is False here (CPU-only machine or CPU torch)"
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m` deselection, so an unmarked test here is still selected by -m gpu
def pytest_collection_modifyitems(config, items):
    ours = [item for item in items if HERE in Path(str(item.path)).resolve().parents]
    if not ours:
        return
    reason = cuda_skip_reason()
    for item in ours:
        item.add_marker(pytest.mark.gpu)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
