"""Which torch.distributed backend each of the job's groups uses, from where the cells compute (pure: no torch).

`choose_backends(device_kinds, local_rank=, visible_gpus=)` (docs/distributed.md, "Backends"):

- every cell on the CPU (`engine.device` and `trainer.device` both `cpu`): gloo for everything, no device;
- cells on CUDA: the default group and the data groups (cells, prefix sums, Megatron's TP/PP/DP groups, which
  Megatron creates with the default backend) are `cpu:gloo,cuda:nccl`: a CUDA tensor (gradients, weights,
  activations between stages) goes over NCCL, a CPU tensor over gloo, so no collective has to know where its
  tensor lives. The control group stays gloo alone: decisions and small objects travel as CPU tensors, and a
  gloo group never waits on a GPU stream. `device_index` is this rank's GPU (`init_process_group(device_id=)`
  binds the NCCL communicator to it eagerly).

A rank's GPU is `local_gpu`: 0 when it sees one GPU (srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES set per
rank), else its local rank (torchrun: every rank sees the node's GPUs). `BackendError` when it sees none or fewer
than its local rank needs: one line a user can act on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "CONTROL_BACKEND",
    "MIXED_BACKEND",
    "BackendError",
    "Backends",
    "cell_engine_gpus",
    "choose_backends",
    "local_gpu",
]

CONTROL_BACKEND = "gloo"
MIXED_BACKEND = "cpu:gloo,cuda:nccl"


class BackendError(ValueError):
    """The devices asked for are not there (a launch mistake, said in one line)."""


@dataclass(frozen=True)
class Backends:
    default: str  # init_process_group's backend
    data: str  # cell and prefix groups (Megatron's take the default's)
    control: str = CONTROL_BACKEND
    device_index: int | None = None  # this rank's CUDA device; None on the CPU

    @property
    def uses_nccl(self) -> bool:
        return "nccl" in self.default


def local_gpu(local_rank: int, visible: int) -> int:
    """The CUDA device index of the rank with `local_rank` on its node, where it sees `visible` GPUs (module
    docstring)."""
    if visible == 1:
        return 0
    if 0 <= local_rank < visible:
        return local_rank
    raise BackendError(
        f"LOCAL_RANK={local_rank}: this rank sees {visible} GPU{'s' if visible != 1 else ''}; run one rank per GPU "
        "(torchrun --nproc-per-node at most the node's GPUs; srun --gpus-per-task=1)"
    )


def cell_engine_gpus(leader_gpu: int, cell_size: int, visible: int) -> int:
    """The first GPU of a cell's SGLang engine, which its leader starts with `tp_size` = the cell's size on the
    cell's GPUs: `cell_size` consecutive devices from the leader's own, all visible to the leader (docs/sglang.md,
    "In the training program"). `BackendError` where the cell's GPUs are not the leader's to use."""
    if leader_gpu + cell_size <= visible:
        return leader_gpu
    raise BackendError(
        f"engine.backend=sglang with cluster.cell_size={cell_size}: the cell's leader (GPU {leader_gpu}) sees "
        f"{visible} GPU{'s' if visible != 1 else ''}, and its SGLang engine runs on the cell's {cell_size} GPUs from "
        "its own on; launch so that each rank sees its node's GPUs (torchrun; srun --gpus-per-node instead of "
        "--gpus-per-task=1) and a node's GPUs hold whole cells (ranks per node a multiple of cluster.cell_size)"
    )


def choose_backends(device_kinds: Iterable[str], *, local_rank: int, visible_gpus: int) -> Backends:
    """The backends of this rank's groups when its cells compute on `device_kinds` ("cpu" / "cuda": the engine's
    and the trainer's), with `visible_gpus` CUDA devices visible to it (module docstring)."""
    kinds = set(device_kinds)
    unknown = kinds - {"cpu", "cuda"}
    if unknown:
        raise BackendError(f"device kinds {sorted(unknown)}: expected cpu or cuda")
    if "cuda" not in kinds:
        return Backends(default="gloo", data="gloo")
    if kinds != {"cuda"}:
        raise BackendError(
            "engine.device and trainer.device must be the same kind: a cell swaps between its engine and its trainer "
            "in one process"
        )
    return Backends(default=MIXED_BACKEND, data=MIXED_BACKEND, device_index=local_gpu(local_rank, visible_gpus))
