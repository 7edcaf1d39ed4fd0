"""Fixtures the unit tests share (pytest finds them here; no import needed).

`store_port`: a TCPStore server on a free port of 127.0.0.1 for the test (`local_store.store_client(port)` connects).

`model_parallel`: a one-rank gloo group (unless one exists) with megatron's parallel_state at TP=1, PP=1, torn down
after the module if this fixture made it. Importing this module imports neither megatron nor torch.distributed's
backends; the fixture does, when a test asks for it.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def model_parallel(tmp_path_factory):
    from gyre.trainer.model import init_model_parallel  # before megatron: gyre.trainer's import patch (cpu_patch)

    from megatron.core import parallel_state  # isort: skip

    created = not dist.is_initialized()
    if created:
        store = tmp_path_factory.mktemp("gloo") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    init_model_parallel(1, 1, seed=0)
    yield
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


@pytest.fixture
def store_port():
    from local_store import store_server

    server = store_server(0)  # the port the kernel picks as it binds: no other process can take it first
    yield server.port
    del server
