"""One execution split across micro-steps and cells: `num_targets_E`, `seq_ratio_E` and the Eq. 5 sums.

Each micro-step is a separate `policy_loss` call that knows the execution's global L_i (from admission) and
its s_i (accumulated beforehand with `sequence_log_ratio_sums` and `finalize_sequence_ratio`); the micro-step
losses and their accumulated gradients must equal one call over the whole batch.
"""

import math
import re

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from gyre.rl import LossConfig, finalize_sequence_ratio, policy_loss, sequence_log_ratio_sums, sequence_ratio

CFG = LossConfig()  # token ratio cap 5, clip [0.995, 1.005], token loss cap 100
e = math.exp

# The split hand case: 4 executions, num_executions = 5 (one more raw execution absent).
#   token: execution, logp, log rho (behavior = logp - log rho)
SPLIT_TOKENS = [
    (0, -1.0, 0.02),  # t0 \
    (0, -0.5, 0.02),  # t1  } e0: A = 1,  s = exp(0.03 / 3) = e^0.01 > 1.005   -> m = 0 (positive side)
    (0, -2.0, -0.01),  # t2 /
    (1, -1.0, -0.02),  # t3 \
    (1, -0.7, 0.01),  # t4   } e1: A = -1, s = exp(-0.03 / 3) = e^-0.01 < 0.995 -> m = 0 (negative side)
    (1, -1.5, -0.02),  # t5 /
    (2, -1.0, 2.0),  # t6 \     e2: A = 2, s = exp(0 / 3) = 1 -> m = 1; t6: rho e^2 > 5, w = 5 (token cap)
    (2, -60.0, 0.0),  # t7  }   t7: raw loss 120 -> 100 (loss cap binds, zero gradient)
    (2, -3.0, -2.0),  # t8 /    t8: w = e^-2
    (3, -2.0, 0.3),  # t9       e3: A = -0.5, s = e^0.3 > 1.005 but A < 0 -> m = 1
]
SPLIT_ADV = [1.0, -1.0, 2.0, -0.5]
SPLIT_N = 5
SPLIT_S = [e(0.01), e(-0.01), 1.0, e(0.3)]
SPLIT_L = [3, 3, 3, 1]
# Three micro-steps; e0, e1 and e2 each span several. Local execution order is scrambled per micro-step,
# and micro-step 0 also lists e3, which has no targets there.
MICRO_STEPS = [([0, 1, 3, 6], [2, 1, 0, 3]), ([2, 7, 9], [3, 2, 0]), ([4, 5, 8], [1, 2])]
# Loss: e2: (10 + 100 + 6 e^-2) / 3, e3: -(-0.5)(e^0.3)(-2) = -e^0.3; e0, e1 masked; over num_executions = 5.
SPLIT_LOSS = ((10 + 100 + 6 * e(-2)) / 3 - e(0.3)) / 5
SPLIT_GRAD = [0, 0, 0, 0, 0, 0, -2 * 5 / (3 * 5), 0, -2 * e(-2) / (3 * 5), 0.5 * e(0.3) / 5]
# Without seq_ratio_E each micro-step decides m_i from its own part (an approximation):
#   micro-step 0: e2's t6 alone has s = e^2 > 1.005 with A > 0 -> masked there, losing 10 / (3 * 5);
#   micro-step 1: e0's t2 alone has s = e^-0.01, A > 0 -> kept, adding -(1)(e^-0.01)(-2) / (3 * 5);
#   micro-step 2: e1's t4, t5 have s = e^-0.005 = 0.99501 > 0.995 -> kept, adding
#                 (-(-1)(e^0.01)(-0.7) - (-1)(e^-0.02)(-1.5)) / (3 * 5).
APPROX_LOSS = SPLIT_LOSS + (-10 + 2 * e(-0.01) - 0.7 * e(0.01) - 1.5 * e(-0.02)) / (3 * 5)


