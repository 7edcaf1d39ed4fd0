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

import numpy as np

__all__ = ["NO_ROUTE", "step_routes"]

NO_ROUTE = -1  # a token's expert ids at a layer when the engine did not route it (the router's own top-k)


def step_routes(step) -> np.ndarray:
    """A micro-step's recorded routing for replay: its `routed_experts_ULK` (module docstring). ValueError when it
    has none: a trainer that replays routes must not fall back to its own routers silently."""
    routes = getattr(step, "routed_experts_ULK", None)
    if routes is None:
        raise ValueError(
            f"trainer.routing_replay=true but micro-step {step.index} of batch {step.batch} carries no routed experts "
            "(routed_experts_ULK): the rollout's engine must record each token's experts"
        )
    return np.asarray(routes)
