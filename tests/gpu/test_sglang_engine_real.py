"""The SGLang adapter over a real `sglang.Engine` on a tiny saved model: its behavior log-probs equal gyre's
teacher-forced ones (atol 1e-3, docs/sglang.md).

Needs a CUDA device (tests/gpu/conftest.py) and sglang, which does not install on CPU machines; the adapter's
plumbing is tested over a fake in tests/unit/test_engine_sglang_adapter.py, whose helpers this reuses.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from engine_fixtures import sharp_tiny_model
from test_engine_sglang_adapter import request, run

from gyre.engine.protocol import SamplingParams
from gyre.engine.sglang_engine import SGLangEngine


@pytest.mark.gpu
@pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None, reason="sglang does not import here (needs CUDA torch and a GPU)"
)
def test_real_sglang_engine_matches_native_logprobs(tmp_path):
    """On a GPU machine with sglang: the adapter over a real engine on a tiny saved model, log-probs vs gyre's."""
    from gyre.engine.sampling import sequence_logprobs
    from gyre.engine.weights import save_pretrained

    model = sharp_tiny_model()
    save_pretrained(model, tmp_path)
    params = SamplingParams(temperature=0.8, max_new_tokens=16)

    async def go():
        engine = SGLangEngine.from_pretrained(str(tmp_path), mem_fraction_static=0.2, dtype="float32")
        try:
            return await engine.generate(request("real", (1, 2, 3), params))
        finally:
            await engine.close()

    result = run(go())
    expected = sequence_logprobs(model, [1, 2, 3], list(result.output_ids), params)
    assert torch.allclose(torch.tensor(result.output_logprobs), expected, atol=1e-3)
