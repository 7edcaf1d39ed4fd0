"""gyre.distributed.backends: gloo on CPU cells; on CUDA cells `cpu:gloo,cuda:nccl` for the default and data
groups with the rank's own GPU, the control group gloo alone; a missing GPU is one line. The job's group
creation gives each kind its backend, on CPU and on a CUDA layout (torch.distributed and the device count
mocked: no GPU here; the real NCCL groups are the GPU check's)."""

from __future__ import annotations

import types

import pytest

from gyre.config import TrainConfig
from gyre.config.engine import EngineConfig
from gyre.config.trainer import TrainerConfig
from gyre.distributed import groups as groups_module
from gyre.distributed.backends import MIXED_BACKEND, BackendError, Backends, choose_backends
from gyre.distributed.layout import Layout
from gyre.runtime.job import spmd as job_module
from gyre.runtime.job.launch import LaunchError


def test_cpu_cells_use_gloo_everywhere_and_no_device():
    chosen = choose_backends(("cpu", "cpu"), local_rank=3, visible_gpus=0)
    assert chosen == Backends(default="gloo", data="gloo", control="gloo", device_index=None)
    assert not chosen.uses_nccl


@pytest.mark.parametrize(
    ("local_rank", "visible", "device"),
    [(0, 8, 0), (5, 8, 5), (7, 8, 7), (3, 1, 0)],  # torchrun sees the node's GPUs; srun --gpus-per-task=1 sees one
)
def test_cuda_cells_use_nccl_for_cuda_tensors_on_the_ranks_own_gpu(local_rank, visible, device):
    chosen = choose_backends(("cuda", "cuda"), local_rank=local_rank, visible_gpus=visible)
    assert chosen.default == chosen.data == MIXED_BACKEND == "cpu:gloo,cuda:nccl"
    assert chosen.control == "gloo" and chosen.device_index == device and chosen.uses_nccl


@pytest.mark.parametrize(
    ("kinds", "local_rank", "visible", "message"),
    [
        (("cuda", "cuda"), 0, 0, "LOCAL_RANK=0: this rank sees 0 GPUs"),
        (("cuda", "cuda"), 4, 4, "LOCAL_RANK=4: this rank sees 4 GPUs"),
        (("cuda", "cpu"), 0, 8, "must be the same kind"),
        (("cuda", "xla"), 0, 8, r"device kinds \['xla'\]"),
    ],
)
def test_devices_that_are_not_there_are_one_line(kinds, local_rank, visible, message):
    with pytest.raises(BackendError, match=message):
        choose_backends(kinds, local_rank=local_rank, visible_gpus=visible)


def cuda_config() -> TrainConfig:
    return TrainConfig(engine=EngineConfig(device="cuda"), trainer=TrainerConfig(device="cuda"))


def test_the_job_reads_the_visible_gpus_and_says_a_launch_error(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert job_module.job_backends(cuda_config(), local_rank=6).device_index == 6
    assert job_module.job_backends(TrainConfig(), local_rank=6) == Backends(default="gloo", data="gloo")
    one = TrainConfig(engine=EngineConfig(device="cuda:3"), trainer=TrainerConfig(device="cuda:3"))
    assert job_module.job_backends(one, local_rank=None).device_index == 3  # one process run plainly
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(LaunchError, match="sees 0 GPUs"):
        job_module.job_backends(cuda_config(), local_rank=0)


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_each_group_kind_gets_its_backend(monkeypatch, kind):
    """Rank 0 of 2 cells x 2 ranks: the control group is gloo, the cells and the prefix sums the data backend."""
    layout = Layout(world_size=4, num_cells=2, cell_size=2)
    backends = choose_backends((kind, kind), local_rank=0, visible_gpus=4)
    made = []

    def new_group(*, ranks, backend, use_local_synchronization=False):
        made.append((tuple(ranks), backend))
        return object()

    fake = types.SimpleNamespace(
        is_initialized=lambda: True,
        get_rank=lambda: 0,
        get_world_size=lambda: 4,
        new_group=new_group,
        distributed_c10d=types.SimpleNamespace(_world=types.SimpleNamespace(pg_names={"default": 0})),
        ProcessGroup=object,
    )
    monkeypatch.setattr(groups_module, "dist", fake)
    built = groups_module.build_process_groups(layout, backend=backends.data)
    data = "gloo" if kind == "cpu" else "cpu:gloo,cuda:nccl"
    assert made == [((0, 1, 2, 3), "gloo"), ((0, 1), data), ((2, 3), data), ((0, 2), data), ((1, 3), data)]
    assert built.cell_group is not None and set(built.prefix_groups) == {2}
