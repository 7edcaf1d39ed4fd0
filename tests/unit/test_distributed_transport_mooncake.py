"""gyre.distributed.transport_mooncake's link: the protocol (tcp, rdma) and RDMA device names of `trainer.mooncake`
reach `TransferEngine.initialize`, with MC_FORCE_TCP set for tcp and unset for rdma while the engine starts.

The plan (`engine_start`) and Mooncake's topology JSON (`topology_devices`) are pure and tested here for both
protocols. A recording stand-in for `TransferEngine` checks what the transport calls, and with which environment,
through `one_sided_transport`. The real engine (where `mooncake` imports): TCP publish and pull in one process, and
rdma up to its device check, which fails on a host without an RDMA device (skipped where there is one). RDMA
transfers are not run here (no NIC). The three-process TCP contract is tests/integration/test_weight_transport.py.
"""

from __future__ import annotations

import os
from typing import ClassVar

import pytest
import torch
from local_store import store_client as client

from gyre.config import MooncakeConfig
from gyre.distributed import transport_mooncake
from gyre.distributed.one_sided import one_sided_transport
from gyre.distributed.transport import flatten_state_dict
from gyre.distributed.transport_mooncake import EngineStart, engine_start, topology_devices


def test_tcp_forces_tcp_and_checks_no_device():
    assert engine_start("10.0.0.5") == EngineStart(
        initialize_args=("10.0.0.5", "P2PHANDSHAKE", "tcp", ""), force_tcp=True, device_filter=None
    )


@pytest.mark.parametrize("names", ["mlx5_0,mlx5_1", "mlx5_2", ""])
def test_rdma_passes_the_device_names_and_lets_mooncake_find_them(names):
    assert engine_start("10.0.0.5", "rdma", names) == EngineStart(
        initialize_args=("10.0.0.5", "P2PHANDSHAKE", "rdma", names), force_tcp=False, device_filter=names
    )


