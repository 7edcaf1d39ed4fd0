"""The dense decoder on a CUDA device: the forward equals the CPU forward (fp32, atol 1e-4).

The models are the decoder unit tests' random ones (tests/unit/test_engine_model.py), every parameter random so no
term of the forward is vacuous. Skipped without a CUDA device (tests/gpu/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from test_engine_model import arange_positions, random_model, tokens
from torch.testing import assert_close


@pytest.mark.gpu
def test_cuda_matches_cpu():
    model = random_model("qwen3")
    ids = tokens(2, 8)
    with torch.no_grad():
        cpu, _ = model(ids, arange_positions(2, 8))
        gpu, _ = model.to("cuda")(ids.cuda(), arange_positions(2, 8).cuda())
    assert_close(gpu.cpu(), cpu, atol=1e-4, rtol=0.0)
