"""gyre.distributed.transport_store on a real TCPStore (127.0.0.1): snapshots, versions, reads that outlive their
version, tensors larger than a store value, and the one-sided transport chooser. The multi-process contract
(three processes, seven dtypes) is in tests/integration/test_weight_transport.py."""

from __future__ import annotations

import threading

import pytest
import torch
from local_store import store_client as client

from gyre.distributed.one_sided import one_sided_transport
from gyre.distributed.transport import WeightTransport, WeightVersionError, flatten_state_dict
from gyre.distributed.transport_store import StoreWeightTransport


def weights_of(value: float, numel: int = 1000):
    tensors = {"a": torch.full((numel,), value), "b": torch.full((3, 5), value, dtype=torch.bfloat16)}
    return tensors, flatten_state_dict(tensors)


def test_a_pull_after_the_core_moved_on_gets_the_published_snapshot(store_port):
    core = StoreWeightTransport(client(store_port), chunk_bytes=512)
    receiver = StoreWeightTransport(client(store_port), chunk_bytes=512)
    assert isinstance(core, WeightTransport)
    tensors, flat = weights_of(1.5)
    core.publish(flat, 1)
    flat.buffer.fill_(0)  # the core trains on: its buffer changes in place after the publication
    tensors["a"].add_(1.0)
    got, version = receiver.pull(torch.zeros(flat.buffer.numel() + 32, dtype=torch.uint8), version=1)
    from gyre.distributed.transport import unflatten

    back = unflatten(got.buffer, got.manifest)
    assert version == 1 and torch.equal(back["a"], torch.full((1000,), 1.5))
    assert torch.equal(back["b"], torch.full((3, 5), 1.5, dtype=torch.bfloat16))


def test_versions_replace_each_other_and_old_ones_leave_the_store(store_port):
    store = client(store_port)
    core, receiver = StoreWeightTransport(store, keep_versions=1), StoreWeightTransport(client(store_port))
    into = torch.zeros(8192, dtype=torch.uint8)
    for version in (1, 2):
        core.publish(weights_of(float(version))[1], version)
    assert receiver.pull(into)[1] == 2
    with pytest.raises(WeightVersionError, match="asked for 1, but version 2 replaced it"):
        receiver.pull(into, version=1)
    assert not store.check(["gyre/weights/v1"]) and not store.check(["gyre/weights/v1/0"])
    with pytest.raises(WeightVersionError, match="expected > the last published 2"):
        core.publish(weights_of(3.0)[1], 2)
    with pytest.raises(ValueError, match="into: 16 bytes, but version 2 needs"):
        receiver.pull(torch.zeros(16, dtype=torch.uint8))
    core.close()
    assert not store.check(["gyre/weights/current", "gyre/weights/v2"])


def test_a_pull_waits_for_a_version_not_yet_published(store_port):
    core, receiver = StoreWeightTransport(client(store_port)), StoreWeightTransport(client(store_port), timeout_s=10)
    core.publish(weights_of(1.0)[1], 1)
    later = threading.Timer(0.3, lambda: core.publish(weights_of(2.0)[1], 2))
    later.start()
    flat, version = receiver.pull(torch.zeros(8192, dtype=torch.uint8), version=2)
    later.join()
    assert version == 2 and torch.equal(flat.buffer, weights_of(2.0)[1].buffer)
    with pytest.raises(TimeoutError, match=r"no publication under 'gyre/weights/v3' within 0\.2 s"):
        StoreWeightTransport(client(store_port), timeout_s=0.2).pull(torch.zeros(8192, dtype=torch.uint8), version=3)


