"""The streaming 1F1B pipeline (`gyre.trainer.pipeline`) on real gloo processes: PP 2, PP 3, TP 2 x PP 2 against PP 1.

PP x TP processes hold the stages (and tensor shards) of one Megatron GPTModel (weights of a native
`build_model(seed=...)` through `load_hf_state_dict`) and stream one batch of micro-steps of different lengths,
including a unit with a split execution (s_i over two micro-steps, Eq. 5). The accumulated gradients, gathered back
to HF names, must equal those of one process running `accumulate_unit` over the same units (fp32: relative 1e-5),
with exactly one warm-up and one drain per batch, also when the stream pauses (the claim sleeps and answers WAIT)
and when the batch is empty. Every stage returns the last stage's loss and loss metrics.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from gyre.distributed.local import run_local

TIMEOUT_S = 150.0
VOCAB = 64
# One intra-op thread per stage: with torch's default (one per core) the stages' OpenMP threads compete for the
# 2 cores and a batch took 3-9 s instead of ~50 ms here.
ENV = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def model_config(tied: bool):
    from gyre.models.decoder_config import DecoderConfig

    return DecoderConfig(
        model_type="qwen2",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,  # divisible by PP 2 and 3
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        attention_qkv_bias=True,
        tie_word_embeddings=tied,
    )


def batch_units(seed: int) -> list[tuple[int, tuple]]:
    """(index, claim unit) of one batch: 6 micro-steps of 1-3 rows of 5-20 tokens; micro-steps 2 and 3 share a
    split execution and form one unit."""
    from gyre.data.claim_units import ClaimUnitAssembler
    from gyre.data.microstep import TokenRow, build_microstep

    rng = np.random.default_rng(seed)
    num_steps = 6
    num_executions = 3 * num_steps + 1
    split_slot = num_executions - 1

    def row(slot: int, execution: str, num_targets: int | None = None) -> TokenRow:
        length = int(rng.integers(5, 21))
        targets = np.zeros(length, dtype=bool)
        targets[length // 3 :] = True
        return TokenRow(
            group_id=slot // 3,
            execution=execution,
            leaf=0,
            role="main",
            ids=rng.integers(0, VOCAB, length).astype(np.int64),
            targets=targets,
            behavior_logprobs=np.where(targets, -rng.uniform(0.5, 4.0, length), 0.0),
            advantage=float(rng.normal()),
            execution_num_targets=int(targets.sum()) if num_targets is None else num_targets,
            batch_execution=slot,
        )

    split_rows = [row(split_slot, "split") for _ in range(2)]
    split_targets = sum(r.num_targets for r in split_rows)
    split_rows = [row(split_slot, "split", split_targets) for _ in range(2)]  # L_i over both parts
    assembler = ClaimUnitAssembler()
    units = []
    for index in range(num_steps):
        rows = [row(3 * index + k, f"e{3 * index + k}") for k in range(int(rng.integers(1, 4)))]
        split = ()
        if index in (2, 3):
            rows.append(split_rows[index - 2])
            split = ("split",)
        units += assembler.add(build_microstep(0, index, rows, num_executions, split=split))
    units += assembler.flush()
    return list(enumerate(units))


def build_stage(tied: bool, pipeline_parallel: int, tensor_parallel: int = 1):
    """This rank's stage (and TP shard) of the Megatron model with the native model's weights (seed 3)."""
    from gyre.models.decoder import build_model
    from gyre.trainer.convert import load_hf_state_dict
    from gyre.trainer.model import build_gpt_model, init_model_parallel

    init_model_parallel(tensor_parallel, pipeline_parallel)
    model = build_gpt_model(model_config(tied))
    load_hf_state_dict(model, build_model(model_config(tied), seed=3).state_dict(), model_config(tied))
    return model


def hf_gradients(model, tied: bool) -> dict[str, torch.Tensor]:
    """Every stage's and TP shard's `.grad` in HF names, on every rank (collective over the model-parallel group)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from gyre.trainer.convert import megatron_to_hf

    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone() for n, p in model.named_parameters()}
    pp, tp = (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )
    mine = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(), grads)
    gathered = [mine]
    if pp * tp > 1:
        gathered = [None] * (pp * tp)
        dist.all_gather_object(gathered, mine, group=parallel_state.get_model_parallel_group())
    shards = [[None] * tp for _ in range(pp)]
    for pp_rank, tp_rank, shard in gathered:
        shards[pp_rank][tp_rank] = shard
    return megatron_to_hf(shards, model_config(tied))


def loss_config():
    from gyre.config.loss import LossConfig

    return LossConfig()