def split_inputs(dtype):
    execution, logp, log_ratio = zip(*SPLIT_TOKENS, strict=True)
    logp_T = torch.tensor(logp, dtype=dtype, requires_grad=True)
    behavior_T = torch.tensor([lp - lr for lp, lr in zip(logp, log_ratio, strict=True)], dtype=dtype)
    return logp_T, behavior_T, torch.tensor(execution), torch.tensor(SPLIT_ADV, dtype=dtype)


def micro_step_args(tokens, local, execution_T):
    """Token selection and local execution indices of one micro-step (`local[k]` = global id of local k)."""
    sel = torch.tensor(tokens, dtype=torch.int64)
    to_local = {g: k for k, g in enumerate(local)}
    local_T = torch.tensor([to_local[int(g)] for g in execution_T[sel]], dtype=torch.int64)
    return sel, local_T, torch.tensor(local, dtype=torch.int64)


def accumulate_seq_ratio(logp_T, behavior_T, execution_T, steps, num_global, cells=None):
    """The documented recipe: per micro-step sums, index_add into batch-wide slots per cell, one all_reduce
    (here: a sum over cells) of the stacked [2, E] tensor, then finalize."""
    cells = cells or [0] * len(steps)
    reduced = torch.zeros(max(cells) + 1, 2, num_global, dtype=torch.float64)
    with torch.no_grad():
        for (tokens, local), cell in zip(steps, cells, strict=True):
            sel, local_T, local_ids = micro_step_args(tokens, local, execution_T)
            sum_E, count_E = sequence_log_ratio_sums(logp_T[sel] - behavior_T[sel], local_T, len(local))
            reduced[cell].index_add_(1, local_ids, torch.stack([sum_E, count_E.double()]))
    total = reduced.sum(0)  # all_reduce(SUM) over cells
    return finalize_sequence_ratio(total[0], total[1]), total[1]


