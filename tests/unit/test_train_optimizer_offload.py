"""Optimizer offload (`trainer.optimizer_offload_fraction`, docs/training.md "Optimizer offload"): refused where it
cannot run, built with keywords megatron-core's `HybridDeviceOptimizer` has, and gyre's side of the step (fp32
gradients handed as `decoupled_grad`, no fp32 main weights of gyre's own) updating the model as the main-weights path
does. The hybrid optimizer itself needs CUDA: tests/gpu/test_optimizer_offload_cuda.py steps it there."""

from __future__ import annotations

import inspect
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_train_streaming_unit import CONFIG, rows

from gyre.config import ConfigError
from gyre.config.trainer import TrainerConfig
from gyre.data.microstep import build_microstep
from gyre.models.decoder import build_model


def test_offload_is_refused_on_a_cpu_trainer_and_with_the_native_backend():
    with pytest.raises(ConfigError, match=r"fraction=0\.5 is not allowed: expected 0 with trainer\.device=cpu"):
        TrainerConfig(backend="megatron", optimizer_offload_fraction=0.5)
    with pytest.raises(ConfigError, match=r"expected 0 with trainer\.backend=native"):
        TrainerConfig(device="cuda", optimizer_offload_fraction=0.5)
    with pytest.raises(ConfigError, match=r"optimizer_offload_fraction=1\.5 is not allowed: expected a number in"):
        TrainerConfig(backend="megatron", device="cuda", optimizer_offload_fraction=1.5)
    assert TrainerConfig(backend="megatron", device="cuda", optimizer_offload_fraction=0.5).optimizer_offload_fraction


def test_the_app_refuses_it_in_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "gyre.train", "trainer.optimizer_offload_fraction=0.5", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("gyre.train: config error: trainer.optimizer_offload_fraction=0.5 is not allowed")


def test_the_hybrid_optimizer_gets_keywords_megatron_has(monkeypatch):
    """Each keyword `hybrid_optimizer` passes is a named parameter of megatron-core's `HybridDeviceOptimizer`, or
    reaches torch's AdamW (its **kwargs become the sub-optimizers' defaults); the attributes gyre's step uses exist
    in its source (a CPU cannot build one: it takes CUDA streams)."""
    from megatron.core.optimizer import cpu_offloading
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    import gyre.trainer.megatron_trainable as megatron_trainable

    calls = []
    monkeypatch.setattr(cpu_offloading, "HybridDeviceOptimizer", lambda *args, **kwargs: calls.append((args, kwargs)))
    params = [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]
    megatron_trainable.hybrid_optimizer(params, offload_fraction=0.5, lr=1e-3, weight_decay=0.1)
    ((args, kwargs),) = calls
    assert args == (params,) and kwargs["offload_fraction"] == 0.5 and kwargs["param_update_in_fp32"] is True
    named = inspect.signature(HybridDeviceOptimizer.__init__).parameters
    adamw = inspect.signature(torch.optim.AdamW.__init__).parameters
    for keyword in kwargs:
        assert keyword in named or keyword in adamw, keyword
    assert kwargs["cpu_optimizer_cls"] is kwargs["gpu_optimizer_cls"] is torch.optim.AdamW
    source = inspect.getsource(HybridDeviceOptimizer)
    for name in ('"decoupled_grad"', "self.gpu_optimizer", "def zero_grad(self, set_to_none"):
        assert name in source, name


class HostHybrid:
    """A stand-in for `HybridDeviceOptimizer` on a CPU, with its contract as gyre uses it: fp32 main weights of its
    own (`param_update_in_fp32`), each parameter's gradient read from `decoupled_grad` (else `.grad`), the updated
    weights written into the parameters, `zero_grad` clearing both, `gpu_optimizer` the inner optimizer."""

    def __init__(self, params, *, offload_fraction, lr, weight_decay):
        self.params = list(params)
        self.main = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.gpu_optimizer = torch.optim.AdamW(self.main, lr=lr, weight_decay=weight_decay)

    def step(self):
        for p, main in zip(self.params, self.main, strict=True):
            main.grad = getattr(p, "decoupled_grad", p.grad)
        self.gpu_optimizer.step()
        with torch.no_grad():
            for p, main in zip(self.params, self.main, strict=True):
                p.copy_(main)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None
            p.decoupled_grad = None


def test_an_offloading_core_updates_the_model_as_the_main_weights_path_does(model_parallel, monkeypatch):
    """bf16: with offload the trainer keeps no fp32 main weights of its own (the optimizer does), accumulates fp32
    gradients, clips them with the same norm and hands them to the optimizer; two steps give the main-weights
    path's model bit for bit (the same AdamW on the same fp32 numbers), and no gradient stays referenced."""
    import gyre.trainer.megatron_trainable as megatron_trainable
    from gyre.trainer.convert import load_hf_state_dict
    from gyre.trainer.model import build_gpt_model

    monkeypatch.setattr(megatron_trainable, "hybrid_optimizer", HostHybrid)
    native = build_model(CONFIG, seed=1)
    trainables = []
    for fraction in (0.0, 0.5):
        model = build_gpt_model(CONFIG, dtype=torch.bfloat16)
        load_hf_state_dict(model, native.state_dict(), CONFIG)
        trainables.append(
            megatron_trainable.MegatronTrainable(
                model.train(), lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, offload_fraction=fraction
            )
        )
    plain, offloaded = trainables
    assert offloaded.weights.main is None and isinstance(offloaded.optimizer, HostHybrid)
    for seed in range(2):
        step = build_microstep(0, 0, rows(np.random.default_rng(seed)), num_executions=2)
        norms = []
        for trainable in trainables:
            trainable.logprobs(step).sum().backward()
            norms.append(trainable.update()["grad_norm"])
        assert norms[0] == norms[1] and norms[0] > 0.5  # clipped alike
    for p, q in zip(plain.parameters(), offloaded.parameters(), strict=True):
        assert torch.equal(p, q)
    assert not torch.equal(plain.parameters()[0], native.state_dict()["model.embed_tokens.weight"].bfloat16())
    assert all(getattr(p, "decoupled_grad", None) is None and p.grad is None for p in offloaded.parameters())
    assert all(main.grad is None for main in offloaded.optimizer.main)
