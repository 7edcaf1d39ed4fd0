"""The tiny sharpened decoder shared by the engine tests (sampling and the native engine).

A qwen3-style model with vocabulary 97 whose lm_head is scaled by 40: the near-uniform random init
becomes peaked, so top-k/top-p filters remove real probability mass and greedy ties are rare.
Imported by the test modules as `engine_fixtures` (pytest puts this directory on sys.path).
"""

from __future__ import annotations

import torch

from gyre.models import DecoderConfig, DecoderLM, build_model

VOCAB = 97


def sharp_tiny_model() -> DecoderLM:
    config = DecoderConfig.from_hf(
        {
            "model_type": "qwen3",
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "rope_theta": 500.0,
            "max_position_embeddings": 128,
        }
    )
    model = build_model(config, seed=3).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model
