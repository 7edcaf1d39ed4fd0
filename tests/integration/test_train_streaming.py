"""Exact elastic membership (docs/architecture.md, contract 7) on real gloo processes.

Cells of one rank each: rank 0 is the controller and the core; the controller's thread pumps each step's
micro-steps onto the step's board in the TCPStore (`gyre.distributed.step_pump`) as they become ready, slowly,
while the core trains, and admits satellites at random micro-steps; a satellite pulls the core's weights of that
step over a one-sided transport (Mooncake, else the store snapshot) and claims from the same board
(`gyre.trainer.streaming.train_claimed_step`). After a burst of mu steps, the core's parameters must equal one
process running the same claim units in order (fp32: relative 1e-5), and every unit must have been processed
exactly once, some of them by satellites.
"""

from __future__ import annotations

import datetime
import random
import threading
import time

import numpy as np
import pytest
import torch

from gyre.distributed.local import run_local, shared_store

TIMEOUT_S = 150.0
VOCAB = 64
LR = 1e-2


def model_config():
    from gyre.models.decoder_config import DecoderConfig

    return DecoderConfig(
        model_type="qwen2",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        attention_qkv_bias=True,
    )


def make_trainable(backend: str = "native", tensor_parallel: int = 1):
    """The model both runs start from: the native decoder, or the same weights in a Megatron GPTModel (TP-sharded;
    megatron's parallel state must be initialized on the default group first)."""
    from gyre.models.decoder import build_model

    native = build_model(model_config(), seed=3)
    if backend == "native":
        from gyre.trainer.native_trainable import NativeTrainable

        return NativeTrainable(native, lr=LR, max_grad_norm=1.0)
    from gyre.trainer.convert import load_hf_state_dict
    from gyre.trainer.megatron_trainable import MegatronTrainable
    from gyre.trainer.model import build_gpt_model, init_model_parallel

    init_model_parallel(tensor_parallel, 1)
    model = build_gpt_model(model_config())
    load_hf_state_dict(model, native.state_dict(), model_config())
    return MegatronTrainable(model, lr=LR, max_grad_norm=1.0)


def batch_microsteps(seed: int, batch: int, num_steps: int = 8) -> list:
    """Micro-steps of one batch: 4 executions per micro-step, plus one execution split over micro-steps 2-3."""
    from gyre.data.microstep import TokenRow, build_microstep

    rng = np.random.default_rng(seed * 100 + batch)
    num_executions = 4 * num_steps + 1
    split_slot = num_executions - 1

    def row(slot: int, execution: str, num_targets: int | None = None) -> TokenRow:
        length = int(rng.integers(6, 14))
        targets = np.zeros(length, dtype=bool)
        targets[length // 2 :] = True
        behavior = np.where(targets, -rng.uniform(0.5, 4.0, length), 0.0)
        return TokenRow(
            group_id=slot // 4,
            execution=execution,
            leaf=0,
            role="main",
            ids=rng.integers(0, VOCAB, length).astype(np.int64),
            targets=targets,
            behavior_logprobs=behavior,
            advantage=float(rng.normal()),
            execution_num_targets=int(targets.sum()) if num_targets is None else num_targets,
            batch_execution=slot,
        )

    split_rows = [row(split_slot, "split") for _ in range(2)]
    split_targets = sum(r.num_targets for r in split_rows)
    split_rows = [row(split_slot, "split", split_targets) for _ in range(2)]  # L_i over both parts
    steps = []
    for index in range(num_steps):
        rows = [row(4 * index + k, f"e{4 * index + k}") for k in range(4)]
        split = ()
        if index in (2, 3):
            rows.append(split_rows[index - 2])
            split = ("split",)
        steps.append(build_microstep(batch, index, rows, num_executions, split=split))
    return steps


def loss_config():
    from gyre.config.loss import LossConfig

    return LossConfig()


def flat_parameters(trainable) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainable.parameters()])


def units_of(seed: int, step: int) -> list:
    from gyre.data.claim_units import ClaimUnitAssembler

    assembler = ClaimUnitAssembler()
    return [u for ms in batch_microsteps(seed, step) for u in assembler.add(ms)] + assembler.flush()


def run_reference(trainable, seed: int, mu: int) -> None:
    """One process: every claim unit of every step in order, one update per step."""
    from gyre.trainer.streaming import train_step

    for step in range(mu):
        queue = list(enumerate(units_of(seed, step)))
        train_step(
            trainable,
            claim=lambda queue=queue: queue.pop(0) if queue else None,
            cells=lambda: 1,
            prefix_group=lambda k: None,
            is_core=True,
            core_rank=0,
            final=True,
            config=loss_config(),
        )


