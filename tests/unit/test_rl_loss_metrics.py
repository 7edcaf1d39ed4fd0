"""gyre.rl.loss_metrics: policy_loss's metrics over several calls (micro-steps, cells) equal those of one call over
all their targets, for the statistics that are additive (fractions and means by their own denominators, minima,
maxima); a step without targets has no metrics; the sums survive the store's JSON."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from gyre.config.loss import LossConfig
from gyre.rl import policy_loss
from gyre.rl.loss_metrics import EXECUTION_WEIGHTED, MAXIMA, MINIMA, TOKEN_WEIGHTED, LossMetricSums


def executions(rng: random.Random, count: int) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """(logp_T, behavior_logp_T, advantage) of `count` executions, some far off-policy (clipped, capped)."""
    out = []
    for _ in range(count):
        n = rng.randint(1, 6)
        behavior = -torch.rand(n, dtype=torch.float64) * 3
        drift = torch.randn(n, dtype=torch.float64) * rng.choice([0.01, 0.5, 3.0])
        out.append(((behavior + drift).clamp(max=0), behavior, rng.gauss(0, 1)))
    return out


def call_metrics(parts, num_executions: int) -> dict[str, float]:
    logp = torch.cat([p[0] for p in parts])
    behavior = torch.cat([p[1] for p in parts])
    execution = torch.cat([torch.full((len(p[0]),), i, dtype=torch.int64) for i, p in enumerate(parts)])
    advantage = torch.tensor([p[2] for p in parts], dtype=torch.float64)
    _, metrics = policy_loss(logp, behavior, execution, advantage, num_executions, LossConfig())
    return metrics


@pytest.mark.parametrize("seed", range(5))
def test_calls_combine_to_the_metrics_of_one_call(seed):
    rng = random.Random(seed)
    batch = executions(rng, 12)
    cuts = sorted(rng.sample(range(1, 12), 3))
    parts = [batch[a:b] for a, b in zip([0, *cuts], [*cuts, 12], strict=True)]
    core, satellite = LossMetricSums(), LossMetricSums()
    for index, part in enumerate(parts):  # two cells, two micro-steps each
        (core if index % 2 == 0 else satellite).add(call_metrics(part, 12))
    satellite = LossMetricSums.from_dict(json.loads(json.dumps(satellite.to_dict())))  # through the store
    core.merge(satellite)
    whole = call_metrics(batch, 12)
    got = core.means()
    assert set(got) == set(TOKEN_WEIGHTED + EXECUTION_WEIGHTED + MINIMA + MAXIMA)
    for name, value in got.items():
        assert math.isclose(value, whole[name], rel_tol=1e-9, abs_tol=1e-12), (name, value, whole[name])


def test_a_step_without_targets_has_no_metrics():
    sums = LossMetricSums()
    sums.add({"num_targets": 0.0, "num_executions_with_targets": 0.0})  # what a call with no targets reports
    assert sums.means() == {} and sums.targets == 0
    other = LossMetricSums()
    other.merge(sums)
    assert other.means() == {}


def test_an_overflowed_ratio_is_left_out_not_reported():
    sums = LossMetricSums()
    metrics = call_metrics(executions(random.Random(1), 3), 3)
    sums.add({**metrics, "token_ratio_max": math.inf, "token_ratio_mean": math.inf})
    means = sums.means()
    assert "token_ratio_max" not in means and "token_ratio_mean" not in means
    assert means["clip_fraction"] == metrics["clip_fraction"]
