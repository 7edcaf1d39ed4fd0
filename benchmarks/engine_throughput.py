"""Decode throughput of the native engine vs transformers' `generate`, same model and prompts, side by side.

For batch 1 and 16: the same fixed-seed random prompts (32 tokens) go to `NativeEngine` (16 concurrent
`generate` calls at batch 16) and to one HF `generate` call per batch (batch 16: one call with a batch of 16;
prompts have equal length, so no padding; HF's defaults otherwise: SDPA, dynamic cache), each request producing
exactly `--new-tokens` tokens (no stop ids on the native side, `min_new_tokens` on HF's) sampled at temperature 1
with no top-k/top-p (`--temperature 0`: greedy), fp32, the same torch thread count. Warm-up runs are excluded;
the two sides alternate within each repeat and the median tokens/s of `--repeats` runs is reported. tokens/s
counts new tokens only (prefill included in the time). Also KV bytes per token: from the config, checked
against the native engine's `memory_bytes()["kv"]` and against the bytes of HF's cache.
Two native modes run side by side: the default engine ("native") and `compile_decode=True` ("native_compiled",
the decode step through `torch.compile`; its warm-up run includes compiling, reported as `*_warmup_s`).
Targets (issue 4): native/HF >= 1.5 at batch 16 and >= 1.0 at batch 1, reported per mode (`<mode>_target_met`).
Prints one JSON object (last line).

    python benchmarks/engine_throughput.py [--repeats 7] [--new-tokens 128] [--threads N] [--quick] [--no-compiled]
    python benchmarks/engine_throughput.py --device cuda --larger   # a random 16-layer d-1024 model on a GPU

Without CUDA, `--device cuda` prints a line and a JSON object with "skipped" and exits 0. See docs/engine.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from report import emit

from gyre.config import TinyModelSpec
from gyre.engine.native import NativeEngine
from gyre.engine.protocol import GenerateRequest, SamplingParams
from gyre.models import build_tiny_model, tiny_model_dir
from gyre.models.decoder_config import DecoderConfig, read_config
from gyre.models.hf_weights import load_pretrained

RESULT_PATH = Path(__file__).parent / "results" / "engine_throughput.json"
TARGETS = {1: 1.0, 16: 1.5}  # native/HF tokens/s ratio wanted at each batch size
# --larger (CUDA): same family as the tiny model, big enough that the GPU, not Python, sets the pace.
LARGER_SPEC = TinyModelSpec(
    hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8, intermediate_size=2816
)


def make_prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`num` prompts of `length` ids drawn uniformly from the non-special ids (10 and up), fixed seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab_size, (num, length), generator=generator).tolist()


def kv_bytes_per_token(config: DecoderConfig, dtype: torch.dtype) -> int:
    """Keys and values of one token over all layers: 2 * layers * kv_heads * head_dim * element size."""
    element = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class NativeSide:
    """Runs batches on one `NativeEngine` (max_running = the largest batch) inside one event loop."""

    def __init__(self, model_dir: Path, device: torch.device, max_batch: int, compile_decode: bool = False):
        self.device = device
        self.engine = NativeEngine(
            load_pretrained(model_dir, device=device),
            max_running=max_batch,
            device=device,
            compile_decode=compile_decode,
        )
        self.loop = asyncio.new_event_loop()
        self.runs = 0

    def run(self, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
        """Wall seconds and new tokens for all `prompts` submitted concurrently."""
        self.runs += 1
        requests = [
            GenerateRequest(
                request_id=f"r{self.runs}-{i}", execution_id=f"x{self.runs}-{i}", input_ids=ids, params=params
            )
            for i, ids in enumerate(prompts)
        ]

        async def all_requests():
            return await asyncio.gather(*(self.engine.generate(r) for r in requests))

        synchronize(self.device)
        start = time.perf_counter()
        results = self.loop.run_until_complete(all_requests())
        synchronize(self.device)
        elapsed = time.perf_counter() - start
        return elapsed, sum(len(r.output_ids) for r in results)

    def kv_bytes_per_token(self, prompt: list[int], params: SamplingParams) -> float:
        """KV bytes the engine holds for one finished request (its prefix entry) per reserved token."""
        fresh = NativeEngine(self.engine.model, max_running=1, device=self.device)  # no prefix entries yet
        request = GenerateRequest(request_id="kv", execution_id="kv", input_ids=prompt, params=params)
        self.loop.run_until_complete(fresh.generate(request))
        kv_bytes = fresh.memory_bytes()["kv"]
        self.loop.run_until_complete(fresh.close())
        return kv_bytes / (len(prompt) + params.max_new_tokens)

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.close())
        self.loop.close()


class HFSide:
    """transformers' `AutoModelForCausalLM.generate` with its defaults (attention, cache), sampling at `temperature`."""

    def __init__(self, model_dir: Path, device: torch.device):
        import transformers

        transformers.utils.logging.set_verbosity_error()  # keep stdout/stderr to the figures
        transformers.utils.logging.disable_progress_bar()
        self.device = device
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.to(device).eval()

    def run(self, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
        input_ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        synchronize(self.device)
        start = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=params.temperature > 0,
                temperature=params.temperature if params.temperature > 0 else None,
                top_k=0,
                top_p=1.0,
                max_new_tokens=params.max_new_tokens,
                min_new_tokens=params.max_new_tokens,  # never stop early at eos (the native side has no stop ids)
                pad_token_id=self.model.config.pad_token_id,
            )
        synchronize(self.device)
        elapsed = time.perf_counter() - start
        return elapsed, (out.shape[1] - input_ids.shape[1]) * out.shape[0]

    def kv_bytes_per_token(self, prompt: list[int]) -> float:
        """Bytes of the cache one forward over `prompt` leaves, per token."""
        with torch.no_grad():
            out = self.model(torch.tensor([prompt], device=self.device), use_cache=True)
        cache = out["cache"] if "cache" in out else out["past_key_values"]  # renamed in transformers 5.x
        tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        return sum(t.numel() * t.element_size() for t in tensors) / len(prompt)


