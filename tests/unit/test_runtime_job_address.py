"""gyre.runtime.job.rank_address: where a rank's one-sided weight transport listens (docs/configuration.md,
`trainer.weight_transport`): the user's $GYRE_RANK_ADDR first; the loopback for a job whose rendezvous is on the
loopback; otherwise an address that is not a loopback one whenever this machine has a route to the rendezvous."""

from __future__ import annotations

import socket

import pytest

from gyre.runtime.job import rank_address


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
