"""The execution-level policy loss (Eq. 5-6): a GSPO variant with token-level importance correction.

Tensors in, tensors out; no IO, no collectives. Inputs are flat over the target tokens of a packed batch
(suffix `_T`): a packed micro-batch `logp_RS` of rows R by positions S becomes `logp_RS[target_RS]`, and
the gradient flows back through the boolean index. Per-execution tensors carry the suffix `_E`; `E` is the
number of executions this call knows about, `num_executions` the number of raw executions of the whole
batch (B * N), the denominator of the batch mean.

Contract. By default L_i and s_i (Eq. 5) are taken over the targets present in the call, so every target
of an execution must be in the same call; a batch split by execution into micro-steps then sums to the
batch loss, each micro-step computed with the batch's `num_executions`. An execution too long for one
micro-step (xLong: ~700K tokens) may be split across micro-steps and cells when the caller passes what
the call cannot see: `num_targets_E` (L_i over the whole admitted target set, known at admission) fixes
the 1/L_i normalization, and `seq_ratio_E` (s_i over all the execution's targets, accumulated beforehand
with `sequence_log_ratio_sums` and `finalize_sequence_ratio`) fixes the shared mask m_i. With both, the
micro-step losses and their accumulated gradients sum to the loss and gradient of one call over the batch.
A split execution without `seq_ratio_E` is a ValueError unless `allow_partial_seq_ratio=True` (s_i, hence
m_i, is then decided per part: an approximation).

Gradient (see docs/loss.md): d loss / d logp_u = -m_i * w_u * A_i / (L_i * num_executions) where the
token-loss cap does not bind, and 0 where it binds (raw token loss > cap: the min picks the constant).
`w_u` and `s_i` are stop-gradient, so no gradient flows through the ratios themselves.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from gyre.config.loss import LossConfig

__all__ = [
    "LossConfig",
    "finalize_sequence_ratio",
    "policy_loss",
    "sequence_clip_keep",
    "sequence_log_ratio_sums",
    "sequence_ratio",
]


def sequence_ratio(log_ratio_T: Tensor, execution_T: Tensor, num_local: int) -> tuple[Tensor, Tensor]:
    """Eq. 5: s_i = exp(mean over the execution's targets of log rho_u), detached, over the targets given.

    Returns (s_E, count_E): s_E in float64 (accumulated in float64 so the clipping decision of a long
    execution does not depend on the order of its tokens), count_E = L_i as int64. An execution with
    L_i = 0 has s_i = 1. For an execution split across calls use `sequence_log_ratio_sums` per part and
    `finalize_sequence_ratio` on the accumulated sums.
    """
    sum_E, count_E = _log_ratio_sums(log_ratio_T, execution_T, num_local)
    return _finalize(sum_E, count_E), count_E


def sequence_log_ratio_sums(log_ratio_T: Tensor, execution_T: Tensor, num_local: int) -> tuple[Tensor, Tensor]:
    """The additive pieces of Eq. 5 over the targets given: (sum_E, count_E), detached.

    sum_E[i] = sum of log rho_u over the targets of execution i in this call (float64), count_E[i] = their
    number (int64). Both are sums, so a caller accumulates them over the micro-steps of a batch (mapping
    local execution indices to batch-wide ones with `index_add_`) and over cells with one all_reduce(SUM)
    of `torch.stack([sum_E, count_E.double()])` (counts are exact in float64 below 2^53), then calls
    `finalize_sequence_ratio` to get s_i over the execution's whole target set. Weights are frozen during
    gradient accumulation, so a no-grad pass over the micro-steps at the current weights gives the s_i of
    one call over the whole batch, up to float64 summation order and forward-kernel nondeterminism.

    log_ratio_T: logp - behavior_logp of the target tokens (finite, floating), [T].
    execution_T: int64 index of each token's execution, in [0, num_local), [T].
    """
    if not isinstance(log_ratio_T, Tensor) or not log_ratio_T.is_floating_point() or log_ratio_T.dim() != 1:
        raise ValueError(f"log_ratio_T must be a 1-D floating-point tensor, got {_describe(log_ratio_T)}")
    if not isinstance(execution_T, Tensor) or execution_T.dtype != torch.int64 or execution_T.dim() != 1:
        raise ValueError(f"execution_T must be a 1-D int64 tensor, got {_describe(execution_T)}")
    if execution_T.shape != log_ratio_T.shape or execution_T.device != log_ratio_T.device:
        raise ValueError(
            "log_ratio_T and execution_T must have the same shape [T] on one device, got "
            f"{_describe(log_ratio_T)}, {_describe(execution_T)}"
        )
    num_local = _non_negative_int("num_local", num_local)
    with torch.no_grad():
        bad = ~torch.isfinite(log_ratio_T)
        if bool(bad.any()):
            raise ValueError(f"log_ratio_T has non-finite values at target tokens {_where(bad)}")
        bad = (execution_T < 0) | (execution_T >= num_local)
        if bool(bad.any()):
            raise ValueError(
                f"execution_T must be in [0, {num_local}); out of range at target tokens {_where(bad)} "
                f"(values {execution_T[bad][:5].tolist()})"
            )
    return _log_ratio_sums(log_ratio_T, execution_T, num_local)


def finalize_sequence_ratio(sum_E: Tensor, count_E: Tensor) -> Tensor:
    """Eq. 5 from accumulated sums: s_i = exp(sum_E / count_E) in float64; s_i = 1 where count_E = 0.

    sum_E: float sums of log rho_u per execution (finite), [E]; count_E: target counts (integer or
    integral float, >= 0), [E] -- as returned by `sequence_log_ratio_sums`, possibly accumulated.
    """
    if not isinstance(sum_E, Tensor) or not sum_E.is_floating_point() or sum_E.dim() != 1:
        raise ValueError(f"sum_E must be a 1-D floating-point tensor, got {_describe(sum_E)}")
    if not isinstance(count_E, Tensor) or count_E.dtype == torch.bool or count_E.dim() != 1:
        raise ValueError(f"count_E must be a 1-D numeric tensor, got {_describe(count_E)}")
    if count_E.shape != sum_E.shape:
        raise ValueError(
            f"sum_E and count_E must have the same shape [E], got {_describe(sum_E)}, {_describe(count_E)}"
        )
    sum_E = sum_E.detach().to(torch.float64)
    count_E = count_E.detach().to(torch.float64)
    with torch.no_grad():
        bad = ~torch.isfinite(sum_E)
        if bool(bad.any()):
            raise ValueError(f"sum_E has non-finite values at executions {_where(bad)}")
        bad = ~(torch.isfinite(count_E) & (count_E >= 0))
        if bool(bad.any()):
            raise ValueError(f"count_E must be finite and >= 0; not at executions {_where(bad)}")
    return _finalize(sum_E, count_E)


def _finalize(sum_E: Tensor, count_E: Tensor) -> Tensor:
    """Unchecked exp(sum / count) in float64, 1 where count = 0."""
    mean_E = sum_E.to(torch.float64) / count_E.clamp(min=1)  # L_i = 0: sum 0, mean 0, s_i = 1
    return torch.exp(mean_E)


def _log_ratio_sums(log_ratio_T: Tensor, execution_T: Tensor, num_local: int) -> tuple[Tensor, Tensor]:
    """Unchecked (sum_E float64, count_E int64) over the targets given; inputs already validated."""
    log_ratio_T = log_ratio_T.detach().to(torch.float64)
    count_E = torch.bincount(execution_T, minlength=num_local)
    sum_E = torch.zeros(num_local, dtype=torch.float64, device=log_ratio_T.device)
    return sum_E.index_add(0, execution_T, log_ratio_T), count_E


def sequence_clip_keep(s_E: Tensor, advantage_E: Tensor, config: LossConfig) -> Tensor:
    """The shared clipping mask m_i as a bool (True: m_i = 1, the execution trains).

    m_i = 0 when A_i > 0 and s_i > high, or A_i < 0 and s_i < low; 1 otherwise (strict inequalities,
    as in the paper). A_i = 0 is never masked; its loss is 0 anyway.
    """
    drop_E = ((advantage_E > 0) & (s_E > config.seq_clip_high)) | ((advantage_E < 0) & (s_E < config.seq_clip_low))
    return ~drop_E


def policy_loss(
    logp_T: Tensor,
    behavior_logp_T: Tensor,
    execution_T: Tensor,
    advantage_E: Tensor,
    num_executions: int,
    config: LossConfig,
    *,
    num_targets_E: Tensor | None = None,
    seq_ratio_E: Tensor | None = None,
    allow_partial_seq_ratio: bool = False,
) -> tuple[Tensor, dict[str, float]]:
    """The batch loss L(theta) = (1 / num_executions) sum_i L_i (Eq. 6), or this call's share of it, and
    detached metrics.

    logp_T: current log-probs of the target tokens (requires grad), [T].
    behavior_logp_T: recorded behavior log-probs of the same tokens (finite, <= 0), [T].
    execution_T: int64 index of each token's execution, in [0, E), [T].
    advantage_E: group-relative advantage A_i per execution (finite), [E].
    num_executions: raw executions of the batch (B * N); executions with no targets count in it.
    num_targets_E: optional integer L_i per execution over its WHOLE admitted target set (known at
        admission), >= the targets present here, [E]. Given, each present target is weighted 1/L_i with this
        L_i, so the calls over the micro-steps an execution is split into sum to its unsplit loss and
        gradient. Default: L_i = the targets present (every target of an execution must be in this call).
    seq_ratio_E: optional s_i per execution over its whole target set (finite, > 0; detached, used in
        float64), [E], e.g. `finalize_sequence_ratio` of sums accumulated over the batch's micro-steps by
        a no-grad pass. Given, it decides the mask m_i and is what the seq_ratio metrics report. Not given,
        s_i is computed from the targets present.
    allow_partial_seq_ratio: keyword only. A split execution (some `num_targets_E` larger than its
        targets present, which are > 0) without `seq_ratio_E` is a ValueError: s_i of the part present is
        not the s_i of Eq. 5, so the shared mask m_i would be decided per part. True accepts that
        approximation: the parts may then disagree on m_i, and the sum differs from the unsplit loss
        wherever a part's s_i falls on the other side of the clip interval than the whole execution's.

    Arithmetic is in float32 (float64 if an input is float64); the loss has that dtype.
    """
    num_executions = _validate(logp_T, behavior_logp_T, execution_T, advantage_E, num_executions, config)
    num_local = advantage_E.shape[0]
    _validate_split(execution_T, num_local, num_targets_E, seq_ratio_E, allow_partial_seq_ratio)
    dtype = torch.promote_types(torch.promote_types(logp_T.dtype, behavior_logp_T.dtype), torch.float32)
    dtype = torch.promote_types(dtype, advantage_E.dtype)
    logp_T = logp_T.to(dtype)
    behavior_logp_T = behavior_logp_T.to(dtype)
    advantage_E = advantage_E.to(dtype)

    log_ratio_T = (logp_T - behavior_logp_T).detach()  # log rho_u (Eq. 5)
    rho_T = torch.exp(log_ratio_T)  # may overflow to inf; the cap below makes the weight finite
    s_E, count_E = sequence_ratio(log_ratio_T, execution_T, num_local)  # Eq. 5 over the present targets
    if seq_ratio_E is not None:
        s_E = seq_ratio_E.detach().to(torch.float64)  # Eq. 5 over the whole target set, from the caller
    keep_E = sequence_clip_keep(s_E, advantage_E, config)  # m_i

    weight_T = rho_T.clamp(max=config.token_ratio_cap)  # w_u = sg(min(rho_u, 5))
    coef_E = keep_E.to(dtype) * advantage_E  # m_i * A_i
    raw_T = -coef_E[execution_T] * weight_T * logp_T  # -m_i w_u A_i log pi(y_u | c_u)
    # l_u = min(cap, raw_u): where raw_u > cap the constant is picked and the token's gradient is 0; at a tie
    # raw_u passes with its gradient. (`torch.minimum` would split a tie's gradient in half.)
    loss_capped_T = raw_T.detach() > config.token_loss_cap
    token_loss_T = torch.where(loss_capped_T, torch.full_like(raw_T, config.token_loss_cap), raw_T)

    # Eq. 6: L_i = (1 / L_i) sum_{u in T_i} l_u, whatever rows (or micro-steps, with num_targets_E) carry the
    # targets; L_i = 0 gives 0.
    sum_E = torch.zeros(num_local, dtype=dtype, device=logp_T.device).index_add(0, execution_T, token_loss_T)
    denominator_E = count_E if num_targets_E is None else num_targets_E
    execution_loss_E = sum_E / denominator_E.clamp(min=1).to(dtype)
    loss = execution_loss_E.sum() / num_executions

    metrics = _metrics(log_ratio_T, rho_T, s_E, count_E, keep_E, loss_capped_T, config)
    return loss, metrics


def _metrics(
    log_ratio_T: Tensor,
    rho_T: Tensor,
    s_E: Tensor,
    count_E: Tensor,
    keep_E: Tensor,
    loss_capped_T: Tensor,
    config: LossConfig,
) -> dict[str, float]:
    """Detached floats, gathered with one device-to-host copy. Execution statistics are over the
    executions with targets; with no targets at all the fractions are 0 and the ratios 1."""
    num_targets = log_ratio_T.shape[0]
    if num_targets == 0:
        stats = [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    else:
        with torch.no_grad():
            has_E = count_E > 0
            s_sel = s_E[has_E]
            f64 = torch.float64
            stats = torch.stack(
                [
                    (~keep_E[has_E]).to(f64).mean(),
                    (rho_T > config.token_ratio_cap).to(f64).mean(),
                    loss_capped_T.to(f64).mean(),
                    s_sel.mean(),
                    s_sel.min(),
                    s_sel.max(),
                    rho_T.to(f64).mean(),
                    rho_T.to(f64).max(),
                    log_ratio_T.to(f64).abs().mean(),
                    log_ratio_T.to(f64).abs().max(),
                    has_E.sum().to(f64),
                ]
            ).tolist()
    names = (
        "clip_fraction",  # executions with m_i = 0 / executions with targets
        "token_cap_fraction",  # target tokens with rho_u > token_ratio_cap
        "loss_cap_fraction",  # target tokens where the token-loss cap binds (zero gradient)
        "seq_ratio_mean",  # s_i over executions with targets
        "seq_ratio_min",
        "seq_ratio_max",
        "token_ratio_mean",  # rho_u over target tokens (uncapped)
        "token_ratio_max",
        "abs_log_ratio_mean",  # mean |logp - behavior_logp|
        "abs_log_ratio_max",  # max |logp - behavior_logp|: how far the trainer's log-probs are from the engine's
        "num_executions_with_targets",
    )
    metrics = dict(zip(names, stats, strict=True))
    metrics["num_targets"] = float(num_targets)
    return metrics


def _validate(
    logp_T: Tensor,
    behavior_logp_T: Tensor,
    execution_T: Tensor,
    advantage_E: Tensor,
    num_executions: int,
    config: LossConfig,
) -> int:
    """Raise ValueError/TypeError naming the offending input; return num_executions as an int."""
    if not isinstance(config, LossConfig):
        raise TypeError(f"config must be a LossConfig, got {type(config).__name__}")
    for name, t in (("logp_T", logp_T), ("behavior_logp_T", behavior_logp_T), ("advantage_E", advantage_E)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if not isinstance(execution_T, Tensor) or execution_T.dtype != torch.int64:
        got = execution_T.dtype if isinstance(execution_T, Tensor) else type(execution_T).__name__
        raise ValueError(f"execution_T must be an int64 tensor, got {got}")
    if execution_T.dim() != 1:
        raise ValueError(f"execution_T must be 1-D, got shape {tuple(execution_T.shape)}")
    if behavior_logp_T.shape != logp_T.shape or execution_T.shape != logp_T.shape:
        raise ValueError(
            "logp_T, behavior_logp_T and execution_T must have the same shape [T], got "
            f"{tuple(logp_T.shape)}, {tuple(behavior_logp_T.shape)}, {tuple(execution_T.shape)}"
        )
    devices = {t.device for t in (logp_T, behavior_logp_T, execution_T, advantage_E)}
    if len(devices) > 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(str(d) for d in devices)}")
    try:
        num_executions = operator.index(num_executions)
    except TypeError:
        raise TypeError(f"num_executions must be an integer, got {type(num_executions).__name__}") from None
    if num_executions < 1:
        raise ValueError(f"num_executions must be >= 1 (B * N raw executions), got {num_executions}")

    num_local = advantage_E.shape[0]
    with torch.no_grad():
        if not bool(torch.isfinite(advantage_E).all()):
            raise ValueError(f"advantage_E has non-finite values at executions {_where(~torch.isfinite(advantage_E))}")
        if not bool(torch.isfinite(logp_T).all()):
            raise ValueError(f"logp_T has non-finite values at target tokens {_where(~torch.isfinite(logp_T))}")
        bad = ~torch.isfinite(behavior_logp_T)
        if bool(bad.any()):
            raise ValueError(f"behavior_logp_T has non-finite values at target tokens {_where(bad)}")
        bad = behavior_logp_T > 0
        if bool(bad.any()):
            raise ValueError(
                f"behavior_logp_T must be log-probabilities (<= 0); positive at target tokens {_where(bad)}, "
                f"max {behavior_logp_T.max().item():g}"
            )
        bad = (execution_T < 0) | (execution_T >= num_local)
        if bool(bad.any()):
            raise ValueError(
                f"execution_T must index advantage_E, in [0, {num_local}); out of range at target tokens "
                f"{_where(bad)} (values {execution_T[bad][:5].tolist()})"
            )
        with_targets = int((torch.bincount(execution_T, minlength=num_local) > 0).sum())
    if num_executions < with_targets:
        raise ValueError(
            f"num_executions={num_executions} is smaller than the {with_targets} executions with targets; "
            "it must be the batch's raw execution count B * N"
        )
    return num_executions


def _validate_split(
    execution_T: Tensor,
    num_local: int,
    num_targets_E: Tensor | None,
    seq_ratio_E: Tensor | None,
    allow_partial_seq_ratio: bool,
) -> None:
    """Check the optional per-execution inputs of a split execution against [E] and the present targets."""
    if not isinstance(allow_partial_seq_ratio, bool):
        raise TypeError(f"allow_partial_seq_ratio must be a bool, got {type(allow_partial_seq_ratio).__name__}")
    for name, t in (("num_targets_E", num_targets_E), ("seq_ratio_E", seq_ratio_E)):
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.shape != (num_local,):
            raise ValueError(f"{name} must have shape [E] = ({num_local},) like advantage_E, got {tuple(t.shape)}")
        if t.device != execution_T.device:
            raise ValueError(f"{name} must be on the inputs' device {execution_T.device}, got {t.device}")
    if num_targets_E is not None:
        if num_targets_E.is_floating_point() or num_targets_E.is_complex() or num_targets_E.dtype == torch.bool:
            raise ValueError(f"num_targets_E must be an integer tensor (L_i per execution), got {num_targets_E.dtype}")
        with torch.no_grad():
            present_E = torch.bincount(execution_T, minlength=num_local)
            bad = num_targets_E < present_E
            if bool(bad.any()):
                raise ValueError(
                    "num_targets_E must be >= the targets present per execution (L_i over the whole admitted "
                    f"target set); smaller at executions {_where(bad)}: num_targets_E "
                    f"{num_targets_E[bad][:5].tolist()} < present {present_E[bad][:5].tolist()}"
                )
            partial = (present_E > 0) & (num_targets_E > present_E)
            if seq_ratio_E is None and not allow_partial_seq_ratio and bool(partial.any()):
                raise ValueError(
                    f"executions {_where(partial)} are split (num_targets_E {num_targets_E[partial][:5].tolist()} > "
                    f"present {present_E[partial][:5].tolist()}) and no seq_ratio_E was given: s_i of the part "
                    "present would decide the shared mask m_i (Eq. 5 takes s_i over ALL the execution's targets). "
                    "Pass seq_ratio_E = finalize_sequence_ratio of sequence_log_ratio_sums accumulated over the "
                    "batch's micro-steps, or allow_partial_seq_ratio=True to accept the per-part approximation"
                )
    if seq_ratio_E is not None:
        if not seq_ratio_E.is_floating_point():
            raise ValueError(f"seq_ratio_E must be a floating-point tensor, got dtype {seq_ratio_E.dtype}")
        with torch.no_grad():
            bad = ~torch.isfinite(seq_ratio_E)
            if bool(bad.any()):
                raise ValueError(f"seq_ratio_E has non-finite values at executions {_where(bad)}")
            bad = seq_ratio_E <= 0
            if bool(bad.any()):
                raise ValueError(
                    f"seq_ratio_E must be > 0 (s_i = exp(mean log rho)); not at executions {_where(bad)} "
                    f"(values {seq_ratio_E[bad][:5].tolist()})"
                )


def _non_negative_int(name: str, value: int) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _describe(t: object) -> str:
    """Dtype and shape of a tensor, or the type of anything else, for an error message."""
    if isinstance(t, Tensor):
        return f"{t.dtype} of shape {tuple(t.shape)} on {t.device}"
    return type(t).__name__


def _where(bad: Tensor, limit: int = 5) -> str:
    """The first few indices where `bad` is True, for an error message."""
    idx = torch.nonzero(bad).flatten()
    shown = idx[:limit].tolist()
    more = f" and {idx.numel() - limit} more" if idx.numel() > limit else ""
    return f"{shown}{more}"
