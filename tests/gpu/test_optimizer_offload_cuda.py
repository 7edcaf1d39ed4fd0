"""Optimizer offload on CUDA (`trainer.optimizer_offload_fraction`, docs/training.md "Optimizer offload"): a small bf16
Megatron trainer with half its optimizer offloaded takes a step through megatron-core's `HybridDeviceOptimizer`. Half
the parameters (by count) step on the host (their AdamW moments there), the gradient norm and the updated weights
are those of the trainer whose optimizer is whole on the device (up to bf16 rounding of the same fp32 update), and the
device holds at least 12 bytes less for each offloaded parameter (fp32 main weight and two moments). Skipped without
a CUDA device (tests/gpu/conftest.py); not run where it was written (no GPU there)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_train_streaming_unit import rows

from gyre.data.microstep import build_microstep
from gyre.models.decoder import build_model
from gyre.models.decoder_config import DecoderConfig

CONFIG = DecoderConfig(  # ~1.6M parameters: what is offloaded outweighs the allocator's rounding
    model_type="qwen3",
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    qk_norm=True,
)


@pytest.fixture
def one_rank(tmp_path):
    from gyre.trainer.model import init_model_parallel  # before megatron: gyre.trainer's import patch

    from megatron.core import parallel_state  # isort: skip

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    init_model_parallel(1, 1, seed=0)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def one_step(state: dict, fraction: float):
    """A bf16 trainer on CUDA from `state`, one step; (trainer, grad norm, device bytes it holds after the step, its
    weights before the step)."""
    from gyre.trainer.convert import load_hf_state_dict
    from gyre.trainer.megatron_trainable import MegatronTrainable
    from gyre.trainer.model import build_gpt_model

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = build_gpt_model(CONFIG, dtype=torch.bfloat16)
    load_hf_state_dict(model, state, CONFIG)
    trainer = MegatronTrainable(model.cuda().train(), lr=1e-2, max_grad_norm=1.0, offload_fraction=fraction)
    initial = [p.detach().float().cpu() for p in trainer.parameters()]
    step = build_microstep(0, 0, rows(np.random.default_rng(0)), num_executions=2)
    trainer.logprobs(step).sum().backward()
    norm = trainer.update()["grad_norm"]
    torch.cuda.synchronize()
    return trainer, norm, torch.cuda.memory_allocated() - before, initial


@pytest.mark.gpu
def test_a_core_with_half_its_optimizer_offloaded_steps_as_the_whole_on_the_device(one_rank):
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    state = build_model(CONFIG, seed=1).state_dict()
    plain, plain_norm, plain_bytes, _ = one_step(state, 0.0)
    plain_weights = [p.detach().float().cpu() for p in plain.parameters()]
    del plain
    hybrid, norm, hybrid_bytes, initial = one_step(state, 0.5)
    assert isinstance(hybrid.optimizer, HybridDeviceOptimizer) and hybrid.weights.main is None
    on_host = [p for opt in hybrid.optimizer.cpu_optimizers for g in opt.param_groups for p in g["params"]]
    total = sum(p.numel() for p in hybrid.parameters())
    offloaded = sum(p.numel() for p in on_host)
    assert total / 2 <= offloaded < total / 2 + max(p.numel() for p in hybrid.parameters())
    moments = [v for opt in hybrid.optimizer.cpu_optimizers for s in opt.state.values() for v in s.values()]
    assert moments and all(not v.is_cuda for v in moments if isinstance(v, torch.Tensor) and v.dim())
    assert norm == pytest.approx(plain_norm, rel=1e-5)
    for got, want in zip(hybrid.parameters(), plain_weights, strict=True):
        torch.testing.assert_close(got.detach().float().cpu(), want, rtol=2**-7, atol=1e-6)
    assert all(not torch.equal(p.detach().float().cpu(), w) for p, w in zip(hybrid.parameters(), initial, strict=True))
    assert plain_bytes - hybrid_bytes >= 12 * offloaded * 0.95, (plain_bytes, hybrid_bytes, offloaded)
