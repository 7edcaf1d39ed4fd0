"""`start_proxy`: the proxy alone (chat template, sessions, server) over a routing table its caller owns.

The serving stack (`gyre.serve.stack`), the training runtime's controller and each proxy shard process
(`gyre.proxy.shard`) start their proxy with it; the caller adds and drops engines on the table (the runtime as cells
change roles). It reads the model's `config.json` (vocabulary, context limit) with `gyre.models.decoder_config`
(stdlib) and the chat template from the same directory, so starting a proxy loads no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gyre.config.proxy import ProxyConfig
from gyre.models.decoder_config import read_config
from gyre.proxy.render import ChatTemplate, PayloadCache, PromptBuilder
from gyre.proxy.routing import RoutingTable
from gyre.proxy.server import ProxyServer
from gyre.proxy.sessions import SessionRegistry


async def start_proxy(
    config: ProxyConfig,
    *,
    model_dir: str | Path,
    table: RoutingTable,
    records_dir: str | Path | None,
    template=None,  # gyre.proxy.render.ChatTemplate; loaded from model_dir when None
    admin_key: str | None = None,  # a random one when None
    before_start: Callable[[ProxyServer, SessionRegistry], None] | None = None,  # e.g. adds routes
) -> tuple[ProxyServer, SessionRegistry]:
    """The proxy over `table` (engines added and dropped by the caller), with its sessions writing `records_dir`.

    Reads the model's config.json (vocabulary, context limit) and chat template; started and serving on return."""
    model_config = read_config(model_dir)
    template = template if template is not None else ChatTemplate.from_pretrained(model_dir)
    registry = SessionRegistry(
        vocab_size=model_config.vocab_size,
        make_builder=lambda payload: PromptBuilder(template, payload),
        make_payload_cache=PayloadCache,
        records_dir=records_dir,
    )
    proxy = ProxyServer(
        config,
        template=template,
        registry=registry,
        table=table,
        context_limit=model_config.max_position_embeddings,
        admin_key=admin_key,
    )
    if before_start is not None:
        before_start(proxy, registry)
    await proxy.start()
    return proxy, registry