def reference_worker(rank: int, world_size: int, *, seed: int, tied: bool, out: str) -> float:
    """PP = 1: `accumulate_unit` over the batch's units in order ("plain"), and over its first unit alone ("one")."""
    from gyre.trainer.megatron_trainable import MegatronTrainable, global_grad_norm
    from gyre.trainer.streaming import accumulate_unit

    trainable = MegatronTrainable(build_stage(tied, 1), lr=1e-2)
    losses = {}
    for name, units in (("plain", batch_units(seed)), ("one", batch_units(seed)[:1])):
        losses[name] = sum(accumulate_unit(trainable, unit, loss_config()) for _, unit in units)
        losses[f"{name}_grad_norm"] = float(global_grad_norm(trainable.parameters()))
        torch.save(hf_gradients(trainable.model, tied), f"{out}.{name}")
        for p in trainable.parameters():
            p.grad = None
    return losses


def tied_gradients_equal(model) -> bool:
    """Tied embeddings: the last stage's output-layer copy got the same (summed) gradient as the first stage's."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    grad = model.shared_embedding_or_output_weight().grad
    grads = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(grads, grad, group=parallel_state.get_pipeline_model_parallel_group())
    return torch.equal(grads[0], grads[-1])


PAUSES = [0, 2, 0, 1, 3, 1]  # WAIT answers before each claim (a slow stream): 7 in all


def stream(units: list, pauses: list[int]):
    """A claim callable over `units`: before the i-th claim, `pauses[i]` times 50 ms of nothing (WAIT)."""
    from gyre.trainer.pipeline import WAIT

    plan: list = []
    for i in range(len(units) + 1):
        plan += [WAIT] * (pauses[i] if i < len(pauses) else 0)
        plan.append(units[i] if i < len(units) else None)
    answers = iter(plan)

    def claim():
        answer = next(answers, None)
        if answer is WAIT:
            time.sleep(0.05)
        return answer

    return claim


def pipeline_worker(rank: int, world_size: int, *, seed: int, tied: bool, out: str, tensor_parallel: int = 1) -> dict:
    """PP = world_size / TP: the batch streamed plain, with pauses, then only its first unit (fewer micro-steps
    than the first stage's warm-up at PP 3), then an empty batch; gradients zeroed between. At TP > 1 every TP
    rank of the first stage claims the same units (as a cell leader's broadcast gives them)."""
    from gyre.trainer.megatron_trainable import global_grad_norm
    from gyre.trainer.pipeline import StreamingPipeline

    model = build_stage(tied, world_size // tensor_parallel, tensor_parallel)
    pipeline = StreamingPipeline(model, config=loss_config())
    runs = {}
    batches = {"plain": batch_units(seed), "paused": batch_units(seed), "one": batch_units(seed)[:1], "empty": []}
    for name, units in batches.items():
        claim = stream(units, PAUSES if name == "paused" else [])
        before = dict(vars(pipeline.counters))
        started = time.perf_counter()
        result = pipeline.run(claim)
        elapsed = time.perf_counter() - started
        counters = {k: v - before[k] for k, v in vars(pipeline.counters).items()}
        grad_norm = float(global_grad_norm([p for p in model.parameters() if p.requires_grad]))  # what clips
        grads = hf_gradients(model, tied)
        tied_copies_equal = tied_gradients_equal(model) if tied else None
        if rank == 0:
            torch.save(grads, f"{out}.{name}")
        for p in model.parameters():
            p.grad = None
        runs[name] = {
            "counters": counters,
            "units": result.units,
            "micro_steps": result.micro_steps,
            "tokens": result.tokens,
            "loss": result.loss,
            "targets": result.metrics.targets,  # the loss metrics' target count, shared like the loss
            "seconds": elapsed,
            "tied_copies_equal": tied_copies_equal,
            "grad_norm": grad_norm,
        }
    return runs


def relative_difference(grads: dict, reference: dict) -> tuple[float, float]:
    """(whole model, worst tensor) relative L2 difference of two HF-named gradient dicts."""
    assert sorted(grads) == sorted(reference)
    names = sorted(reference)
    difference = torch.cat([(grads[n] - reference[n]).reshape(-1) for n in names]).norm()
    whole = float(difference / torch.cat([reference[n].reshape(-1) for n in names]).norm())
    worst = max(float((grads[n] - reference[n]).norm() / reference[n].norm().clamp_min(1e-12)) for n in names)
    return whole, worst


@pytest.fixture(scope="module")
def pp1_reference(tmp_path_factory):
    """The PP = 1 run for (seed, tied), made once per module: it depends on nothing else, and each is a process
    importing Megatron. Returns (losses, the path prefix of its gradient files)."""
    made: dict[tuple[int, bool], tuple[dict, str]] = {}

    def reference(seed: int, tied: bool) -> tuple[dict, str]:
        if (seed, tied) not in made:
            out = str(tmp_path_factory.mktemp("reference") / f"seed{seed}-tied{tied}")
            kwargs = {"seed": seed, "tied": tied, "out": out}
            losses = run_local(f"{__file__}:reference_worker", 1, kwargs=kwargs, timeout_s=TIMEOUT_S, env=ENV)[0]
            made[seed, tied] = (losses, out)
        return made[seed, tied]

    return reference


@pytest.mark.slow
@pytest.mark.parametrize(
    ("pipeline_parallel", "tied", "tensor_parallel"), [(2, False, 1), (2, True, 1), (3, False, 1), (2, True, 2)]
)
def test_streaming_1f1b_gives_the_pp1_gradients(tmp_path, pp1_reference, pipeline_parallel, tied, tensor_parallel):
    """PP = 2 (untied and tied embeddings), PP = 3 (a middle stage) and TP 2 x PP 2 (4 processes) against one
    process at PP = 1 on the same claim units (one such process per (seed, tied), shared by the cases)."""
    seed = 5
    out = tmp_path / "pipeline"
    started = time.perf_counter()
    results = run_local(
        f"{__file__}:pipeline_worker",
        pipeline_parallel * tensor_parallel,
        kwargs={"seed": seed, "tied": tied, "out": str(out), "tensor_parallel": tensor_parallel},
        timeout_s=TIMEOUT_S,
        env=ENV,
    )
    reference_losses, reference_out = pp1_reference(seed, tied)
    print(
        f"PP={pipeline_parallel} TP={tensor_parallel} tied={tied}: both worlds in {time.perf_counter() - started:.1f} s"
    )
    units = batch_units(seed)
    num_steps = sum(len(unit) for _, unit in units)
    num_tokens = sum(step.num_tokens for _, unit in units for step in unit)
    assert num_steps == 6 and len(units) == 5 and len({s.num_tokens for _, u in units for s in u}) > 1
    expected = {
        "plain": {"reference": "plain", "units": units, "scores": 2, "pauses": 0},
        "paused": {"reference": "plain", "units": units, "scores": 2, "pauses": sum(PAUSES)},
        "one": {"reference": "one", "units": units[:1], "scores": 0, "pauses": 0},
    }
    for name, want in expected.items():
        reference = torch.load(f"{reference_out}.{want['reference']}")
        assert all(g.any() for g in reference.values())  # every tensor of every stage learns from the batch
        whole, worst = relative_difference(torch.load(f"{out}.{name}"), reference)
        print(f"  {name}: relative gradient difference {whole:.2e} (worst tensor {worst:.2e})")
        assert whole <= 1e-5, f"{name}: PP={pipeline_parallel} vs PP=1 relative gradient difference {whole:.2e}"
        steps = [step for _, unit in want["units"] for step in unit]
        for rank, runs in enumerate(results):
            run = runs[name]
            print(f"    stage {rank}: {run['counters']} in {run['seconds'] * 1e3:.0f} ms")
            assert run["counters"]["warmups"] == 1 and run["counters"]["drains"] == 1  # one fill, one flush
            norm, reference_norm = run["grad_norm"], reference_losses[f"{want['reference']}_grad_norm"]
            assert abs(norm - reference_norm) <= 1e-5 * reference_norm, (name, rank, norm, reference_norm)
            assert run["counters"]["forwards"] == run["counters"]["backwards"] == len(steps)
            assert run["counters"]["score_forwards"] == want["scores"]  # the split unit's s_i pass
            assert run["counters"]["pauses"] == want["pauses"]
            assert run["units"] == [index for index, _ in want["units"]]
            assert run["micro_steps"] == len(steps) and run["tokens"] == sum(s.num_tokens for s in steps)
            assert run["tied_copies_equal"] is (True if tied else None)
        loss = results[-1][name]["loss"]
        assert loss == pytest.approx(reference_losses[want["reference"]], rel=1e-5, abs=1e-7)
        assert all(runs[name]["loss"] == loss for runs in results)  # the last stage's loss, shared with every stage
        targets = {runs[name]["targets"] for runs in results}  # the loss metrics' target count, as shared
        assert len(targets) == 1 and (targets == {0.0}) == (name == "empty"), (name, targets)
    assert results[-1]["plain"]["tokens"] == num_tokens
    assert all(not g.any() for g in torch.load(f"{out}.empty").values())
    for runs in results:
        assert runs["empty"]["counters"]["warmups"] == runs["empty"]["counters"]["drains"] == 1
        assert runs["empty"]["micro_steps"] == 0 and runs["empty"]["counters"]["forwards"] == 0
