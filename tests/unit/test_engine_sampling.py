"""Behavior log-probs: what `sample_next` records during cached decoding equals a teacher-forced recomputation."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from engine_fixtures import sharp_tiny_model

from gyre.engine.protocol import SamplingParams
from gyre.engine.sampling import sample_next, sampling_logprobs, seeded_uniforms, sequence_logprobs

ATOL = 1e-5
PARAM_CASES = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7": SamplingParams(temperature=0.7),
    "top_k5": SamplingParams(top_k=5),
    "top_p0.8": SamplingParams(top_p=0.8),
    "t1.3_k8_p0.9": SamplingParams(temperature=1.3, top_k=8, top_p=0.9),
}


@pytest.fixture(scope="module")
def model():
    return sharp_tiny_model()


@torch.no_grad()
def decode(model, prompt, params, num_tokens):
    """Prefill, then sample token by token from the KV cache; return (output ids, recorded log-probs).

    Each draw passes its sequence position, as the engine does (the counter of a seeded row's uniform)."""
    ids_1T = torch.tensor([prompt])
    logits_1TV, cache = model(ids_1T, torch.arange(len(prompt))[None], num_logits_to_keep=1)
    out, logps = [], []
    for step in range(num_tokens):
        token_B, logp_B = sample_next(logits_1TV[:, -1], params, [len(prompt) + step])
        out.append(int(token_B[0]))
        logps.append(float(logp_B[0]))
        position = torch.tensor([[len(prompt) + step]])
        logits_1TV, cache = model(token_B[:, None], position, kv_cache=cache)
    return out, torch.tensor(logps)


@pytest.mark.parametrize("name", sorted(PARAM_CASES))
def test_recorded_logprobs_equal_teacher_forced(model, name):
    params = PARAM_CASES[name]
    for seed, prompt in ((0, [5, 17, 2]), (1, [40, 41, 42, 43, 44, 45, 46]), (2, [9])):
        out, recorded = decode(model, prompt, dataclasses.replace(params, seed=seed), 24)
        recomputed = sequence_logprobs(model, prompt, out, params)
        assert recomputed.dtype == torch.float32 and recomputed.shape == (24,)
        assert torch.isfinite(recorded).all()
        torch.testing.assert_close(recorded, recomputed, atol=ATOL, rtol=0.0)
        if params.filters:  # the filter really renormalized something, so the test is not vacuous
            raw = sequence_logprobs(model, prompt, out, SamplingParams(temperature=params.temperature))
            assert (recomputed - raw).abs().max() > 1e-3


def test_batched_per_row_params_equal_teacher_forced(model):
    """One batch, a different SamplingParams and seed per row: each row equals its own teacher-forced pass."""
    rows = [dataclasses.replace(PARAM_CASES[name], seed=10 + b) for b, name in enumerate(sorted(PARAM_CASES))]
    prompts = [[3 + b, 20 + b, 50 - b, 7] for b in range(len(rows))]
    ids_BT = torch.tensor(prompts)
    positions_BT = torch.arange(4).expand(len(rows), 4)
    with torch.no_grad():
        logits_BTV, cache = model(ids_BT, positions_BT, num_logits_to_keep=1)
    outs, logps = [], []
    for step in range(16):
        token_B, logp_B = sample_next(logits_BTV[:, -1], rows, [4 + step] * len(rows))
        outs.append(token_B)
        logps.append(logp_B)
        with torch.no_grad():
            logits_BTV, cache = model(token_B[:, None], torch.full((len(rows), 1), 4 + step), kv_cache=cache)
    out_BN, logp_BN = torch.stack(outs, 1), torch.stack(logps, 1)
    for b, params in enumerate(rows):
        recomputed = sequence_logprobs(model, prompts[b], out_BN[b], params)
        torch.testing.assert_close(logp_BN[b], recomputed, atol=ATOL, rtol=0.0)
        # A seeded row draws the same tokens alone as in the batch.
        alone, _ = decode(model, prompts[b], params, 16)
        assert alone == out_BN[b].tolist()


def test_greedy_matches_argmax_of_full_forward(model):
    prompt = [11, 12, 13, 14]
    out, recorded = decode(model, prompt, SamplingParams(temperature=0), 20)
    ids_1T = torch.tensor([prompt + out])
    with torch.no_grad():
        logits_TV = model(ids_1T, torch.arange(ids_1T.shape[1])[None])[0][0, len(prompt) - 1 : -1]
    assert logits_TV.argmax(-1).tolist() == out
    # Greedy reports the policy's own (untempered, unfiltered) log-prob of the argmax.
    expected = torch.log_softmax(logits_TV.float(), -1).gather(1, torch.tensor(out)[:, None])[:, 0]
    torch.testing.assert_close(recorded, expected, atol=ATOL, rtol=0.0)
    torch.testing.assert_close(
        sequence_logprobs(model, prompt, out, SamplingParams(temperature=0, top_k=3, top_p=0.5)),
        expected,
        atol=ATOL,
        rtol=0.0,
    )


def test_seeded_reproducibility(model):
    prompt = [1, 2, 3]
    params = SamplingParams(temperature=1.3, top_k=8, top_p=0.9, seed=1234)
    first, lp1 = decode(model, prompt, params, 32)
    torch.manual_seed(123)  # the global RNG's state does not matter to a seeded request
    again, lp2 = decode(model, prompt, params, 32)
    other, _ = decode(model, prompt, dataclasses.replace(params, seed=99), 32)
    assert first == again and torch.equal(lp1, lp2)
    assert first != other


def test_seeded_continuation_draws_the_same_next_tokens(model):
    """Counter-based draws: resuming from prompt + the first k outputs (a migrated or rerouted call) continues the
    same stream, although its first token now comes from a prefill's logits, not a decode step's."""
    prompt = [8, 30, 31, 4]
    params = SamplingParams(temperature=1.0, seed=2024)
    whole, lp_whole = decode(model, prompt, params, 30)
    for k in (1, 7, 18):
        rest, lp_rest = decode(model, prompt + whole[:k], params, 30 - k)
        assert rest == whole[k:]
        torch.testing.assert_close(lp_rest, lp_whole[k:], atol=ATOL, rtol=0.0)


def splitmix64(seed: int, index: int) -> int:
    """Reference SplitMix64 on Python ints: output `index` (from 0) of the generator seeded with `seed`."""
    mask = (1 << 64) - 1
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_seeded_uniforms_are_splitmix64_outputs():
    assert splitmix64(0, 0) == 0xE220A8397B1DCDAF  # the published first output for seed 0
    rng = random.Random(0)
    seeds = [0, 1, 2**63 - 1] + [rng.randrange(2**63) for _ in range(500)]
    positions = [0, 2**31, 5] + [rng.randrange(2**40) for _ in range(500)]
    got = seeded_uniforms(torch.tensor(seeds), torch.tensor(positions))
    expected = torch.tensor([(splitmix64(s, t) >> 40) / 2**24 for s, t in zip(seeds, positions, strict=True)])
    assert got.dtype == torch.float32 and torch.equal(got, expected)  # int64 wrap-around is exact
    assert float(got.min()) >= 0 and float(got.max()) < 1


def test_a_seeded_row_draws_the_same_token_in_any_batch_and_order():
    """A seeded row's draw depends only on its logits, seed and position: not on the other rows (seeded, unseeded,
    greedy, filtered) nor on its place in the batch."""
    logits_BV = torch.randn(6, 40, generator=torch.Generator().manual_seed(3)) * 3
    rows = [
        SamplingParams(seed=5),
        SamplingParams(temperature=0.8, top_k=6, seed=6),
        SamplingParams(),
        SamplingParams(temperature=0),
        SamplingParams(top_p=0.7, seed=8),
        SamplingParams(temperature=1.2),
    ]
    positions = [11, 3, 0, 7, 250, 9]
    batch_tokens, batch_logps = sample_next(logits_BV, rows, positions)
    for order in ([5, 4, 3, 2, 1, 0], [1, 0, 4, 2, 3, 5]):
        tokens, logps = sample_next(logits_BV[order], [rows[i] for i in order], [positions[i] for i in order])
        for b, i in enumerate(order):
            if rows[i].seed is not None or rows[i].greedy:
                assert int(tokens[b]) == int(batch_tokens[i]) and float(logps[b]) == float(batch_logps[i])
    for i, params in enumerate(rows):
        if params.seed is not None:
            alone, logp = sample_next(logits_BV[i : i + 1], params, [positions[i]])
            assert int(alone[0]) == int(batch_tokens[i]) and float(logp[0]) == float(batch_logps[i])
    # Another position (or another seed) is another uniform: over many positions, the draws differ.
    draws = {int(sample_next(logits_BV[:1], rows[0], [t])[0][0]) for t in range(40)}
    assert len(draws) > 3


def test_unseeded_rows_draw_from_the_global_rng_as_before():
    """Unseeded: one torch.rand(B, 1) from the global RNG per call, inverted through each row's CDF."""
    logits_BV = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.9)
    torch.manual_seed(77)
    tokens, _ = sample_next(logits_BV, params)
    torch.manual_seed(77)
    u_B1 = torch.rand(4, 1)
    cdf_BV = sampling_logprobs(logits_BV, params).exp().cumsum(-1)
    assert tokens.tolist() == torch.searchsorted(cdf_BV, u_B1 * cdf_BV[:, -1:], right=True)[:, 0].tolist()
    torch.manual_seed(77)
    assert torch.equal(sample_next(logits_BV, params)[0], tokens)


