"""A TCPStore on 127.0.0.1 for the store-backed unit tests (claims, step pump, store transport, control plane).

`conftest.py`'s `store_port` fixture starts the server and stops it after the test; `store_client(port)` is one
client (a TCPStore client is used by one thread: give each thread its own).
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

HOST = "127.0.0.1"
TIMEOUT = datetime.timedelta(seconds=10)


def store_server(port: int) -> dist.TCPStore:
    return dist.TCPStore(HOST, port, 1, True, timeout=TIMEOUT, wait_for_workers=False)


def store_client(port: int) -> dist.TCPStore:
    return dist.TCPStore(HOST, port, 1, False, timeout=TIMEOUT)
