"""Rollout engines. So far: the native dense decoder (model, HF config, HF-layout weights).

See `docs/native-model.md`. Imports torch, safetensors and stdlib only.
"""

from gyre.engine.hf_config import DecoderConfig, RopeScaling
from gyre.engine.model import (
    DecoderLM,
    KVCache,
    block_causal_mask,
    build_model,
    rope_inv_freq,
    segments_from_positions,
)
from gyre.engine.weights import load_pretrained, read_config, save_pretrained

__all__ = [
    "DecoderConfig",
    "DecoderLM",
    "KVCache",
    "RopeScaling",
    "block_causal_mask",
    "build_model",
    "load_pretrained",
    "read_config",
    "rope_inv_freq",
    "save_pretrained",
    "segments_from_positions",
]
