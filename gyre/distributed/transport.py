"""Weight transport from the core to satellites and engines: the protocol, the manifest and its checks.

Contract (docs/architecture.md: the core publishes; satellites and engines pull)
- The core holds its weights as one flat contiguous buffer plus a manifest (`TensorSpec`: name, dtype, shape,
  byte offset per tensor) and an integer version: a `FlatWeights` (`gyre.models.flat_weights`), the same object the
  engines' `update_weights` takes. `flatten_state_dict` builds one; `unflatten` views the tensors back out.
- `WeightTransport.publish(weights, version)` on the core makes `version` the current publication; versions
  strictly increase. `pull(into, version=None)` on a receiver copies the current publication into `into`, the
  receiver's own preallocated contiguous CPU/GPU buffer (uint8 or the model dtype, at least `nbytes` long), and
  returns `(FlatWeights(buffer=<uint8 view of into's first nbytes>, manifest), version)`.
- Asking for a version older than the current one raises `WeightVersionError` (a `ValueError`): that version is
  gone. A version newer than the current one: torch.distributed raises (publish and pull meet in one call, the
  core decides what is published), Mooncake waits for it up to its `timeout_s`.
- A malformed manifest (unknown dtype, a tensor outside the buffer, misaligned or overlapping tensors, duplicate
  names) raises `ValueError` on the core before anything moves, and on the receivers too where they
  take part in the same call (torch.distributed).
- Implementations: `TorchWeightTransport` (`transport_torch`: a collective broadcast from the core's rank; publish
  and pull meet in one call), `MooncakeWeightTransport` (`transport_mooncake`: the core registers its buffer
  with a Mooncake Transfer Engine and posts a descriptor in a store; receivers read it whenever they want) and
  `StoreWeightTransport` (`transport_store`: a snapshot in versioned chunks through the job's store, one-sided
  like Mooncake). `gyre.distributed.one_sided.one_sided_transport` picks Mooncake or the store snapshot for
  satellites joining mid-step; this module imports none of the implementations (they import it).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from gyre.config.checks import is_int
from gyre.models.flat_weights import FlatWeights, TensorSpec, flatten_weights, unflatten_weights


class WeightVersionError(ValueError):
    """A receiver asked for a version that is not (or no longer) the one published."""


@runtime_checkable
class WeightTransport(Protocol):
    """Moves the core's flat weights to receivers (see the module docstring)."""

    def publish(self, weights: FlatWeights, version: int) -> None:
        """On the core: make `weights` the current publication under `version` (> every earlier version)."""
        ...

    def pull(self, into: torch.Tensor, *, version: int | None = None) -> tuple[FlatWeights, int]:
        """On a receiver: copy the current publication (which must be `version` when given) into `into`."""
        ...

    def close(self) -> None: ...


def flatten_state_dict(tensors: Mapping[str, torch.Tensor]) -> FlatWeights:
    """Named tensors packed into one 16-byte-aligned uint8 buffer with its manifest (`gyre.models.flat_weights`)."""
    return flatten_weights(tensors)


