"""The execution-level policy loss (Eq. 5-6): a GSPO variant with token-level importance correction.

Tensors in, tensors out; no IO, no collectives. Inputs are flat over the target tokens of a packed batch
(suffix `_T`): a packed micro-batch `logp_RS` of rows R by positions S becomes `logp_RS[target_RS]`, and
the gradient flows back through the boolean index. Per-execution tensors carry the suffix `_E`; `E` is the
number of executions this call knows about, `num_executions` the number of raw executions of the whole
batch (B * N), the denominator of the batch mean.

Contract: every target of an execution is in the same call. L_i and s_i (Eq. 5) are taken over the targets
present, so splitting one execution across calls would change its weight. With that contract the loss of
a batch split by execution into micro-steps is the sum of the micro-step losses, each computed with the
batch's `num_executions`.

Gradient (see docs/loss.md): d loss / d logp_u = -m_i * w_u * A_i / (L_i * num_executions) where the
token-loss cap does not bind, and 0 where it binds (raw token loss > cap: the min picks the constant).
`w_u` and `s_i` are stop-gradient, so no gradient flows through the ratios themselves.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import Tensor

from gyre.config.checks import require

__all__ = ["LossConfig", "policy_loss", "sequence_clip_keep", "sequence_ratio"]


@dataclass(kw_only=True)
class LossConfig:
    token_ratio_cap: float = 5.0
    """Cap on the token importance weight: w_u = sg(min(rho_u, cap)) (> 0; paper: 5)."""
    seq_clip_low: float = 0.995
    """An execution with A_i < 0 and s_i < seq_clip_low is masked (m_i = 0); in [0, 1) (paper: 0.995)."""
    seq_clip_high: float = 1.005
    """An execution with A_i > 0 and s_i > seq_clip_high is masked (m_i = 0); > 1 (paper: 1.005)."""
    token_loss_cap: float = 100.0
    """Cap on the token loss: l_u = min(cap, raw_u); where it binds the token's gradient is 0 (> 0; paper: 100)."""

    def __post_init__(self) -> None:
        require(self.token_ratio_cap > 0, "loss.token_ratio_cap", self.token_ratio_cap, "a number > 0")
        require(0 <= self.seq_clip_low < 1, "loss.seq_clip_low", self.seq_clip_low, "a number in [0, 1)")
        require(self.seq_clip_high > 1, "loss.seq_clip_high", self.seq_clip_high, "a number > 1")
        require(self.token_loss_cap > 0, "loss.token_loss_cap", self.token_loss_cap, "a number > 0")


def sequence_ratio(log_ratio_T: Tensor, execution_T: Tensor, num_local: int) -> tuple[Tensor, Tensor]:
    """Eq. 5: s_i = exp(mean over the execution's targets of log rho_u), detached.

    Returns (s_E, count_E): s_E in float64 (accumulated in float64 so the clipping decision of a long
    execution does not depend on the order of its tokens), count_E = L_i as int64. An execution with
    L_i = 0 has s_i = 1.
    """
    log_ratio_T = log_ratio_T.detach().to(torch.float64)
    count_E = torch.bincount(execution_T, minlength=num_local)
    sum_E = torch.zeros(num_local, dtype=torch.float64, device=log_ratio_T.device)
    sum_E = sum_E.index_add(0, execution_T, log_ratio_T)
    mean_E = sum_E / count_E.clamp(min=1)  # L_i = 0: sum 0, mean 0, s_i = 1
    return torch.exp(mean_E), count_E


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
) -> tuple[Tensor, dict[str, float]]:
    """The batch loss L(theta) = (1 / num_executions) sum_i L_i (Eq. 6) and detached metrics.

    logp_T: current log-probs of the target tokens (requires grad), [T].
    behavior_logp_T: recorded behavior log-probs of the same tokens (finite, <= 0), [T].
    execution_T: int64 index of each token's execution, in [0, E), [T].
    advantage_E: group-relative advantage A_i per execution (finite), [E].
    num_executions: raw executions of the batch (B * N); executions with no targets count in it.

    Arithmetic is in float32 (float64 if an input is float64); the loss has that dtype.
    """
    num_executions = _validate(logp_T, behavior_logp_T, execution_T, advantage_E, num_executions, config)
    dtype = torch.promote_types(torch.promote_types(logp_T.dtype, behavior_logp_T.dtype), torch.float32)
    dtype = torch.promote_types(dtype, advantage_E.dtype)
    logp_T = logp_T.to(dtype)
    behavior_logp_T = behavior_logp_T.to(dtype)
    advantage_E = advantage_E.to(dtype)
    num_local = advantage_E.shape[0]

    log_ratio_T = (logp_T - behavior_logp_T).detach()  # log rho_u (Eq. 5)
    rho_T = torch.exp(log_ratio_T)  # may overflow to inf; the cap below makes the weight finite
    s_E, count_E = sequence_ratio(log_ratio_T, execution_T, num_local)  # Eq. 5, gradient-free
    keep_E = sequence_clip_keep(s_E, advantage_E, config)  # m_i

    weight_T = rho_T.clamp(max=config.token_ratio_cap)  # w_u = sg(min(rho_u, 5))
    coef_E = keep_E.to(dtype) * advantage_E  # m_i * A_i
    raw_T = -coef_E[execution_T] * weight_T * logp_T  # -m_i w_u A_i log pi(y_u | c_u)
    # l_u = min(cap, raw_u): where raw_u > cap the constant is picked and the token's gradient is 0; at a tie
    # raw_u passes with its gradient. (`torch.minimum` would split a tie's gradient in half.)
    loss_capped_T = raw_T.detach() > config.token_loss_cap
    token_loss_T = torch.where(loss_capped_T, torch.full_like(raw_T, config.token_loss_cap), raw_T)

    # Eq. 6: L_i = (1 / L_i) sum_{u in T_i} l_u, whatever rows carry the targets; L_i = 0 gives 0.
    sum_E = torch.zeros(num_local, dtype=dtype, device=logp_T.device).index_add(0, execution_T, token_loss_T)
    execution_loss_E = sum_E / count_E.clamp(min=1).to(dtype)
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
        stats = [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
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


def _where(bad: Tensor, limit: int = 5) -> str:
    """The first few indices where `bad` is True, for an error message."""
    idx = torch.nonzero(bad).flatten()
    shown = idx[:limit].tolist()
    more = f" and {idx.numel() - limit} more" if idx.numel() > limit else ""
    return f"{shown}{more}"