def measure(
    sides: dict[str, NativeSide | HFSide], prompts: list[list[int]], params: SamplingParams, repeats: int
) -> dict[str, Any]:
    """One warm-up each, then `repeats` runs alternating the sides; median tokens/s of each and each native/HF ratio.

    `sides` maps a name to a side; "hf" is the baseline. The warm-up's seconds are reported (`<name>_warmup_s`): for
    the compiled engine they include compiling this batch shape.
    """
    row: dict[str, Any] = {"batch": len(prompts)}
    for name, side in sides.items():
        row[f"{name}_warmup_s"] = round(side.run(prompts, params)[0], 2)
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, side in sides.items():
            elapsed, tokens = side.run(prompts, params)
            assert tokens == len(prompts) * params.max_new_tokens, (name, tokens)
            rates[name].append(tokens / elapsed)
    median = {name: statistics.median(runs) for name, runs in rates.items()}
    for name in sides:
        row[f"{name}_tokens_per_s"] = round(median[name], 1)
    for name in sides:
        if name != "hf":
            row[f"{name}_ratio"] = round(median[name] / median["hf"], 3)
    for name, runs in rates.items():
        row[f"{name}_runs"] = [round(r, 1) for r in runs]
    return row


def resolve_model_dir(args: argparse.Namespace, scratch: Path) -> tuple[Path, str]:
    if args.model_dir is not None:
        return args.model_dir, str(args.model_dir)
    if args.larger:
        spec = LARGER_SPEC
        return build_tiny_model(scratch / "larger", spec=spec, seed=0), (
            f"random qwen3 d{spec.hidden_size} x {spec.num_hidden_layers} layers (--larger)"
        )
    return tiny_model_dir(), "tiny default (gyre.models.tiny_model_dir)"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model-dir", type=Path, default=None, help="HF-layout directory (default: the tiny model)")
    parser.add_argument("--larger", action="store_true", help="build a random 16-layer d-1024 model (meant for CUDA)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy on both sides")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both sides (default: torch's)")
    parser.add_argument(
        "--no-compiled", action="store_true", help="skip the engine with compile_decode=True (torch.compile, inductor)"
    )
    parser.add_argument("--quick", action="store_true", help="2 repeats of 32 new tokens: a smoke run")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here (default: results/; --quick: none)")
    args = parser.parse_args()
    if args.larger and args.model_dir is not None:
        parser.error("--larger and --model-dir are exclusive")
    if args.quick:
        args.repeats, args.new_tokens = 2, 32
    elif args.out is None:
        args.out = RESULT_PATH
    return args


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("engine_throughput: --device cuda but no CUDA device is available; skipped")
        emit({"benchmark": "engine_throughput", "device": "cuda", "skipped": "no CUDA device available"})
        return
    import transformers

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gyre-engine-throughput-") as scratch:
        model_dir, model_name = resolve_model_dir(args, Path(scratch))
        config = read_config(model_dir)
        prompts = make_prompts(max(args.batches), args.prompt_tokens, config.vocab_size)
        params = SamplingParams(temperature=args.temperature, max_new_tokens=args.new_tokens)
        native = NativeSide(model_dir, device, max(args.batches))
        sides: dict[str, NativeSide | HFSide] = {"native": native}
        if not args.no_compiled:
            sides["native_compiled"] = NativeSide(model_dir, device, max(args.batches), compile_decode=True)
        sides["hf"] = hf = HFSide(model_dir, device)
        rows = []
        for batch in args.batches:
            row = measure(sides, prompts[:batch], params, args.repeats)
            if batch in TARGETS:
                row["target_ratio"] = TARGETS[batch]
                for name in sides:
                    if name != "hf":
                        row[f"{name}_target_met"] = row[f"{name}_ratio"] >= TARGETS[batch]
            rows.append(row)
            print(
                f"batch {batch:3d}: "
                + " | ".join(
                    f"{name} {row[f'{name}_tokens_per_s']:9.1f} tok/s"
                    + (f" (x{row[f'{name}_ratio']:.2f} HF)" if name != "hf" else "")
                    for name in sides
                ),
                file=sys.stderr,
            )
        kv = {
            "from_config": kv_bytes_per_token(config, torch.float32),
            "native_engine": native.kv_bytes_per_token(prompts[0], params),
            "hf_cache": hf.kv_bytes_per_token(prompts[0]),
        }
        for side in sides.values():
            if isinstance(side, NativeSide):
                side.close()
    emit(
        {
            "benchmark": "engine_throughput",
            "model": model_name,
            "params": sum(p.numel() for p in hf.model.parameters()),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": "float32",
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "hf_attn_implementation": hf.model.config._attn_implementation,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "sampling": "greedy" if args.temperature == 0 else f"temperature {args.temperature}, no top-k/top-p",
            "repeats": args.repeats,
            "modes": {
                "native": "NativeEngine defaults (eager decode)",
                "native_compiled": "NativeEngine(compile_decode=True): decode step through torch.compile (inductor)",
                "hf": "transformers generate, defaults",
            },
            "rows": rows,
            "kv_bytes_per_token": kv,
            "wall_s": round(time.perf_counter() - start, 2),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
