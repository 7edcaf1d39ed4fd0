"""gyre.distributed transports: bit-exact weights from a core to two receivers, versions, and malformed manifests.

One contract, parametrized over the implementations (torch.distributed broadcast; the pull-based Mooncake over TCP
on loopback and the store snapshot, one sequence):
three real processes (rank 0 the core, ranks 1 and 2 receivers; receiver 1 pulls into a uint8 buffer, receiver
2 into a bfloat16 one), tensors of seven dtypes incl. bfloat16 compared with `torch.equal` after a first and a
second publication. Mooncake tests skip, with the import error as the reason, where `mooncake` does not import.
"""

from __future__ import annotations

import pytest
import torch

from gyre.distributed.local import run_local, shared_store
from gyre.distributed.transport import WeightTransport, check_manifest, flatten_state_dict, unflatten
from gyre.models.flat_weights import FlatWeights, TensorSpec

TIMEOUT_S = 120.0


def make_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Deterministic named tensors of several dtypes and shapes (odd sizes: alignment padding is exercised)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(33, 7, generator=gen).to(torch.bfloat16),
        "layers.0.q.weight": torch.randn(5, 3, generator=gen),
        "layers.0.norm.weight": torch.randn(7, generator=gen).to(torch.float16),
        "layers.0.scale": torch.randn(3, 2, 2, generator=gen).to(torch.float64),
        "positions": torch.randint(-(2**40), 2**40, (11,), generator=gen),
        "codes": torch.randint(-128, 128, (9,), generator=gen).to(torch.int8),
        "mask": torch.rand(13, generator=gen) > 0.5,
        "scalar": torch.tensor(float(seed), dtype=torch.bfloat16),
    }


def _mismatches(flat: FlatWeights, seed: int) -> list[str]:
    got, want = unflatten(flat.buffer, flat.manifest), make_tensors(seed)
    if list(got) != list(want):
        return [f"names {list(got)} != {list(want)}"]
    return [n for n in want if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])]


def _receiving_buffer(rank: int, nbytes: int) -> torch.Tensor:
    if rank == 1:
        return torch.zeros(nbytes + 64, dtype=torch.uint8)
    return torch.zeros((nbytes + 64) // 2, dtype=torch.bfloat16)  # "the model dtype"


def _bad_manifest(flat: FlatWeights) -> FlatWeights:
    spec = flat.manifest[0]
    beyond = TensorSpec(name=spec.name, dtype=spec.dtype, shape=(10**6,), offset=spec.offset)
    return FlatWeights(buffer=flat.buffer, manifest=(beyond, *flat.manifest[1:]))


def _error(call) -> str:
    try:
        call()
    except ValueError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def torch_worker(rank: int, world_size: int) -> dict:
    """Collective sequence: v1, v2, a stale receiver at v3 (nothing moves), a malformed manifest, then v4."""
    from gyre.distributed.transport_torch import TorchWeightTransport

    transport = TorchWeightTransport(source_rank=0)
    out: dict = {"is_protocol": isinstance(transport, WeightTransport)}
    nbytes = flatten_state_dict(make_tensors(1)).buffer.numel()
    if rank == 0:
        transport.publish(flatten_state_dict(make_tensors(1)), 1)
        transport.publish(flatten_state_dict(make_tensors(2)), 2)
        out["stale"] = _error(lambda: transport.publish(flatten_state_dict(make_tensors(3)), 3))
        out["malformed"] = _error(lambda: transport.publish(_bad_manifest(flatten_state_dict(make_tensors(4))), 4))
        transport.publish(flatten_state_dict(make_tensors(4)), 4)
        return out
    into = _receiving_buffer(rank, nbytes)
    flat, version = transport.pull(into, version=1)
    out["v1"] = [version, _mismatches(flat, 1)]
    flat, version = transport.pull(into)
    out["v2"] = [version, _mismatches(flat, 2)]
    out["stale"] = _error(lambda: transport.pull(into, version=2 if rank == 1 else None))
    out["malformed"] = _error(lambda: transport.pull(into))
    flat, version = transport.pull(into, version=4)
    out["v4"] = [version, _mismatches(flat, 4)]
    return out


def pull_worker(rank: int, world_size: int, *, kind: str) -> dict:
    """Pull-based sequence: v1, v2 (a stale ask for v1 fails), a malformed manifest (v2 stays), a pull that waits
    for v3 before it is published."""
    import time

    import torch.distributed as dist

    store, _ = shared_store()
    if kind == "mooncake":
        from gyre.distributed.transport_mooncake import MooncakeWeightTransport

        transport = MooncakeWeightTransport(store=store, host="127.0.0.1", chunk_bytes=96, timeout_s=60)
    else:
        from gyre.distributed.transport_store import StoreWeightTransport

        transport = StoreWeightTransport(store, chunk_bytes=96, timeout_s=60)
    out: dict = {"is_protocol": isinstance(transport, WeightTransport)}
    nbytes = flatten_state_dict(make_tensors(1)).buffer.numel()
    into = _receiving_buffer(rank, nbytes)
    if rank == 0:
        published = [flatten_state_dict(make_tensors(1))]
        transport.publish(published[-1], 1)
    dist.barrier()
    if rank:
        flat, version = transport.pull(into, version=1)
        out["v1"] = [version, _mismatches(flat, 1)]
    dist.barrier()
    if rank == 0:
        published.append(flatten_state_dict(make_tensors(2)))
        transport.publish(published[-1], 2)
        out["malformed"] = _error(lambda: transport.publish(_bad_manifest(flatten_state_dict(make_tensors(9))), 9))
        out["not_increasing"] = _error(lambda: transport.publish(flatten_state_dict(make_tensors(2)), 2))
    dist.barrier()
    if rank:
        out["stale"] = _error(lambda: transport.pull(into, version=1))
        flat, version = transport.pull(into)
        out["v2"] = [version, _mismatches(flat, 2)]
    dist.barrier()
    if rank == 0:
        time.sleep(0.5)  # the receivers are already waiting for v3
        published.append(flatten_state_dict(make_tensors(3)))
        transport.publish(published[-1], 3)
    else:
        flat, version = transport.pull(into, version=3)
        out["v3"] = [version, _mismatches(flat, 3)]
    dist.barrier()  # the core's buffers stay alive until every receiver is done
    transport.close()
    return out


@pytest.mark.slow  # real processes: a few seconds each on 2 cores
def test_torch_transport_three_processes():
    core, *receivers = run_local(f"{__file__}:torch_worker", 3, timeout_s=TIMEOUT_S)
    assert [out["is_protocol"] for out in (core, *receivers)] == [True] * 3
    for out in receivers:
        assert out["v1"] == [1, []]
        assert out["v2"] == [2, []]
        assert out["v4"] == [4, []]
        assert "the core refused its own publication, nothing moved" in out["malformed"]
        assert "lie beyond the buffer" in out["malformed"]
    # receiver 1 asked for 2 while the core published 3: it, the core and receiver 2 all get a clear error.
    assert receivers[0]["stale"].startswith("WeightVersionError: version: asked for 2, but version 3 replaced it")
    assert receivers[1]["stale"].startswith("WeightVersionError: receivers refused the publication, nothing moved")
    assert "rank 1: WeightVersionError: version: asked for 2" in core["stale"]
    assert core["malformed"].startswith("ValueError: manifest[0] ('embed.weight'): bytes 0..2000000 lie beyond")


def _mooncake_missing() -> str | None:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as error:
        return f"mooncake does not import ({error}); pip install mooncake-transfer-engine-non-cuda + apt libibverbs1"
    return None


@pytest.mark.slow  # real processes: a few seconds each on 2 cores
@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(
            "mooncake", marks=pytest.mark.skipif(_mooncake_missing() is not None, reason=str(_mooncake_missing()))
        ),
        "store",
    ],
)
def test_pull_transport_three_processes(kind):
    core, *receivers = run_local(f"{__file__}:pull_worker", 3, kwargs={"kind": kind}, timeout_s=TIMEOUT_S)
    assert [out["is_protocol"] for out in (core, *receivers)] == [True] * 3
    for out in receivers:
        assert out["v1"] == [1, []]
        assert out["v2"] == [2, []]
        assert out["v3"] == [3, []]
        assert out["stale"].startswith("WeightVersionError: version: asked for 1, but version 2 replaced it")
    assert core["malformed"].startswith("ValueError: manifest[0] ('embed.weight'): bytes 0..2000000 lie beyond")
    assert core["not_increasing"] == "WeightVersionError: version: got 2, expected > the last published 2"


