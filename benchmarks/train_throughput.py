"""Training tokens/s of gyre's packed streaming micro-steps vs a plain fixed-batch Megatron loop, same rows, one run.

Data: one seeded batch per optimizer step of B * N executions, one row each (a single-trajectory harness), lengths
lognormal (median `--median-tokens`, sigma 0.9) clipped to [64, `--max-row-tokens`], ids from the tiny default
model's vocabulary, targets on the tail of each row (the last 40-80%: the agent's turns after a prompt), group-centred
advantages, and on-policy behavior log-probs (the starting model's own log-probs, so step 0's loss is the same on
both sides and Eq. 5's mask is not degenerate). Both sides start from the tiny default model's weights and run the
same number of optimizer updates on the same batches; which side goes first rotates per step.

- streaming: rows packed first-fit decreasing (`gyre.data.packing.first_fit_decreasing`, executions are single rows so
  none is split) into micro-steps of at most `--budget` tokens, then `gyre.trainer.streaming.train_step` with
  `MegatronTrainable` on one process (one cell, TP 1), claim units from `gyre.data.ClaimUnitAssembler`. A
  micro-step feeds exactly its U tokens, no padding (`gyre.trainer.logprobs.packed_logprobs`: one forward per row, so
  attention costs the sum of the rows' squared lengths, not U^2).
- plain: the slime/verl-style loop: the rows in batch order, fixed micro-batches of `--micro-batch-rows` rows, each
  right-padded to the longest row of its micro-batch ([B, S] input, positions 0..S-1, causal mask), through
  megatron's `get_forward_backward_func` with a `forward_step_func` whose loss is the same `gyre.rl.policy_loss`
  (its batch share; times num_microbatches because the schedule divides by it), megatron's
  `DistributedDataParallel` and `get_megatron_optimizer` (Adam, clip 1.0; CPU patches of `gyre.trainer.cpu_patch`).

tokens/s = non-pad tokens trained / wall seconds of the measured steps (a warm-up step per side is excluded). Packing
efficiency = non-pad / tokens fed to the model; for streaming also the fill of the token budget (tokens / (micro-steps
* budget)), what a trainer that pads each micro-step to the budget (static shapes) would get. The process is pinned to
one core with one torch thread (the machine is shared; both sides get the same core). Prints one JSON object (last).

    python benchmarks/train_throughput.py [--quick] [--out benchmarks/results/train_throughput.json]
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from report import emit

log = logging.getLogger("train_throughput")
RESULT_PATH = Path(__file__).parent / "results" / "train_throughput.json"
TARGET_RATIO = 0.9  # streaming tokens/s over plain tokens/s
TARGET_EFFICIENCY = 0.95  # non-pad / fed tokens of the streaming micro-steps
MIN_ROW_TOKENS = 64
FIRST_ID = 10  # ids below are the tokenizer's special tokens
LR = 1e-5
PAD_ID = 9  # the tiny model's pad token (config.json pad_token_id); its logits are never read


def make_rows(rng: np.random.Generator, *, groups: int, group_size: int, median: int, max_tokens: int, vocab: int):
    """One batch's `TokenRow`s (one per execution, batch order) with behavior log-probs still 0."""
    from gyre.data.microstep import TokenRow

    rows = []
    for g in range(groups):
        rewards = rng.uniform(0.0, 1.0, group_size)
        advantages = rewards - rewards.mean()  # group-centred (gyre's default, no std normalization)
        for m in range(group_size):
            length = int(np.clip(rng.lognormal(np.log(median), 0.9), MIN_ROW_TOKENS, max_tokens))
            targets = np.zeros(length, dtype=bool)
            targets[int(length * rng.uniform(0.2, 0.6)) :] = True
            rows.append(
                TokenRow(
                    group_id=g,
                    execution=f"g{g}m{m}",
                    leaf=0,
                    role="main",
                    ids=rng.integers(FIRST_ID, vocab, length).astype(np.int64),
                    targets=targets,
                    behavior_logprobs=np.zeros(length),
                    advantage=float(advantages[m]),
                    execution_num_targets=int(targets.sum()),
                    batch_execution=g * group_size + m,
                )
            )
    return rows


