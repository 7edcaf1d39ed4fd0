"""Peak memory of loading a ~0.6B-parameter Qwen3-layout checkpoint into the Megatron trainer at TP = 1 and TP = 2.

A checkpoint with Qwen3-0.6B's layout (`CONFIG`: 28 layers, hidden 1,024, 16 query and 8 KV heads of 128, MLP
3,072, a 151,936-token vocabulary, tied embeddings; 596M parameters) and random bf16 weights, as real Qwen3
checkpoints are stored, is written once to a temporary directory in files of at most 1 GB with an index. Then for
each loader and TP size, one fresh run of `gyre.distributed.local` ranks over gloo, each of which builds its
Megatron shard in fp32 (the trainer's dtype on CPU) and fills it:

- `sharded` (what the runtime does, `gyre.trainer.shard_loading.load_hf_checkpoint`): the model built without random
  init, then each tensor's share for this rank read from its file slice by slice;
- `whole` (what it did before): every rank reads the whole checkpoint in fp32 (`load_pretrained`), converts it and
  loads its shard (`load_hf_state_dict`).

Reported per rank: peak resident memory (`VmHWM`, which includes the ~0.5 GiB of torch and megatron-core every rank
has imported), resident memory before loading, and the load's wall time. Check (docs/training.md, "Sharded
loading"): the sharded peak per rank at TP = 2 <= 0.6 x at TP = 1.

    python benchmarks/load_memory.py [--out benchmarks/results/load_memory.json] [--keep DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
import time
from pathlib import Path

from report import emit

from gyre.distributed.local import run_local

GIB = 1 << 30
LOADERS = ("sharded", "whole")
TP_SIZES = (1, 2)
MAX_SHARD_BYTES = 1 << 30


def model_config():
    from gyre.models.decoder_config import DecoderConfig

    return DecoderConfig(
        model_type="qwen3",
        vocab_size=151_936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40_960,
        rope_theta=1_000_000.0,
        qk_norm=True,
        tie_word_embeddings=True,
    )


def write_checkpoint(path: Path, config=None) -> int:
    """Random bf16 weights of `config` (default `model_config()`) in HF layout under `path`, in files of at most
    1 GB with an index; returns the parameter count."""
    import torch

    from gyre.models.decoder import DecoderLM
    from gyre.models.hf_weights import save_pretrained

    config = config or model_config()
    with torch.device("meta"):
        model = DecoderLM(config)
    generator = torch.Generator().manual_seed(0)
    state = {
        name: (torch.randn(t.shape, generator=generator) * 0.02).to(torch.bfloat16)
        for name, t in model.state_dict().items()
    }
    model.load_state_dict(state, assign=True)
    save_pretrained(model, path, max_shard_bytes=MAX_SHARD_BYTES)
    return sum(t.numel() for t in state.values())


def resident_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def load_worker(rank: int, world_size: int, *, loader: str, path: str) -> dict:
    import torch

    from gyre.models.decoder_config import read_config
    from gyre.models.hf_weights import load_pretrained
    from gyre.trainer.model import build_gpt_model, init_model_parallel

    init_model_parallel(tensor_parallel_size=world_size, seed=0)
    config = read_config(path)
    before = resident_bytes("VmRSS")
    started = time.perf_counter()
    if loader == "sharded":
        from gyre.trainer.shard_loading import load_hf_checkpoint

        model = build_gpt_model(config, perform_initialization=False)
        load_hf_checkpoint(model, path, config)
    else:
        from gyre.trainer.convert import load_hf_state_dict

        model = build_gpt_model(config)
        native = load_pretrained(path, torch.float32, "cpu")
        load_hf_state_dict(model, native.state_dict(), config)
        del native
    elapsed = time.perf_counter() - started
    peak = resident_bytes("VmHWM")  # before the checksum, which must not add to it either (no fp64 copies)
    checksum = float(sum(p.detach().sum(dtype=torch.float64) for p in model.parameters()))
    return {
        "peak_rss_gib": round(peak / GIB, 3),
        "rss_before_load_gib": round(before / GIB, 3),
        "rss_after_load_gib": round(resident_bytes("VmRSS") / GIB, 3),
        "parameter_gib": round(sum(p.numel() * p.element_size() for p in model.parameters()) / GIB, 3),
        "load_s": round(elapsed, 2),
        "checksum": checksum,
    }


def main(out: Path | None, keep: Path | None) -> None:
    workdir = keep or Path(tempfile.mkdtemp(prefix="gyre-load-memory-"))
    try:
        if not (workdir / "config.json").is_file():
            began = time.perf_counter()
            parameters = write_checkpoint(workdir)
            print(f"wrote {parameters / 1e6:.0f}M parameters to {workdir} ({time.perf_counter() - began:.0f} s)")
        else:
            parameters = None
        files_gib = sum(f.stat().st_size for f in workdir.glob("*.safetensors")) / GIB
        runs = []
        for loader in LOADERS:
            for tp in TP_SIZES:
                per_rank = run_local(
                    f"{__file__}:load_worker", tp, kwargs={"loader": loader, "path": str(workdir)}, timeout_s=1800
                )
                runs.append({"loader": loader, "tensor_parallel_size": tp, "ranks": per_rank})
                print(f"{loader} TP={tp}: {[{k: r[k] for k in ('peak_rss_gib', 'load_s')} for r in per_rank]}")
    finally:
        if keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    peak = {(r["loader"], r["tensor_parallel_size"]): max(x["peak_rss_gib"] for x in r["ranks"]) for r in runs}
    growth = {
        (r["loader"], r["tensor_parallel_size"]): max(x["peak_rss_gib"] - x["rss_before_load_gib"] for x in r["ranks"])
        for r in runs
    }
    ratio = peak[("sharded", 2)] / peak[("sharded", 1)]
    checksums = {(r["loader"], r["tensor_parallel_size"]): [x["checksum"] for x in r["ranks"]] for r in runs}
    emit(
        {
            "benchmark": "load_memory",
            "model": dataclasses.asdict(model_config()),
            "parameters": parameters,
            "checkpoint_gib": round(files_gib, 3),
            "checkpoint_dtype": "bfloat16",
            "trainer_dtype": "float32",
            "runs": runs,
            "checks": {
                "sharded_peak_tp2_over_tp1": round(ratio, 3),
                "at_most_0.6": ratio <= 0.6,
                "sharded_growth_tp2_over_tp1": round(growth[("sharded", 2)] / growth[("sharded", 1)], 3),
                "whole_peak_tp2_over_tp1": round(peak[("whole", 2)] / peak[("whole", 1)], 3),
                "sharded_over_whole_peak_tp2": round(peak[("sharded", 2)] / peak[("whole", 2)], 3),
                "same_weights_as_whole": all(checksums[("sharded", tp)] == checksums[("whole", tp)] for tp in TP_SIZES),
            },
            "note": "CPU, gloo; peak RSS per rank includes the ~0.5 GiB of torch and megatron-core each rank imports; "
            "growth = peak - RSS before loading",
        },
        out,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep", type=Path, default=None, help="write (or reuse) the checkpoint here; not deleted")
    args = parser.parse_args()
    main(args.out, args.keep)
