"""The execution-level loss (Eq. 5-6): hand-computed values and gradients, packing invariance, bad inputs."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from gyre.config import ConfigError
from gyre.rl import LossConfig, policy_loss, sequence_clip_keep, sequence_ratio

CFG = LossConfig()  # paper values: token ratio cap 5, clip [0.995, 1.005], token loss cap 100
e = math.exp

# The hand case. 8 target tokens of 5 executions, interleaved (order carries no meaning), plus an
# execution 5 with no targets and num_executions = 8 (two more raw executions absent from the call).
#   token: execution, logp, behavior_logp  -> log rho = logp - behavior
HAND_TOKENS = [
    (2, -1.0, -3.0),  # t0: log rho  2.0, rho e^2 = 7.39 > 5       -> w = 5 (token ratio cap)
    (0, -1.0, -1.5),  # t1: log rho  0.5
    (3, -2.0, -2.3),  # t2: log rho  0.3
    (2, -3.0, -1.0),  # t3: log rho -2.0, w = e^-2
    (1, -1.2, -0.8),  # t4: log rho -0.4
    (0, -2.0, -1.7),  # t5: log rho -0.3
    (4, -0.5, -0.3),  # t6: log rho -0.2, w = e^-0.2
    (2, -60.0, -60.0),  # t7: log rho 0, w = 1; raw loss 120 -> capped at 100
]
HAND_ADV = [1.0, -1.0, 2.0, -0.5, 0.5, 1.0]
HAND_N = 8
# Eq. 5, s_i = exp(mean log rho over the execution's targets):
#   e0: exp((0.5 - 0.3) / 2) = e^0.1 = 1.105 > 1.005 with A > 0  -> m = 0 (clipped, positive side)
#   e1: exp(-0.4) = 0.670 < 0.995 with A < 0                     -> m = 0 (clipped, negative side)
#   e2: exp((2 - 2 + 0) / 3) = 1                                  -> m = 1
#   e3: exp(0.3) = 1.350 > 1.005 but A < 0                        -> m = 1 (the sign decides)
#   e4: exp(-0.2) = 0.819 < 0.995 but A > 0                       -> m = 1
#   e5: no targets, s = 1                                          -> m = 1, contributes nothing
HAND_S = [e(0.1), e(-0.4), 1.0, e(0.3), e(-0.2), 1.0]
HAND_KEEP = [False, False, True, True, True, True]
# Token losses l_u = min(100, -m A w logp):
#   t0: -(2)(5)(-1)       = 10
#   t3: -(2)(e^-2)(-3)    = 6 e^-2
#   t7: -(2)(1)(-60)      = 120 -> 100 (cap binds)
#   t2: -(-0.5)(e^0.3)(-2) = -e^0.3 (negative: the cap never binds for A < 0)
#   t6: -(0.5)(e^-0.2)(-0.5) = 0.25 e^-0.2
#   t1, t5, t4: masked -> 0
# Eq. 6: L_2 = (10 + 6 e^-2 + 100) / 3, L_3 = -e^0.3, L_4 = 0.25 e^-0.2; loss = (L_2 + L_3 + L_4) / 8
HAND_LOSS = ((10 + 6 * e(-2) + 100) / 3 - e(0.3) + 0.25 * e(-0.2)) / 8
# d loss / d logp_u = -m A w / (L_i * 8), 0 where the cap binds:
HAND_GRAD = [
    -2 * 5 / (3 * 8),  # t0: uses the capped weight 5; no gradient through rho (stop-gradient)
    0.0,  # t1: masked
    0.5 * e(0.3) / 8,  # t2
    -2 * e(-2) / (3 * 8),  # t3
    0.0,  # t4: masked
    0.0,  # t5: masked
    -0.5 * e(-0.2) / 8,  # t6
    0.0,  # t7: loss cap binds, min picks the constant 100
]
HAND_RHO = [e(2.0), e(0.5), e(0.3), e(-2.0), e(-0.4), e(-0.3), e(-0.2), 1.0]
HAND_METRICS = {
    "clip_fraction": 2 / 5,  # e0, e1 of the 5 executions with targets
    "token_cap_fraction": 1 / 8,  # t0
    "loss_cap_fraction": 1 / 8,  # t7
    "seq_ratio_mean": (e(0.1) + e(-0.4) + 1 + e(0.3) + e(-0.2)) / 5,
    "seq_ratio_min": e(-0.4),
    "seq_ratio_max": e(0.3),
    "token_ratio_mean": sum(HAND_RHO) / 8,
    "token_ratio_max": e(2.0),
    "abs_log_ratio_mean": (2 + 0.5 + 0.3 + 2 + 0.4 + 0.3 + 0.2 + 0) / 8,
    "abs_log_ratio_max": 2.0,
    "num_executions_with_targets": 5.0,
    "num_targets": 8.0,
}


def hand_inputs(dtype):
    execution, logp, behavior = zip(*HAND_TOKENS, strict=True)
    logp_T = torch.tensor(logp, dtype=dtype, requires_grad=True)
    return (
        logp_T,
        torch.tensor(behavior, dtype=dtype),
        torch.tensor(execution, dtype=torch.int64),
        torch.tensor(HAND_ADV, dtype=dtype),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hand_computed_loss_gradient_and_metrics(dtype):
    logp_T, behavior_T, execution_T, advantage_E = hand_inputs(dtype)
    loss, metrics = policy_loss(logp_T, behavior_T, execution_T, advantage_E, HAND_N, CFG)
    loss.backward()
    assert loss.dtype == dtype
    assert_close(loss, torch.tensor(HAND_LOSS, dtype=dtype))
    assert_close(logp_T.grad, torch.tensor(HAND_GRAD, dtype=dtype))
    assert set(metrics) == set(HAND_METRICS)
    assert all(type(v) is float for v in metrics.values())
    for name, want in HAND_METRICS.items():
        assert metrics[name] == pytest.approx(want, rel=1e-5), name

    s_E, count_E = sequence_ratio(logp_T - behavior_T, execution_T, len(HAND_ADV))
    assert_close(s_E, torch.tensor(HAND_S, dtype=torch.float64), rtol=1e-6, atol=1e-7)
    assert count_E.tolist() == [2, 1, 3, 1, 1, 0]
    assert sequence_clip_keep(s_E, advantage_E, CFG).tolist() == HAND_KEEP


def test_loss_cap_binds_strictly_above_the_cap():
    # A = 1, w = 1 (logp == behavior): raw = -logp. At raw = 100 exactly the value passes through with its
    # gradient -1 / (L n); above 100 the constant is picked and the gradient is 0.
    logp_T = torch.tensor([-100.0, -100.5, -99.0], dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(
        logp_T,
        logp_T.detach().clone(),
        torch.tensor([0, 1, 2]),
        torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64),
        4,
        CFG,
    )
    loss.backward()
    assert_close(loss, torch.tensor((100 + 100 + 99) / 4, dtype=torch.float64))
    assert_close(logp_T.grad, torch.tensor([-0.25, 0.0, -0.25], dtype=torch.float64))
    assert metrics["loss_cap_fraction"] == pytest.approx(1 / 3)


def test_token_ratio_cap_and_clip_interval_come_from_the_config():
    # One execution, A = 1, log rho = 0.004 -> s = e^0.004 = 1.004: kept at high 1.005, masked at high 1.003.
    # Token ratio 1.004 -> w = 1.004 at cap 5, w = 1 at cap 1.
    logp_T = torch.tensor([-2.0], dtype=torch.float64, requires_grad=True)
    args = (torch.tensor([-2.004], dtype=torch.float64), torch.tensor([0]), torch.tensor([1.0], dtype=torch.float64))
    loss, _ = policy_loss(logp_T, *args, 1, LossConfig(token_ratio_cap=1.0))
    assert_close(loss, torch.tensor(2.0, dtype=torch.float64))  # -(1)(1)(-2)
    loss, _ = policy_loss(logp_T, *args, 1, LossConfig())
    assert_close(loss, torch.tensor(2.0 * e(0.004), dtype=torch.float64))
    loss, metrics = policy_loss(logp_T, *args, 1, LossConfig(seq_clip_high=1.003))
    assert loss.item() == 0.0
    assert metrics["clip_fraction"] == 1.0
    loss, _ = policy_loss(logp_T, *args, 1, LossConfig(token_loss_cap=1.5))
    assert_close(loss, torch.tensor(1.5, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------
# Eq. 6 invariance: how the targets of an execution are spread over packed rows, and in what order,
# changes neither s_i, nor m_i, nor the loss, nor any token's gradient.

ADVANTAGES = [-1.5, -0.25, 0.0, 0.75, 2.0]
# log rho per token: small ones keep s_i near the clip interval, large ones cross it and the token cap.
LOG_RATIOS = [0.0, 0.002, -0.003, 0.004, 0.5, -1.0, 2.5]


@st.composite
def packed_batches(draw):
    num_local = draw(st.integers(1, 4))
    tokens = []  # (execution, logp, behavior)
    for i in range(num_local):
        for _ in range(draw(st.integers(0, 6))):
            # Very negative log-probs make the token loss cap bind when A > 0.
            logp = draw(st.one_of(st.floats(-70.0, -0.01, allow_nan=False), st.sampled_from([-60.0, -95.0])))
            behavior = min(logp - draw(st.sampled_from(LOG_RATIOS)), 0.0)
            tokens.append((i, logp, behavior))
    advantages = draw(st.lists(st.sampled_from(ADVANTAGES), min_size=num_local, max_size=num_local))
    num_executions = num_local + draw(st.integers(0, 3))
    num_rows = draw(st.integers(1, 4))
    row_of = [draw(st.integers(0, num_rows - 1)) for _ in tokens]
    order = draw(st.permutations(range(len(tokens))))
    fillers = [draw(st.integers(0, 3)) for _ in range(num_rows)]  # context tokens, not targets
    return tokens, advantages, num_executions, num_rows, row_of, order, fillers


def flat_reference(tokens, advantages, num_executions):
    logp_T = torch.tensor([t[1] for t in tokens], requires_grad=True)
    behavior_T = torch.tensor([t[2] for t in tokens])
    execution_T = torch.tensor([t[0] for t in tokens], dtype=torch.int64)
    advantage_E = torch.tensor(advantages)
    loss, metrics = policy_loss(logp_T, behavior_T, execution_T, advantage_E, num_executions, CFG)
    loss.backward()
    s_E, count_E = sequence_ratio(logp_T - behavior_T, execution_T, len(advantages))
    return loss, metrics, logp_T.grad, s_E, count_E, sequence_clip_keep(s_E, advantage_E, CFG)


@settings(max_examples=150, deadline=None)
@given(packed_batches())
def test_packing_and_order_change_nothing(batch):
    tokens, advantages, num_executions, num_rows, row_of, order, fillers = batch
    loss_ref, metrics_ref, grad_ref, s_ref, count_ref, keep_ref = flat_reference(tokens, advantages, num_executions)

    # Pack: each row gets its fillers first, then its tokens in the drawn global order.
    rows = [[None] * fillers[r] for r in range(num_rows)]
    for k in order:
        rows[row_of[k]].append(k)
    width = max(len(row) for row in rows)
    logp_RS = torch.full((num_rows, width), -0.7)
    behavior_RS = torch.full((num_rows, width), -0.9)
    execution_RS = torch.zeros((num_rows, width), dtype=torch.int64)
    target_RS = torch.zeros((num_rows, width), dtype=torch.bool)
    place = {}
    for r, row in enumerate(rows):
        for j, k in enumerate(row):
            if k is not None:
                execution_RS[r, j], logp_RS[r, j], behavior_RS[r, j] = tokens[k]
                target_RS[r, j] = True
                place[k] = (r, j)
    logp_RS.requires_grad_(True)

    logp_T = logp_RS[target_RS]
    behavior_T = behavior_RS[target_RS]
    execution_T = execution_RS[target_RS]
    advantage_E = torch.tensor(advantages)
    loss, metrics = policy_loss(logp_T, behavior_T, execution_T, advantage_E, num_executions, CFG)
    loss.backward()

    s_E, count_E = sequence_ratio(logp_T - behavior_T, execution_T, len(advantages))
    assert torch.equal(count_E, count_ref)
    assert_close(s_E, s_ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(sequence_clip_keep(s_E, advantage_E, CFG), keep_ref)
    assert_close(loss, loss_ref)
    grad_T = torch.stack([logp_RS.grad[place[k]] for k in range(len(tokens))]) if tokens else torch.zeros(0)
    assert_close(grad_T, grad_ref)
    assert torch.all(logp_RS.grad[~target_RS] == 0)  # context tokens get no gradient
    assert metrics.keys() == metrics_ref.keys()
    for name, value in metrics.items():
        assert value == pytest.approx(metrics_ref[name], rel=1e-6, abs=1e-9), name


def test_execution_without_targets_adds_nothing_but_counts_in_the_denominator():
    # e0: one token, A = 1, logp = behavior = -2 -> L_0 = 2. e1 has no targets.
    logp_T = torch.tensor([-2.0], dtype=torch.float64, requires_grad=True)
    behavior_T = torch.tensor([-2.0], dtype=torch.float64)
    execution_T = torch.tensor([0])
    for advantage_E, num_executions in (([1.0], 1), ([1.0, 3.0], 2), ([1.0, -3.0], 5)):
        logp_T.grad = None
        loss, metrics = policy_loss(
            logp_T, behavior_T, execution_T, torch.tensor(advantage_E, dtype=torch.float64), num_executions, CFG
        )
        loss.backward()
        assert_close(loss, torch.tensor(2.0 / num_executions, dtype=torch.float64))
        assert_close(logp_T.grad, torch.tensor([-1.0 / num_executions], dtype=torch.float64))
        assert metrics["num_executions_with_targets"] == 1.0
        assert metrics["seq_ratio_min"] == 1.0


def test_no_targets_at_all_gives_zero_loss_with_a_graph():
    logp_T = torch.zeros(0, requires_grad=True)
    loss, metrics = policy_loss(logp_T, torch.zeros(0), torch.zeros(0, dtype=torch.int64), torch.ones(3), 3, CFG)
    loss.backward()
    assert loss.item() == 0.0
    assert logp_T.grad.shape == (0,)
    assert metrics["num_targets"] == 0.0
    assert metrics["clip_fraction"] == 0.0
    assert metrics["seq_ratio_mean"] == 1.0


def test_micro_steps_split_by_execution_sum_to_the_batch_loss():
    logp_T, behavior_T, execution_T, advantage_E = hand_inputs(torch.float64)
    full, _ = policy_loss(logp_T, behavior_T, execution_T, advantage_E, HAND_N, CFG)
    parts = []
    for group in ([0, 2], [1, 3, 4, 5]):  # each micro-step carries whole executions, renumbered locally
        sel = torch.isin(execution_T, torch.tensor(group))
        local = {g: k for k, g in enumerate(group)}
        local_T = torch.tensor([local[int(i)] for i in execution_T[sel]], dtype=torch.int64)
        part, _ = policy_loss(logp_T[sel], behavior_T[sel], local_T, advantage_E[group], HAND_N, CFG)
        parts.append(part)
    assert_close(parts[0] + parts[1], full)


def test_low_precision_logp_is_computed_in_float32():
    logp_T, behavior_T, execution_T, advantage_E = hand_inputs(torch.float32)
    loss, _ = policy_loss(logp_T.detach().bfloat16(), behavior_T, execution_T, advantage_E, HAND_N, CFG)
    assert loss.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------
# Bad inputs name what is wrong.


def good_inputs():
    return {
        "logp_T": torch.tensor([-1.0, -2.0, -0.5]),
        "behavior_logp_T": torch.tensor([-1.1, -2.0, -0.4]),
        "execution_T": torch.tensor([0, 1, 1]),
        "advantage_E": torch.tensor([1.0, -1.0]),
        "num_executions": 4,
        "config": CFG,
    }


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"behavior_logp_T": torch.tensor([-1.0, -2.0])}, "same shape"),
        ({"execution_T": torch.tensor([0, 1])}, "same shape"),
        ({"logp_T": torch.tensor([[-1.0, -2.0, -0.5]])}, "logp_T must be 1-D"),
        ({"advantage_E": torch.tensor([[1.0, -1.0]])}, "advantage_E must be 1-D"),
        ({"execution_T": torch.tensor([0, 1, 1], dtype=torch.int32)}, "execution_T must be an int64"),
        ({"execution_T": torch.tensor([0.0, 1.0, 1.0])}, "execution_T must be an int64"),
        ({"logp_T": torch.tensor([-1, -2, 0])}, "logp_T must be a floating-point"),
        (
            {"behavior_logp_T": torch.tensor([-1.1, NAN, -0.4])},
            "behavior_logp_T has non-finite values at target tokens [1]",
        ),
        (
            {"behavior_logp_T": torch.tensor([-INF, -2.0, -0.4])},
            "behavior_logp_T has non-finite values at target tokens [0]",
        ),
        ({"behavior_logp_T": torch.tensor([-1.1, -2.0, 0.3])}, "positive at target tokens [2]"),
        ({"logp_T": torch.tensor([-1.0, NAN, -0.5])}, "logp_T has non-finite values at target tokens [1]"),
        ({"advantage_E": torch.tensor([INF, -1.0])}, "advantage_E has non-finite values at executions [0]"),
        ({"execution_T": torch.tensor([0, 2, 1])}, "in [0, 2); out of range at target tokens [1] (values [2])"),
        ({"execution_T": torch.tensor([-1, 1, 1])}, "out of range at target tokens [0] (values [-1])"),
        ({"num_executions": 1}, "num_executions=1 is smaller than the 2 executions with targets"),
        ({"num_executions": 0}, "num_executions must be >= 1"),
    ],
)
def test_bad_input_raises_value_error_naming_it(change, message):
    kwargs = good_inputs() | change
    with pytest.raises(ValueError) as info:
        policy_loss(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [({"num_executions": 2.0}, "num_executions must be an integer"), ({"config": {}}, "config must be a LossConfig")],
)
def test_wrong_type_raises_type_error(change, message):
    with pytest.raises(TypeError, match=message):
        policy_loss(**(good_inputs() | change))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"token_ratio_cap": 0.0}, "loss.token_ratio_cap=0.0"),
        ({"token_loss_cap": -1.0}, "loss.token_loss_cap=-1.0"),
        ({"token_loss_cap": INF}, "loss.token_loss_cap=inf"),
        ({"seq_clip_low": 1.0}, "loss.seq_clip_low=1.0"),
        ({"seq_clip_low": -0.1}, "loss.seq_clip_low=-0.1"),
        ({"seq_clip_high": 1.0}, "loss.seq_clip_high=1.0"),
        ({"seq_clip_high": 0.9}, "loss.seq_clip_high=0.9"),
    ],
)
def test_bad_config_names_field_value_and_allowed(kwargs, field):
    with pytest.raises(ConfigError) as info:
        LossConfig(**kwargs)
    assert field in str(info.value)
    assert "expected" in str(info.value)
