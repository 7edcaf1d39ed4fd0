"""Peak memory of the caller when one weight bucket goes to several engine endpoints at once.

A streamed publication sends the same bucket (`FlatWeights`) to every engine concurrently (`RemoteEngine.load_bucket`
on each). The caller's resident memory must not grow by a copy of the bucket per engine. This runs `--engines`
endpoints in their own processes (each serves a `ScriptedEngine`, which reads no tensor; the endpoint still reads the
whole body), builds one bucket of `--bucket-mib` MiB in this process, and measures this process's peak resident
memory (`VmHWM`, reset by writing 5 to `/proc/self/clear_refs` right before) while the bucket is sent to all of them:

- `streamed` (what `RemoteEngine` does): `begin_update`, `load_bucket` on every engine at once, `end_update`; the
  frame goes out as its head and slices of the bucket's own buffer (`gyre.engine.wire.weights_frame_parts`);
- `joined` (what it did before): each engine's call joins the frame into one bytes body (`weights_to_frame`) and
  posts it.

Reported per mode: the peak growth over the resident memory before the send (MiB) and the wall time. Check: the
streamed growth stays far below one bucket (a few MiB of slices per connection), where joined grows by about a bucket
per engine or more.

    python benchmarks/weight_stream_memory.py [--bucket-mib 256] [--engines 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import subprocess
import sys
import time
from pathlib import Path

from load_memory import resident_bytes
from report import emit

MIB = 1 << 20
TENSOR_MIB = 4  # the bucket holds whole tensors of this size


def bucket(mib: int):
    """A `FlatWeights` of `mib` MiB of float32 tensors, its pages touched (resident before the measurement)."""
    import torch

    from gyre.models.flat_weights import FlatWeights, TensorSpec

    buffer = torch.ones(mib * MIB, dtype=torch.uint8)
    count, size = mib // TENSOR_MIB, TENSOR_MIB * MIB
    manifest = tuple(
        TensorSpec(name=f"model.layers.{i}.weight", dtype="float32", shape=(size // 4,), offset=i * size)
        for i in range(count)
    )
    return FlatWeights(buffer=buffer, manifest=manifest)


async def serve() -> None:
    """One endpoint serving a scripted engine; prints its URL, serves until stdin closes."""
    from gyre.engine.endpoint import EngineServer
    from gyre.engine.scripted import ScriptedEngine

    server = EngineServer(ScriptedEngine(lambda request: [1]), max_body_bytes=1 << 34)
    print(await server.start(), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop()


async def send(urls: list[str], weights, mode: str, version: int) -> dict:
    import aiohttp

    from gyre.engine import wire
    from gyre.engine.remote import RemoteEngine

    engines = [await RemoteEngine.connect(url) for url in urls]
    try:
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = resident_bytes("VmRSS")
        started = time.perf_counter()
        if mode == "streamed":
            await asyncio.gather(*(engine.begin_update(version=version) for engine in engines))
            await asyncio.gather(*(engine.load_bucket(weights) for engine in engines))
            await asyncio.gather(*(engine.end_update(version=version) for engine in engines))
        else:
            async with aiohttp.ClientSession() as session:

                async def post(url: str) -> None:
                    body = wire.weights_to_frame(weights, version=version)
                    async with session.post(url + "/update_weights", data=body) as response:
                        assert response.status == 200, await response.text()

                await asyncio.gather(*(post(url) for url in urls))
        seconds = time.perf_counter() - started
        peak = resident_bytes("VmHWM")
    finally:
        for engine in engines:
            await engine.close()
    return {"peak_growth_mib": round((peak - before) / MIB, 1), "seconds": round(seconds, 3)}


def main(bucket_mib: int, engine_count: int, out: Path | None) -> None:
    servers = [
        subprocess.Popen(
            [sys.executable, __file__, "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        for _ in range(engine_count)
    ]
    try:
        urls = [server.stdout.readline().strip() for server in servers]
        weights = bucket(bucket_mib)

        async def run() -> dict:
            await send(urls, bucket(TENSOR_MIB), "streamed", 0)  # warm-up: imports, connections
            return {
                mode: await send(urls, weights, mode, version) for version, mode in ((1, "streamed"), (2, "joined"))
            }

        modes = asyncio.run(run())
    finally:
        for server in servers:
            server.stdin.close()
        for server in servers:
            server.wait(timeout=60)
    emit({"benchmark": "weight_stream_memory", "bucket_mib": bucket_mib, "engines": engine_count, **modes}, out)


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        asyncio.run(serve())
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-mib", type=int, default=256)
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    main(args.bucket_mib, args.engines, args.out)