class StoreWithHook:
    """The real TCPStore client, calling `hook(key)` before each non-waiting read (to interleave a publication with
    a receiver's read at a chosen chunk)."""

    def __init__(self, store, hook) -> None:
        self.store, self.hook = store, hook

    def compare_set(self, key, expected, desired):
        self.hook(key)
        return self.store.compare_set(key, expected, desired)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_read_that_outlives_its_version_raises_and_never_mixes_versions(store_port):
    core = StoreWeightTransport(client(store_port), keep_versions=1, chunk_bytes=256)
    core.publish(weights_of(1.0)[1], 1)

    def publish_twice_at_chunk_3(key: str) -> None:
        if key == "gyre/weights/v1/3":
            core.publish(weights_of(2.0)[1], 2)  # v1 is released (keep_versions=1) while it is read
            core.publish(weights_of(3.0)[1], 3)

    receiver = StoreWeightTransport(StoreWithHook(client(store_port), publish_twice_at_chunk_3), chunk_bytes=256)
    into = torch.zeros(8192, dtype=torch.uint8)
    with pytest.raises(WeightVersionError, match=r"version 1 was released while it was read \(current: 3\)"):
        receiver.pull(into)
    flat, version = receiver.pull(into)  # pull again: the current one, whole
    assert version == 3 and torch.equal(flat.buffer, weights_of(3.0)[1].buffer)


def test_concurrent_publications_and_pulls_give_one_version_whole(store_port):
    """A core publishing as fast as it can while a receiver pulls: each pull is one version's bytes or an error."""
    core = StoreWeightTransport(client(store_port), keep_versions=1, chunk_bytes=256)
    core.publish(weights_of(1.0, numel=4000)[1], 1)
    stop, results = threading.Event(), []

    def receive() -> None:
        receiver = StoreWeightTransport(client(store_port), chunk_bytes=256)
        into = torch.zeros(20000, dtype=torch.uint8)
        while not stop.is_set():
            try:
                flat, version = receiver.pull(into)
            except WeightVersionError:
                results.append(None)
                continue
            results.append(torch.equal(flat.buffer, weights_of(float(version), numel=4000)[1].buffer))

    thread = threading.Thread(target=receive)
    thread.start()
    for version in range(2, 100):
        core.publish(weights_of(float(version), numel=4000)[1], version)
    stop.set()
    thread.join()
    assert results and all(ok is not False for ok in results), results  # no pull mixed two versions
    assert any(ok for ok in results)


def test_tensors_larger_than_a_store_value_travel_in_chunks(store_port):
    big = {"embed": torch.randn(5 << 20, generator=torch.Generator().manual_seed(0))}  # 20 MiB > 8 MiB per value
    flat = flatten_state_dict(big)
    StoreWeightTransport(client(store_port), chunk_bytes=4 << 20).publish(flat, 1)
    got, _ = StoreWeightTransport(client(store_port)).pull(torch.empty(flat.buffer.numel(), dtype=torch.uint8))
    assert torch.equal(got.buffer, flat.buffer)


def test_bad_settings_name_the_field(store_port):
    with pytest.raises(ValueError, match=r"chunk_bytes: got 16777216, expected 1 \.\. 8388608"):
        StoreWeightTransport(client(store_port), chunk_bytes=16 << 20)
    with pytest.raises(ValueError, match="keep_versions: got 0"):
        StoreWeightTransport(client(store_port), keep_versions=0)
    with pytest.raises(ValueError, match="kind: got 'rdma', expected one of auto, mooncake, store"):
        one_sided_transport(client(store_port), kind="rdma")


def _mooncake_imports() -> bool:
    try:
        from gyre.distributed.transport_mooncake import import_transfer_engine

        import_transfer_engine()
    except ImportError:
        return False
    return True


def test_the_chooser_takes_mooncake_where_it_imports_else_the_store(store_port):
    assert type(one_sided_transport(client(store_port), kind="store")).__name__ == "StoreWeightTransport"
    chosen = one_sided_transport(client(store_port), kind="auto", prefix="gyre/auto")
    assert type(chosen).__name__ == ("MooncakeWeightTransport" if _mooncake_imports() else "StoreWeightTransport")
    chosen.close()
    if not _mooncake_imports():
        with pytest.raises(ImportError, match="mooncake-transfer-engine"):
            one_sided_transport(client(store_port), kind="mooncake")
