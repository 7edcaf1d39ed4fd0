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
    weight_version: str | None = None


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


@dataclass(kw_only=True)
class InitWeightsUpdateGroupReqInput:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


@dataclass(kw_only=True)
class UpdateWeightsFromDistributedReqInput:
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    weight_version: str | None = None
    load_format: str | None = None


@dataclass(kw_only=True)
class BeginWeightUpdateReqInput:
    selector: str = "all"


@dataclass(kw_only=True)
class EndWeightUpdateReqInput:
    pass
