"""Role-swap overhead of one cell in one process: the native engine and a Megatron trainable of the same model.

The cell starts in rollout (engine serving, trainer offloaded). Each repetition:
- rollout -> training: engine `stop_accepting` + `drain` (no request is in flight here, so drain returns at once;
  in a run it waits for, or aborts, the requests still decoding) + `release_memory(weights=True, kv=True)`, then
  trainer `restore()`;
- one training step (two micro-steps of random rows, AdamW update; timed apart, not part of the swap);
- training -> rollout: `gather_hf_state_dict` from the trainer (before `offload()`: an offloaded model has no
  bytes to gather), trainer `offload()`, engine `resume_memory` + `update_weights(new weights, version + 1)` +
  `resume_accepting`;
- a check: one greedy request to the engine gives the same tokens as a fresh engine built from the trainer's
  gathered weights.
Reports seconds (median, min, max) of each direction and of its parts, `memory_bytes()` of engine and trainer in
each role, and the machine. The model is the tiny default model (fp32, CPU): the figures measure the mechanism's
fixed costs, not the paper's 8.52 s / 3.46 s at scale. Prints one JSON object (last line).

    python benchmarks/role_swap.py [--repeats 10] [--quick] [--out benchmarks/results/role_swap.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from report import emit

from gyre.engine.native import NativeEngine
from gyre.engine.protocol import GenerateRequest, SamplingParams
from gyre.models.decoder import build_model
from gyre.models.decoder_config import read_config
from gyre.models.hf_weights import load_pretrained, read_state_dict
from gyre.models.tiny import tiny_model_dir
from gyre.trainer.convert import gather_hf_state_dict, load_hf_state_dict
from gyre.trainer.logprobs import packed_logprobs
from gyre.trainer.megatron_trainable import MegatronTrainable
from gyre.trainer.model import build_gpt_model, init_model_parallel
from gyre.trainer.offload import TrainerState

PROMPT = list(range(5, 37))  # 32 token ids of the tiny vocabulary
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)
LOAD_AT_START = os.getloadavg()[0]  # the machine may be shared: context for the spread of the timings
PAPER_S = {"rollout_to_training": 8.52, "training_to_rollout": 3.46}  # the paper's averages, at their scale


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def train_step(trainable: MegatronTrainable, vocab_size: int, generator: torch.Generator) -> None:
    """Two micro-steps of the negative log-likelihood of random rows (a stand-in for the RL loss), one update."""
    for _ in range(2):
        row = torch.randint(0, vocab_size, (64,), generator=generator)
        (-packed_logprobs(trainable.model, row, [0, 32, 64]).sum()).backward()
    trainable.update()


async def greedy(engine: NativeEngine, request_id: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The greedy tokens of `PROMPT` and their log-probs."""
    request = GenerateRequest(request_id=request_id, execution_id=request_id, input_ids=PROMPT, params=GREEDY)
    result = await engine.generate(request)
    return result.output_ids, result.output_logprobs


