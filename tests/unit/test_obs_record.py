"""StepRecord: the per-step record's checks and its flat JSON form (gyre/obs/record.py)."""

import json
import math

import pytest

from gyre.obs.record import LOSS_METRICS, StepRecord, TransitionRecord, json_ready, record_from_dict


def full_record() -> StepRecord:
    return StepRecord(
        step=3,
        wall_time_s=120.5,
        burst=1,
        reward_mean=0.42,
        pass_rate=0.375,
        loss={"loss": -0.01, "clip_fraction": 0.25, "seq_ratio_max": 1.1},
        grad_norm=0.8,
        staleness_group_mean=0.5,
        staleness_token_mean=0.6,
        staleness_max=1.0,
        staleness_groups=4,
        staleness_tokens=900.0,
        roles=("training", "training", "rollout", "to_rollout"),
        waterlevel=0.83,
        rollout_capacity=16,
        transitions=(TransitionRecord(cell=3, to="rollout", start_s=110.0, duration_s=2.5),),
        reroutes=2,
        rerouted_executions=(17, 17),
        calls_rerouted=3,
        kv_migrations=1,
        rollout_tokens=5000,
        train_tokens=900,
        rollout_tokens_per_s=41.5,
        train_tokens_per_s=300.0,
    )


def test_to_dict_is_flat_json_and_reads_back():
    record = full_record()
    data = record.to_dict()
    assert data["loss/loss"] == -0.01 and data["loss/clip_fraction"] == 0.25 and "loss" not in data
    assert data["roles"] == ["training", "training", "rollout", "to_rollout"]
    assert data["transitions"] == [{"cell": 3, "to": "rollout", "start_s": 110.0, "duration_s": 2.5, "phases": {}}]
    assert record_from_dict(json.loads(json.dumps(data))) == record


def test_unmeasured_metrics_are_none_not_zero():
    record = StepRecord(step=0, wall_time_s=1.0)
    data = record.to_dict()
    assert data["reward_mean"] is None and data["grad_norm"] is None and data["staleness_max"] is None
    assert not any(key.startswith("loss/") for key in data)
    assert record_from_dict(data) == record


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"step": -1}, "step"),
        ({"step": True}, "step"),
        ({"wall_time_s": math.inf}, "wall_time_s"),
        ({"pass_rate": 1.5}, "pass_rate"),
        ({"loss": {"entropy": 1.0}}, "loss"),
        ({"loss": {"loss": "x"}}, "loss.loss"),
        ({"roles": ("idle",)}, "roles"),
        ({"reroutes": 2, "rerouted_executions": (1,)}, "rerouted_executions"),
        ({"grad_norm": "1"}, "grad_norm"),
        ({"rollout_capacity": -1}, "rollout_capacity"),
    ],
)
def test_bad_values_name_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"StepRecord\.{field}=.* is not allowed: expected"):
        StepRecord(**{"step": 0, "wall_time_s": 0.0, **changes})


def test_bad_transition_and_unknown_keys():
    with pytest.raises(ValueError, match=r"transition\.to='idle'"):
        TransitionRecord(cell=0, to="idle", start_s=0.0, duration_s=1.0)
    with pytest.raises(ValueError, match=r"StepRecord\.record=\['rewrad'\]"):
        record_from_dict({"step": 0, "wall_time_s": 0.0, "rewrad": 1.0})


def test_nan_loss_is_kept_and_written_as_null():
    record = StepRecord(step=0, wall_time_s=0.0, loss={"loss": math.nan})
    assert json.loads(json.dumps(json_ready(record.to_dict()), allow_nan=False))["loss/loss"] is None


def test_loss_metrics_are_those_policy_loss_reports():
    import torch

    from gyre.rl.loss import LossConfig, policy_loss

    _, metrics = policy_loss(
        logp_T=torch.zeros(3), behavior_logp_T=torch.zeros(3), advantage_E=torch.ones(1),
        execution_T=torch.zeros(3, dtype=torch.int64), num_executions=1, config=LossConfig(),
    )  # fmt: skip
    reported = set(metrics) - {"num_executions_with_targets", "num_targets"}
    assert reported == set(LOSS_METRICS) - {"loss"}
