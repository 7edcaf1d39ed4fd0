"""gyre.trainer.precision: a bf16 model trains with fp32 main weights, gradients and optimizer state. Micro-steps'
gradients add up in fp32 exactly, the model holds the main weights rounded, an update smaller than bf16's spacing
still accumulates, and the Megatron trainer does the same with its TP attributes kept (so its gradient norm
counts alike)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_train_streaming_unit import CONFIG, rows

from gyre.data.microstep import build_microstep
from gyre.models.decoder import build_model
from gyre.trainer.native_trainable import NativeTrainable
from gyre.trainer.precision import MainWeights


def microstep(seed: int):
    return build_microstep(0, 0, rows(np.random.default_rng(seed)), num_executions=2)


def bf16_trainable(lr: float = 1e-3) -> NativeTrainable:
    return NativeTrainable(build_model(CONFIG, seed=1).to(torch.bfloat16), lr=lr, max_grad_norm=0.0)


def test_fp32_parameters_are_their_own_main_weights():
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))]
    weights = MainWeights(params)
    assert not weights.mixed and weights.main is weights.params
    grads = weights.gradients()
    assert all(g is p.grad and torch.equal(g, torch.zeros_like(p)) for g, p in zip(grads, params, strict=True))


def test_micro_steps_add_up_in_fp32_and_the_model_keeps_no_gradient():
    trainable = bf16_trainable()
    steps = [microstep(seed) for seed in range(3)]
    expected = None
    for step in steps:  # each micro-step's bf16 gradient alone, summed here in fp32
        alone = bf16_trainable()
        alone.logprobs(step).sum().backward()
        grads = [g.clone() for g in alone.gradients()]
        expected = grads if expected is None else [e + g for e, g in zip(expected, grads, strict=True)]
    for step in steps:
        trainable.logprobs(step).sum().backward()
    assert all(p.grad is None for p in trainable.parameters())
    got = trainable.gradients()
    assert all(g.dtype == torch.float32 for g in got)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


def test_a_satellite_keeps_fp32_gradients_only_and_they_equal_the_cores():
    """A satellite never steps: no fp32 copy of its weights, no AdamW; its fp32 gradient accumulators sum the
    micro-steps exactly as the core's main weights' gradients do (what the step reduces onto the core)."""
    core = bf16_trainable()
    satellite = NativeTrainable(build_model(CONFIG, seed=1).to(torch.bfloat16), lr=1e-3, max_grad_norm=0.0, steps=False)
    assert satellite.weights.main is None and satellite.optimizer is None
    for trainable in (core, satellite):
        for seed in range(3):
            trainable.logprobs(microstep(seed)).sum().backward()
    assert all(p.grad is None for p in satellite.parameters())
    for got, want in zip(satellite.gradients(), core.gradients(), strict=True):
        assert got.dtype == torch.float32 and torch.equal(got, want)
    held = sum(p.numel() * p.element_size() for p in satellite.parameters())
    held += sum(g.numel() * g.element_size() for g in satellite.gradients())
    params = sum(p.numel() for p in satellite.parameters())
    assert held == (2 + 4) * params  # bf16 weights and fp32 gradients: no fp32 main weights (the core holds 2 + 4 + 4)
    satellite.drop_gradients()
    assert all(torch.equal(g, torch.zeros_like(g)) for g in satellite.gradients())
    with pytest.raises(RuntimeError, match="a satellite does not step"):
        satellite.update()
    with pytest.raises(RuntimeError, match="do not step"):
        satellite.weights.copy_to_model()


def test_a_satellites_gradients_start_afresh_at_each_step():
    """After `drop_gradients` (a satellite's end of step) the next micro-steps accumulate into fresh fp32
    gradients, equal to the core's of the same micro-steps: dropping them must not cut the accumulation hooks off."""
    core = bf16_trainable()
    satellite = NativeTrainable(build_model(CONFIG, seed=1).to(torch.bfloat16), lr=1e-3, max_grad_norm=0.0, steps=False)
    for seed in (0, 1):
        for trainable in (core, satellite):
            trainable.logprobs(microstep(seed)).sum().backward()
        for got, want in zip(satellite.gradients(), core.gradients(), strict=True):
            assert torch.equal(got, want)
        assert any(bool(g.abs().sum() > 0) for g in satellite.gradients())
        core.drop_gradients()
        satellite.drop_gradients()


def test_the_update_is_fp32_and_the_model_holds_it_rounded():
    trainable = bf16_trainable(lr=1e-2)
    logp = trainable.logprobs(microstep(0))
    assert logp.dtype == torch.float32  # log-probs in fp32 from bf16 hidden states
    logp.sum().backward()
    trainable.update()
    state = trainable.optimizer.state[trainable.weights.main[0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    for p, main in zip(trainable.parameters(), trainable.weights.main, strict=True):
        assert p.dtype == torch.bfloat16 and main.dtype == torch.float32
        assert torch.equal(p, main.to(torch.bfloat16))
    assert all(main.grad is None for main in trainable.weights.main)


def test_updates_below_bf16_spacing_still_accumulate():
    """The norm weights start at exactly 1.0, where bf16's spacing is 2^-8 below and 2^-7 above: an Adam step
    of lr=1e-4 moves none of them in bf16, yet the fp32 main weights move, and after enough steps the model's
    weights do. Updating the bf16 weights directly would round every step back to 1.0."""
    trainable = bf16_trainable(lr=1e-4)
    norms = [i for i, (name, _) in enumerate(trainable.model.named_parameters()) if name.endswith("norm.weight")]
    assert norms and all(bool((trainable.parameters()[i] == 1).all()) for i in norms)
    trainable.logprobs(microstep(0)).sum().backward()
    trainable.update()
    assert all(bool((trainable.parameters()[i] == 1).all()) for i in norms)
    assert any(bool((trainable.weights.main[i] != 1).any()) for i in norms)
    for _ in range(100):
        trainable.logprobs(microstep(0)).sum().backward()
        trainable.update()
    assert any(bool((trainable.parameters()[i] != 1).any()) for i in norms)


def test_megatron_bf16_trains_with_fp32_main_weights(model_parallel):
    from gyre.trainer.convert import load_hf_state_dict
    from gyre.trainer.megatron_trainable import MegatronTrainable, global_grad_norm
    from gyre.trainer.model import build_gpt_model

    native = build_model(CONFIG, seed=1)
    fp32, bf16 = build_gpt_model(CONFIG), build_gpt_model(CONFIG, dtype=torch.bfloat16)
    for model in (fp32, bf16):
        load_hf_state_dict(model, native.state_dict(), CONFIG)
        model.train()
    reference, trainable = MegatronTrainable(fp32, lr=1e-3), MegatronTrainable(bf16, lr=1e-3)
    step = microstep(0)
    want, got = reference.logprobs(step), trainable.logprobs(step)
    assert got.dtype == torch.float32
    assert float((got - want).abs().max()) < 0.05  # bf16 rounding of a tiny model, not a different function
    want.sum().backward()
    got.sum().backward()
    assert all(p.grad is None for p in trainable.parameters())
    for main, p in zip(trainable.weights.main, trainable.parameters(), strict=True):
        assert getattr(main, "tensor_model_parallel", None) == getattr(p, "tensor_model_parallel", None)
    norm, norm_fp32 = float(global_grad_norm(trainable.weights.main)), float(global_grad_norm(reference.parameters()))
    assert norm == pytest.approx(norm_fp32, rel=0.05)
    trainable.update()
    for p, main in zip(trainable.parameters(), trainable.weights.main, strict=True):
        assert p.dtype == torch.bfloat16 and torch.equal(p, main.to(torch.bfloat16))
