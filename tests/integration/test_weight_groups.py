"""gyre.distributed.weight_groups: rank 0's side of a weight group against workers that join it as SGLang's do
(`init_custom_process_group`: a TCP rendezvous at rank 0's address, the store prefixed by the group's name, torch's
`_new_process_group_helper` under that name), each in its own process as SGLang's tensor-parallel workers are, with
gloo on the CPU (NCCL on GPUs is the GPU check's). Rank 0 broadcasts a publication tensor by tensor; every worker
receives it bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from torch import distributed as dist

from gyre.distributed.local import HOST
from gyre.distributed.weight_groups import WeightGroupStore, broadcast_weights, open_weight_group

WORKER = """
import datetime, hashlib, json, os, sys
import torch
from torch import distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

address, port, rank, world_size, name, specs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \\
    sys.argv[5], json.loads(sys.argv[6])
timeout = datetime.timedelta(seconds=60)
store, rank, world_size = next(rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout))
store.set_timeout(timeout)
group, _ = _new_process_group_helper(
    world_size, rank, [], Backend("gloo"), PrefixStore(name, store), group_name=name, backend_options=None,
    timeout=timeout,
)
_world.pg_group_ranks[group] = {r: r for r in range(world_size)}
digests = {}
for weight_name, dtype, shape in specs:
    tensor = torch.empty(shape, dtype=getattr(torch, dtype))
    dist.broadcast(tensor, src=0, group=group)
    digests[weight_name] = hashlib.sha256(tensor.view(torch.uint8).numpy().tobytes()).hexdigest()
print(json.dumps(digests), flush=True)
# Leave without finalization (as gyre.distributed.local's ranks do): a gloo group torn down while a peer closes its
# side aborted a worker with "terminate called without an active exception" about once in 10 runs under load.
os._exit(0)
"""


def digest(tensor: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def test_workers_joined_as_sglangs_receive_rank_0s_broadcasts_exactly():
    generator = torch.Generator().manual_seed(0)
    named = {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=generator).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=generator),
        "model.norm.weight": torch.ones(16),
    }
    specs = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in named.items()]
    tp_size = 2
    store = WeightGroupStore(HOST, 1 + tp_size, timeout_s=60)
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                WORKER,
                HOST,
                str(store.port),
                str(1 + r),
                str(1 + tp_size),
                "g0",
                json.dumps(specs),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(tp_size)
    ]
    group = None
    try:
        group = open_weight_group(store, backend="gloo", group_name="g0")
        sent = broadcast_weights(group, list(named.items()))
        outputs = [worker.communicate(timeout=60) for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
        if group is not None:  # out of torch's registry: a later test in this process builds the job's groups
            dist.destroy_process_group(group)
    assert group not in dist.distributed_c10d._world.pg_names
    assert all(worker.returncode == 0 for worker in workers), [err[-2000:] for _, err in outputs]
    expected = {name: digest(t) for name, t in named.items()}
    assert [json.loads(out) for out, _ in outputs] == [expected, expected]
    assert sent == sum(t.numel() * t.element_size() for t in named.values())
