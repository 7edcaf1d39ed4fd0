"""Rollout engines: the protocol every engine implements, and the native torch engine with its decode path.

Importing this package loads the protocol only (stdlib, `gyre.engine.protocol`), so a light process such as the
proxy imports the protocol and its errors without torch. The inference stack is imported on first access to one
of its names (PEP 562): `NativeEngine`, `KVBuffer` (`gyre.engine.native`) and the sampling functions
(`gyre.engine.sampling`); those need torch. `gyre.engine.decode` holds the inference path the native engine applies
to the shared model (stacked projections, `decode_forward`).

Also here, imported from their modules: `gyre.engine.endpoint` (HTTP server of an engine), `gyre.engine.remote`
(`RemoteEngine`, its client), `gyre.engine.wire` (their format) and `gyre.engine.errors` (its errors, stdlib),
`gyre.engine.sglang_engine` (the SGLang adapter). The model both engines and trainers run (`DecoderConfig`,
`DecoderLM`, HF-layout weights IO) is `gyre.models`. See `docs/engine.md`, `docs/native-model.md`, `docs/sglang.md`.
"""

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
from gyre.lazy_names import lazy_names

# name -> module defining it, imported on first access (each imports torch)
_LAZY = {
    "FlatWeights": "gyre.models.flat_weights",
    "TensorSpec": "gyre.models.flat_weights",
    "KVBuffer": "gyre.engine.native",
    "NativeEngine": "gyre.engine.native",
    "seeded_uniforms": "gyre.engine.sampling",
    "sample_next": "gyre.engine.sampling",
    "sampling_logprobs": "gyre.engine.sampling",
    "sequence_logprobs": "gyre.engine.sampling",
}

__getattr__, __dir__ = lazy_names(__name__, _LAZY)


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
    "KVExport",
    "NativeEngine",
    "SamplingParams",
    "TensorSpec",
    "TokenChunk",
    "sample_next",
    "sampling_logprobs",
    "seeded_uniforms",
    "sequence_logprobs",
]
