"""`gyre.models.tiny.bias_toward_end_of_turn` (the repo recipe's starting model, docs/recipes.md "repo"): a
random-init tiny model almost never ends its turn; biased, it samples `<|im_end|>` with probability ~0.2-0.3 at every
position whatever the input, so a harness's answers end before the output cap. Cached apart from the plain model."""

from __future__ import annotations

import torch

from gyre.config import TinyModelSpec
from gyre.models.hf_weights import load_pretrained
from gyre.models.tiny import tiny_model_dir
from gyre.models.tokenizer import load_tokenizer

SPEC = TinyModelSpec(num_hidden_layers=1, max_position_embeddings=512)


def end_of_turn_probability(model_dir) -> torch.Tensor:
    model = load_pretrained(model_dir).eval()
    end = load_tokenizer(model_dir).token_to_id("<|im_end|>")
    ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        logits, _ = model(ids, positions)
    return torch.softmax(logits.float(), dim=-1)[..., end]


def test_the_biased_model_ends_its_turn_at_every_position_and_the_plain_one_does_not(tmp_path):
    plain = tiny_model_dir(tmp_path, SPEC)
    biased = tiny_model_dir(tmp_path, SPEC, ends_turns=True)
    assert biased != plain and biased.name == plain.name + "-ends-turns"
    assert end_of_turn_probability(plain).max() < 0.05
    p = end_of_turn_probability(biased)
    assert p.min() > 0.1 and p.max() < 0.5, (p.min(), p.max())
    assert tiny_model_dir(tmp_path, SPEC, ends_turns=True) == biased  # cached
