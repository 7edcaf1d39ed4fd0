"""The one-sided weight transport for satellites joining a step in flight: Mooncake where it imports, else the store.

`one_sided_transport(store, kind=...)` builds a `WeightTransport` (`gyre.distributed.transport`) receivers pull from at
their own pace: `MooncakeWeightTransport` (`transport_mooncake`) or `StoreWeightTransport` (`transport_store`). The
factory lives here, apart from the protocol, so the implementations import the protocol and nothing imports back.
"""

from __future__ import annotations

import logging

from gyre.config.trainer import MooncakeConfig
from gyre.distributed.transport import WeightTransport

log = logging.getLogger(__name__)

ONE_SIDED_KINDS = ("auto", "mooncake", "store")


def one_sided_transport(
    store,
    *,
    kind: str = "auto",
    host: str = "127.0.0.1",
    prefix: str = "gyre/weights",
    timeout_s: float = 120.0,
    mooncake: MooncakeConfig | None = None,
) -> WeightTransport:
    """A transport receivers pull from at their own pace, for satellites that join a step in flight.

    kind "mooncake": `MooncakeWeightTransport` over `store` on `host` (the address peers reach this rank at), on the
    link `mooncake` says (`trainer.mooncake`: protocol tcp or rdma, RDMA device names; default TCP); ImportError
    naming what to install when `mooncake` does not import. kind "store": `StoreWeightTransport` through `store`.
    kind "auto": Mooncake where it imports, else the store snapshot. Every rank of the job makes one with the same
    kind, prefix, link and store (each its own client); the core publishes, joiners pull."""
    if kind not in ONE_SIDED_KINDS:
        raise ValueError(f"kind: got {kind!r}, expected one of {', '.join(ONE_SIDED_KINDS)}")
    if mooncake is None:
        mooncake = MooncakeConfig()
    if not isinstance(mooncake, MooncakeConfig):
        raise ValueError(f"mooncake: got {type(mooncake).__name__}, expected a MooncakeConfig (trainer.mooncake)")
    if kind != "store":
        from gyre.distributed.transport_mooncake import MooncakeWeightTransport, import_transfer_engine

        try:
            import_transfer_engine()
        except ImportError as error:
            if kind == "mooncake":
                raise
            log.info("weights for joiners go through the store: %s", error)
        else:
            return MooncakeWeightTransport(
                store=store,
                host=host,
                prefix=prefix,
                timeout_s=timeout_s,
                protocol=mooncake.protocol,
                device_names=mooncake.device_names,
            )
    from gyre.distributed.transport_store import StoreWeightTransport

    return StoreWeightTransport(store, prefix=prefix, timeout_s=timeout_s)