def run_micro_steps(logp_T, behavior_T, execution_T, advantage_E, steps, num_executions, num_targets_E, s_E):
    """One policy_loss call and one backward per micro-step; returns the summed loss and the metrics."""
    total, metrics = 0.0, []
    for tokens, local in steps:
        sel, local_T, local_ids = micro_step_args(tokens, local, execution_T)
        loss, m = policy_loss(
            logp_T[sel],
            behavior_T[sel],
            local_T,
            advantage_E[local_ids],
            num_executions,
            CFG,
            num_targets_E=num_targets_E[local_ids],
            seq_ratio_E=None if s_E is None else s_E[local_ids],
            allow_partial_seq_ratio=s_E is None,
        )
        loss.backward()
        total = total + loss.detach()
        metrics.append(m)
    return total, metrics


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hand_case_split_across_micro_steps_equals_one_call(dtype):
    logp_T, behavior_T, execution_T, advantage_E = split_inputs(dtype)
    full, full_metrics = policy_loss(logp_T, behavior_T, execution_T, advantage_E, SPLIT_N, CFG)
    full.backward()
    assert_close(full, torch.tensor(SPLIT_LOSS, dtype=dtype))
    assert_close(logp_T.grad, torch.tensor(SPLIT_GRAD, dtype=dtype))
    assert full_metrics["clip_fraction"] == 0.5  # both signs bind: e0 (A > 0), e1 (A < 0)
    assert full_metrics["token_cap_fraction"] == pytest.approx(0.1)  # t6
    assert full_metrics["loss_cap_fraction"] == pytest.approx(0.1)  # t7
    grad_full = logp_T.grad.clone()

    s_E, count_E = accumulate_seq_ratio(logp_T, behavior_T, execution_T, MICRO_STEPS, len(SPLIT_ADV))
    assert count_E.tolist() == SPLIT_L
    assert_close(s_E, torch.tensor(SPLIT_S, dtype=torch.float64), rtol=1e-6, atol=1e-7)
    s_one, _ = sequence_ratio(logp_T - behavior_T, execution_T, len(SPLIT_ADV))
    assert_close(s_E, s_one, rtol=1e-12, atol=1e-12)

    logp_T.grad = None
    num_targets_E = torch.tensor(SPLIT_L)
    total, metrics = run_micro_steps(
        logp_T, behavior_T, execution_T, advantage_E, MICRO_STEPS, SPLIT_N, num_targets_E, s_E
    )
    assert_close(total, full.detach())
    assert_close(logp_T.grad, grad_full)
    # Each micro-step reports the given s_i of the executions it carries targets of.
    assert metrics[0]["seq_ratio_min"] == pytest.approx(e(-0.01), rel=1e-6)  # e0, e1, e2 present
    assert metrics[0]["seq_ratio_max"] == pytest.approx(e(0.01), rel=1e-6)
    assert metrics[0]["clip_fraction"] == pytest.approx(2 / 3)
    assert metrics[1]["seq_ratio_max"] == pytest.approx(e(0.3), rel=1e-6)  # e3 present
    assert metrics[1]["clip_fraction"] == pytest.approx(1 / 3)  # e0 masked by its global s_i


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_without_seq_ratio_each_micro_step_decides_the_mask_from_its_part(dtype):
    logp_T, behavior_T, execution_T, advantage_E = split_inputs(dtype)
    total, metrics = run_micro_steps(
        logp_T, behavior_T, execution_T, advantage_E, MICRO_STEPS, SPLIT_N, torch.tensor(SPLIT_L), None
    )
    assert_close(total, torch.tensor(APPROX_LOSS, dtype=dtype))  # the approximation, by hand
    assert metrics[0]["seq_ratio_max"] == pytest.approx(e(2.0), rel=1e-5)  # e2's local s_i from t6 alone
    assert metrics[1]["seq_ratio_min"] == pytest.approx(e(-0.01), rel=1e-5)  # e0's local s_i from t2 alone
    assert metrics[2]["seq_ratio_max"] == pytest.approx(e(-0.005), rel=1e-5)  # e1's local s_i from t4, t5


def test_global_num_targets_without_a_split_execution_is_the_default():
    # All targets present: num_targets_E = the present counts and seq_ratio_E = the present s_i change nothing.
    logp_T, behavior_T, execution_T, advantage_E = split_inputs(torch.float64)
    base, base_metrics = policy_loss(logp_T, behavior_T, execution_T, advantage_E, SPLIT_N, CFG)
    s_E, count_E = sequence_ratio(logp_T - behavior_T, execution_T, len(SPLIT_ADV))
    for kwargs in ({"num_targets_E": count_E}, {"seq_ratio_E": s_E}, {"num_targets_E": count_E, "seq_ratio_E": s_E}):
        loss, metrics = policy_loss(logp_T, behavior_T, execution_T, advantage_E, SPLIT_N, CFG, **kwargs)
        assert torch.equal(loss, base)
        assert metrics == base_metrics