def unflatten(buffer: torch.Tensor, manifest: Iterable[TensorSpec | Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Named tensors viewed (no copy) out of `buffer` by `manifest`, which is checked first (`check_manifest`)."""
    data = as_bytes(buffer, what="buffer")
    specs = check_manifest(manifest, nbytes=data.numel())
    return unflatten_weights(FlatWeights(buffer=data, manifest=specs))


def as_bytes(buffer: torch.Tensor, *, what: str) -> torch.Tensor:
    """A 1-D contiguous tensor of any dtype as its uint8 bytes (a view)."""
    if not isinstance(buffer, torch.Tensor) or buffer.dim() != 1 or not buffer.is_contiguous():
        got = type(buffer).__name__ if not isinstance(buffer, torch.Tensor) else f"shape {tuple(buffer.shape)}"
        raise ValueError(f"{what}: got {got}, expected a 1-D contiguous tensor")
    return buffer.view(torch.uint8)


def _dtype(name: Any, *, what: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{what}.dtype: got {name!r}, expected a torch dtype name such as 'bfloat16'")
    return dtype


def check_manifest(manifest: Iterable[TensorSpec | Mapping[str, Any]], *, nbytes: int) -> tuple[TensorSpec, ...]:
    """The manifest as `TensorSpec`s, checked against a buffer of `nbytes` bytes; `ValueError` naming the tensor."""
    if isinstance(manifest, (str, bytes, Mapping)) or not isinstance(manifest, Iterable):
        raise ValueError(f"manifest: got {type(manifest).__name__}, expected a sequence of tensor specs")
    specs: list[TensorSpec] = []
    for index, entry in enumerate(manifest):
        if isinstance(entry, Mapping):
            try:
                entry = TensorSpec(**entry)
            except TypeError as error:
                raise ValueError(f"manifest[{index}]: {error}") from None
        if not isinstance(entry, TensorSpec):
            raise ValueError(f"manifest[{index}]: got {type(entry).__name__}, expected a TensorSpec")
        specs.append(entry)
    seen: set[str] = set()
    extents = []
    for index, spec in enumerate(specs):
        what = f"manifest[{index}] ({spec.name!r})"
        if not isinstance(spec.name, str) or not spec.name:
            raise ValueError(f"manifest[{index}].name: got {spec.name!r}, expected a non-empty string")
        if spec.name in seen:
            raise ValueError(f"{what}: the name appears twice")
        seen.add(spec.name)
        if not all(is_int(d) and d >= 0 for d in spec.shape):
            raise ValueError(f"{what}.shape: got {spec.shape!r}, expected non-negative integers")
        size = torch.empty(0, dtype=_dtype(spec.dtype, what=what)).element_size()
        if spec.offset % size:
            raise ValueError(f"{what}.offset: got {spec.offset}, expected a multiple of its element size {size}")
        end = spec.offset + torch.Size(spec.shape).numel() * size
        if end > nbytes:
            raise ValueError(f"{what}: bytes {spec.offset}..{end} lie beyond the buffer ({nbytes} bytes)")
        if end > spec.offset:
            extents.append((spec.offset, end, spec.name))
    extents.sort()
    for (_, end, name), (start, _, other) in itertools.pairwise(extents):
        if start < end:
            raise ValueError(f"manifest: tensors {name!r} and {other!r} overlap (byte {start} < {end})")
    return tuple(specs)


@dataclass(frozen=True, kw_only=True)
class Publication:
    """What a receiver learns before the bytes move: the version, the byte length and the manifest."""

    version: int
    nbytes: int
    manifest: tuple[TensorSpec, ...]

    def to_wire(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "nbytes": self.nbytes,
            "manifest": [dataclasses.asdict(spec) for spec in self.manifest],
        }

    @classmethod
    def from_wire(cls, message: Mapping[str, Any]) -> Publication:
        version, nbytes = message.get("version"), message.get("nbytes")
        for name, value in (("version", version), ("nbytes", nbytes)):
            if not is_int(value) or value < 0:
                raise ValueError(f"publication.{name}: got {value!r}, expected an integer >= 0")
        return cls(version=version, nbytes=nbytes, manifest=check_manifest(message.get("manifest", ()), nbytes=nbytes))


def publication_of(weights: FlatWeights, version: int) -> Publication:
    """The checked publication of `weights` under `version` (the core's side of every transport)."""
    if not isinstance(weights, FlatWeights):
        raise ValueError(f"weights: got {type(weights).__name__}, expected FlatWeights (see flatten_state_dict)")
    if not is_int(version) or version < 0:
        raise ValueError(f"version: got {version!r}, expected an integer >= 0")
    nbytes = as_bytes(weights.buffer, what="weights.buffer").numel()
    return Publication(version=version, nbytes=nbytes, manifest=check_manifest(weights.manifest, nbytes=nbytes))


def check_receiver(publication: Publication, into: torch.Tensor, version: int | None) -> None:
    """A receiver's checks before the bytes move: the version it asked for, and room in its buffer."""
    if version is not None:
        if version < publication.version:
            raise WeightVersionError(
                f"version: asked for {version}, but version {publication.version} replaced it; pull the current one"
            )
        if version > publication.version:
            raise WeightVersionError(f"version: asked for {version}, but the core published {publication.version}")
    room = as_bytes(into, what="into").numel()
    if room < publication.nbytes:
        raise ValueError(f"into: {room} bytes, but version {publication.version} needs {publication.nbytes}")
