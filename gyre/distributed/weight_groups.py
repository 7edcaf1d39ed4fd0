"""A process group outside the job's, between rank 0 and one SGLang engine's tensor-parallel workers, over which
rank 0 broadcasts a publication (SGLang's `init_weights_update_group` / `update_weights_from_distributed`;
docs/sglang.md, "Publications").

SGLang's workers join it with `sglang.srt.utils.init_custom_process_group(backend, init_method=tcp://address:port,
world_size, rank=rank_offset + tp_rank, group_name)`: a TCP rendezvous whose store rank 0 serves, prefixed by the
group's name, and torch's `_new_process_group_helper` under that name. `open_weight_group` is rank 0's side of the
same, as group rank 0: it serves the store (`WeightGroupStore`, made first so that its port can be sent to the
engine) and then builds the group, which returns once every worker joined. `broadcast_weights` sends a publication
as SGLang receives it: one broadcast from rank 0 per tensor, in the order of the names sent with
`update_weights_from_distributed`.

This module reaches into `torch.distributed.distributed_c10d` (`_new_process_group_helper`, `_world`), as SGLang
does: the only way to build a group beside the job's default one.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable

import torch
from torch import distributed as dist

__all__ = ["WeightGroupStore", "broadcast_weights", "open_weight_group"]


class WeightGroupStore:
    """Rank 0's rendezvous store of one weight group, listening on `host` (a free port: `port`)."""

    def __init__(self, host: str, world_size: int, *, timeout_s: float):
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.host, self.world_size = host, world_size
        self.store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False, timeout=self.timeout)
        self.port = self.store.port


def open_weight_group(store: WeightGroupStore, *, backend: str, group_name: str):
    """Rank 0's side of the group `group_name` (module docstring): blocks until every worker joined, or raises
    after the store's timeout."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    prefixed = PrefixStore(group_name, store.store)
    group, _ = _new_process_group_helper(
        store.world_size,
        0,
        [],
        Backend(backend),
        prefixed,
        group_name=group_name,
        backend_options=None,
        timeout=store.timeout,
    )
    # A broadcast names its source by global rank: in this group, rank r is global rank r (as SGLang sets it).
    _world.pg_group_ranks[group] = {rank: rank for rank in range(store.world_size)}
    return group


def broadcast_weights(group, named: Iterable[tuple[str, torch.Tensor]], *, device: torch.device | None = None) -> int:
    """Broadcast every tensor of `named` from rank 0 over `group`, in order (moved to `device` first: the GPU for an
    NCCL group); the bytes sent."""
    sent = 0
    for _, tensor in named:
        tensor = tensor.detach().contiguous()
        if device is not None and tensor.device != device:
            tensor = tensor.to(device)
        dist.broadcast(tensor, src=0, group=group)
        sent += tensor.numel() * tensor.element_size()
    return sent
