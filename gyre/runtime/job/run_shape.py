"""What a checkpoint is tied to (docs/runtime.md, "Checkpoints and resume"): the run's schedule (`run_shape`) and the
layout of the core's optimizer state (`trainer_layout`). A checkpoint keeps both in its `state.json`; the run plan
resumes from it only with the same. Pure: the config in, a dict out."""

from __future__ import annotations

from typing import Any

from gyre.config import TrainConfig

__all__ = ["run_shape", "trainer_layout"]


def run_shape(cfg: TrainConfig) -> dict:
    """What a checkpoint's state depends on: a run resumes from it only with the same (`gyre.runtime.job.plan.
    resolve_checkpoint` compares them)."""
    cl, algo = cfg.cluster, cfg.algo
    return {
        "algo.mode": algo.mode,
        "cluster.num_cells": cl.num_cells,
        "cluster.cell_capacity": cl.cell_capacity,
        "cluster.separate_capacity": cl.separate_capacity,  # the ledger's C_s (a checkpoint without it: not compared)
        "algo.group_size": algo.group_size,
        "algo.oversample": algo.oversample,
        "algo.batch_groups": algo.batch_groups,
        "algo.mu": algo.mu,
        "algo.extra_groups": algo.extra_groups,
        "algo.dispatch": algo.dispatch,
        "seed": cfg.seed,
    }


def trainer_layout(cfg: TrainConfig) -> dict[str, Any]:
    """What the core's optimizer state is laid out for (its shards, the order of its parameters): a checkpoint keeps
    it in `state.json`, and a run resumes from the checkpoint only with the same (`gyre.runtime.job.plan.
    resolve_checkpoint`)."""
    t = cfg.trainer
    layout = {
        "trainer.backend": t.backend,
        "trainer.tensor_parallel_size": t.tensor_parallel_size,
        "trainer.pipeline_parallel_size": t.pipeline_parallel_size,
    }
    if t.expert_parallel_size > 1:  # absent at 1, so checkpoints written before the field existed still resume
        layout["trainer.expert_parallel_size"] = t.expert_parallel_size
    if t.optimizer_offload_fraction > 0:  # the hybrid optimizer's state: its own main weights, its host share
        layout["trainer.optimizer_offload_fraction"] = t.optimizer_offload_fraction
    return layout