def test_larger_num_targets_scales_an_execution_down():
    # One token of an execution with L_i = 4 (three more targets elsewhere): weight 1/4, gradient -A / (4 n).
    logp_T = torch.tensor([-2.0], dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(
        logp_T,
        logp_T.detach().clone(),
        torch.tensor([0]),
        torch.tensor([1.0], dtype=torch.float64),
        2,
        CFG,
        num_targets_E=torch.tensor([4], dtype=torch.int32),
        seq_ratio_E=torch.tensor([1.0], dtype=torch.float64),
    )
    loss.backward()
    assert_close(loss, torch.tensor(2.0 / (4 * 2), dtype=torch.float64))
    assert_close(logp_T.grad, torch.tensor([-1.0 / (4 * 2)], dtype=torch.float64))


def test_a_split_execution_without_seq_ratio_is_an_error_unless_allowed():
    # e0 has 1 of its 3 targets here, e1 all of its 2: s_i of e0's part is not Eq. 5's s_i.
    args = (
        torch.tensor([-1.0, -2.0, -0.5], requires_grad=True),
        torch.tensor([-1.1, -2.0, -0.4]),
        torch.tensor([0, 1, 1]),
        torch.tensor([1.0, -1.0]),
        4,
        CFG,
    )
    with pytest.raises(ValueError, match=re.escape("executions [0] are split (num_targets_E [3] > present [1])")):
        policy_loss(*args, num_targets_E=torch.tensor([3, 2]))
    with pytest.raises(ValueError, match=r"sequence_log_ratio_sums .* allow_partial_seq_ratio=True"):
        policy_loss(*args, num_targets_E=torch.tensor([3, 2]))
    approx, _ = policy_loss(*args, num_targets_E=torch.tensor([3, 2]), allow_partial_seq_ratio=True)
    exact, _ = policy_loss(*args, num_targets_E=torch.tensor([3, 2]), seq_ratio_E=torch.tensor([1.0, 1.0]))
    assert torch.isfinite(approx) and torch.isfinite(exact)
    # Nothing split (every execution's targets all present, or none present): no seq_ratio_E needed.
    policy_loss(*args, num_targets_E=torch.tensor([1, 2]))
    policy_loss(*args[:3], torch.tensor([1.0, -1.0, 0.5]), 4, CFG, num_targets_E=torch.tensor([1, 2, 7]))
    with pytest.raises(TypeError, match="allow_partial_seq_ratio must be a bool"):
        policy_loss(*args, allow_partial_seq_ratio=1)


def test_seq_ratio_decides_the_mask():
    # Present targets give s = 1 (kept); a given s_i above the interval masks the execution (A > 0).
    args = (torch.tensor([-2.0], requires_grad=True), torch.tensor([-2.0]), torch.tensor([0]), torch.tensor([1.0]))
    loss, metrics = policy_loss(*args, 1, CFG, seq_ratio_E=torch.tensor([1.01]))
    assert loss.item() == 0.0
    assert metrics["clip_fraction"] == 1.0
    assert metrics["seq_ratio_max"] == pytest.approx(1.01)
    loss, _ = policy_loss(*args, 1, CFG, seq_ratio_E=torch.tensor([1.004]))
    assert loss.item() == pytest.approx(2.0)


def test_empty_micro_step_with_split_arguments():
    loss, metrics = policy_loss(
        torch.zeros(0, requires_grad=True),
        torch.zeros(0),
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(0),
        3,
        CFG,
        num_targets_E=torch.zeros(0, dtype=torch.int64),
        seq_ratio_E=torch.zeros(0),
    )
    loss.backward()
    assert loss.item() == 0.0
    assert metrics["num_targets"] == 0.0


# ---------------------------------------------------------------------------------------------------
# Property: random executions split into random micro-steps, micro-steps into random cells.

ADVANTAGES = [-1.5, -0.25, 0.0, 0.75, 2.0]
# A per-execution drift puts s_i inside or outside [0.995, 1.005] on either side; the per-token noise
# includes ratios past the token cap (e^2.5 > 5) and a large negative one.
DRIFTS = [-0.02, -0.004, 0.0, 0.004, 0.02]
NOISE = [0.0, 0.0, 0.002, -0.003, 0.004, 2.5, -1.0]


@st.composite
def split_batches(draw):
    num_global = draw(st.integers(1, 5))
    tokens = []  # (execution, logp, behavior)
    for i in range(num_global):
        drift = draw(st.sampled_from(DRIFTS))
        for _ in range(draw(st.integers(0, 8))):
            # Very negative log-probs make the token loss cap bind when A > 0.
            logp = draw(st.one_of(st.floats(-70.0, -0.01, allow_nan=False), st.sampled_from([-60.0, -95.0])))
            behavior = min(logp - drift - draw(st.sampled_from(NOISE)), 0.0)
            tokens.append((i, logp, behavior))
    advantages = draw(st.lists(st.sampled_from(ADVANTAGES), min_size=num_global, max_size=num_global))
    num_executions = num_global + draw(st.integers(0, 3))
    num_steps = draw(st.integers(1, 5))
    step_of = [draw(st.integers(0, num_steps - 1)) for _ in tokens]
    steps = []
    for k in range(num_steps):
        mine = [t for t, s in enumerate(step_of) if s == k]
        present = {tokens[t][0] for t in mine}
        absent = draw(st.sets(st.integers(0, num_global - 1)))  # executions listed with no targets here
        local = draw(st.permutations(sorted(present | absent)))
        steps.append((draw(st.permutations(mine)), list(local)))
    cells = [draw(st.integers(0, 2)) for _ in range(num_steps)]
    return tokens, advantages, num_executions, steps, cells


@settings(max_examples=200, deadline=None)
@given(split_batches())
def test_micro_steps_with_global_counts_and_ratios_sum_to_one_call(batch):
    tokens, advantages, num_executions, steps, cells = batch
    dtype = torch.float64
    logp_T = torch.tensor([t[1] for t in tokens], dtype=dtype, requires_grad=True)
    behavior_T = torch.tensor([t[2] for t in tokens], dtype=dtype)
    execution_T = torch.tensor([t[0] for t in tokens], dtype=torch.int64)
    advantage_E = torch.tensor(advantages, dtype=dtype)
    num_global = len(advantages)

    full, full_metrics = policy_loss(logp_T, behavior_T, execution_T, advantage_E, num_executions, CFG)
    full.backward()
    grad_full = logp_T.grad.clone()
    s_one, count_one = sequence_ratio(logp_T - behavior_T, execution_T, num_global)
    _label(full_metrics, s_one, count_one, advantage_E, steps, execution_T)

    s_E, count_E = accumulate_seq_ratio(logp_T, behavior_T, execution_T, steps, num_global, cells)
    assert torch.equal(count_E, count_one.double())
    assert_close(s_E, s_one, rtol=1e-12, atol=1e-12)

    logp_T.grad = None
    total, metrics = run_micro_steps(
        logp_T, behavior_T, execution_T, advantage_E, steps, num_executions, count_one, s_E
    )
    assert_close(total, full.detach())
    assert_close(logp_T.grad, grad_full)
    assert sum(m["num_targets"] for m in metrics) == len(tokens)
    assert sum(m["loss_cap_fraction"] * m["num_targets"] for m in metrics) == pytest.approx(
        full_metrics["loss_cap_fraction"] * len(tokens)
    )


def _label(metrics, s_E, count_E, advantage_E, steps, execution_T):
    """Hypothesis events (`--hypothesis-show-statistics`): the mask binds on both sides, both caps bind."""
    has = count_E > 0
    if bool((has & (advantage_E > 0) & (s_E > CFG.seq_clip_high)).any()):
        event("mask binds, A > 0")
    if bool((has & (advantage_E < 0) & (s_E < CFG.seq_clip_low)).any()):
        event("mask binds, A < 0")
    if metrics["token_cap_fraction"] > 0:
        event("token ratio cap binds")
    if metrics["loss_cap_fraction"] > 0:
        event("token loss cap binds")
    spans = [len({int(execution_T[t]) for t in tokens}) for tokens, _ in steps]
    split = sum(spans) > int(has.sum())
    event("an execution spans several micro-steps" if split else "no execution is split")


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
        "num_targets_E": torch.tensor([3, 2]),
        "seq_ratio_E": torch.tensor([1.0, 0.99], dtype=torch.float64),
    }


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_targets_E": torch.tensor([3, 1])}, "num_targets_E must be >= the targets present per execution"),
        ({"num_targets_E": torch.tensor([0, 2])}, "smaller at executions [0]: num_targets_E [0] < present [1]"),
        ({"num_targets_E": torch.tensor([3, 2, 1])}, "num_targets_E must have shape [E] = (2,)"),
        ({"num_targets_E": torch.tensor([[3, 2]])}, "num_targets_E must have shape [E] = (2,)"),
        ({"num_targets_E": torch.tensor([3.0, 2.0])}, "num_targets_E must be an integer tensor"),
        ({"num_targets_E": torch.tensor([True, True])}, "num_targets_E must be an integer tensor"),
        ({"seq_ratio_E": torch.tensor([1.0])}, "seq_ratio_E must have shape [E] = (2,)"),
        ({"seq_ratio_E": torch.tensor([1, 1])}, "seq_ratio_E must be a floating-point tensor"),
        ({"seq_ratio_E": torch.tensor([1.0, NAN])}, "seq_ratio_E has non-finite values at executions [1]"),
        ({"seq_ratio_E": torch.tensor([INF, 1.0])}, "seq_ratio_E has non-finite values at executions [0]"),
        ({"seq_ratio_E": torch.tensor([0.0, 1.0])}, "seq_ratio_E must be > 0"),
        ({"seq_ratio_E": torch.tensor([1.0, -0.5])}, "not at executions [1] (values [-0.5])"),
    ],
)
def test_bad_split_input_raises_value_error_naming_it(change, message):
    with pytest.raises(ValueError) as info:
        policy_loss(**(good_inputs() | change))
    assert message in str(info.value)


