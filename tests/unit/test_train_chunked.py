"""Log-probs a chunk of tokens at a time (`gyre.trainer.chunked`) and the native trainer's long-row path: the same
values and gradients as the full `[tokens, vocab]` logits (fp32: 1e-6 relative for the chunking alone, 1e-5
against the dense-mask forward), whatever the chunk size, with and without activation recompute."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gyre.models.decoder import block_causal_mask, build_model, segments_from_positions
from gyre.models.decoder_config import DecoderConfig
from gyre.trainer.chunked import chunked_token_logprobs
from gyre.trainer.native_trainable import packed_logprobs

CONFIG = DecoderConfig(
    model_type="qwen3",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    rope_theta=500.0,
    qk_norm=True,
)


def full_logprobs(hidden_NC, targets_N, weight_VC, temperature=1.0):
    return F.log_softmax(F.linear(hidden_NC, weight_VC).float() / temperature, -1).gather(1, targets_N[:, None])[:, 0]


@pytest.mark.parametrize("chunk_tokens", [1, 3, 7, 16, 40])
def test_chunks_give_the_full_logits_values_and_gradients(chunk_tokens):
    generator = torch.Generator().manual_seed(chunk_tokens)
    hidden = torch.randn(16, 8, generator=generator, requires_grad=True)
    weight = torch.randn(50, 8, generator=generator, requires_grad=True)
    targets = torch.randint(0, 50, (16,), generator=generator)
    scale = torch.randn(16, generator=generator)

    want = full_logprobs(hidden, targets, weight, temperature=0.7)
    want_grads = torch.autograd.grad((want * scale).sum(), (hidden, weight))
    got = chunked_token_logprobs(
        hidden, targets, lambda h: F.linear(h, weight), chunk_tokens=chunk_tokens, temperature=0.7
    )
    got_grads = torch.autograd.grad((got * scale).sum(), (hidden, weight))

    assert got.dtype == torch.float32 and got.shape == (16,)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # fp32 rounding: cross_entropy vs log_softmax
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_no_tokens_and_no_gradients():
    weight = torch.randn(10, 4)
    empty = chunked_token_logprobs(torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64), lambda h: h @ weight.T)
    assert empty.shape == (0,) and empty.dtype == torch.float32
    with torch.no_grad():
        hidden = torch.randn(5, 4, requires_grad=True)
        got = chunked_token_logprobs(hidden, torch.arange(5), lambda h: h @ weight.T, chunk_tokens=2)
    assert not got.requires_grad
    torch.testing.assert_close(got, full_logprobs(hidden, torch.arange(5), weight), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"chunk_tokens": 0}, "chunk_tokens=0"),
        ({"chunk_tokens": 2.5}, "chunk_tokens=2.5"),
        ({"temperature": 0.0}, "temperature=0.0"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        chunked_token_logprobs(torch.zeros(3, 4), torch.zeros(3, dtype=torch.int64), lambda h: h, **kwargs)
    with pytest.raises(ValueError, match="expected \\[N, C\\] and \\[N\\]"):
        chunked_token_logprobs(torch.zeros(3, 4), torch.zeros(2, dtype=torch.int64), lambda h: h)


def packed_step(lengths: tuple[int, ...], seed: int) -> SimpleNamespace:
    """What `packed_logprobs` reads of a `MicroStep`: the packed ids and the row offsets."""
    generator = np.random.default_rng(seed)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    ids = generator.integers(0, CONFIG.vocab_size, size=int(offsets[-1])).astype(np.int64)
    return SimpleNamespace(ids_U=ids, row_offsets_R1=offsets)


def dense_logprobs(model, step) -> torch.Tensor:
    """The old path: one forward over all the packed tokens under the block-diagonal mask, full logits."""
    ids = torch.from_numpy(step.ids_U)[None]
    offsets = step.row_offsets_R1.tolist()
    positions = torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(offsets)])[None]
    logits = model(ids, positions, attention_mask=block_causal_mask(segments_from_positions(positions)))[0][0]
    logp = F.log_softmax(logits[:-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
    return torch.where(positions[0] == 0, torch.zeros(()), torch.cat((torch.zeros(1), logp)))


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_native_packed_rows_equal_the_dense_path(recompute):
    model = build_model(CONFIG, seed=4)
    step = packed_step((9, 1, 23, 5), seed=1)
    scale = torch.randn(int(step.row_offsets_R1[-1]), generator=torch.Generator().manual_seed(2))

    want = dense_logprobs(model, step)
    want_grads = torch.autograd.grad((want * scale).sum(), list(model.parameters()))
    got = packed_logprobs(model, step, chunk_tokens=4, recompute=recompute)
    got_grads = torch.autograd.grad((got * scale).sum(), list(model.parameters()))

    assert (got - want).abs().max().item() <= 1e-5
    for (name, _), g, w in zip(model.named_parameters(), got_grads, want_grads, strict=True):
        assert (g - w).abs().max().item() <= 1e-5, name


def test_an_unknown_recompute_is_refused():
    model = build_model(CONFIG, seed=4)
    with pytest.raises(ValueError, match="recompute='some'"):
        model.final_hidden(torch.zeros(1, 3, dtype=torch.int64), torch.arange(3)[None], recompute="some")
