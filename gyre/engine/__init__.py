"""Rollout engines: the protocol, the native torch engine and its dense decoder, HF-layout weights.

Also here, imported from their modules: `gyre.engine.endpoint` (HTTP server of an engine), `gyre.engine.remote`
(`RemoteEngine`, its client), `gyre.engine.wire` (their format), `gyre.engine.sglang_engine` (the SGLang adapter).
See `docs/engine.md`, `docs/native-model.md`, `docs/sglang.md`. This package's import needs torch and safetensors.
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
from gyre.engine.native import KVBuffer, NativeEngine
from gyre.engine.protocol import (
    Engine,
    EngineBusyError,
    EngineLoad,
    EngineUnavailableError,
    FinishReason,
    FlatWeights,
    GenerateRequest,
    GenerateResult,
    GenerateTimings,
    KVExport,
    SamplingParams,
    TensorSpec,
    TokenChunk,
)
from gyre.engine.sampling import request_generator, sample_next, sampling_logprobs, sequence_logprobs
from gyre.engine.weights import load_pretrained, read_config, save_pretrained

__all__ = [
    "DecoderConfig",
    "DecoderLM",
    "Engine",
    "EngineBusyError",
    "EngineLoad",
    "EngineUnavailableError",
    "FinishReason",
    "FlatWeights",
    "GenerateRequest",
    "GenerateResult",
    "GenerateTimings",
    "KVBuffer",
    "KVCache",
    "KVExport",
    "NativeEngine",
    "RopeScaling",
    "SamplingParams",
    "TensorSpec",
    "TokenChunk",
    "block_causal_mask",
    "build_model",
    "load_pretrained",
    "read_config",
    "request_generator",
    "rope_inv_freq",
    "sample_next",
    "sampling_logprobs",
    "save_pretrained",
    "segments_from_positions",
    "sequence_logprobs",
]