def with_behavior(rows, model) -> list:
    """The rows with behavior log-probs = `model`'s log-probs at their targets (on-policy), one no-grad pass."""
    import dataclasses

    from gyre.trainer.logprobs import packed_logprobs

    out = []
    with torch.no_grad():
        for row in rows:
            logp = packed_logprobs(model, row.ids, [0, row.num_tokens]).double().numpy()
            out.append(dataclasses.replace(row, behavior_logprobs=np.where(row.targets, logp, 0.0)))
    return out


def pack(rows, budget: int, batch: int) -> list:
    """Micro-steps of at most `budget` tokens, first-fit decreasing (single-row executions: nothing is split)."""
    from gyre.data.microstep import build_microstep
    from gyre.data.packing import first_fit_decreasing

    bins = first_fit_decreasing([row.num_tokens for row in rows], budget)
    return [build_microstep(batch, i, [rows[r] for r in b], len(rows)) for i, b in enumerate(bins)]


def fixed_batches(rows, micro_batch_rows: int) -> list[list]:
    return [rows[i : i + micro_batch_rows] for i in range(0, len(rows), micro_batch_rows)]


# ----------------------------------------------------------------------------- the two sides


def streaming_step(trainable, micro_steps, loss_config) -> float:
    from gyre.data.claim_units import ClaimUnitAssembler
    from gyre.trainer.streaming import train_step

    assembler = ClaimUnitAssembler()
    units = [u for ms in micro_steps for u in assembler.add(ms)] + assembler.flush()
    queue = list(enumerate(units))
    result = train_step(
        trainable,
        claim=lambda: queue.pop(0) if queue else None,
        cells=lambda: 1,
        prefix_group=lambda k: None,
        is_core=True,
        core_rank=0,
        final=True,
        config=loss_config,
    )
    return result.loss


def streaming_side(trainable, loss_config, rows, micro_steps, fixed) -> float:
    return streaming_step(trainable, micro_steps, loss_config)


