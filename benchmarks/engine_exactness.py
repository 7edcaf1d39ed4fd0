"""The native engine's behavior log-probs vs a teacher-forced forward, and the bytes release/resume moves.

Seven sampling settings (temperature 1, 0.7, 1.3; top-k 5; top-p 0.8; temperature 0.8 with top-k 20 and top-p 0.9;
top-p 0.95), served concurrently (continuous batching), 32 tokens each; the largest |engine log-prob -
`sequence_logprobs`| over all tokens, on the sharpened test model and on the tiny default model (target 1e-5).
Then the tiny default model's `memory_bytes()` before `release_memory`, after it and after `resume_memory`.
Prints one JSON object (last line).

    python benchmarks/engine_exactness.py [--out benchmarks/results/engine_exactness.json]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import random
import sys
from pathlib import Path

import torch
from report import emit

from gyre.engine.native import NativeEngine
from gyre.engine.protocol import GenerateRequest, SamplingParams
from gyre.engine.sampling import sequence_logprobs
from gyre.models.hf_weights import load_pretrained
from gyre.models.tiny import tiny_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
from engine_fixtures import VOCAB, sharp_tiny_model  # the tests' sharpened model

SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.8), (0.8, 20, 0.9), (1.0, 0, 0.95)]


def request(rid: str, prompt, params: SamplingParams) -> GenerateRequest:
    return GenerateRequest(request_id=rid, execution_id=rid, input_ids=prompt, params=params)


async def max_logprob_error(model, vocab: int) -> float:
    engine = NativeEngine(copy.deepcopy(model), max_running=8)
    rng = random.Random(0)
    cases = [
        SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=32, seed=i)
        for i, (t, k, p) in enumerate(SETTINGS)
    ]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(4, 40))] for _ in cases]
    results = await asyncio.gather(
        *(engine.generate(request(f"r{i}", p, c)) for i, (p, c) in enumerate(zip(prompts, cases, strict=True)))
    )
    await engine.close()
    worst = 0.0
    for prompt, params, result in zip(prompts, cases, results, strict=True):
        reference = sequence_logprobs(model, prompt, result.output_ids, params)
        worst = max(worst, (torch.tensor(result.output_logprobs) - reference).abs().max().item())
    return worst


async def memory_bytes(model) -> dict:
    engine = NativeEngine(copy.deepcopy(model), max_running=4)
    params = SamplingParams(max_new_tokens=64)
    await asyncio.gather(*(engine.generate(request(f"m{i}", [1, 2, 3, i + 4], params)) for i in range(4)))
    before = engine.memory_bytes()
    await engine.release_memory()
    released = engine.memory_bytes()
    await engine.resume_memory()
    resumed = engine.memory_bytes()
    await engine.close()
    return {"before": before, "released": released, "resumed": resumed}


async def main(out: Path | None) -> None:
    tiny = load_pretrained(tiny_model_dir())
    emit(
        {
            "benchmark": "engine_exactness",
            "settings": [{"temperature": t, "top_k": k, "top_p": p} for t, k, p in SETTINGS],
            "max_abs_logprob_error": {
                "sharp_test_model": await max_logprob_error(sharp_tiny_model(), VOCAB),
                "tiny_default_model": await max_logprob_error(tiny, tiny.config.vocab_size),
            },
            "target": 1e-5,
            "memory_bytes_tiny_default": await memory_bytes(tiny),
        },
        out,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    asyncio.run(main(parser.parse_args().out))