def test_round_trip_without_processes():
    tensors = make_tensors(5)
    flat = flatten_state_dict(tensors)
    assert flat.buffer.dtype == torch.uint8 and all(spec.offset % 16 == 0 for spec in flat.manifest)
    assert _mismatches(flat, 5) == []
    as_bf16 = flat.buffer.view(torch.bfloat16)  # a receiver's buffer of the model dtype holds the same bytes
    assert all(
        torch.equal(a, b) for a, b in zip(unflatten(as_bf16, flat.manifest).values(), tensors.values(), strict=True)
    )


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        ([{"name": "a", "dtype": "float32", "shape": [4], "offset": 0}] * 2, r"manifest\[1\] \('a'\): the name appe"),
        ([{"name": "a", "dtype": "float33", "shape": [4], "offset": 0}], r"manifest\[0\] \('a'\)\.dtype: got 'float33"),
        ([{"name": "a", "dtype": "float32", "shape": [4], "offset": 2}], r"\.offset: got 2, expected a multiple of"),
        ([{"name": "a", "dtype": "float32", "shape": [9], "offset": 32}], r"bytes 32\.\.68 lie beyond the buffer \(64"),
        ([{"name": "a", "dtype": "float32", "shape": [-1], "offset": 0}], r"\.shape: got \(-1,\), expected non-neg"),
        (
            [
                {"name": "a", "dtype": "int64", "shape": [3], "offset": 0},
                {"name": "b", "dtype": "int8", "shape": [1], "offset": 20},
            ],
            r"tensors 'a' and 'b' overlap \(byte 20 < 24\)",
        ),
        ([{"name": "a", "dtype": "int8", "shape": [1]}], r"manifest\[0\]: .*offset"),
        ({"name": "a"}, r"manifest: got dict, expected a sequence"),
        ([{"name": "", "dtype": "int8", "shape": [1], "offset": 0}], r"manifest\[0\]\.name: got ''"),
    ],
)
def test_malformed_manifests_raise_value_error(manifest, message):
    with pytest.raises(ValueError, match=message):
        check_manifest(manifest, nbytes=64)
    with pytest.raises(ValueError, match=message):
        unflatten(torch.zeros(64, dtype=torch.uint8), manifest)
