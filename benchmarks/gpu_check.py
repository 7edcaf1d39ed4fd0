"""The GPU check: what a lent device must show, in one command and a few minutes (docs/cluster.md, "The GPU check").

    python benchmarks/gpu_check.py [--device cuda|cpu] [--out benchmarks/results/gpu_check.json]

Without a CUDA device (and without `--device cpu`) it prints why and exits 0: skipped. `--device cpu` runs every
step on the CPU over gloo: that is how the tests keep this script working on machines without a GPU
(`tests/integration/test_gpu_check.py`); its figures say nothing about a GPU. On a lent device run
`pytest -m gpu && python benchmarks/gpu_check.py` (the GPU tests, then this).

Steps, each timed and checked; every step runs, then a failed check exits 1:
1. **process group**: a world of 1 through `gyre.distributed.backends` (on CUDA `cpu:gloo,cuda:nccl` bound to the
   GPU with `device_id`): an all_reduce of a device tensor and of a CPU tensor each return their input.
2. **native engine on the device**: the tiny default model's shape (random init), fp32; 8 requests of 32 tokens
   sampled concurrently (temperature 1, seeded); tokens/s; its behavior log-probs against a teacher-forced
   forward on the device (`sequence_logprobs`), max |difference| <= 1e-4.
3. **engine vs trainer**: a Megatron model at TP = 1 on the device holding the engine's weights scores the
   engine's rows; max |trainer - engine| log-prob over the sampled tokens: fp32 <= 1e-3, and the bf16 gap
   reported (mean; docs/training.md, "Precision", has CPU's ~1e-3).
4. **a bf16 Megatron step**: that model in bf16 with fp32 main weights, one micro-step of those rows (the negative
   log-likelihood) and an update: finite gradient norm, weights changed, seconds.
5. **role swap memory**: the trainer's `offload()` and the engine's `release_memory()`: on CUDA
   `torch.cuda.memory_allocated` must drop by at least 90% of what their `memory_bytes()` count, and as much come
   back after `restore()` / `resume_memory()`; on the CPU the objects' own counts.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from report import emit

ROWS = 8
NEW_TOKENS = 32
PROMPT_TOKENS = 24
ENGINE_EXACT = 1e-4  # the engine's behavior log-probs vs its own model teacher-forced (CPU: ~1e-6)
TRAINER_EXACT_FP32 = 1e-3  # Megatron's kernels vs the native decoder's on the same weights
RELEASED_SHARE = 0.9  # of the bytes `memory_bytes()` counts, what memory_allocated must lose at a release


def skip_reason(device: str) -> str | None:
    if device == "cuda" and not torch.cuda.is_available():
        return "needs a CUDA device: torch.cuda.is_available() is False here (CPU-only machine or CPU torch)"
    return None


def allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def process_group(device: torch.device) -> dict[str, Any]:
    from gyre.distributed.backends import choose_backends

    backends = choose_backends(
        (device.type, device.type), local_rank=0, visible_gpus=torch.cuda.device_count() if device.type == "cuda" else 0
    )
    init: dict[str, Any] = {"backend": backends.default}
    if backends.device_index is not None:
        torch.cuda.set_device(backends.device_index)
        init["device_id"] = torch.device("cuda", backends.device_index)
    store = Path(tempfile.mkdtemp(prefix="gyre-gpu-check-")) / "store"
    dist.init_process_group(**init, init_method=f"file://{store}", rank=0, world_size=1)
    ok = True
    for where in {device, torch.device("cpu")}:
        tensor = torch.arange(4.0, device=where)
        dist.all_reduce(tensor)
        ok = ok and torch.equal(tensor.cpu(), torch.arange(4.0))
    return {"backend": backends.default, "device_index": backends.device_index, "ok": ok}


def tiny_config():
    from gyre.config import TinyModelSpec
    from gyre.models.tiny import decoder_config

    spec = TinyModelSpec()
    return decoder_config(spec, vocab_size=spec.vocab_size, bos_token_id=0, eos_token_id=2)


async def sample_rows(model, device: torch.device) -> dict[str, Any]:
    from gyre.engine.native import NativeEngine
    from gyre.engine.protocol import GenerateRequest, SamplingParams
    from gyre.engine.sampling import sequence_logprobs

    engine = NativeEngine(model, max_running=ROWS)
    generator = np.random.default_rng(0)
    prompts = [generator.integers(3, model.config.vocab_size, PROMPT_TOKENS).tolist() for _ in range(ROWS)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=i) for i in range(ROWS)]
    started = time.perf_counter()
    results = await asyncio.gather(
        *(
            engine.generate(GenerateRequest(request_id=f"r{i}", execution_id=f"e{i}", input_ids=p, params=q))
            for i, (p, q) in enumerate(zip(prompts, params, strict=True))
        )
    )
    seconds = time.perf_counter() - started
    worst = 0.0
    with torch.no_grad():
        for prompt, param, result in zip(prompts, params, results, strict=True):
            reference = sequence_logprobs(model, prompt, result.output_ids, param).cpu()
            worst = max(worst, (torch.tensor(result.output_logprobs) - reference).abs().max().item())
    memory = {"counted": sum(engine.memory_bytes().values()), "allocated_before": allocated(device)}
    await engine.release_memory(weights=True, kv=True)
    memory["allocated_released"] = allocated(device)
    memory["counted_released"] = sum(engine.memory_bytes().values())
    await engine.resume_memory(weights=True, kv=True)
    memory["allocated_resumed"] = allocated(device)
    await engine.close()
    tokens = sum(len(r.output_ids) for r in results)
    return {
        "rows": [(p, list(r.output_ids), list(r.output_logprobs)) for p, r in zip(prompts, results, strict=True)],
        "tokens_per_s": tokens / seconds,
        "max_logprob_error": worst,
        "memory": memory,
    }


def microstep(rows):
    from gyre.data.microstep import TokenRow, build_microstep

    token_rows = []
    for i, (prompt, output, logprobs) in enumerate(rows):
        ids = np.array(prompt + output, dtype=np.int64)
        targets = np.arange(len(ids)) >= len(prompt)
        behavior = np.zeros(len(ids))
        behavior[targets] = logprobs
        token_rows.append(
            TokenRow(
                group_id=0,
                execution=f"e{i}",
                leaf=0,
                role="main",
                ids=ids,
                targets=targets,
                behavior_logprobs=behavior,
                advantage=1.0,
                execution_num_targets=int(targets.sum()),
                batch_execution=i,
            )
        )
    return build_microstep(0, 0, token_rows, num_executions=len(token_rows))


def megatron(config, hf_state, dtype: torch.dtype, device: torch.device):
    from gyre.trainer.convert import load_hf_state_dict
    from gyre.trainer.megatron_trainable import MegatronTrainable
    from gyre.trainer.model import build_gpt_model

    model = build_gpt_model(config, dtype=dtype)
    load_hf_state_dict(model, hf_state, config)
    return MegatronTrainable(model.to(device).train(), lr=1e-4, max_grad_norm=1.0)


def trainer_steps(config, model, rows, device: torch.device) -> dict[str, Any]:
    from gyre.trainer.model import init_model_parallel
    from gyre.trainer.offload import TrainerState

    init_model_parallel(1, 1, seed=0)
    step = microstep(rows)
    behavior = torch.from_numpy(step.behavior_logp_U)[torch.from_numpy(step.target_U)]
    state = {name: t.detach().cpu().float() for name, t in model.state_dict().items()}
    out: dict[str, Any] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        trainable = megatron(config, state, dtype, device)
        with torch.no_grad():
            logprobs = trainable.logprobs(step).float().cpu()[torch.from_numpy(step.target_U)]
        gap = (logprobs - behavior).abs()
        out[f"engine_vs_trainer_{name}"] = {"max": gap.max().item(), "mean": gap.mean().item()}
        if dtype is torch.bfloat16:
            before = [p.detach().clone() for p in trainable.parameters()]
            started = time.perf_counter()
            (-trainable.logprobs(step).sum()).backward()
            update = trainable.update()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            out["bf16_step"] = {
                "seconds": time.perf_counter() - started,
                "grad_norm": update["grad_norm"],
                "changed": any(not torch.equal(p, b) for p, b in zip(trainable.parameters(), before, strict=True)),
            }
            trainer = TrainerState(trainable)
            counted = sum(trainer.memory_bytes().values())
            memory = {"counted": counted, "allocated_before": allocated(device)}
            trainer.offload()
            memory["allocated_released"] = allocated(device)
            memory["counted_released"] = sum(trainer.memory_bytes().values())
            trainer.restore()
            memory["allocated_resumed"] = allocated(device)
            out["trainer_memory"] = memory
    return out


def released_enough(memory: dict[str, Any]) -> bool:
    if memory["allocated_before"] is None:  # CPU: the object's own count
        return memory["counted_released"] == 0
    dropped = memory["allocated_before"] - memory["allocated_released"]
    returned = memory["allocated_resumed"] - memory["allocated_released"]
    return min(dropped, returned) >= RELEASED_SHARE * memory["counted"]


def main(device_name: str, out: Path | None) -> int:
    reason = skip_reason(device_name)
    if reason is not None:
        emit({"benchmark": "gpu_check", "skipped": reason}, out)
        return 0
    from gyre.models.decoder import build_model

    device = torch.device("cuda", 0) if device_name == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 in the exactness checks
        torch.backends.cudnn.allow_tf32 = False
    began = time.perf_counter()
    timings: dict[str, float] = {}
    started = time.perf_counter()
    group = process_group(device)
    timings["process_group_s"] = time.perf_counter() - started
    config = tiny_config()
    torch.manual_seed(0)
    model = build_model(config).to(device).eval()
    started = time.perf_counter()
    engine = asyncio.run(sample_rows(model, device))
    timings["engine_s"] = time.perf_counter() - started
    started = time.perf_counter()
    trainer = trainer_steps(config, model, engine["rows"], device)
    timings["trainer_s"] = time.perf_counter() - started
    step = trainer["bf16_step"]
    checks = {
        "process_group": group["ok"],
        "engine_logprobs_exact": engine["max_logprob_error"] <= ENGINE_EXACT,
        "engine_vs_trainer_fp32": trainer["engine_vs_trainer_fp32"]["max"] <= TRAINER_EXACT_FP32,
        "bf16_step": math.isfinite(step["grad_norm"]) and step["changed"],
        "engine_memory_released": released_enough(engine["memory"]),
        "trainer_memory_released": released_enough(trainer["trainer_memory"]),
    }
    result = {
        "benchmark": "gpu_check",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "process_group": group,
        "engine": {k: v for k, v in engine.items() if k != "rows"},
        "trainer": trainer,
        "timings_s": timings,
        "total_s": time.perf_counter() - began,
        "checks": checks,
        "passed": all(checks.values()),
    }
    dist.destroy_process_group()
    emit(result, out)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main(args.device, args.out))
