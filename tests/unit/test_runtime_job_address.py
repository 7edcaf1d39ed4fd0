"""gyre.runtime.job.spmd.rank_address: where a rank's one-sided weight transport listens (docs/configuration.md,
`trainer.weight_transport`): the user's $GYRE_RANK_ADDR first; the loopback for a job whose rendezvous is on the
loopback; otherwise an address that is not a loopback one whenever this machine has a route to the rendezvous.
Beside it, what `open_job` binds (the runtime store: rank 0's address, never every interface) and the job's secret."""

from __future__ import annotations

import socket

import pytest

from gyre.distributed.layout import Layout
from gyre.runtime.job.spmd import JOB_SECRET_ENV, job_secret, rank_address, store_host


def test_the_users_address_wins():
    assert rank_address({"GYRE_RANK_ADDR": "10.1.2.3", "MASTER_ADDR": "127.0.0.1"}) == "10.1.2.3"


def test_a_local_job_listens_on_the_loopback():
    for master in ("", "localhost", "127.0.0.1"):
        assert rank_address({"MASTER_ADDR": master}) == "127.0.0.1"
    assert rank_address({}) == "127.0.0.1"


def test_a_job_across_hosts_gets_an_address_of_this_host_not_the_loopback():
    master = "192.0.2.1"  # TEST-NET-1: a UDP connect sends nothing; it only picks the route
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, 1))
    except OSError as error:
        pytest.skip(f"no route from this machine to {master}: {error}")
    address = rank_address({"MASTER_ADDR": master})
    assert not address.startswith("127."), address


def test_the_runtime_store_listens_on_rank_0s_address():
    assert store_host({"MASTER_ADDR": "10.0.0.5"}, world_size=1) == "127.0.0.1"  # a job of one rank
    assert store_host({"MASTER_ADDR": "127.0.0.1"}, world_size=4) == "127.0.0.1"  # every rank local
    assert store_host({"GYRE_RANK_ADDR": "10.0.0.5", "MASTER_ADDR": "node0"}, world_size=4) == "10.0.0.5"
    # MASTER_ADDR is one of this host's addresses: the store listens there (the rendezvous reached it already)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 1))  # TEST-NET-1: nothing is sent, the route names this host's address
            own = probe.getsockname()[0]
    except OSError:
        own = None
    if own is not None and not own.startswith("127."):
        assert store_host({"MASTER_ADDR": own}, world_size=4) == own
    # the host name resolves to a loopback address (Debian's 127.0.1.1): fine when every rank is on this host ...
    debian = {"GYRE_RANK_ADDR": "127.0.1.1", "MASTER_ADDR": "node0"}
    assert store_host({**debian, "LOCAL_WORLD_SIZE": "4"}, world_size=4) == "127.0.1.1"
    assert store_host({**debian, "SLURM_NNODES": "1"}, world_size=4) == "127.0.1.1"
    # ... an error naming the way out when other hosts would have to reach it
    with pytest.raises(ValueError, match="set GYRE_RANK_ADDR"):
        store_host({**debian, "LOCAL_WORLD_SIZE": "2"}, world_size=4)


def test_the_job_secret_is_the_launchers_or_random_and_its_value_is_never_shown():
    assert job_secret({JOB_SECRET_ENV: "from-the-launcher"}) == "from-the-launcher"
    made = {job_secret({}) for _ in range(3)}
    assert len(made) == 3 and all(len(secret) >= 40 for secret in made)  # 32 random bytes, base64
    for bad in ("two words", "new\nline", "non-ascii-\u00e9"):
        with pytest.raises(ValueError) as refused:
            job_secret({JOB_SECRET_ENV: bad})
        assert bad not in str(refused.value) and "value not shown" in str(refused.value)


def listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) on which something listens at `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


def test_open_job_binds_the_store_to_the_loopback_and_keeps_the_secret_out_of_its_repr(monkeypatch):
    import torch.distributed as dist

    from gyre.config import ClusterConfig, TrainConfig
    from gyre.runtime.job.spmd import open_job

    if dist.is_initialized():
        pytest.skip("a process group of another test is open in this process")
    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(JOB_SECRET_ENV, "the-launchers-secret")
    cfg = TrainConfig(cluster=ClusterConfig(num_cells=1, cell_size=1, cell_capacity=8))
    job = open_job(cfg, Layout(world_size=1, num_cells=1, cell_size=1))
    try:
        assert job.secret == "the-launchers-secret" and "the-launchers-secret" not in repr(job)
        assert (job.store_host, job.host) == ("127.0.0.1", "127.0.0.1")
        assert listening_addresses(job.store_port) == {"0100007F"}, "the store must listen on 127.0.0.1 only"
        client = job.store()
        client.set("gyre/test", b"1")
        assert client.get("gyre/test") == b"1"
    finally:
        job.close()
