"""Weight transport throughput: Mooncake over TCP on loopback vs torch.distributed (gloo), core -> 1 and 2 receivers.

For each transport and receiver count, one run of 1 + R local processes (`gyre.distributed.local`): a flat uint8 buffer
of each size is published `--repeats` times (after one warm-up publication: engine handshake, registration) and
every receiver pulls each version into its own preallocated buffer. A trial is timed on the core from a barrier
before the publication to a barrier after the last receiver finished. Reported: per-receiver GB/s (bytes / median
trial time; with 2 receivers each receives the whole buffer, so the core sends twice the bytes), and the median
time to move the tiny default model (`gyre.models.tiny_model_dir`, fp32) plus the one-off flatten time.
Prints one JSON object (last line).

    python benchmarks/weight_sync.py [--sizes-mib 64 256] [--repeats 3] [--out benchmarks/results/weight_sync.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from report import emit

from gyre.distributed.local import run_local, shared_store

TRANSPORTS = ("mooncake_tcp", "torch_gloo")


def bench_worker(
    rank: int, world_size: int, *, transport: str, sizes_mib: list[int], repeats: int, model_dir: str
) -> dict:
    import torch
    import torch.distributed as dist

    from gyre.distributed.transport import flatten_state_dict
    from gyre.models.flat_weights import FlatWeights
    from gyre.models.hf_weights import load_pretrained

    if transport == "mooncake_tcp":
        from gyre.distributed.transport_mooncake import MooncakeWeightTransport

        store, _ = shared_store()
        mover = MooncakeWeightTransport(store=store, host="127.0.0.1")
    else:
        from gyre.distributed.transport_torch import TorchWeightTransport

        mover = TorchWeightTransport(source_rank=0)
    version = 0

    def trials(flat: FlatWeights | None, nbytes: int) -> list[float]:
        nonlocal version
        into = None if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
        times = []
        for trial in range(repeats + 1):  # the first is a warm-up
            version += 1
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                mover.publish(flat, version)
            if transport == "mooncake_tcp":
                dist.barrier()  # pull-based: receivers read after the publication is posted
            if rank:
                received, got = mover.pull(into, version=version)
                assert got == version and received.buffer.numel() == nbytes
            dist.barrier()
            if trial:
                times.append(time.perf_counter() - start)
        return times

    result: dict = {"sizes": {}}
    for mib in sizes_mib:
        nbytes = mib << 20
        flat = None
        if rank == 0:
            flat = FlatWeights(buffer=torch.randint(0, 256, (nbytes,), dtype=torch.uint8), manifest=())
        result["sizes"][str(mib)] = trials(flat, nbytes)
        del flat
    flat = None
    if rank == 0:
        state = load_pretrained(model_dir).state_dict()
        start = time.perf_counter()
        flat = flatten_state_dict(state)
        result["flatten_s"] = time.perf_counter() - start
        result["model_bytes"], result["model_tensors"] = flat.buffer.numel(), len(flat.manifest)
    nbytes = [flat.buffer.numel() if flat is not None else 0]
    dist.broadcast_object_list(nbytes, src=0)
    result["tiny_model"] = trials(flat, nbytes[0])
    dist.barrier()  # the core's buffers stay registered until every receiver is done
    mover.close()
    return result


def main(sizes_mib: list[int], repeats: int, out: Path | None) -> None:
    from gyre.models.tiny import tiny_model_dir

    model_dir = str(tiny_model_dir())
    gbps: dict = {t: {} for t in TRANSPORTS}
    model_s: dict = {t: {} for t in TRANSPORTS}
    model: dict = {}
    for transport in TRANSPORTS:
        for receivers in (1, 2):
            kwargs = {
                "transport": transport,
                "sizes_mib": sizes_mib,
                "repeats": repeats,
                "model_dir": model_dir,
            }
            core = run_local(f"{__file__}:bench_worker", 1 + receivers, kwargs=kwargs, timeout_s=600)[0]
            key = f"{receivers}_receiver{'s' if receivers > 1 else ''}"
            gbps[transport][key] = {
                mib: round((int(mib) << 20) / statistics.median(times) / 1e9, 3) for mib, times in core["sizes"].items()
            }
            model_s[transport][key] = round(statistics.median(core["tiny_model"]), 5)
            model = {"bytes": core["model_bytes"], "tensors": core["model_tensors"], "flatten_s": core["flatten_s"]}
    emit(
        {
            "benchmark": "weight_sync",
            "sizes_mib": sizes_mib,
            "repeats": repeats,
            "gbps_per_receiver": gbps,
            "tiny_model": {**model, "publish_and_pull_s": model_s},
            "note": "loopback on one machine: the core and the receivers share its cores and memory bandwidth",
        },
        out,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    main(args.sizes_mib, args.repeats, args.out)
