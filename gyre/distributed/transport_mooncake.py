"""`WeightTransport` over the Mooncake Transfer Engine (TCP or RDMA): receivers read the core.

Contract
- Every process makes one `MooncakeWeightTransport(store=..., host=..., protocol=..., device_names=...)`: it starts
  a Transfer Engine with the P2P handshake (no metadata server) on `host`, the address peers reach it at (127.0.0.1
  in tests). Its session id is `host:<rpc port>`. Mooncake's data listeners bind all interfaces
  (docs/distributed.md); what gyre opens itself (the store) binds the configured host.
- The link (`engine_start`, a pure plan): Mooncake's (0.3.13) `TransferEngine.initialize(local_hostname,
  metadata_server, protocol, device_name)` does not pick the transport from `protocol` (which picks its memory
  allocator): it lists the RDMA devices whose names are in `device_name` (comma-separated; "" = all), installs RDMA
  if it found any and `MC_FORCE_TCP` is unset, else TCP. So for protocol "tcp" gyre sets `MC_FORCE_TCP=1` while
  `initialize` runs (a host with RDMA NICs still gets TCP, and nobody needs to export the variable); for "rdma" it
  unsets it meanwhile and first asks Mooncake's own discovery (`get_local_topology(device_name=...)`) for the
  devices, and raises `RuntimeError` naming the filter where there are none, where Mooncake would fall back to TCP
  silently. The environment is restored after the call.
- Ran here: TCP on loopback (CPU, no RDMA device); rdma up to the device check, which finds none here. Not run:
  RDMA transfers (no NIC on the machines these tests run on).
- `publish(weights, version)` on the core registers `weights.buffer` (CPU memory) with the engine and posts a
  descriptor (session id, buffer address, byte length, manifest, version) under `<prefix>/current` and
  `<prefix>/v<version>` in `store` (a torch.distributed `Store`, e.g. the job's TCPStore). It returns at once;
  no receiver needs to be present. The core keeps the buffers of the last `keep_versions` publications
  registered and referenced, so a receiver that is still reading one of them reads intact bytes; older ones are
  unregistered, released and their keys deleted. The caller must not change a published buffer in place.
- `pull(into, version=None)` on a receiver reads the current publication (or waits, up to `timeout_s`, for
  `version` to be published) into `into`, registered once with its own engine, in chunks of `chunk_bytes`.
  Asking for a version older than the current one raises `WeightVersionError`; so does a read that outlived its
  buffer (`keep_versions` newer publications arrived meanwhile): pull again.
- `import mooncake` fails without Debian's `libibverbs1`, `libnl-3-200`, `libnl-route-3-200`: the constructor
  raises `ImportError` naming them.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gyre.config.trainer import check_mooncake_link
from gyre.distributed.transport import (
    Publication,
    WeightVersionError,
    as_bytes,
    check_receiver,
    publication_of,
)
from gyre.models.flat_weights import FlatWeights

log = logging.getLogger(__name__)

DEBIAN_LIBS = "libibverbs1 libnl-3-200 libnl-route-3-200"
METADATA_SERVER = "P2PHANDSHAKE"  # peers exchange segment descriptors over the engines' RPC port: no etcd
FORCE_TCP_ENV = "MC_FORCE_TCP"  # read by Mooncake (presence, not value) when an engine installs its transport


@dataclass(frozen=True, kw_only=True)
class EngineStart:
    """How one Transfer Engine starts on a link (module docstring, "The link"); `start_engine` carries it out."""

    initialize_args: tuple[str, str, str, str]
    """`TransferEngine.initialize(local_hostname, metadata_server, protocol, device_name)`."""
    force_tcp: bool
    """MC_FORCE_TCP set (True) or unset (False) while the engine starts."""
    device_filter: str | None
    """rdma: the filter `get_local_topology(device_name=...)` must find a device for first; tcp: None (no check)."""


def engine_start(host: str, protocol: str = "tcp", device_names: str = "") -> EngineStart:
    """The plan for an engine on `host` over `protocol` ("tcp" or "rdma") restricted to `device_names` ("" = every
    RDMA device; rdma only). `ConfigError` (a ValueError) naming the argument for anything else."""
    check_mooncake_link("MooncakeWeightTransport", protocol, device_names)
    return EngineStart(
        initialize_args=(host, METADATA_SERVER, protocol, device_names),
        force_tcp=protocol == "tcp",
        device_filter=device_names if protocol == "rdma" else None,
    )


def topology_devices(topology: str) -> list[str]:
    """The RDMA device names in Mooncake's `get_local_topology()` JSON: `{"cpu:0": [[preferred...], [other...]],
    "cuda:0": ...}`, each location's devices in one of its two lists; sorted, each once."""
    parsed = json.loads(topology) if topology.strip() else {}
    if not isinstance(parsed, dict):
        raise ValueError(f"Mooncake topology: got {type(parsed).__name__}, expected a JSON object")
    names: set[str] = set()
    for location, lists in parsed.items():
        if not isinstance(lists, list) or not all(isinstance(group, list) for group in lists):
            raise ValueError(f"Mooncake topology[{location!r}]: got {lists!r}, expected lists of device names")
        names.update(str(name) for group in lists for name in group)
    return sorted(names)


@contextmanager
def _force_tcp(force: bool) -> Iterator[None]:
    """MC_FORCE_TCP set (force) or unset meanwhile, then as it was. Process-wide: engines start one at a time."""
    before = os.environ.get(FORCE_TCP_ENV)
    if before is not None and not force:
        log.warning("%s=%r ignored while the Mooncake engine starts: the config asks for rdma", FORCE_TCP_ENV, before)
    if force:
        os.environ[FORCE_TCP_ENV] = "1"
    else:
        os.environ.pop(FORCE_TCP_ENV, None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(FORCE_TCP_ENV, None)
        else:
            os.environ[FORCE_TCP_ENV] = before


def start_engine(engine, plan: EngineStart) -> None:
    """Carry out `plan` on a new `TransferEngine` (or a stand-in with its `initialize`/`get_local_topology`)."""
    host, _, protocol, device_names = plan.initialize_args
    with _force_tcp(plan.force_tcp):
        if plan.device_filter is not None:
            found = topology_devices(engine.get_local_topology(device_name=plan.device_filter))
            if not found:
                which = f"named in {plan.device_filter!r}" if plan.device_filter else "at all"
                raise RuntimeError(
                    f"protocol rdma: Mooncake finds no RDMA device {which} on this host (it would fall back to TCP); "
                    "check `ibv_devices`, trainer.mooncake.device_names, or use trainer.mooncake.protocol=tcp"
                )
            log.info("Mooncake RDMA devices: %s", ",".join(found))
        code = engine.initialize(*plan.initialize_args)
    if code != 0:
        raise RuntimeError(
            f"Mooncake TransferEngine.initialize({host!r}, {METADATA_SERVER}, {protocol!r}, {device_names!r}) "
            f"returned {code}"
        )


def import_transfer_engine():
    """Mooncake's `TransferEngine` class, or an ImportError that says what to install."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as error:
        raise ImportError(
            f"the Mooncake transport needs `pip install mooncake-transfer-engine-non-cuda` (CPU) or "
            f"`mooncake-transfer-engine` (CUDA) and Debian's {DEBIAN_LIBS}: {error}"
        ) from error
    return TransferEngine


class MooncakeWeightTransport:
    """Pull-based transport: the core posts descriptors in a store, receivers read its registered buffer."""

    def __init__(
        self,
        *,
        store: dist.Store,
        host: str,
        prefix: str = "gyre/weights",
        protocol: str = "tcp",  # or "rdma" (module docstring, "The link")
        device_names: str = "",  # rdma: the RDMA devices to use, "mlx5_0,mlx5_1" ("" = every one found)
        keep_versions: int = 2,
        chunk_bytes: int = 64 << 20,
        timeout_s: float = 120.0,
    ):
        if keep_versions < 1:
            raise ValueError(f"keep_versions: got {keep_versions}, expected >= 1")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes: got {chunk_bytes}, expected >= 1")
        plan = engine_start(host, protocol, device_names)
        self.store, self.prefix, self.keep_versions = store, prefix, keep_versions
        self.chunk_bytes, self.timeout_s, self.protocol = chunk_bytes, timeout_s, protocol
        self._engine = import_transfer_engine()()
        start_engine(self._engine, plan)
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self._published: OrderedDict[int, torch.Tensor] = OrderedDict()  # version -> buffer kept registered
        self._registered: dict[int, torch.Tensor] = {}  # address -> receiving buffer registered with the engine
        self._last_version: int | None = None

    # ------------------------------------------------------------------ core side

    def publish(self, weights: FlatWeights, version: int) -> None:
        publication = publication_of(weights, version)
        if self._last_version is not None and version <= self._last_version:
            raise WeightVersionError(f"version: got {version}, expected > the last published {self._last_version}")
        buffer = as_bytes(weights.buffer, what="weights.buffer")
        if buffer.device.type != "cpu":
            raise ValueError(f"weights.buffer: on {buffer.device}; the Mooncake transport registers CPU memory")
        if not any(kept.data_ptr() == buffer.data_ptr() for kept in self._published.values()):
            self._register(buffer)
        self._published[version] = buffer
        descriptor = {**publication.to_wire(), "session": self.session_id, "address": buffer.data_ptr()}
        encoded = json.dumps(descriptor).encode()
        self.store.set(self._key(version), encoded)
        self.store.set(self._key(None), encoded)
        self._last_version = version
        while len(self._published) > self.keep_versions:
            old_version, old = self._published.popitem(last=False)
            self.store.delete_key(self._key(old_version))
            if not any(kept.data_ptr() == old.data_ptr() for kept in self._published.values()):
                self._unregister(old)

    # ------------------------------------------------------------------ receiver side

    def pull(self, into: torch.Tensor, *, version: int | None = None) -> tuple[FlatWeights, int]:
        descriptor = self._descriptor(version)
        publication = Publication.from_wire(descriptor)
        check_receiver(publication, into, version)
        data = as_bytes(into, what="into")
        if data.device.type != "cpu":
            raise ValueError(f"into: on {data.device}; the Mooncake transport registers CPU memory")
        if publication.nbytes:
            self._ensure_registered(data)
            self._read(str(descriptor["session"]), int(descriptor["address"]), data, publication.nbytes)
        current = self._current()
        if current is not None and current["version"] >= publication.version + self.keep_versions:
            raise WeightVersionError(
                f"version {publication.version} was released while it was read (current: {current['version']}); "
                "pull again"
            )
        return FlatWeights(buffer=data[: publication.nbytes], manifest=publication.manifest), publication.version

    def _descriptor(self, version: int | None) -> dict:
        current = self._current()
        if version is None or (current is not None and current["version"] >= version):
            if current is None:
                current = self._wait(self._key(None))
            if version is not None and current["version"] > version:
                raise WeightVersionError(
                    f"version: asked for {version}, but version {current['version']} replaced it; pull the current one"
                )
            return current
        return self._wait(self._key(version))

    def _current(self) -> dict | None:
        key = self._key(None)
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def _wait(self, key: str) -> dict:
        try:
            self.store.wait([key], datetime.timedelta(seconds=self.timeout_s))
        except dist.DistStoreError as error:
            raise TimeoutError(f"no publication under {key!r} within {self.timeout_s:.0f} s: {error}") from None
        return json.loads(self.store.get(key))

    def _read(self, session: str, address: int, data: torch.Tensor, nbytes: int) -> None:
        starts = range(0, nbytes, self.chunk_bytes)
        lengths = [min(self.chunk_bytes, nbytes - start) for start in starts]
        code = self._engine.batch_transfer_sync_read(
            session, [data.data_ptr() + s for s in starts], [address + s for s in starts], lengths
        )
        if code != 0:
            raise RuntimeError(f"Mooncake read of {nbytes} bytes from {session} returned {code}")

    def _ensure_registered(self, data: torch.Tensor) -> None:
        address = data.data_ptr()
        held = self._registered.get(address)
        if held is not None and held.numel() >= data.numel():
            return
        for old in list(self._registered.values()):  # a receiver keeps one buffer registered: its latest
            self._unregister(old)
        self._registered.clear()
        self._register(data)
        self._registered[address] = data

    # ------------------------------------------------------------------ both

    def _register(self, buffer: torch.Tensor) -> None:
        if buffer.numel() == 0:
            return
        code = self._engine.register_memory(buffer.data_ptr(), buffer.numel())
        if code != 0:
            raise RuntimeError(f"Mooncake register_memory of {buffer.numel()} bytes returned {code}")

    def _unregister(self, buffer: torch.Tensor) -> None:
        if buffer.numel() == 0:
            return
        code = self._engine.unregister_memory(buffer.data_ptr())
        if code != 0:
            log.warning("Mooncake unregister_memory at %#x returned %d", buffer.data_ptr(), code)

    def _key(self, version: int | None) -> str:
        return f"{self.prefix}/current" if version is None else f"{self.prefix}/v{version}"

    def close(self) -> None:
        """Unregister every buffer; the engine's threads end with the process."""
        for buffer in [*self._published.values(), *self._registered.values()]:
            self._unregister(buffer)
        self._published.clear()
        self._registered.clear()
