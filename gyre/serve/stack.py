"""The serving stack of `gyre.serve`: chat template, engines, routing table, sessions and the proxy, wired.

The embedded engine runs on its own thread and event loop behind the engine endpoint (the layout of a cell
leader in the SPMD job); the proxy reaches it, and any `engine_urls`, through `RemoteEngine`.

The proxy half alone (template, sessions, server over a routing table the caller owns) is
`gyre.proxy.start.start_proxy`, which this stack, the training runtime's controller and the proxy shards run.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from gyre.config.serve import ServeConfig
from gyre.engine.endpoint import ServerThread
from gyre.engine.remote import RemoteEngine
from gyre.proxy.routing import RoutingTable
from gyre.proxy.server import ProxyServer
from gyre.proxy.sessions import SessionRegistry
from gyre.proxy.start import start_proxy

log = logging.getLogger(__name__)


@dataclass
class ServeStack:
    proxy: ProxyServer
    registry: SessionRegistry
    table: RoutingTable
    remotes: list[RemoteEngine]
    engine_thread: ServerThread | None

    async def close(self) -> None:
        await self.proxy.stop()
        self.registry.close_all()
        for remote in self.remotes:
            await remote.close()
        if self.engine_thread is not None:
            await asyncio.to_thread(self.engine_thread.stop)


def resolve_model_dir(model_dir: str) -> Path:
    if model_dir:
        return Path(model_dir)
    from gyre.models.tiny import tiny_model_dir

    return tiny_model_dir()


async def build_stack(cfg: ServeConfig, *, records_dir: str | Path | None) -> ServeStack:
    """Load the template and model, start the engine(s) and the proxy. Bad model dir or address: ValueError/OSError."""
    import torch

    from gyre.engine.native import NativeEngine
    from gyre.models.decoder_config import read_config
    from gyre.models.hf_weights import load_pretrained
    from gyre.proxy.render import ChatTemplate

    model_dir = resolve_model_dir(cfg.model_dir)
    read_config(model_dir)  # a directory without config.json is named as such before anything else is read
    template = ChatTemplate.from_pretrained(model_dir)
    remotes: list[RemoteEngine] = []
    table = RoutingTable()
    thread = None
    if cfg.engine.enabled:
        dtype = getattr(torch, cfg.engine.dtype)
        model = await asyncio.to_thread(load_pretrained, model_dir, dtype, cfg.engine.device)
        thread = ServerThread(
            lambda: NativeEngine(
                model,
                max_running=cfg.engine.max_running,
                max_tokens_in_flight=cfg.engine.max_total_tokens or None,
                policy_version=cfg.engine.policy_version,
            )
        )
        url = await asyncio.to_thread(thread.start)
        remotes.append(await RemoteEngine.connect(url))
        table.add_engine("embedded", remotes[-1])
    try:
        for index, url in enumerate(cfg.engine_urls):
            remotes.append(await RemoteEngine.connect(url))
            table.add_engine(f"external-{index}", remotes[-1])
        proxy, registry = await start_proxy(
            cfg.proxy, model_dir=model_dir, table=table, records_dir=records_dir, template=template
        )
    except BaseException:
        for remote in remotes:
            await remote.close()
        if thread is not None:
            await asyncio.to_thread(thread.stop)
        raise
    return ServeStack(proxy=proxy, registry=registry, table=table, remotes=remotes, engine_thread=thread)