@pytest.mark.parametrize(
    ("protocol", "names", "message"),
    [
        ("nvlink", "", "MooncakeWeightTransport.protocol='nvlink' is not allowed: expected one of tcp, rdma"),
        ("tcp", "mlx5_0", "MooncakeWeightTransport.device_names='mlx5_0' is not allowed: expected '' with"),
        ("rdma", "mlx5_0, mlx5_1", "MooncakeWeightTransport.device_names='mlx5_0, mlx5_1' is not allowed"),
        ("rdma", "mlx5_0,", "MooncakeWeightTransport.device_names='mlx5_0,' is not allowed"),
    ],
)
def test_a_bad_link_names_the_argument(protocol, names, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        engine_start("127.0.0.1", protocol, names)


def test_topology_devices_reads_both_lists_of_every_location():
    no_device = '{\n\t"cpu:0" : \n\t[\n\t\t[],\n\t\t[]\n\t]\n}\n'  # what Mooncake 0.3.13 answers on this host
    assert topology_devices(no_device) == []
    two_numa = '{"cpu:0": [["mlx5_0"], ["mlx5_1"]], "cpu:1": [["mlx5_1"], ["mlx5_0"]], "cuda:0": [[], ["mlx5_1"]]}'
    assert topology_devices(two_numa) == ["mlx5_0", "mlx5_1"]
    assert topology_devices("") == []
    with pytest.raises(ValueError, match=r"Mooncake topology\['cpu:0'\]: got 'mlx5_0'"):
        topology_devices('{"cpu:0": "mlx5_0"}')


class RecordingEngine:
    """Stands in for `mooncake.engine.TransferEngine`: records the calls that start it and MC_FORCE_TCP then."""

    topology = '{"cpu:0": [["mlx5_0"], ["mlx5_1"]]}'
    calls: ClassVar[list] = []  # reset by the fixture

    def get_local_topology(self, device_name: str | None = None) -> str:
        self.calls.append(("get_local_topology", device_name, os.environ.get("MC_FORCE_TCP")))
        return self.topology

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        self.calls.append(
            ("initialize", (local_hostname, metadata_server, protocol, device_name), os.environ.get("MC_FORCE_TCP"))
        )
        return 0

    def get_rpc_port(self) -> int:
        return 15000


@pytest.fixture
def recording_engine(monkeypatch):
    RecordingEngine.calls = []
    monkeypatch.setattr(transport_mooncake, "import_transfer_engine", lambda: RecordingEngine)
    return RecordingEngine


def test_the_transport_starts_the_engine_on_the_configured_rdma_devices(recording_engine, monkeypatch):
    monkeypatch.setenv("MC_FORCE_TCP", "yes")  # a user's export: the config wins while the engine starts
    link = MooncakeConfig(protocol="rdma", device_names="mlx5_0,mlx5_1")
    made = one_sided_transport(None, kind="mooncake", host="10.0.0.5", mooncake=link)
    assert (type(made).__name__, made.session_id, made.protocol) == (
        "MooncakeWeightTransport",
        "10.0.0.5:15000",
        "rdma",
    )
    assert recording_engine.calls == [
        ("get_local_topology", "mlx5_0,mlx5_1", None),
        ("initialize", ("10.0.0.5", "P2PHANDSHAKE", "rdma", "mlx5_0,mlx5_1"), None),
    ]
    assert os.environ["MC_FORCE_TCP"] == "yes"  # restored


def test_the_transport_forces_tcp_while_the_engine_starts(recording_engine, monkeypatch):
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    for link in (None, MooncakeConfig()):  # the default link is TCP
        one_sided_transport(None, kind="mooncake", host="127.0.0.1", mooncake=link)
    assert recording_engine.calls == [("initialize", ("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), "1")] * 2
    assert "MC_FORCE_TCP" not in os.environ


def test_rdma_without_a_device_fails_instead_of_falling_back_to_tcp(recording_engine, monkeypatch):
    monkeypatch.setattr(recording_engine, "topology", '{"cpu:0": [[], []]}')
    link = MooncakeConfig(protocol="rdma", device_names="mlx5_9")
    with pytest.raises(RuntimeError, match="protocol rdma: Mooncake finds no RDMA device named in 'mlx5_9'"):
        one_sided_transport(None, kind="mooncake", mooncake=link)
    assert [call[0] for call in recording_engine.calls] == ["get_local_topology"]  # initialize never ran


def test_one_sided_transport_refuses_a_link_that_is_not_a_mooncake_config():
    with pytest.raises(ValueError, match=r"mooncake: got dict, expected a MooncakeConfig \(trainer.mooncake\)"):
        one_sided_transport(None, kind="mooncake", mooncake={"protocol": "rdma"})


# ----------------------------------------------------------------------------- the real TransferEngine


def _mooncake_missing() -> str | None:
    try:
        transport_mooncake.import_transfer_engine()
    except ImportError as error:
        return str(error)
    return None


needs_mooncake = pytest.mark.skipif(_mooncake_missing() is not None, reason=str(_mooncake_missing()))


@needs_mooncake
def test_real_engine_over_tcp_publishes_and_pulls_in_one_process(store_port):
    link = MooncakeConfig(protocol="tcp")
    core = one_sided_transport(client(store_port), kind="mooncake", mooncake=link, prefix="gyre/tcp")
    receiver = one_sided_transport(client(store_port), kind="mooncake", mooncake=link, prefix="gyre/tcp")
    flat = flatten_state_dict({"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)})
    core.publish(flat, 1)
    got, version = receiver.pull(torch.zeros(flat.buffer.numel(), dtype=torch.uint8))
    assert version == 1 and torch.equal(got.buffer, flat.buffer)
    receiver.close()
    core.close()


@needs_mooncake
def test_real_engine_refuses_rdma_on_a_host_without_an_rdma_device(monkeypatch):
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)  # set, Mooncake would skip the discovery asked for below
    engine = transport_mooncake.import_transfer_engine()()
    if topology_devices(engine.get_local_topology(device_name="")):
        pytest.skip("this host has an RDMA device: rdma would start here")
    with pytest.raises(RuntimeError, match="protocol rdma: Mooncake finds no RDMA device at all on this host"):
        one_sided_transport(None, kind="mooncake", mooncake=MooncakeConfig(protocol="rdma"))
