"""`WeightTransport` through the job's key-value store (its TCPStore): the one-sided fallback where Mooncake is absent.

Role: satellites joining a step in flight pull the core's weights while the core trains (docs/training.md, the
streaming step). `MooncakeWeightTransport` reads the core's registered buffer; where `mooncake` does not import,
this transport carries a snapshot of it through a `torch.distributed.Store` every rank already reaches. Same
protocol (`gyre.distributed.transport.WeightTransport`), same checks, same errors.

Contract
- `publish(weights, version)` on the core copies `weights.buffer` into the store as chunks of `chunk_bytes` under
  `<prefix>/v<version>/<i>`, then the publication (version, byte length, manifest, chunk size and count) under
  `<prefix>/v<version>`, then the same under `<prefix>/current`, and returns: no receiver needs to be present. It
  is a snapshot: the core may change its parameters right after `publish` returns.
- A version's keys are written once and never overwritten. The core keeps the last `keep_versions` versions and
  deletes older ones (descriptor first, then chunks). So a pull reads the chunks of one version only: it returns
  that version's bytes whole, or raises `WeightVersionError` when the version was released during the read (pull
  again); it never mixes two versions.
- `pull(into, version=None)` on a receiver reads the current version, or waits up to `timeout_s` for `version` to
  be published; a version older than the current one raises `WeightVersionError` (`check_receiver`). `into` may
  live on any device (chunks go through host memory).
- Each process makes its own instance over its own store client (a client is used by one thread at a time).
- Chunks: TCPStore's libuv backend drops a client that sends a value over 8 MiB, so `chunk_bytes` is at most
  `STORE_VALUE_MAX_BYTES`. The store server (on rank 0) holds `keep_versions` copies of the published bytes:
  this is for small models and CPU runs; clusters use Mooncake (docs/distributed.md has measured rates).
"""

from __future__ import annotations

import datetime
import json

import numpy as np
import torch
import torch.distributed as dist

from gyre.config.checks import is_int
from gyre.distributed.claims import STORE_VALUE_MAX_BYTES
from gyre.distributed.transport import Publication, WeightVersionError, as_bytes, check_receiver, publication_of
from gyre.models.flat_weights import FlatWeights

__all__ = ["StoreWeightTransport"]

_MISSING = b"gyre:missing-key"  # compare_set's answer for a key that is not there (see _get_now)


