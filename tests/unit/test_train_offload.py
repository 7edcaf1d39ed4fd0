"""gyre.trainer.offload on a tiny Megatron GPTModel (TP=1, one-rank gloo group): offload frees every device storage of
params, grads and AdamW state into one host buffer; restore brings the same tensor objects back bit-identical; the
next step equals that of a run that never offloaded; misuse raises RuntimeError naming the state;
a restore that fails part way can be called again."""

from __future__ import annotations

import pytest
import torch

from gyre.models.decoder import build_model
from gyre.models.decoder_config import DecoderConfig
from gyre.trainer import offload
from gyre.trainer.convert import gather_hf_state_dict, load_hf_state_dict
from gyre.trainer.logprobs import packed_logprobs
from gyre.trainer.megatron_trainable import MegatronTrainable
from gyre.trainer.model import build_gpt_model
from gyre.trainer.offload import TrainerState

pytestmark = pytest.mark.slow  # megatron import and model builds: several seconds

CONFIG = DecoderConfig(
    model_type="qwen3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    qk_norm=True,
    tie_word_embeddings=True,  # one parameter used twice: offloaded and restored once
)
ROW = torch.tensor([3, 17, 5, 40, 2, 9, 33, 12, 7, 60, 1, 25])


def make_trainable() -> MegatronTrainable:
    """The same weights every call (loaded from one seeded native model), AdamW with weight decay and clipping."""
    model = build_gpt_model(CONFIG)
    load_hf_state_dict(model, build_model(CONFIG, seed=7).state_dict(), CONFIG)
    return MegatronTrainable(model, lr=1e-2, weight_decay=0.1, max_grad_norm=1.0)


def backward(trainable: MegatronTrainable) -> None:
    """Accumulate the gradient of the row's negative log-likelihood (a stand-in for the RL loss)."""
    loss = -packed_logprobs(trainable.model, ROW, [0, len(ROW)]).sum()
    loss.backward()


def train_step(trainable: MegatronTrainable) -> None:
    backward(trainable)
    trainable.update()


def snapshot(trainable: MegatronTrainable) -> dict[str, torch.Tensor]:
    """Clones of every param, grad and optimizer-state tensor, keyed by parameter name."""
    out = {}
    for name, p in trainable.model.named_parameters():
        out[f"param:{name}"] = p.detach().clone()
        if p.grad is not None:
            out[f"grad:{name}"] = p.grad.clone()
        for key, value in trainable.optimizer.state[p].items():
            out[f"opt:{name}:{key}"] = value.clone()
    return out


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
        assert torch.equal(got[key].view(-1).view(torch.uint8), want[key].view(-1).view(torch.uint8)), key


def test_offload_restore_is_bit_identical_and_training_continues_exactly(model_parallel):
    reference, swapped = make_trainable(), make_trainable()
    for trainable in (reference, swapped):
        train_step(trainable)
        train_step(trainable)
        backward(trainable)  # grads present at the swap (mid-accumulation), so they are offloaded too
    state = TrainerState(swapped)
    before = snapshot(swapped)
    objects = {key: id(t) for key, t in _live(swapped).items()}
    resident = state.memory_bytes()
    # fp32: params, one grad per param, AdamW exp_avg and exp_avg_sq per param plus a 4-byte step each.
    param_bytes = sum(p.numel() * 4 for p in swapped.model.parameters())
    num_params = len(list(swapped.model.parameters()))
    assert resident == {"params": param_bytes, "grads": param_bytes, "optimizer": 2 * param_bytes + 4 * num_params}

    released = state.offload()
    assert released == sum(resident.values())
    assert state.memory_bytes() == {"params": 0, "grads": 0, "optimizer": 0}
    assert state.host_bytes >= released
    assert all(p.grad is None and p.numel() == 0 for p in swapped.model.parameters())
    assert all(v.numel() == 0 for s in swapped.optimizer.state.values() for v in s.values())

    assert state.restore() == released
    assert state.host_bytes == 0 and state.memory_bytes() == resident
    assert_bit_identical(snapshot(swapped), before)
    assert {key: id(t) for key, t in _live(swapped).items()} == objects, "restore must keep the same tensor objects"

    # A second cycle works the same, then both runs take one more step and finish a third: exactly equal.
    state.offload()
    state.restore()
    for trainable in (reference, swapped):
        trainable.update()
        train_step(trainable)
    assert_bit_identical(snapshot(swapped), snapshot(reference))
    assert gather_hf_state_dict(swapped.model, CONFIG).keys() == gather_hf_state_dict(reference.model, CONFIG).keys()


def _live(trainable: MegatronTrainable) -> dict[str, torch.Tensor]:
    """The tensor objects themselves (not clones): params, grads, optimizer state."""
    out = {}
    for name, p in trainable.model.named_parameters():
        out[f"param:{name}"] = p
        if p.grad is not None:
            out[f"grad:{name}"] = p.grad
        out.update({f"opt:{name}:{k}": v for k, v in trainable.optimizer.state[p].items()})
    return out


def test_drop_grads_frees_them_and_offload_skips_them(model_parallel):
    trainable = make_trainable()
    train_step(trainable)
    backward(trainable)
    state = TrainerState(trainable)
    assert state.memory_bytes()["grads"] > 0
    state.drop_grads()
    assert state.memory_bytes()["grads"] == 0
    assert all(p.grad is None for p in trainable.model.parameters())
    resident = state.memory_bytes()
    assert state.offload() == resident["params"] + resident["optimizer"]
    assert sum(state.memory_bytes().values()) == 0
    state.restore()
    assert all(p.grad is None for p in trainable.model.parameters())


def test_misuse_raises_naming_the_state(model_parallel):
    trainable = make_trainable()
    train_step(trainable)
    state = TrainerState(trainable)
    with pytest.raises(RuntimeError, match=r"restore\(\) called while the trainer state is resident"):
        state.restore()
    state.offload()
    with pytest.raises(RuntimeError, match=r"offload\(\) called while the trainer state is already offloaded"):
        state.offload()
    with pytest.raises(RuntimeError, match=r"an optimizer step while the trainer state is offloaded"):
        trainable.update()
    with pytest.raises(RuntimeError, match=r"a forward of the model while the trainer state is offloaded"):
        backward(trainable)
    with pytest.raises(RuntimeError, match=r"model.state_dict\(\) while the trainer state is offloaded"):
        gather_hf_state_dict(trainable.model, CONFIG)
    with pytest.raises(RuntimeError, match=r"drop_grads\(\) while the trainer state is offloaded"):
        state.drop_grads()
    state.restore()
    train_step(trainable)  # the refused calls left nothing half-done


def test_rejects_what_is_not_a_trainable():
    with pytest.raises(TypeError, match=r"trainable must have .model"):
        TrainerState(object())


def test_a_restore_that_fails_part_way_can_be_retried(model_parallel, monkeypatch):
    trainable = make_trainable()
    train_step(trainable)
    state = TrainerState(trainable)
    before = snapshot(trainable)
    state.offload()
    calls = []
    real = offload._bytes_of

    def fail_on_the_fifth(storage):  # stands in for a device that is still full (out of memory)
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("out of memory (simulated)")
        return real(storage)

    monkeypatch.setattr(offload, "_bytes_of", fail_on_the_fifth)
    with pytest.raises(RuntimeError, match=r"simulated"):
        state.restore()
    assert state.offloaded
    state.restore()
    assert_bit_identical(snapshot(trainable), before)
