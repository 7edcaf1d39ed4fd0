"""The request types gyre's adapter sends (fields among SGLang 0.5.23's `io_struct` ones)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class ReleaseMemoryOccupationReqInput:
    tags: list[str] | None = None


@dataclass(kw_only=True)
class ResumeMemoryOccupationReqInput:
    tags: list[str] | None = None


@dataclass(kw_only=True)
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: list[bytes]
    load_format: str | None = None
    flush_cache: bool = True


@dataclass(kw_only=True)
class PauseGenerationReqInput:
    mode: str = "abort"


@dataclass(kw_only=True)
class ContinueGenerationReqInput:
    torch_empty_cache: bool = True


@dataclass(kw_only=True)
class FlushCacheReqOutput:
    success: bool
    message: str = ""