def reference_worker(rank: int, world_size: int, *, seed: int, mu: int, out: str) -> None:
    """The Megatron reference in a process of its own (megatron's parallel state needs a process group)."""
    trainable = make_trainable("megatron", 1)
    run_reference(trainable, seed, mu)
    torch.save(hf_parameters(trainable), out)


def hf_parameters(trainable) -> dict[str, torch.Tensor]:
    """The whole model in HF names (Megatron shards gathered), to compare layouts."""
    if hasattr(trainable, "model") and not hasattr(trainable.model, "lm_head"):
        from gyre.trainer.convert import gather_hf_state_dict

        return gather_hf_state_dict(trainable.model, model_config())
    return {name: p.detach().clone() for name, p in trainable.model.state_dict().items()}


def pulls_of(seed: int, step: int) -> list[list]:
    """The step's micro-steps as the packer's pulls would emit them: a split execution's micro-steps in one pull."""
    pulls: list[list] = []
    for micro_step in batch_microsteps(seed, step):
        continues = pulls and micro_step.has_split and pulls[-1][-1].has_split
        if continues:
            pulls[-1].append(micro_step)
        else:
            pulls.append([micro_step])
    return pulls


def controller(store, *, seed: int, mu: int, num_cells: int, joins: list[list[int]]) -> None:
    """The controller thread: per step a `StepPump` from an in-process queue onto the board. Groups become ready
    slowly (the stream is slower than a unit's compute: cells wait on it); satellites are admitted once the
    micro-steps `joins[step]` names are reached."""
    from gyre.data.queue import MicroStepQueue
    from gyre.distributed.claims import StepBoard
    from gyre.distributed.step_pump import StepPump

    rng = random.Random(seed)
    cells = 1
    for step in range(mu):
        queue = MicroStepQueue()
        pulls = pulls_of(seed, step)
        ready_at = [time.monotonic()]
        for _ in pulls:
            ready_at.append(ready_at[-1] + rng.uniform(0.02, 0.08))

        def refill(queue=queue, pulls=pulls, ready_at=ready_at) -> bool:
            if not pulls or time.monotonic() < ready_at[len(ready_at) - len(pulls) - 1]:
                return False  # no group ready yet
            for micro_step in pulls.pop(0):
                queue.put(micro_step)
            if not pulls:
                queue.close()
            return True

        pending = sorted(joins[step])

        def admit_joiners(pump, pending=pending) -> None:
            while pending and pending[0] <= pump.num_put and pump.can_admit:
                pending.pop(0)
                pump.admit()

        pump = StepPump(StepBoard(store, step, max_cells=num_cells, cells=cells), queue, refill=refill)
        pump.run(poll_s=0.002, between=admit_joiners)
        cells = pump.board.cells


def stream_worker(
    rank: int,
    world_size: int,
    *,
    seed: int,
    mu: int,
    joins: list[list[int]],
    out: str,
    backend: str = "native",
    cell_size: int = 1,
    transport_kind: str = "auto",
):
    import torch.distributed as dist

    from gyre.distributed.groups import build_process_groups
    from gyre.distributed.layout import Layout
    from gyre.distributed.one_sided import one_sided_transport
    from gyre.trainer.streaming import train_claimed_step

    num_cells = world_size // cell_size
    groups = build_process_groups(Layout(world_size=world_size, num_cells=num_cells, cell_size=cell_size))
    timeout = datetime.timedelta(seconds=60)
    store, port = shared_store(timeout.total_seconds())
    trainable = make_trainable(backend, cell_size)
    dist.barrier(group=groups.control_group)  # every rank is up before the stream starts
    feeder = None
    if rank == 0:
        feed_store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
        feeder = threading.Thread(
            target=controller,
            args=(feed_store,),
            kwargs={"seed": seed, "mu": mu, "num_cells": num_cells, "joins": joins},
            daemon=True,
        )
        feeder.start()

    prefix = f"test/weights/{groups.coordinate}"
    transport = one_sided_transport(store, kind=transport_kind, host="127.0.0.1", prefix=prefix, timeout_s=60)
    training = groups.cell == 0
    processed: dict[str, list[int]] = {}
    for step in range(mu):
        result = train_claimed_step(
            trainable,
            store=store,
            step=step,
            groups=groups,
            transport=transport,
            version=step + 1,
            training=training,
            final=step == mu - 1,
            config=loss_config(),
            timeout_s=60,
        )
        if result is None:
            continue
        training = True
        processed[str(step)] = result.units if groups.coordinate == 0 else []
    state = hf_parameters(trainable) if backend == "megatron" or rank == 0 else None  # gather: every TP rank joins
    if feeder is not None:
        feeder.join(timeout=30)
        torch.save(state, out)
    dist.barrier(group=groups.control_group)  # the store lives on rank 0: keep it until every rank is done
    transport.close()
    return {"processed": processed, "transport": type(transport).__name__}


