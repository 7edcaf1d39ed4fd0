"""The memory plan's prediction against measured peak memory: a core cell's training on CPU at five layouts.

Two checkpoints are written once: a scaled-up Qwen3-layout dense model (`model_config("dense")`: 12 layers, hidden
768, 12 query and 4 KV heads of 64, MLP 2,304, a 32,000-token vocabulary, untied; about 132M parameters) and a
Qwen3-MoE one (`model_config("moe")`: 8 layers of 8 experts of width 768, top 2, the same attention and vocabulary;
about 175M). Then for each layout, one fresh run of `gyre.distributed.local` ranks over gloo, each a core rank as the
runtime builds it (`build_trainable`, Megatron, fp32 on CPU) taking two steps (log-probs, backward, the step's flat
copy of the gradients, AdamW's update: the second step's backward holds AdamW's moments):

- TP 1, TP 2, TP 2 with full recompute (dense): one micro-step of `--tokens` tokens a step;
- TP 2 x PP 2 (dense, 4 ranks): two micro-steps a step through the streaming 1F1B pipeline (`StreamingPipeline`),
  so the first stage holds two micro-steps' activations at once and the last one;
- EP 2 (MoE, TP 1: 2 ranks, each with half the experts and a copy of the dense part): one micro-step a step.

Reported per rank: the peak resident memory (`VmHWM`), the resident memory once torch, megatron and gyre are imported
and the process groups made (the process's own, measured: it stands for the plan's constant), and the plan's
prediction of the same (`gyre.trainer.memory_plan.training_terms` of the rank's pipeline stage: the terms this
trainer-only run exercises: weights, fp32 gradients, AdamW's moments, and the larger of the activations and the
step's flat gradients; no engine, no publication, no controller), with the relative error; and each step's wall and
CPU seconds (user + system, which other load on the machine disturbs less) and minor page faults. Each layout runs
with the allocator as gyre's CPU ranks set it (`gyre.runtime.job.allocator.return_freed_memory`, which `open_job`
calls) and with glibc as it comes. Check: within 15%.

    python benchmarks/memory_plan.py [--tokens 4096] [--only NAME ...] [--out benchmarks/results/memory_plan.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from load_memory import resident_bytes  # the same /proc/self/status reader
from report import emit

from gyre.distributed.local import run_local

GIB = 1 << 30
TOLERANCE = 0.15
ALLOCATORS = ("gyre", "glibc default")  # gyre's CPU ranks' setting (freed memory returned), glibc as it comes
ROW_TOKENS = 1024


class Layout(NamedTuple):  # not a dataclass: run_local loads this file as a module outside sys.modules
    name: str
    tp: int
    pp: int = 1
    ep: int = 1
    recompute: str = "none"
    model: str = "dense"
    microsteps: int = 1  # a step's micro-steps (the pipeline's first stage holds PP of them)

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * max(1, self.ep // self.tp)


LAYOUTS = (
    Layout("TP 1", tp=1),
    Layout("TP 2", tp=2),
    Layout("TP 2, full recompute", tp=2, recompute="full"),
    Layout("TP 2 x PP 2", tp=2, pp=2, microsteps=2),
    Layout("EP 2 (MoE)", tp=1, ep=2, model="moe"),
)


def model_config(kind: str):
    from gyre.models.decoder_config import DecoderConfig

    shared = {
        "vocab_size": 32_000,
        "hidden_size": 768,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "qk_norm": True,
    }
    if kind == "dense":
        return DecoderConfig(model_type="qwen3", intermediate_size=2304, num_hidden_layers=12, **shared)
    return DecoderConfig(
        model_type="qwen3_moe",
        intermediate_size=2304,
        num_hidden_layers=8,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        **shared,
    )


def write_checkpoint(path: Path, kind: str) -> int:
    import torch

    from gyre.models.decoder import DecoderLM
    from gyre.models.hf_weights import save_pretrained

    with torch.device("meta"):
        model = DecoderLM(model_config(kind))
    generator = torch.Generator().manual_seed(0)
    state = {n: torch.randn(t.shape, generator=generator) * 0.02 for n, t in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    save_pretrained(model, path)
    return sum(t.numel() for t in state.values())


def microstep(tokens: int, vocab: int, index: int = 0):
    import numpy as np

    from gyre.data.microstep import TokenRow, build_microstep

    rng = np.random.default_rng(index)
    rows = []
    for r in range(max(1, tokens // ROW_TOKENS)):
        targets = np.array([False] * 8 + [True] * (ROW_TOKENS - 8))
        rows.append(
            TokenRow(
                group_id=0,
                execution=f"e{r}",
                leaf=0,
                role="main",
                ids=rng.integers(0, vocab, ROW_TOKENS).astype(np.int64),
                targets=targets,
                behavior_logprobs=np.where(targets, -3.0, 0.0),
                advantage=1.0 if r % 2 else -1.0,
                execution_num_targets=int(targets.sum()),
                batch_execution=r,
            )
        )
    return build_microstep(0, index, rows, num_executions=len(rows))


def worker(rank: int, world_size: int, *, path: str, tokens: int, layout: dict, allocator: str) -> dict:
    import resource

    import torch
    from megatron.core import parallel_state

    from gyre.config import TrainConfig
    from gyre.config.cluster import ClusterConfig
    from gyre.config.model import ModelConfig
    from gyre.config.trainer import TrainerConfig
    from gyre.runtime.cell.trainers import build_trainable
    from gyre.runtime.job.allocator import return_freed_memory
    from gyre.trainer.model import init_model_parallel

    layout = Layout(**layout)
    if allocator == "gyre":
        assert return_freed_memory()  # what open_job does first on a CPU trainer's every rank
    init_model_parallel(layout.tp, layout.pp, seed=0, expert_parallel_size=layout.ep)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    baseline = resident_bytes("VmRSS")
    cfg = TrainConfig(
        model=ModelConfig(model_dir=path),
        cluster=ClusterConfig(num_cells=1, cell_size=world_size, cell_capacity=16),
        trainer=TrainerConfig(
            backend="megatron",
            tensor_parallel_size=layout.tp,
            pipeline_parallel_size=layout.pp,
            expert_parallel_size=layout.ep,
            recompute=layout.recompute,
        ),
    )
    trainer = build_trainable(cfg, Path(path))
    vocab = model_config(layout.model).vocab_size
    steps = [microstep(tokens, vocab, index) for index in range(layout.microsteps)]
    wall, cpu, faults = [], [], []
    for _ in range(2):
        started, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        if trainer.pipeline is not None:  # the first stage claims the step's one unit; the others receive it
            trainer.pipeline.run(iter([(0, tuple(steps)), None]).__next__)
        else:
            for step in steps:
                (-trainer.logprobs(step).sum()).backward()
        flat = torch.cat([g.reshape(-1) for g in trainer.gradients()])  # the step's flat copy (reduce_gradients)
        del flat
        trainer.update()
        after = resource.getrusage(resource.RUSAGE_SELF)
        wall.append(round(time.perf_counter() - started, 2))
        cpu.append(round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2))
        faults.append(after.ru_minflt - before.ru_minflt)
    return {
        "stage": stage,
        "peak_rss": resident_bytes("VmHWM"),
        "baseline_rss": baseline,
        "step_wall_s": wall,
        "step_cpu_s": cpu,
        "step_minor_faults": faults,
    }


def predicted(layout: Layout, tokens: int, stage: int, baseline: int) -> int:
    """The plan's terms this run exercises, for a core rank of `stage`, on the rank's measured baseline."""
    from gyre.trainer.memory_plan import MemoryInputs, training_terms

    inputs = MemoryInputs(
        model=model_config(layout.model),
        trainer_backend="megatron",
        tp=layout.tp,
        pp=layout.pp,
        ep=layout.ep,
        cell_size=layout.ranks,
        recompute=layout.recompute,
        tokens_per_microstep=tokens,
    )
    terms = {t.name: t.bytes for t in training_terms(inputs, stage=stage, core=True)}
    held = terms["weights"] + terms["gradients (fp32)"] + terms["AdamW moments (fp32)"]
    return baseline + held + max(terms["activations"], terms["step's flat gradients"])


def _run(allocator: str, layout: Layout, checkpoints: dict[str, Path], tokens: int) -> dict:
    kwargs = {
        "path": str(checkpoints[layout.model]),
        "tokens": tokens,
        "layout": layout._asdict(),
        "allocator": allocator,
    }
    ranks = run_local(f"{__file__}:worker", layout.ranks, kwargs=kwargs, timeout_s=3600)
    for rank in ranks:
        rank["predicted"] = predicted(layout, tokens, rank["stage"], rank["baseline_rss"])
        rank["error"] = round(rank["predicted"] / rank["peak_rss"] - 1.0, 3)
    shown = [(round(r["peak_rss"] / GIB, 2), round(r["predicted"] / GIB, 2), r["error"]) for r in ranks]
    cpu = [r["step_cpu_s"] for r in ranks]
    print(f"{allocator}, {layout.name}: (measured GiB, predicted GiB, error) {shown}; step CPU s {cpu}", flush=True)
    return {"allocator": allocator, "layout": layout._asdict(), "ranks": ranks}


def main(tokens: int, only: list[str], out: Path | None) -> None:
    layouts = [layout for layout in LAYOUTS if not only or layout.name in only]
    workdir = Path(tempfile.mkdtemp(prefix="gyre-memory-plan-"))
    try:
        checkpoints, parameters = {}, {}
        for kind in sorted({layout.model for layout in layouts}):
            checkpoints[kind] = workdir / kind
            parameters[kind] = write_checkpoint(checkpoints[kind], kind)
            print(f"wrote {parameters[kind] / 1e6:.0f}M parameters ({kind}) to {checkpoints[kind]}", flush=True)
        # side by side: each layout with both allocators before the next layout (the machine's load drifts)
        runs = [_run(allocator, layout, checkpoints, tokens) for layout in layouts for allocator in ALLOCATORS]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    errors = {
        name: [r["error"] for run in runs if run["allocator"] == name for r in run["ranks"]] for name in ALLOCATORS
    }
    emit(
        {
            "benchmark": "memory_plan",
            "models": {kind: dataclasses.asdict(model_config(kind)) for kind in checkpoints},
            "parameters": parameters,
            "tokens_per_microstep": tokens,
            "trainer_dtype": "float32",
            "runs": runs,
            "checks": {
                name: {
                    "max_abs_error": max(abs(e) for e in errs),
                    f"within_{TOLERANCE}": all(abs(e) <= TOLERANCE for e in errs),
                }
                for name, errs in errors.items()
            },
            "note": "CPU, gloo, a core cell's training only (no engine, no publication, no controller); the plan's "
            "constant replaced by each rank's measured resident memory after its imports; step times on a shared "
            "2-core machine (other load present): compare CPU seconds side by side",
        },
        out,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--only", nargs="*", default=[], help="layout names to run (default: all)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    main(args.tokens, args.only, args.out)