def padded_logprobs(model, ids_BS: torch.Tensor) -> torch.Tensor:
    """fp32 [B, S]: log p(ids[b, s] | ids[b, :s]) (0 at s = 0), causal mask, positions 0..S-1 (right padding)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    B, S = ids_BS.shape
    positions_BS = torch.arange(S).expand(B, S)
    mask_11SS = ~torch.ones(S, S, dtype=torch.bool).tril()[None, None]  # True = masked out (megatron)
    logits_BSV = model(ids_BS, positions_BS, mask_11SS)
    logits_SBV = logits_BSV[:, :-1].float().transpose(0, 1).contiguous()
    nll_SB = vocab_parallel_cross_entropy(logits_SBV, ids_BS[:, 1:].transpose(0, 1).contiguous())
    return torch.cat((torch.zeros(B, 1), -nll_SB.transpose(0, 1)), dim=1)


class PlainLoop:
    """Megatron DDP + its optimizer + get_forward_backward_func over fixed, padded micro-batches."""

    def __init__(self, model, pad_id: int):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        model.train()
        self.ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, clip_grad=1.0), [self.ddp]
        )
        self.pad_id = pad_id

    def step(self, batches: Sequence[Sequence], num_executions: int, loss_config) -> float:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from gyre.data.microstep import build_microstep
        from gyre.rl import policy_loss

        num_micro = len(batches)
        prepared = []
        for rows in batches:
            S = max(row.num_tokens for row in rows)
            ids_BS = torch.full((len(rows), S), self.pad_id, dtype=torch.int64)
            target_BS = torch.zeros(len(rows), S, dtype=torch.bool)
            for b, row in enumerate(rows):
                ids_BS[b, : row.num_tokens] = torch.from_numpy(row.ids)
                target_BS[b, : row.num_tokens] = torch.from_numpy(row.targets)
            # Same loss inputs as a micro-step of these rows: targets flattened row-major, as logp_BS[target_BS].
            prepared.append((ids_BS, target_BS, build_microstep(0, 0, rows, num_executions)))

        def forward_step(data_iterator: Iterator, model):
            ids_BS, target_BS, ms = next(data_iterator)
            logp_BS = padded_logprobs(model, ids_BS)

            def loss_func(logp_BS):
                loss, _ = policy_loss(logp_BS[target_BS], **ms.loss_inputs(), config=loss_config)
                return loss * num_micro, {"loss": loss.detach()}  # the schedule divides by num_microbatches

            return logp_BS, loss_func

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(prepared),
            model=[self.ddp],
            num_microbatches=num_micro,
            seq_length=max(ids.shape[1] for ids, _, _ in prepared),
            micro_batch_size=max(ids.shape[0] for ids, _, _ in prepared),
            forward_only=False,
        )
        ok, _, _ = self.optimizer.step()
        assert ok, "megatron's optimizer skipped the step"
        return sum(float(x["loss"]) for x in losses)


# ----------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from gyre.config.loss import LossConfig
    from gyre.models.decoder_config import read_config
    from gyre.models.hf_weights import read_state_dict
    from gyre.models.tiny import tiny_model_dir
    from gyre.trainer.convert import load_hf_state_dict
    from gyre.trainer.megatron_trainable import MegatronTrainable
    from gyre.trainer.model import build_gpt_model, init_model_parallel

    model_dir = tiny_model_dir()
    config = read_config(model_dir)
    with tempfile.TemporaryDirectory(prefix="gyre-train-throughput-") as scratch:
        dist.init_process_group("gloo", init_method=f"file://{scratch}/store", rank=0, world_size=1)
        try:
            init_model_parallel(1, 1, seed=0)
            weights = read_state_dict(model_dir, dtype=torch.float32, device="cpu")
            models = {side: build_gpt_model(config) for side in ("streaming", "plain")}
            for model in models.values():
                load_hf_state_dict(model, weights, config)
            rng = np.random.default_rng(args.seed)
            batches = []
            for _ in range(args.steps + 1):  # step 0 is the warm-up
                rows = make_rows(
                    rng,
                    groups=args.groups,
                    group_size=args.group_size,
                    median=args.median_tokens,
                    max_tokens=args.max_row_tokens,
                    vocab=config.vocab_size,
                )
                batches.append(with_behavior(rows, models["streaming"]))
            loss_config = LossConfig()
            sides: dict[str, Callable[[list, list, list], float]] = {}
            models["streaming"].train()
            trainable = MegatronTrainable(models["streaming"], lr=LR, max_grad_norm=1.0)
            sides["streaming"] = functools.partial(streaming_side, trainable, loss_config)
            plain = PlainLoop(models["plain"], pad_id=PAD_ID)
            num_executions = args.groups * args.group_size
            sides["plain"] = lambda rows, micro_steps, fixed: plain.step(fixed, num_executions, loss_config)
            report = measure(args, batches, sides)
        finally:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    return report


def measure(args, batches, sides: dict[str, Callable[[list, list, list], float]]) -> dict[str, Any]:
    """Run every side on every batch (the order rotates per step); step 0 is the warm-up."""
    timing = {side: {"step_s": [], "loss": []} for side in sides}
    counts = {"non_pad": 0, "streaming_fed": 0, "plain_fed": 0, "micro_steps": 0, "micro_batches": 0}
    fills, lower_bounds = [], []
    names = list(sides)
    for step, rows in enumerate(batches):
        micro_steps = pack(rows, args.budget, step)
        fixed = fixed_batches(rows, args.micro_batch_rows)
        for side in names[step % len(names) :] + names[: step % len(names)]:  # rotate who goes first
            start = time.perf_counter()
            loss = sides[side](rows, micro_steps, fixed)
            elapsed = time.perf_counter() - start
            log.info("step %d %s: %.2f s", step, side, elapsed)
            timing[side]["loss"].append(loss)
            if step > 0:
                timing[side]["step_s"].append(elapsed)
            else:
                timing[side]["warmup_s"] = elapsed
        if step == 0:
            continue
        counts["non_pad"] += sum(row.num_tokens for row in rows)
        counts["streaming_fed"] += sum(ms.num_tokens for ms in micro_steps)
        counts["plain_fed"] += sum(len(b) * max(row.num_tokens for row in b) for b in fixed)
        counts["micro_steps"] += len(micro_steps)
        counts["micro_batches"] += len(fixed)
        fills.append(sum(ms.num_tokens for ms in micro_steps) / (len(micro_steps) * args.budget))
        lower_bounds.append(-(-sum(row.num_tokens for row in rows) // args.budget))  # ceil: no packing does better
    measured = len(batches) - 1
    out: dict[str, Any] = {}
    for side in names:
        fed = counts["plain_fed"] if side == "plain" else counts["streaming_fed"]
        wall = sum(timing[side]["step_s"])
        out[side] = {
            "tokens_per_s": counts["non_pad"] / wall,
            "wall_s": wall,
            "step_s": timing[side]["step_s"],
            "median_step_s": statistics.median(timing[side]["step_s"]),
            "warmup_step_s": timing[side]["warmup_s"],
            "packing_efficiency": counts["non_pad"] / fed,
            "fed_tokens_per_step": fed / measured,
            "loss_per_step": timing[side]["loss"],
        }
        if side != "plain":
            out[side]["micro_steps_per_step"] = counts["micro_steps"] / measured
            out[side]["budget_fill"] = sum(fills) / len(fills)
            out[side]["min_possible_micro_steps_per_step"] = sum(lower_bounds) / measured
    out["plain"]["micro_batches_per_step"] = counts["micro_batches"] / measured
    ratio = out["streaming"]["tokens_per_s"] / out["plain"]["tokens_per_s"]
    out["non_pad_tokens_per_step"] = counts["non_pad"] / measured
    out["ratio_streaming_over_plain"] = ratio
    out["step0_loss_abs_diff"] = abs(timing["streaming"]["loss"][0] - timing["plain"]["loss"][0])
    out["met"] = {
        "ratio": ratio >= TARGET_RATIO,
        "packing_efficiency": out["streaming"]["packing_efficiency"] >= TARGET_EFFICIENCY,
        "budget_fill": out["streaming"]["budget_fill"] >= TARGET_EFFICIENCY,
    }
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8, help="B groups per batch")
    parser.add_argument("--group-size", type=int, default=8, help="N executions per group")
    parser.add_argument("--median-tokens", type=int, default=400, help="median row length (lognormal, sigma 0.9)")
    parser.add_argument("--max-row-tokens", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=4096, help="max tokens per streaming micro-step")
    parser.add_argument("--micro-batch-rows", type=int, default=4, help="rows per plain micro-batch")
    parser.add_argument("--steps", type=int, default=2, help="measured optimizer updates per side (+1 warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--core", type=int, default=None, help="pin to this CPU (default: the last allowed one)")
    parser.add_argument("--quick", action="store_true", help="a small batch, one measured step: a smoke run")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here (default: results/; --quick: none)")
    args = parser.parse_args()
    if args.quick:
        args.groups, args.group_size, args.median_tokens, args.max_row_tokens = 2, 4, 96, 256
        args.budget, args.steps = 512, 1
    elif args.out is None:
        args.out = RESULT_PATH
    if args.max_row_tokens > args.budget:
        parser.error(f"--max-row-tokens {args.max_row_tokens} exceeds --budget {args.budget}: a row is never split")
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[-1] if args.core is None else args.core
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    start = time.perf_counter()
    result = run(args)
    emit(
        {
            "benchmark": "train_throughput",
            "mode": "quick" if args.quick else "full",
            "model": "tiny default (gyre.models.tiny_model_dir), megatron-core GPTModel, local spec, fp32, TP 1",
            "data": {
                "executions_per_batch": args.groups * args.group_size,
                "rows": "one per execution",
                "row_tokens": f"lognormal median {args.median_tokens} sigma 0.9, clipped [{MIN_ROW_TOKENS}, "
                f"{args.max_row_tokens}]",
                "targets": "tail 40-80% of each row",
                "seed": args.seed,
            },
            "streaming_budget_tokens": args.budget,
            "plain_micro_batch_rows": args.micro_batch_rows,
            "streaming_logprobs": "gyre.trainer.logprobs.packed_logprobs (one forward per row of a micro-step)",
            "plain_padding": "right-padded to the longest row of each micro-batch",
            "measured_steps": args.steps,
            "warmup_steps": 1,
            "pinned": {"cpu": core, "torch_threads": 1},
            "targets": {"ratio": TARGET_RATIO, "packing_efficiency": TARGET_EFFICIENCY},
            **result,
            "total_wall_s": time.perf_counter() - start,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
