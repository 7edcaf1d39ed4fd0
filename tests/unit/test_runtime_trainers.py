"""gyre.runtime.trainers: a native cell's trainer on the starting checkpoint, the core's weights out of it, and the
`DecoderLM` made of them (what the held-out evaluation and `policy/` get) computing the trainer's own logits.
The Megatron side runs in tests/integration/test_train_program.py (2 cells x TP 2 on 4 processes)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import torch

from gyre.config import TinyModelSpec, TrainConfig
from gyre.config.model import ModelConfig
from gyre.config.trainer import TrainerConfig
from gyre.data.microstep import TokenRow, build_microstep
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


def yarn_model_dir(path):
    """A tiny Qwen3 with Qwen3's 128K recipe: YaRN x4 over 32,768 positions, 131,072 in all (its config.json
    written as Qwen's model cards say to)."""
    spec = TinyModelSpec(max_position_embeddings=131_072, num_hidden_layers=2)
    model_dir = build_tiny_model(path, spec=spec, seed=4)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32_768}
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def microstep(vocab_size: int, length: int = 48):
    ids = np.random.default_rng(0).integers(0, vocab_size, length).astype(np.int64)
    row = TokenRow(
        group_id=0,
        execution="e",
        leaf=0,
        role="main",
        ids=ids,
        targets=np.arange(length) > 0,
        behavior_logprobs=np.zeros(length),
        advantage=1.0,
        execution_num_targets=length - 1,
        batch_execution=0,
    )
    return build_microstep(0, 0, [row], num_executions=1)


def test_a_yarn_128k_checkpoint_trains_in_both_backends_alike(model_parallel, tmp_path):
    """The runtime's own builder loads a YaRN config at 131,072 positions for each backend; the two trainers'
    log-probs agree as on plain RoPE, and differ from the same weights without the scaling (it is applied)."""
    model_dir = yarn_model_dir(tmp_path / "yarn")
    config = read_config(model_dir)
    assert config.rope_scaling.rope_type == "yarn" and config.max_position_embeddings == 131_072
    step = microstep(config.vocab_size)
    got = {}
    for backend in ("native", "megatron"):
        cfg = TrainConfig(model=ModelConfig(model_dir=str(model_dir)), trainer=TrainerConfig(backend=backend))
        with torch.no_grad():
            got[backend] = build_trainable(cfg, model_dir).logprobs(step)
    assert float((got["native"] - got["megatron"]).abs().max()) <= 1e-4
    plain = tmp_path / "plain"
    shutil.copytree(model_dir, plain)
    hf = json.loads((plain / "config.json").read_text())
    hf["rope_scaling"] = None
    (plain / "config.json").write_text(json.dumps(hf))
    cfg = TrainConfig(model=ModelConfig(model_dir=str(plain)))
    with torch.no_grad():
        unscaled = build_trainable(cfg, plain).logprobs(step)
    assert float((unscaled - got["native"]).abs().max()) > 1e-3
