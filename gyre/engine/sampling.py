"""Token sampling with exact behavior log-probs, and the teacher-forced recomputation that must agree with it.

Contract
- `sampling_logprobs(logits_BV, params)` is the log of the distribution a token is drawn from, per row:
  logits (cast to fp32) divided by `temperature`, then top-k (tokens below the k-th largest value removed; ties
  with it kept, as transformers' `TopKLogitsWarper`), then top-p on the renormalized top-k distribution (keep
  the most likely tokens until their mass reaches `top_p`: a token stays iff the mass strictly before it in
  descending order is < top_p; the most likely token always stays), then renormalized. Removed tokens are -inf.
- `sample_next(logits_BV, params, generator)` draws from exactly `exp(sampling_logprobs)` and returns the token
  and its log-prob under that distribution: the behavior log-prob RL importance ratios need. A removed token
  has probability 0 and is never drawn.
- Greedy (`temperature == 0`) takes the argmax of the raw logits and reports log_softmax of the raw logits there
  (the policy's own probability of the token, not log 1 of a degenerate distribution). Greedy outputs are for
  evaluation; RL rollouts should sample with temperature > 0 so the log-probs are those of the sampler.
- `sequence_logprobs(model, input_ids, output_ids, params)` runs one teacher-forced forward of prompt + outputs
  and applies the same transform at each output position. On the same weights it equals the log-probs recorded
  by `sample_next` during cached decoding within float noise (fp32 CPU: 1e-5), unless a token's value lies
  within that noise of a top-k/top-p boundary (filters are discontinuous; the engine's record is the truth).
- Per-row parameters: `params` may be one `SamplingParams` for the batch or one per row; `generator` one
  `torch.Generator` for the batch or one (or None) per row. With one generator per row a row's draws depend
  only on its own logits and generator, so a seeded request samples the same tokens in any batch. Rows with a
  generator draw with `torch.multinomial`; rows without one draw from the global RNG by inverting the CDF
  (the same distribution, one uniform per row: much cheaper than multinomial's one exponential per token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gyre.engine.protocol import SamplingParams

Generators = torch.Generator | Sequence[torch.Generator | None] | None


def request_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded with `params.seed` on `device`, or None (global RNG) when the request has no seed."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def _row_params(params: SamplingParams | Sequence[SamplingParams], B: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * B
    rows = list(params)
    if len(rows) != B:
        raise ValueError(f"params has {len(rows)} entries for {B} logits rows: give one SamplingParams or one per row")
    return rows


def sampling_logprobs(logits_BV: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]) -> torch.Tensor:
    """fp32 `[B, V]`: log of the distribution each row samples from (-inf where filtered); raw log_softmax if greedy."""
    if logits_BV.dim() != 2:
        raise ValueError(f"logits_BV must be [B, V], got shape {tuple(logits_BV.shape)}")
    B, V = logits_BV.shape
    rows = _row_params(params, B)
    logits_BV = logits_BV.float()
    device = logits_BV.device
    # Greedy rows keep temperature 1 here: their reported log-prob is that of the raw logits.
    temperatures = [p.temperature if p.temperature > 0 else 1.0 for p in rows]
    if all(t == temperatures[0] for t in temperatures):  # one scalar for the batch: the same quotients, fewer ops
        scaled_BV = logits_BV / temperatures[0] if temperatures[0] != 1.0 else logits_BV
    else:
        scaled_BV = logits_BV / torch.tensor(temperatures, device=device)[:, None]
    filtering = [p.temperature > 0 and ((0 < p.top_k < V) or p.top_p < 1) for p in rows]
    if not any(filtering):
        return torch.log_softmax(scaled_BV, dim=-1)

    sorted_BV, order_BV = scaled_BV.sort(dim=-1, descending=True)
    # top-k: remove values below the k-th largest (k = V means off).
    k_B1 = torch.tensor(
        [p.top_k if f and 0 < p.top_k < V else V for p, f in zip(rows, filtering, strict=True)], device=device
    )
    kth_B1 = sorted_BV.gather(1, (k_B1 - 1)[:, None])
    sorted_BV = sorted_BV.masked_fill(sorted_BV < kth_B1, float("-inf"))
    # top-p on the renormalized top-k distribution, in the same descending order (masking keeps it sorted).
    top_p_B1 = torch.tensor([p.top_p if f else 1.0 for p, f in zip(rows, filtering, strict=True)], device=device)[
        :, None
    ]
    probs_BV = torch.softmax(sorted_BV, dim=-1)
    mass_before_BV = probs_BV.cumsum(dim=-1) - probs_BV
    # top_p == 1 is off: never remove on cumsum rounding at the tail. Column 0 has mass_before 0 < top_p.
    remove_BV = (mass_before_BV >= top_p_B1) & (top_p_B1 < 1)
    sorted_BV = sorted_BV.masked_fill(remove_BV, float("-inf"))
    filtered_BV = torch.empty_like(scaled_BV).scatter_(1, order_BV, sorted_BV)
    return torch.log_softmax(filtered_BV, dim=-1)


def _draw_global(probs_SV: torch.Tensor) -> torch.Tensor:
    """One token per row from the global RNG, drawn from `probs_SV` by inverting its CDF.

    The same distribution as `torch.multinomial` (up to fp32 rounding of the cumulative sum), with one uniform per
    row instead of one exponential per vocabulary entry: ~10x cheaper for a 512-token vocabulary on CPU. `u` is
    strictly below the total mass (rand < 1), so the index found is in range and its cdf rises there: a token
    of probability 0 is never drawn. Seeded generators keep `torch.multinomial`, so their draws are unchanged.
    """
    cdf_SV = probs_SV.cumsum(dim=-1)
    u_S1 = torch.rand(cdf_SV.shape[0], 1, dtype=cdf_SV.dtype, device=cdf_SV.device) * cdf_SV[:, -1:]
    return torch.searchsorted(cdf_SV, u_S1, right=True)[:, 0]  # first index with cdf > u


@torch.no_grad()
def sample_next(
    logits_BV: torch.Tensor,
    params: SamplingParams | Sequence[SamplingParams],
    generator: Generators = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return `(token_ids_B int64, logprobs_B fp32)`, the behavior log-prob of each token."""
    logp_BV = sampling_logprobs(logits_BV, params)
    B = logp_BV.shape[0]
    rows = _row_params(params, B)
    sampled_rows = [b for b, p in enumerate(rows) if not p.greedy]
    shared_rng = generator is None or (not isinstance(generator, torch.Generator) and all(g is None for g in generator))
    if len(sampled_rows) == B and shared_rng:  # the common rollout batch: every row drawn at once, no indexing
        if generator is not None and len(generator) != B:
            raise ValueError(f"generator has {len(generator)} entries for {B} logits rows")
        token_ids_B = _draw_global(logp_BV.exp())
        return token_ids_B, logp_BV.gather(1, token_ids_B[:, None])[:, 0]
    token_ids_B = logp_BV.argmax(dim=-1)  # greedy rows: argmax of the raw logits (log_softmax is monotonic)
    if sampled_rows:
        probs_BV = logp_BV.exp()  # exactly the distribution the log-probs describe; filtered tokens are 0
        if generator is None or isinstance(generator, torch.Generator):
            index_S = torch.tensor(sampled_rows, device=logp_BV.device)
            if generator is None:
                drawn_S = _draw_global(probs_BV[index_S])
            else:
                drawn_S = torch.multinomial(probs_BV[index_S], 1, generator=generator)[:, 0]
            token_ids_B = token_ids_B.index_copy(0, index_S, drawn_S)
        else:
            generators = list(generator)
            if len(generators) != B:
                raise ValueError(f"generator has {len(generators)} entries for {B} logits rows")
            token_ids_B = token_ids_B.clone()
            # Rows without a generator share the global RNG: one draw for all of them.
            shared = [b for b in sampled_rows if generators[b] is None]
            if shared:
                index_S = torch.tensor(shared, device=logp_BV.device)
                token_ids_B[index_S] = _draw_global(probs_BV[index_S])
            for b in sampled_rows:  # one draw per row from its own generator: independent of the batch
                if generators[b] is not None:
                    token_ids_B[b] = torch.multinomial(probs_BV[b], 1, generator=generators[b])[0]
    logprobs_B = logp_BV.gather(1, token_ids_B[:, None])[:, 0]
    return token_ids_B, logprobs_B


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: Sequence[int] | torch.Tensor,
    output_ids: Sequence[int] | torch.Tensor,
    params: SamplingParams,
) -> torch.Tensor:
    """fp32 `[len(output_ids)]`: behavior log-probs of `output_ids` after `input_ids`, from one teacher-forced forward.

    `model` follows the `DecoderLM` forward contract; the logits predicting output token i (at position
    len(input_ids) - 1 + i) go through `sampling_logprobs` with `params`, exactly as during sampling.
    """
    device = next(model.parameters()).device
    prompt_T = torch.as_tensor(input_ids, dtype=torch.long, device=device).reshape(-1)
    output_T = torch.as_tensor(output_ids, dtype=torch.long, device=device).reshape(-1)
    if prompt_T.numel() == 0:
        raise ValueError("input_ids is empty: the first output token needs at least one prompt token")
    if output_T.numel() == 0:
        return torch.zeros(0, dtype=torch.float32, device=device)
    ids_1T = torch.cat((prompt_T, output_T))[None]
    positions_1T = torch.arange(ids_1T.shape[1], device=device)[None]
    # The last token's logits predict nothing we score; keep only the positions that predict outputs.
    logits_1TV, _ = model(ids_1T[:, :-1], positions_1T[:, :-1], num_logits_to_keep=output_T.numel())
    logp_TV = sampling_logprobs(logits_1TV[0], params)
    return logp_TV.gather(1, output_T[:, None])[:, 0]
