"""The routing a mixture-of-experts trainer replays: what a micro-step carries and how a trainer reads it.

Contract (docs/moe.md): a `MicroStep` of a MoE run carries `routed_experts_ULK`, integer `[U, num_hidden_layers,
top_k]` aligned with `ids_U`: row u holds, for every layer, the expert ids the rollout's engine chose for token u
when it fed that token to the model (the shared model's `routed_experts_BTLK` and SGLang's `return_routed_experts`
layout). Entries of layers without experts are ignored (SGLang and the shared model write -1 there). A token the
engine never fed (a row's last, sampled token) holds `NO_ROUTE` (-1) at every layer: its hidden state feeds no
log-prob, and the Megatron trainer lets its router choose. Concatenating the rows' routing in packing order gives
the micro-step's. Pure: numpy only.
"""

from __future__ import annotations

import logging

import numpy as np

__all__ = ["NO_ROUTE", "step_routes"]

log = logging.getLogger(__name__)

NO_ROUTE = -1  # a token's expert ids at a layer when the engine did not route it (the router's own top-k)


def step_routes(step, config) -> np.ndarray:
    """A micro-step's recorded routing for replay: its `routed_experts_ULK` (module docstring). A micro-step of rows
    none of whose calls kept routing (every call hung up mid-stream, or an engine's routing was refused) has none:
    then every token is `NO_ROUTE`, so the routers choose, as they do for any token no call routed, with a warning
    (rows with routing never reach this: they fill gaps with -1 themselves). `config`: the model's `DecoderConfig`."""
    routes = getattr(step, "routed_experts_ULK", None)
    if routes is None:
        log.warning(
            "trainer.routing_replay=true but micro-step %d of batch %d carries no routed experts: its %d tokens are "
            "routed by the trainer's own routers",
            step.index,
            step.batch,
            step.num_tokens,
        )
        return np.full((step.num_tokens, config.num_hidden_layers, config.num_experts_per_tok), NO_ROUTE, np.int16)
    return np.asarray(routes)
