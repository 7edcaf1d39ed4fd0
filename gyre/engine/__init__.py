"""Rollout engines: the protocol every engine implements, and the native torch engine with its decode path.

Importing this package loads the protocol only (stdlib, `gyre.engine.protocol`), so a light process such as the
proxy imports the protocol and its errors without torch. The inference stack is imported on first access to one
of its names (PEP 562): `NativeEngine`, `KVBuffer` (`gyre.engine.native`), `KVCache` (`gyre.engine.decode`) and
the sampling functions (`gyre.engine.sampling`); those need torch.

Also here, imported from their modules: `gyre.engine.endpoint` (HTTP server of an engine), `gyre.engine.remote`
(`RemoteEngine`, its client), `gyre.engine.wire` (their format) and `gyre.engine.errors` (its errors, stdlib),
`gyre.engine.sglang_engine` (the SGLang adapter). The model both engines and trainers run (`DecoderConfig`,
`DecoderLM`, HF-layout weights IO) is `gyre.models`. See `docs/engine.md`, `docs/native-model.md`, `docs/sglang.md`.
"""

import importlib

from gyre.engine.protocol import (
    Engine,
    EngineBusyError,
    EngineLoad,
    EngineUnavailableError,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    GenerateTimings,
    KVExport,
    SamplingParams,
    TokenChunk,
)

# name -> module defining it, imported on first access (each imports torch)
_LAZY = {
    "FlatWeights": "gyre.models.flat_weights",
    "TensorSpec": "gyre.models.flat_weights",
    "KVBuffer": "gyre.engine.native",
    "NativeEngine": "gyre.engine.native",
    "DecoderConfig": "gyre.engine.hf_config",
    "RopeScaling": "gyre.engine.hf_config",
    "DecoderLM": "gyre.engine.model",
    "KVCache": "gyre.engine.model",
    "block_causal_mask": "gyre.engine.model",
    "build_model": "gyre.engine.model",
    "rope_inv_freq": "gyre.engine.model",
    "segments_from_positions": "gyre.engine.model",
    "load_pretrained": "gyre.engine.weights",
    "read_config": "gyre.engine.weights",
    "save_pretrained": "gyre.engine.weights",
    "request_generator": "gyre.engine.sampling",
    "sample_next": "gyre.engine.sampling",
    "sampling_logprobs": "gyre.engine.sampling",
    "sequence_logprobs": "gyre.engine.sampling",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
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
    "SamplingParams",
    "TensorSpec",
    "TokenChunk",
    "request_generator",
    "sample_next",
    "sampling_logprobs",
    "sequence_logprobs",
]