@pytest.mark.parametrize("name", ["num_targets_E", "seq_ratio_E"])
def test_split_input_that_is_not_a_tensor_raises_type_error(name):
    with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor or None"):
        policy_loss(**(good_inputs() | {name: [1, 1]}))


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((torch.tensor([0.1, NAN]), torch.tensor([0, 1]), 2), ValueError, "log_ratio_T has non-finite values"),
        ((torch.tensor([0.1, 0.2]), torch.tensor([0, 2]), 2), ValueError, "out of range at target tokens [1]"),
        ((torch.tensor([0.1, 0.2]), torch.tensor([0, 1], dtype=torch.int32), 2), ValueError, "1-D int64"),
        ((torch.tensor([0.1, 0.2]), torch.tensor([0]), 2), ValueError, "same shape [T]"),
        ((torch.tensor([1, 2]), torch.tensor([0, 1]), 2), ValueError, "1-D floating-point"),
        ((torch.tensor([0.1]), torch.tensor([0]), -1), ValueError, "num_local must be >= 0"),
        ((torch.tensor([0.1]), torch.tensor([0]), 1.0), TypeError, "num_local must be an integer"),
    ],
)
def test_bad_log_ratio_sums_input(args, error, message):
    with pytest.raises(error) as info:
        sequence_log_ratio_sums(*args)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.tensor([0.1, NAN]), torch.tensor([1, 1])), "sum_E has non-finite values at executions [1]"),
        ((torch.tensor([0.1, 0.2]), torch.tensor([1, -1])), "count_E must be finite and >= 0"),
        ((torch.tensor([0.1, 0.2]), torch.tensor([1.0, NAN])), "count_E must be finite and >= 0"),
        ((torch.tensor([0.1, 0.2]), torch.tensor([1])), "same shape [E]"),
        ((torch.tensor([1, 2]), torch.tensor([1, 1])), "sum_E must be a 1-D floating-point"),
    ],
)
def test_bad_finalize_input(args, message):
    with pytest.raises(ValueError) as info:
        finalize_sequence_ratio(*args)
    assert message in str(info.value)


def test_finalize_gives_one_without_targets_and_is_float64():
    s_E = finalize_sequence_ratio(torch.tensor([0.0, 0.3], dtype=torch.float32), torch.tensor([0, 3]))
    assert s_E.dtype == torch.float64
    assert_close(s_E, torch.tensor([1.0, e(0.1)], dtype=torch.float64))
