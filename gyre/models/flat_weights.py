"""Flat weights: many named tensors in one contiguous byte buffer, described by a manifest.

The one format every weight move speaks: the trainer publishes it (`gyre.trainer.publish`), the transports move it
(`gyre.distributed.transport*`), the engines' `update_weights` take it (`gyre.engine.protocol`), and the engine
endpoint frames it (`gyre.engine.wire`). It lives beside the model, not in any of those, so none of them imports
another to speak it.

Contract
- `TensorSpec(name, dtype, shape, offset)`: where one tensor lies in the buffer (dtype as torch names it without
  the prefix, e.g. "bfloat16"; offset in bytes). `FlatWeights(buffer, manifest)`: a 1-D uint8 buffer and the
  specs of the tensors in it.
- `flatten_weights(named)` packs named tensors (in their order) into one buffer, each starting at a multiple of
  `ALIGN` bytes; `unflatten_weights(flat)` views them back out (no copy), bit for bit. A spec with an unknown
  dtype, a misaligned offset or bytes beyond the buffer raises `ValueError` naming the tensor.

This module imports torch; `gyre.engine.protocol` names these types for type hints only and re-exports them on
first access, so the protocol still imports without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from gyre.config.checks import is_int, require

ALIGN = 16  # byte alignment of every tensor in a flat buffer (a view needs offset % element size == 0)


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """Where one named tensor lies in a flat weight buffer."""

    name: str  # HF parameter name, e.g. "model.layers.0.self_attn.q_proj.weight"
    dtype: str  # torch dtype name without the prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int  # byte offset of the first element in the buffer

    def __post_init__(self) -> None:
        require(is_int(self.offset) and self.offset >= 0, "offset", self.offset, "a byte offset >= 0")
        object.__setattr__(self, "shape", tuple(self.shape))


@dataclass(frozen=True, kw_only=True)
class FlatWeights:
    """Many tensors in one contiguous byte buffer (one transfer instead of hundreds), described by a manifest."""

    buffer: torch.Tensor  # 1-D uint8
    manifest: tuple[TensorSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "manifest", tuple(self.manifest))


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype called `name` ("bfloat16"), or None when torch has no such dtype."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16" (the spelling of `TensorSpec.dtype`)."""
    return str(dtype).removeprefix("torch.")


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements as bytes, in row-major order, on the CPU (a copy only if not already CPU-contiguous)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def padding(offset: int) -> bytes:
    """Zero bytes from `offset` up to the next multiple of `ALIGN`."""
    return bytes(-offset % ALIGN)


def flatten_weights(named: Mapping[str, torch.Tensor]) -> FlatWeights:
    """Named tensors packed into one uint8 buffer with its manifest, each 16-aligned (inverse: `unflatten_weights`)."""
    manifest, parts, offset = [], [], 0
    for name, tensor in named.items():
        spec = TensorSpec(name=name, dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape), offset=offset)
        manifest.append(spec)
        raw = bytes(raw_bytes(tensor))
        parts.append(raw + padding(offset + len(raw)))
        offset += len(parts[-1])
    joined = bytearray(b"".join(parts))
    buffer = torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)
    return FlatWeights(buffer=buffer, manifest=tuple(manifest))


def unflatten_weights(flat: FlatWeights) -> dict[str, torch.Tensor]:
    """Named tensors viewed out of a flat uint8 buffer by its manifest (no copy)."""
    out = {}
    for spec in flat.manifest:
        dtype = torch_dtype(spec.dtype)
        if dtype is None:
            raise ValueError(f"update_weights: {spec.name} has unknown dtype {spec.dtype!r}")
        size = torch.empty(0, dtype=dtype).element_size()
        nbytes = torch.Size(spec.shape).numel() * size
        if spec.offset % size:
            raise ValueError(f"update_weights: {spec.name} starts at byte {spec.offset}, not a multiple of {size}")
        if spec.offset + nbytes > flat.buffer.numel():
            raise ValueError(f"update_weights: {spec.name} lies beyond the buffer ({flat.buffer.numel()} bytes)")
        out[spec.name] = flat.buffer[spec.offset : spec.offset + nbytes].view(dtype).reshape(spec.shape)
    return out