class StoreWeightTransport:
    """Snapshot transport: the core writes versioned chunks into `store`, receivers read them when they want."""

    def __init__(
        self,
        store: dist.Store,
        *,
        prefix: str = "gyre/weights",
        keep_versions: int = 2,
        chunk_bytes: int = 1 << 20,
        timeout_s: float = 120.0,
    ) -> None:
        if not is_int(keep_versions) or keep_versions < 1:
            raise ValueError(f"keep_versions: got {keep_versions!r}, expected an integer >= 1")
        if not is_int(chunk_bytes) or not 1 <= chunk_bytes <= STORE_VALUE_MAX_BYTES:
            raise ValueError(
                f"chunk_bytes: got {chunk_bytes!r}, expected 1 .. {STORE_VALUE_MAX_BYTES} (the store's largest value)"
            )
        if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ValueError(f"timeout_s: got {timeout_s!r}, expected seconds > 0")
        self.store, self.prefix, self.keep_versions = store, prefix, keep_versions
        self.chunk_bytes, self.timeout_s = chunk_bytes, float(timeout_s)
        self._published: list[tuple[int, int]] = []  # (version, chunk count) still in the store, oldest first
        self._last_version: int | None = None

    # ------------------------------------------------------------------ core side

    def publish(self, weights: FlatWeights, version: int) -> None:
        publication = publication_of(weights, version)
        if self._last_version is not None and version <= self._last_version:
            raise WeightVersionError(f"version: got {version}, expected > the last published {self._last_version}")
        data = as_bytes(weights.buffer, what="weights.buffer").detach().cpu().numpy()
        starts = range(0, publication.nbytes, self.chunk_bytes)
        for i, start in enumerate(starts):
            self.store.set(self._chunk_key(version, i), data[start : start + self.chunk_bytes].tobytes())
        descriptor = {**publication.to_wire(), "chunk_bytes": self.chunk_bytes, "chunks": len(starts)}
        encoded = json.dumps(descriptor).encode()
        self.store.set(self._key(version), encoded)
        self.store.set(self._key(None), encoded)
        self._published.append((version, len(starts)))
        self._last_version = version
        while len(self._published) > self.keep_versions:
            self._delete(*self._published.pop(0))

    # ------------------------------------------------------------------ receiver side

    def pull(self, into: torch.Tensor, *, version: int | None = None) -> tuple[FlatWeights, int]:
        descriptor = self._descriptor(version)
        publication = Publication.from_wire(descriptor)
        check_receiver(publication, into, version)
        data, nbytes = as_bytes(into, what="into"), publication.nbytes
        chunk_bytes, chunks = descriptor.get("chunk_bytes"), descriptor.get("chunks")
        if not (is_int(chunk_bytes) and chunk_bytes > 0 and is_int(chunks) and chunks * chunk_bytes >= nbytes):
            raise ValueError(f"publication {publication.version}: chunk_bytes {chunk_bytes!r}, chunks {chunks!r}")
        for i in range(chunks):
            chunk = self._get_now(self._chunk_key(publication.version, i))
            if chunk is None:
                current = self._get_now(self._key(None))
                now = json.loads(current)["version"] if current is not None else None
                raise WeightVersionError(
                    f"version {publication.version} was released while it was read (current: {now}); pull again"
                )
            start = i * chunk_bytes
            expected = min(chunk_bytes, publication.nbytes - start)
            if len(chunk) != expected:
                raise ValueError(f"publication {publication.version}: chunk {i} has {len(chunk)} bytes, not {expected}")
            source = np.frombuffer(chunk, dtype=np.uint8)
            if data.device.type == "cpu":
                data[start : start + expected].numpy()[:] = source
            else:
                data[start : start + expected].copy_(torch.from_numpy(source.copy()))
        return FlatWeights(buffer=data[: publication.nbytes], manifest=publication.manifest), publication.version

    def _descriptor(self, version: int | None) -> dict:
        current = self._get_now(self._key(None))
        if current is not None:
            descriptor = json.loads(current)
            if version is None or descriptor["version"] >= version:
                return descriptor  # an older ask is refused by check_receiver
        key = self._key(None) if version is None else self._key(version)
        try:
            self.store.wait([key], datetime.timedelta(seconds=self.timeout_s))
        except (RuntimeError, TimeoutError) as error:  # torch's DistStoreError is a RuntimeError
            raise TimeoutError(f"no publication under {key!r} within {self.timeout_s:g} s: {error}") from None
        found = self._get_now(key)
        if found is None:  # published and already released meanwhile: the current one answers
            return self._descriptor(None)
        return json.loads(found)

    def _get_now(self, key: str) -> bytes | None:
        """The value under `key`, or None when it is missing, without waiting: `Store.get` waits for a missing key
        until the store's timeout. `compare_set` with an expected value that is never stored returns the value
        when the key exists and the expected value (setting nothing) when it does not."""
        value = self.store.compare_set(key, _MISSING, _MISSING)
        return None if value == _MISSING else value

    # ------------------------------------------------------------------ both

    def _delete(self, version: int, chunks: int) -> None:
        self.store.delete_key(self._key(version))
        for i in range(chunks):
            self.store.delete_key(self._chunk_key(version, i))

    def _key(self, version: int | None) -> str:
        return f"{self.prefix}/current" if version is None else f"{self.prefix}/v{version}"

    def _chunk_key(self, version: int, index: int) -> str:
        return f"{self.prefix}/v{version}/{index}"

    def close(self) -> None:
        """Core: delete every version this instance published (a receiver still reading gets WeightVersionError);
        receivers: nothing to release."""
        for version, chunks in self._published:
            self._delete(version, chunks)
        if self._published:
            self.store.delete_key(self._key(None))
        self._published.clear()