async def fresh_engine_greedy(config, hf: dict[str, torch.Tensor]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    model = build_model(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(hf[name])
    engine = NativeEngine(model.eval(), max_running=1)
    try:
        return await greedy(engine, "fresh")
    finally:
        await engine.close()


def memory(engine: NativeEngine, trainer: TrainerState) -> dict:
    return {"engine": engine.memory_bytes(), "trainer": trainer.memory_bytes(), "trainer_host": trainer.host_bytes}


async def run(repeats: int) -> dict:
    path = tiny_model_dir()
    config = read_config(path)
    state = read_state_dict(path, dtype=torch.float32, device="cpu")
    engine = NativeEngine(load_pretrained(path), max_running=4)
    megatron_model = build_gpt_model(config)
    load_hf_state_dict(megatron_model, state, config)
    num_parameters = sum(p.numel() for p in megatron_model.parameters())
    trainable = MegatronTrainable(megatron_model, lr=1e-3)
    trainer = TrainerState(trainable)
    generator = torch.Generator().manual_seed(0)

    # Start in rollout: the trainer has optimizer state (one step taken) and is offloaded; the engine holds KV.
    train_step(trainable, config.vocab_size, generator)
    hf = gather_hf_state_dict(megatron_model, config)
    trainer.offload()
    version = 1
    await engine.update_weights(hf, version=version)
    previous = await greedy(engine, "warm")

    to_training: dict[str, list[float]] = {"total_s": [], "drain_s": [], "release_memory_s": [], "restore_s": []}
    to_rollout: dict[str, list[float]] = {
        "total_s": [],
        "gather_s": [],
        "offload_s": [],
        "resume_memory_s": [],
        "update_weights_s": [],
    }
    train_s: list[float] = []
    checks: list[bool] = []
    changed: list[bool] = []
    memory_by_role: dict[str, dict] = {}
    for rep in range(repeats):
        memory_by_role["rollout"] = memory(engine, trainer)
        t0 = time.perf_counter()
        engine.stop_accepting()
        await engine.drain()  # nothing in flight: returns at once
        t1 = time.perf_counter()
        await engine.release_memory(weights=True, kv=True)
        t2 = time.perf_counter()
        trainer.restore()
        t3 = time.perf_counter()
        for key, value in zip(to_training, (t3 - t0, t1 - t0, t2 - t1, t3 - t2), strict=True):
            to_training[key].append(value)
        memory_by_role["training"] = memory(engine, trainer)

        start = time.perf_counter()
        train_step(trainable, config.vocab_size, generator)
        train_s.append(time.perf_counter() - start)

        t0 = time.perf_counter()
        hf = gather_hf_state_dict(megatron_model, config)
        t1 = time.perf_counter()
        trainer.offload()
        t2 = time.perf_counter()
        await engine.resume_memory(weights=True, kv=True)
        t3 = time.perf_counter()
        version += 1
        await engine.update_weights(hf, version=version)
        engine.resume_accepting()
        t4 = time.perf_counter()
        for key, value in zip(to_rollout, (t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            to_rollout[key].append(value)
        memory_by_role["rollout_after_swap"] = memory(engine, trainer)

        # Tokens and log-probs equal to a fresh engine's: the served weights are exactly the trainer's; log-probs
        # that differ from the previous version's: the update took effect (the tiny model's tokens may not move).
        served = await greedy(engine, f"check-{rep}")
        checks.append(served == await fresh_engine_greedy(config, hf))
        changed.append(served[1] != previous[1])
        previous = served
    await engine.close()
    if not all(checks):
        raise AssertionError(f"greedy output after a swap differs from a fresh engine's: {checks} (per repetition)")
    return {
        "benchmark": "role_swap",
        "model": {
            "name": "tiny default model (gyre.models.tiny)",
            "dtype": "float32",
            "device": "cpu",
            "parameters": num_parameters,
            "num_hidden_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
        },
        "repeats": repeats,
        "rollout_to_training": {key: summary(values) for key, values in to_training.items()},
        "training_to_rollout": {key: summary(values) for key, values in to_rollout.items()},
        "train_step_s": summary(train_s),
        "memory_bytes": memory_by_role,
        "greedy_equal_fresh_engine": all(checks),  # tokens and log-probs, every repetition
        "greedy_logprobs_changed_every_update": all(changed),
        "greedy_tokens_last": list(served[0]),
        "policy_version_last": version,
        "paper_seconds": PAPER_S,
        "load_average_1m_at_start": LOAD_AT_START,
        "notes": [
            "no request is in flight at the swap: drain returns at once (in a run it waits or aborts after a deadline)",
            "training -> rollout gathers the HF weights before offload(): an offloaded trainer has nothing to gather",
            "CPU: release/offload free the device-side tensors (memory_bytes drops) but process RAM does not: the "
            "engine keeps its host copy in the same storage, the trainer's bytes move to its host buffer",
            "tiny fp32 model on CPU: fixed costs of the mechanism, not comparable to the paper's figures at scale",
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="3 repeats: a smoke run")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    repeats = 3 if args.quick else args.repeats
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="gyre-role-swap-") as scratch:
        dist.init_process_group("gloo", init_method=f"file://{scratch}/store", rank=0, world_size=1)
        try:
            init_model_parallel(1, 1, seed=0)
            result = asyncio.run(run(repeats))
        finally:
            dist.destroy_process_group()
    emit(result, args.out)


if __name__ == "__main__":
    main()
