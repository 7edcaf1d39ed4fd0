"""Peak memory of one training micro-step on one long row: each trainer, 16K-64K tokens, two vocabulary sizes.

For every (trainer, tokens, vocabulary) one fresh run of `gyre.distributed.local` ranks (1, or 2 for Megatron at
TP = 2): build a small Qwen3-layout model (`CONFIG`: 2 layers, hidden 64, 2 heads of 32; the vocabulary as
given, tied embeddings), then one micro-step on one row of random tokens: log-probs (`Trainable.logprobs`, the
long-row path: causal SDPA per row, THD packing in Megatron, log-probs a chunk of tokens at a time), a mean
log-prob loss, backward, clipping and AdamW; the machine's cores shared by the run's ranks (torch threads).
Reported per rank: the peak resident memory (`VmHWM`, which includes
the imports of torch and megatron-core every rank has made) and the resident memory before the step, and the
step's wall time. The checks of docs/training.md, "Long rows": 64K tokens fit in 6 GiB per rank, peak(64K) /
peak(16K) <= 4.5 (linear in L, not quadratic), and at a 151,936-token vocabulary the peak grows by about the
chunks' logits, not by `L x vocab` (64K x 151,936 fp32 logits alone would be 37 GiB).

    python benchmarks/long_rows.py [--tokens 16384 32768 65536] [--out benchmarks/results/long_rows.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

from report import emit

from gyre.distributed.local import run_local

SMALL_VOCAB, QWEN_VOCAB = 512, 151_936
TRAINERS = {"native": 1, "megatron_tp1": 1, "megatron_tp2": 2}  # trainer -> ranks
CHUNK_TOKENS = 1024
THREADS = os.cpu_count() or 1  # torch threads, shared by a run's ranks (more than the cores thrash)
GIB = 1 << 30


def model_config(vocab_size: int, max_positions: int):
    from gyre.models.decoder_config import DecoderConfig

    return DecoderConfig(
        model_type="qwen3",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=max_positions,
        qk_norm=True,
        tie_word_embeddings=True,
    )


def resident_bytes(field: str) -> int:
    """`VmHWM` (peak) or `VmRSS` (now) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def step_worker(rank: int, world_size: int, *, trainer: str, tokens: int, vocab: int, recompute: str) -> dict:
    from types import SimpleNamespace

    import numpy as np
    import torch

    from gyre.models.decoder import build_model

    torch.manual_seed(0)
    config = model_config(vocab, max(tokens, 4096))
    native = build_model(config, seed=0)
    if trainer == "native":
        from gyre.trainer.native_trainable import NativeTrainable

        trainable = NativeTrainable(native, lr=1e-4, chunk_tokens=CHUNK_TOKENS, recompute=recompute)
    else:
        from gyre.trainer.convert import load_hf_state_dict
        from gyre.trainer.megatron_trainable import MegatronTrainable
        from gyre.trainer.model import build_gpt_model, init_model_parallel

        init_model_parallel(tensor_parallel_size=world_size, seed=0)
        model = build_gpt_model(config, recompute=recompute)
        load_hf_state_dict(model, native.state_dict(), config)
        del native
        model.train()
        trainable = MegatronTrainable(model, lr=1e-4, chunk_tokens=CHUNK_TOKENS)
    ids = np.random.default_rng(1).integers(0, vocab, size=tokens).astype(np.int64)
    row = SimpleNamespace(ids_U=ids, row_offsets_R1=np.array([0, tokens], dtype=np.int64))
    before = resident_bytes("VmRSS")
    started = time.perf_counter()
    logp = trainable.logprobs(row)
    (-logp.sum() / tokens).backward()
    trainable.update()
    return {
        "peak_rss_gib": round(resident_bytes("VmHWM") / GIB, 3),
        "rss_before_step_gib": round(before / GIB, 3),
        "step_s": round(time.perf_counter() - started, 2),
    }


def main(tokens_list: list[int], recompute: str, out: Path | None) -> None:
    runs = []
    for vocab in (SMALL_VOCAB, QWEN_VOCAB):
        for trainer, ranks in TRAINERS.items():
            # At the large vocabulary the output projection dominates the time: the shortest and longest rows only.
            for tokens in tokens_list if vocab == SMALL_VOCAB else sorted({min(tokens_list), max(tokens_list)}):
                began = time.perf_counter()
                kwargs = {"trainer": trainer, "tokens": tokens, "vocab": vocab, "recompute": recompute}
                env = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": str(max(1, THREADS // ranks))}
                per_rank = run_local(f"{__file__}:step_worker", ranks, kwargs=kwargs, timeout_s=3600, env=env)
                run = {"trainer": trainer, "tokens": tokens, "vocab": vocab, "ranks": per_rank}
                run["peak_rss_gib_max"] = max(r["peak_rss_gib"] for r in per_rank)
                runs.append(run)
                print(f"{trainer} vocab {vocab} {tokens} tokens: {per_rank} ({time.perf_counter() - began:.0f} s)")
    checks = {}
    longest, shortest = max(tokens_list), min(tokens_list)
    for vocab in (SMALL_VOCAB, QWEN_VOCAB):
        for trainer in TRAINERS:
            peak = {r["tokens"]: r["peak_rss_gib_max"] for r in runs if r["trainer"] == trainer and r["vocab"] == vocab}
            checks[f"{trainer}_vocab{vocab}"] = {
                f"peak_{longest}_gib": peak[longest],
                f"fits_6_gib_at_{longest}": peak[longest] <= 6.0,
                f"peak_ratio_{longest}_over_{shortest}": round(peak[longest] / peak[shortest], 3),
                "ratio_at_most_4.5": peak[longest] / peak[shortest] <= 4.5,
            }
    for trainer in TRAINERS:
        small = next(r for r in runs if (r["trainer"], r["tokens"], r["vocab"]) == (trainer, longest, SMALL_VOCAB))
        large = next(r for r in runs if (r["trainer"], r["tokens"], r["vocab"]) == (trainer, longest, QWEN_VOCAB))
        checks[f"{trainer}_vocab_growth_at_{longest}"] = {
            "peak_growth_gib": round(large["peak_rss_gib_max"] - small["peak_rss_gib_max"], 3),
            "full_logits_would_be_gib": round(longest * QWEN_VOCAB * 4 / TRAINERS[trainer] / GIB, 2),
        }
    emit(
        {
            "benchmark": "long_rows",
            "model": {**dataclasses.asdict(model_config(SMALL_VOCAB, 4096)), "vocab_size": [SMALL_VOCAB, QWEN_VOCAB]},
            "recompute": recompute,
            "logprob_chunk_tokens": CHUNK_TOKENS,
            "runs": runs,
            "checks": checks,
            "note": "CPU, fp32, one row per micro-step; peak RSS includes the ~0.5 GiB of torch and megatron-core "
            "imported in every rank",
        },
        out,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768, 65536])
    parser.add_argument("--recompute", default="full", choices=["none", "selective", "full"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    main(args.tokens, args.recompute, args.out)
