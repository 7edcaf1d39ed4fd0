"""Peak memory per core rank, and the critical path, of one publication: the whole-model gather (before) against the
weight stream (after), side by side in one run (docs/training.md, "Publication").

Two models with random bf16 weights written once to temporary directories (`load_memory.write_checkpoint`):
`dense`, Qwen3-0.6B's layout (596M parameters, tied embeddings), and `moe`, a Qwen3-MoE layout scaled to about the
same size (`moe_config()`). For each layout (TP 2 and TP 2 x PP 2 on `dense`, EP 2 on `moe`) and each path, one fresh
run of `gyre.distributed.local` ranks over gloo builds its Megatron shard in bf16 and loads it from the files
(`load_hf_checkpoint`), while a native engine serves the same model in bf16 in a process of its own behind its HTTP
endpoint (`python -m gyre.engine serve`). Then the measured publication, after every rank reset its high-water mark
(`/proc/self/clear_refs` <- 5):

- `gather` (before): every core rank gathers the whole model in HF names (`gyre.trainer.publish.engine_weights`),
  rank 0 sends it whole (`RemoteEngine.update_weights`);
- `stream` (after): every core rank runs `gyre.trainer.weight_stream.stream_weights`; rank 0 hands each bucket to
  the engine (`gyre.runtime.controller.transitions.stream_to_engines`: begin_update, load_bucket, end_update).

Reported per rank: resident memory before the publication, its peak during it (`VmHWM`), the growth (peak -
before) and the bound the stream must hold: two buckets, a bucket being max(`--bucket-mib`, the largest HF tensor),
plus `CONSTANT_MIB` (a stage leader's gathered unit, gloo's buffers, the HTTP client's). And on rank 0 the critical
path: from the call to the engine's last update done. The engine refuses an incomplete stream (`end_update` checks
that every parameter was loaded); that the streamed tensors are the trainer's, bit for bit, is the tests' part
(tests/integration/test_train_weight_stream.py).

    python benchmarks/publication_memory.py [--bucket-mib 64] [--out benchmarks/results/publication_memory.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from load_memory import model_config, resident_bytes, write_checkpoint
from report import emit

from gyre.distributed.local import LocalRunError, run_local

GIB, MIB = 1 << 30, 1 << 20
CONSTANT_MIB = 160
LAYOUTS = (("dense", "tp2", 2, 1, 1), ("dense", "tp2pp2", 2, 2, 1), ("moe", "ep2", 1, 1, 2))  # model, name, TP, PP, EP
PATHS = ("gather", "stream")
TIMEOUT_S = 1800


def dense_config():
    return model_config()


def moe_config():
    from gyre.models.decoder_config import DecoderConfig

    return DecoderConfig(
        model_type="qwen3_moe",
        vocab_size=151_936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40_960,
        rope_theta=1_000_000.0,
        qk_norm=True,
        tie_word_embeddings=True,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=640,
        norm_topk_prob=True,
    )


def write_worker(rank: int, world_size: int, *, path: str, model: str) -> int:
    """`load_memory.write_checkpoint` in a process of its own (its memory is gone when it ends)."""
    return write_checkpoint(Path(path), dense_config() if model == "dense" else moe_config())


def publication_worker(
    rank: int, world_size: int, *, path: str, tp: int, pp: int, ep: int, how: str, url: str, bucket_mib: int
) -> dict:
    import torch
    import torch.distributed as dist

    from gyre.models.decoder_config import read_config
    from gyre.trainer.model import build_gpt_model, init_model_parallel
    from gyre.trainer.shard_loading import load_hf_checkpoint

    init_model_parallel(tp, pp, expert_parallel_size=ep)
    config = read_config(path)
    model = build_gpt_model(config, dtype=torch.bfloat16, perform_initialization=False)
    load_hf_checkpoint(model, path, config)
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    before = resident_bytes("VmRSS")
    started = time.perf_counter()
    stats = publish(model, config, rank=rank, how=how, url=url, bucket_bytes=bucket_mib * MIB)
    elapsed = time.perf_counter() - started
    peak = resident_bytes("VmHWM")
    dist.barrier()
    return {
        "shard_gib": round(shard / GIB, 3),
        "rss_before_gib": round(before / GIB, 3),
        "peak_rss_gib": round(peak / GIB, 3),
        "growth_gib": round((peak - before) / GIB, 3),
        "critical_path_s": round(elapsed, 2) if rank == 0 else None,
        **stats,
    }


def publish(model, config, *, rank: int, how: str, url: str, bucket_bytes: int) -> dict:
    import torch

    from gyre.engine.remote import RemoteEngine

    if how == "gather":
        from gyre.trainer.publish import engine_weights

        weights = engine_weights(model, config, dtype=torch.bfloat16)
        if rank == 0:

            async def send():
                engine = await RemoteEngine.connect(url)
                try:
                    await engine.update_weights(weights, version=1)
                finally:
                    await engine.close()

            asyncio.run(send())
        return {"buckets": 1, "largest_bucket_mib": round(weights.buffer.numel() / MIB, 1)}
    from gyre.trainer.weight_stream import BucketPipe, stream_weights

    if rank != 0:
        stats = stream_weights(model, config, dtype=torch.bfloat16, bucket_bytes=bucket_bytes, sink=None)
        return {"buckets": stats.buckets, "largest_bucket_mib": round(stats.largest / MIB, 1)}
    from gyre.runtime.controller.transitions import stream_to_engines

    pipe = BucketPipe(slots=2)
    done = {}

    async def send():
        engine = await RemoteEngine.connect(url)
        loop = asyncio.get_running_loop()

        def start():
            def produce():
                done["stats"] = stream_weights(
                    model, config, dtype=torch.bfloat16, bucket_bytes=bucket_bytes, sink=pipe
                )

            return loop.run_in_executor(None, produce)

        try:
            return await stream_to_engines([engine], pipe, start, version=1, timeout_s=600)
        finally:
            await engine.close()

    phases = asyncio.run(send())
    stats = done["stats"]
    return {
        "buckets": stats.buckets,
        "largest_bucket_mib": round(stats.largest / MIB, 1),
        "most_buckets_held": pipe.most_in_use,
        "phases_s": {k: round(v, 2) for k, v in phases.items() if k != "bytes"},
    }


class EngineServer:
    """`python -m gyre.engine serve` on `path` in bf16, in a process of its own; stopped by its PID."""

    def __init__(self, path: Path):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gyre.engine", "serve", f"model_dir={path}", "engine.dtype=bfloat16"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        deadline = time.monotonic() + 600
        for line in self.process.stdout:
            if "engine endpoint:" in line:
                self.url = line.split("engine endpoint:")[1].strip()
                return
            if time.monotonic() > deadline:
                break
        self.stop()
        raise RuntimeError("the engine server did not start")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)


def main(out: Path | None, bucket_mib: int) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="gyre-publication-memory-"))
    configs = {"dense": dense_config(), "moe": moe_config()}
    runs, parameters = [], {}
    try:
        for model in configs:
            began = time.perf_counter()
            kwargs = {"path": str(workdir / model), "model": model}
            parameters[model] = run_local(f"{__file__}:write_worker", 1, kwargs=kwargs, timeout_s=TIMEOUT_S)[0]
            print(f"{model}: {parameters[model] / 1e6:.0f}M parameters ({time.perf_counter() - began:.0f} s)")
        for model, name, tp, pp, ep in LAYOUTS:
            server = EngineServer(workdir / model)
            try:
                for how in PATHS:
                    kwargs = {"path": str(workdir / model), "tp": tp, "pp": pp, "ep": ep, "how": how}
                    kwargs |= {"url": server.url, "bucket_mib": bucket_mib}
                    ranks = tp * pp * max(1, ep // tp)
                    try:
                        per_rank = run_local(
                            f"{__file__}:publication_worker", ranks, kwargs=kwargs, timeout_s=TIMEOUT_S
                        )
                    except LocalRunError as error:  # the old path at PP 2 may not fit the machine
                        if "exit -9" not in str(error):
                            raise
                        print(f"{name} {how}: killed (out of memory)")
                        runs.append({"layout": name, "model": model, "path": how, "out_of_memory": True})
                        continue
                    runs.append({"layout": name, "model": model, "path": how, "ranks": per_rank})
                    summary = [{k: r[k] for k in ("growth_gib", "peak_rss_gib")} for r in per_rank]
                    print(f"{name} {how}: critical path {per_rank[0]['critical_path_s']} s; {summary}")
            finally:
                server.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    checks = {}
    for _, name, *_ in LAYOUTS:
        stream = next(r for r in runs if r["layout"] == name and r["path"] == "stream")
        gather = next(r for r in runs if r["layout"] == name and r["path"] == "gather")
        largest = max(r["largest_bucket_mib"] for r in stream["ranks"])
        bound_gib = (2 * max(bucket_mib, largest) + CONSTANT_MIB) / 1024
        fits = "ranks" in gather
        checks[name] = {
            "stream_growth_max_gib": max(r["growth_gib"] for r in stream["ranks"]),
            "gather_growth_max_gib": max(r["growth_gib"] for r in gather["ranks"]) if fits else "out of memory",
            "bound_gib": round(bound_gib, 3),
            "within_bound": all(r["growth_gib"] <= bound_gib for r in stream["ranks"]),
            "critical_path_s": {
                "gather": gather["ranks"][0]["critical_path_s"] if fits else None,
                "stream": stream["ranks"][0]["critical_path_s"],
            },
        }
    emit(
        {
            "benchmark": "publication_memory",
            "models": {m: dataclasses.asdict(c) for m, c in configs.items()},
            "parameters": parameters,
            "dtype": "bfloat16 (trainer and engine)",
            "bucket_mib": bucket_mib,
            "constant_mib": CONSTANT_MIB,
            "runs": runs,
            "checks": checks,
            "note": "CPU, gloo; growth = VmHWM during the publication - VmRSS before it, per core rank; the engine "
            "runs in a process of its own (not counted)",
        },
        out,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--bucket-mib", type=int, default=64)
    args = parser.parse_args()
    main(args.out, args.bucket_mib)