def check_elastic_run(results, elastic, reference, initial, seed, mu, joins) -> None:
    assert sorted(elastic) == sorted(reference)
    assert any(not torch.equal(reference[n], initial[n]) for n in reference)  # the updates moved the parameters
    difference = torch.cat([(elastic[n] - reference[n]).reshape(-1) for n in sorted(reference)]).norm()
    relative = float(difference / torch.cat([reference[n].reshape(-1) for n in sorted(reference)]).norm())
    assert relative <= 1e-5, f"elastic vs one process: relative difference {relative:.2e}"
    for step in range(mu):
        done = [u for r in results for u in r["processed"].get(str(step), [])]
        assert sorted(done) == list(range(len(units_of(seed, step))))  # every unit exactly once
    by_satellites = sum(len(units) for r in results if r["cell"] > 0 for units in r["processed"].values())
    total = sum(len(units_of(seed, step)) for step in range(mu))
    print(f"joins {joins}, weights pulled over {results[0]['transport']}, units by satellites {by_satellites} of "
          f"{total}, relative difference {relative:.1e}")  # fmt: skip
    assert by_satellites > 0, f"no satellite processed a unit (joins {joins}, {results}): the test exercised nothing"


ATTEMPTS = 3  # runs of the streaming job before "no satellite processed a unit" fails a test (module docstring)


def run_streaming(world_size: int, cell_size: int, kwargs: dict, **options) -> list[dict]:
    """The streaming job's results, each with its cell; run again (at most `ATTEMPTS` times) while no satellite
    processed a unit: whether a satellite's claim beats the core's depends on timing, and on a loaded machine (the
    full suite on 2 cores) the core claimed all 7 units of a one-step run before its satellite had pulled the
    weights (seen once in 2,320 tests; alone it passes, 4 of 4). Every attempt is checked the same way after."""
    for _ in range(ATTEMPTS):
        results = run_local(f"{__file__}:stream_worker", world_size, kwargs=kwargs, timeout_s=TIMEOUT_S, **options)
        for rank, result in enumerate(results):
            result["cell"] = rank // cell_size
        if any(units for result in results if result["cell"] > 0 for units in result["processed"].values()):
            break
    return results


def join_plan(seed: int, mu: int, num_cells: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [sorted(rng.sample(range(4), rng.randint(1, num_cells - 1))) for _ in range(mu)]  # before micro-step 4


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "mu", "seed", "transport_kind"), [(3, 1, 1, "store"), (4, 3, 2, "auto")])
def test_satellites_joining_mid_batch_give_the_one_process_update(tmp_path, world_size, mu, seed, transport_kind):
    """Joiners pull over the store snapshot in one case, over Mooncake where it imports (else the store) in one."""
    joins = join_plan(seed, mu, world_size)
    out = tmp_path / "core.pt"
    kwargs = {"seed": seed, "mu": mu, "joins": joins, "out": str(out)}
    results = run_streaming(world_size, 1, {**kwargs, "transport_kind": transport_kind})
    reference = make_trainable()
    initial = hf_parameters(reference)
    run_reference(reference, seed, mu)
    check_elastic_run(results, torch.load(out), hf_parameters(reference), initial, seed, mu, joins)


@pytest.mark.slow
@pytest.mark.parametrize(("mu", "seed"), [(1, 3), (3, 4)])
def test_megatron_cells_of_two_tensor_parallel_ranks(tmp_path, mu, seed):
    """2 cells x TP 2 (Megatron, gloo) against one Megatron process at TP 1 on the same micro-steps."""
    joins = join_plan(seed, mu, 2)
    out, reference_out = tmp_path / "core.pt", tmp_path / "reference.pt"
    common = {"seed": seed, "mu": mu}
    kwargs = {**common, "joins": joins, "out": str(out), "backend": "megatron", "cell_size": 2}
    results = run_streaming(4, 2, kwargs, env={"PYTHONWARNINGS": "ignore"})
    run_local(
        f"{__file__}:reference_worker",
        1,
        kwargs={**common, "out": str(reference_out)},
        timeout_s=TIMEOUT_S,
        env={"PYTHONWARNINGS": "ignore"},
    )
    initial = {name: p.detach().clone() for name, p in make_trainable().model.state_dict().items()}
    check_elastic_run(results, torch.load(out), torch.load(reference_out), initial, seed, mu, joins)
