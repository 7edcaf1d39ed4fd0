"""gyre.runtime.trainers: a native cell's trainer on the starting checkpoint, the core's weights out of it, and the
`DecoderLM` made of them (what the held-out evaluation and `policy/` get) computing the trainer's own logits.
The Megatron side runs in tests/integration/test_train_program.py (2 cells x TP 2 on 4 processes)."""

from __future__ import annotations

import torch

from gyre.config import TrainConfig
from gyre.config.model import ModelConfig
from gyre.models.hf_weights import read_config
from gyre.models.tiny import build_tiny_model
from gyre.runtime.trainers import build_trainable, policy_model
from gyre.train.native_trainable import NativeTrainable
from gyre.train.publish import engine_weights


def test_the_core_weights_make_a_model_with_the_trainers_logits(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny", seed=4)
    cfg = TrainConfig(model=ModelConfig(model_dir=str(model_dir)))
    trainable = build_trainable(cfg, model_dir)
    assert isinstance(trainable, NativeTrainable)
    with torch.no_grad():  # move the weights off the checkpoint's, as an update would
        for p in trainable.parameters():
            p.add_(0.01 * torch.randn_like(p))
    config = read_config(model_dir)
    weights = engine_weights(trainable, config)
    model = policy_model(weights, config)
    ids = torch.tensor([[1, 5, 7, 9, 11]])
    positions = torch.arange(5)[None]
    with torch.no_grad():
        expected, _ = trainable.model(ids, positions)
        got, _ = model(ids, positions)
    assert torch.equal(got, expected)
    with torch.no_grad():  # a copy: training on does not reach the model made of the weights
        trainable.parameters()[0].add_(1.0)
        again, _ = model(ids, positions)
    assert torch.equal(again, got)
