"""Megatron's model-parallel groups against gyre's process groups, on real gloo processes (CPU, 127.0.0.1).

Every rank calls `build_process_groups_and_model_parallel`: gyre's groups first, then Megatron's. The tests check,
against hand-written member lists, that Megatron's tensor-, pipeline- and model-parallel groups are exactly gyre's
cells on every rank (also at PP 2 with two cells, where Megatron's default rank order would put a pipeline across
cells), that a separate rollout rank takes part in Megatron's group creation but holds no Megatron group, that
every rank made the same `new_group` calls (torch's group counter agrees), and that a layout the user got wrong
fails with one ValueError on every rank before any group exists, and the order that hangs is refused.
Each collective sums 10**rank, so a sum's digits name the members. Every wait is bounded by `run_local`.
"""

from __future__ import annotations

import pytest

from gyre.distributed.local import run_local

TIMEOUT_S = 150.0
QUIET = {"PYTHONWARNINGS": "ignore"}  # megatron's import-time deprecation warnings


def members(group) -> list[int] | None:
    import torch.distributed as dist

    return None if group is None else dist.get_process_group_ranks(group)


def total(group) -> int:
    import torch
    import torch.distributed as dist

    value = torch.tensor([10 ** dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(value, group=group)
    return int(value.item())


def megatron_groups() -> dict:
    """This rank's Megatron groups (None where it holds none) and the sums over the TP and model-parallel ones."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {"initialized": False}
    return {
        "initialized": True,
        "tp": members(ps.get_tensor_model_parallel_group()),
        "pp": members(ps.get_pipeline_model_parallel_group()),
        "mp": members(ps.get_model_parallel_group()),
        "dp": members(ps.get_data_parallel_group()),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "tp_sum": total(ps.get_tensor_model_parallel_group()),
        "mp_sum": total(ps.get_model_parallel_group()),
    }


def group_counter() -> int:
    """torch's count of groups created with counter names (all but local-synchronization ones): equal on every
    rank exactly when every rank made the same such `new_group` calls."""
    import torch.distributed as dist

    return dist.distributed_c10d._world.group_count


def cells_worker(rank: int, world_size: int) -> dict:
    """2 cells x TP 2 through the one entry point, then the same cells re-initialized as PP 2 (TP 1)."""
    from gyre.distributed.layout import Layout
    from gyre.trainer.model import build_process_groups_and_model_parallel, init_model_parallel

    layout = Layout(world_size=world_size, num_cells=2, cell_size=2)
    groups = build_process_groups_and_model_parallel(layout, tensor_parallel_size=2, pipeline_parallel_size=1, seed=1)
    result = {
        "cell": members(groups.cell_group),
        "cell_sum": total(groups.cell_group),
        "prefix2": members(groups.prefix_group(2)),
        "tp2": megatron_groups(),
    }
    init_model_parallel(1, 2, layout=layout)  # gyre's cells stay; Megatron's groups are re-created over them
    result["pp2"] = megatron_groups()
    result["control_sum"] = total(groups.control_group)  # gyre's groups still work after Megatron's
    result["group_counter"] = group_counter()
    return result


@pytest.mark.slow  # 4 processes importing megatron: ~15-30 s on 2 cores
def test_megatron_groups_are_the_cells_of_two_cells_of_two():
    results = run_local(f"{__file__}:cells_worker", 4, timeout_s=TIMEOUT_S, env=QUIET)
    cells = [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["cell"] for r in results] == cells
    assert [r["cell_sum"] for r in results] == [11, 11, 1100, 1100]
    assert [r["prefix2"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    tp2 = [r["tp2"] for r in results]
    assert [m["tp"] for m in tp2] == cells  # TP 2: a cell is one TP group
    assert [m["mp"] for m in tp2] == cells
    assert [m["pp"] for m in tp2] == [[0], [1], [2], [3]]
    assert [m["tp_rank"] for m in tp2] == [0, 1, 0, 1]  # the in-cell coordinate, in the same order
    assert [m["tp_sum"] for m in tp2] == [m["mp_sum"] for m in tp2] == [11, 11, 1100, 1100]
    assert [m["dp"] for m in tp2] == [[0, 2], [1, 3], [0, 2], [1, 3]]  # the coordinate's 2-cell prefix group
    pp2 = [r["pp2"] for r in results]
    assert [m["pp"] for m in pp2] == cells  # PP 2: a cell is one pipeline (Megatron's default order: [0, 2])
    assert [m["mp"] for m in pp2] == cells
    assert [m["tp"] for m in pp2] == [[0], [1], [2], [3]]
    assert [m["pp_rank"] for m in pp2] == [0, 1, 0, 1]
    assert [m["mp_sum"] for m in pp2] == [11, 11, 1100, 1100]
    assert [r["control_sum"] for r in results] == [1111] * 4
    assert len({r["group_counter"] for r in results}) == 1, [r["group_counter"] for r in results]


def pool_worker(rank: int, world_size: int) -> dict:
    """1 cell x TP 2 and one separate rollout rank (world 3, not divisible by TP)."""
    from gyre.distributed.layout import Layout
    from gyre.models.decoder_config import DecoderConfig
    from gyre.trainer.model import build_gpt_model, build_process_groups_and_model_parallel

    layout = Layout(world_size=world_size, num_cells=1, cell_size=2, num_rollout_ranks=1)
    groups = build_process_groups_and_model_parallel(layout, tensor_parallel_size=2)
    result = {"cell": members(groups.cell_group), "megatron": megatron_groups()}
    config = DecoderConfig(
        model_type="qwen2",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    try:
        model = build_gpt_model(config)
        result["embedding_rows"] = model.embedding.word_embeddings.weight.shape[0]  # a TP shard: 64 / 2
    except RuntimeError as error:
        result["build_error"] = str(error)
    result["control_sum"] = total(groups.control_group)  # the rollout rank is not held up by Megatron's groups
    result["group_counter"] = group_counter()
    return result


@pytest.mark.slow  # 3 processes importing megatron
def test_a_rollout_rank_joins_megatrons_group_creation_but_holds_no_group():
    results = run_local(f"{__file__}:pool_worker", 3, timeout_s=TIMEOUT_S, env=QUIET)
    assert [r["cell"] for r in results] == [[0, 1], [0, 1], None]
    cell_ranks = [r["megatron"] for r in results[:2]]
    assert [m["tp"] for m in cell_ranks] == [m["mp"] for m in cell_ranks] == [[0, 1], [0, 1]]
    assert [m["dp"] for m in cell_ranks] == [[0], [1]]  # one cell: no data parallelism, the pool rank left out
    assert [m["tp_sum"] for m in cell_ranks] == [11, 11]
    assert [r.get("embedding_rows") for r in results] == [32, 32, None]
    assert results[2]["megatron"] == {"initialized": False}
    assert "parallel_state is not initialized" in results[2]["build_error"]
    assert [r["control_sum"] for r in results] == [111] * 3
    assert len({r["group_counter"] for r in results}) == 1, [r["group_counter"] for r in results]


def refusals_worker(rank: int, world_size: int) -> dict:
    """A layout whose cells are not TP x PP, then the order that would hang (Megatron's groups first)."""
    import torch.distributed as dist

    from gyre.distributed.groups import build_process_groups
    from gyre.distributed.layout import Layout
    from gyre.trainer.model import build_process_groups_and_model_parallel, init_model_parallel

    result = {}
    try:
        build_process_groups_and_model_parallel(
            Layout(world_size=world_size, num_cells=2, cell_size=1), tensor_parallel_size=2
        )
    except ValueError as error:
        result["mismatch"] = str(error)
    result["groups_after_mismatch"] = len(dist.distributed_c10d._world.pg_names) - 1  # besides the default group
    # One cell of PP 2, Megatron first: its embedding groups put the first stage in one group more than the last,
    # and gyre's cell group (named by its ranks and that count) would get a different name on each member.
    init_model_parallel(1, 2)
    result["groups_held"] = len(dist.distributed_c10d._world.pg_names)
    try:
        build_process_groups(Layout(world_size=world_size, num_cells=1, cell_size=2))
    except RuntimeError as error:
        result["order"] = str(error)
    return result


@pytest.mark.slow  # 2 processes importing megatron
def test_a_wrong_cell_size_and_megatron_first_fail_on_every_rank_without_a_hang():
    results = run_local(f"{__file__}:refusals_worker", 2, timeout_s=TIMEOUT_S, env=QUIET)
    expected = (
        "cell_size: got 1, expected tensor_parallel_size * pipeline_parallel_size = 2 * 1 = 2 "
        "(a cell is one Megatron model replica)"
    )
    assert [r["mismatch"] for r in results] == [expected] * 2
    assert [r["groups_after_mismatch"] for r in results] == [0, 0]  # refused before any group was created
    held = [r["groups_held"] for r in results]
    assert held[0] == held[1] + 1, held  # the asymmetry that makes the other order hang
    assert all("must create the job's first groups" in r["order"] for r in results)