def test_filtered_tokens_are_never_sampled():
    """Over many draws, only tokens the filter keeps appear, with the frequencies exp(logprob) says."""
    logits_V = torch.randn(50, generator=torch.Generator().manual_seed(0))
    draws = 20000
    cases = [SamplingParams(top_k=5), SamplingParams(top_p=0.8), SamplingParams(temperature=1.3, top_k=8, top_p=0.9)]
    for params in cases:
        logp_V = sampling_logprobs(logits_V[None], params)[0]
        kept = torch.isfinite(logp_V)
        assert 1 < int(kept.sum()) < 50
        if params.top_k:
            assert int(kept.sum()) <= params.top_k
        # One seed, positions 0..draws-1: the counter-based uniforms are also checked for uniformity here.
        seeded = dataclasses.replace(params, seed=1)
        tokens_N, logps_N = sample_next(logits_V.expand(draws, -1), seeded, torch.arange(draws))
        assert kept[tokens_N].all(), "a filtered-out token was sampled"
        torch.testing.assert_close(logps_N, logp_V[tokens_N])
        freq_V = torch.bincount(tokens_N, minlength=50).float() / draws
        assert (freq_V - logp_V.exp()).abs().max() < 0.02


def test_sampling_logprobs_by_hand():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    p = torch.softmax(logits[0], 0)  # 0.644, 0.237, 0.087, 0.032
    # top_p 0.7: mass before token 1 is 0.644 < 0.7, before token 2 is 0.881 >= 0.7 -> keep {0, 1}.
    got = sampling_logprobs(logits, SamplingParams(top_p=0.7))[0]
    expected = torch.tensor([math.log(p[0] / (p[0] + p[1])), math.log(p[1] / (p[0] + p[1])), -math.inf, -math.inf])
    torch.testing.assert_close(got, expected)
    # top_p exactly reached by the first token still keeps only it (mass before the next = p0 >= top_p).
    assert torch.isfinite(sampling_logprobs(logits, SamplingParams(top_p=float(p[0])))[0]).tolist() == [
        True,
        False,
        False,
        False,
    ]
    # temperature 2: softmax([1.5, 1, 0.5, 0]).
    torch.testing.assert_close(
        sampling_logprobs(logits, SamplingParams(temperature=2.0))[0], torch.log_softmax(logits[0] / 2, 0)
    )
    # top_k 2 keeps ties with the 2nd largest value (transformers' TopKLogitsWarper).
    tied = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    kept = torch.isfinite(sampling_logprobs(tied, SamplingParams(top_k=2))[0]).tolist()
    assert kept == [True, True, True, False]
    # temperature then top-k then top-p: t=0.5 doubles the gaps; top_k 3 drops token 3; top_p 0.9 on
    # softmax([6, 4, 2]) = (0.867, 0.117, 0.016): mass before token 2 is 0.984 >= 0.9 -> keep {0, 1}.
    got = sampling_logprobs(logits, SamplingParams(temperature=0.5, top_k=3, top_p=0.9))[0]
    q = torch.softmax(torch.tensor([6.0, 4.0]), 0).log()
    torch.testing.assert_close(got, torch.tensor([q[0], q[1], -math.inf, -math.inf]))
    # Order matters. top-p sees the renormalized top-k distribution: top_k 2 gives (0.731, 0.269), whose
    # first token alone reaches 0.7 (unrenormalized, 0.644 < 0.7 would keep two).
    kept = torch.isfinite(sampling_logprobs(logits, SamplingParams(top_k=2, top_p=0.7))[0]).tolist()
    assert kept == [True, False, False, False]
    # top-p sees tempered probabilities: t=2 gives (0.455, 0.276, 0.167, 0.102), mass before token 2 is
    # 0.731 < 0.75 -> keep three (untempered, 0.881 >= 0.75 would keep two).
    kept = torch.isfinite(sampling_logprobs(logits, SamplingParams(temperature=2.0, top_p=0.75))[0]).tolist()
    assert kept == [True, True, True, False]
    # top_k >= V and top_p == 1 are off.
    torch.testing.assert_close(sampling_logprobs(logits, SamplingParams(top_k=4))[0], torch.log_softmax(logits[0], 0))


def test_bf16_logits_are_scored_in_fp32():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(0)).bfloat16()
    tokens, logps = sample_next(logits, SamplingParams(top_k=4, seed=0), [3, 3])
    assert tokens.dtype == torch.int64 and logps.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), -1)
    assert (logps >= expected.gather(1, tokens[:, None])[:, 0]).all()  # renormalized over 4 tokens: larger


def test_argument_errors(model):
    with pytest.raises(ValueError, match="logits_BV must be"):
        sample_next(torch.zeros(5), SamplingParams())
    with pytest.raises(ValueError, match="params has 1 entries for 2"):
        sample_next(torch.zeros(2, 5), [SamplingParams()])
    with pytest.raises(ValueError, match="positions is required when a row is seeded"):
        sample_next(torch.zeros(2, 5), [SamplingParams(), SamplingParams(seed=1)])
    with pytest.raises(ValueError, match="positions has 1 entries for 2"):
        sample_next(torch.zeros(2, 5), SamplingParams(seed=1), [0])
    with pytest.raises(ValueError, match="input_ids is empty"):
        sequence_logprobs(model, [], [1], SamplingParams())
    assert sequence_logprobs(model, [1], [], SamplingParams()).shape == (0,)
