"""Build a tiny Qwen3-MoE model, tokenizer included, as one HF-layout directory; deterministic, no downloads.

`build_qwen3_moe_model(out_dir, seed=0, vocab_size=DEFAULT_VOCAB_SIZE)` trains the tiny tokenizer
(`gyre.models.build_tokenizer`), sizes a `qwen3_moe` decoder from `tiny_qwen3_moe_config` and the tokenizer's
vocabulary, initializes it with `gyre.models.decoder.build_model` (seeded) and writes `config.json`,
`model.safetensors`, `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` into `out_dir`.
Contract, as `gyre.models.tiny.build_tiny_model`'s:
- `load_pretrained(out_dir)` and `load_tokenizer(out_dir)` load it; transformers' `Qwen3MoeForCausalLM` too;
- layer 0 is dense (`mlp_only_layers=[0]`), layers 1-3 sparse (8 experts, top-2, `norm_topk_prob` as Qwen3-30B-A3B),
  so both kinds of layer are exercised; small enough to train on a CPU;
- `config.json` carries the tokenizer's BOS, EOS and PAD ids; the same seed gives byte-identical files;
- `out_dir` must be absent, empty, or hold only the files a build writes.
Importing this module imports neither torch nor tokenizers. See docs/moe.md.
"""

from __future__ import annotations

from pathlib import Path

from gyre.config.checks import is_int
from gyre.models.decoder_config import DecoderConfig
from gyre.models.model_files import prepare_out_dir
from gyre.models.tiny import MODEL_FILES, write_with_tiny_tokenizer
from gyre.models.tokenizer import DEFAULT_VOCAB_SIZE


def tiny_qwen3_moe_config(*, vocab_size: int, bos_token_id: int | None, eos_token_id: int | None) -> DecoderConfig:
    """The tiny Qwen3-MoE shape: hidden 64, 4 layers (layer 0 dense), 4 query / 2 KV heads of 16, 8 experts of
    SwiGLU width 64, top-2 renormalized; dense layer width 128; tied embeddings."""
    return DecoderConfig(
        model_type="qwen3_moe",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        qk_norm=True,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        torch_dtype="float32",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=(0,),
        router_aux_loss_coef=0.001,
    )


def build_qwen3_moe_model(out_dir: str | Path, seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Write the tiny tokenizer (`vocab_size` entries asked for) and a seeded random-init tiny Qwen3-MoE into
    `out_dir` (HF layout); returns `out_dir`. ValueError for a bad seed or an unusable `out_dir`."""
    if not is_int(seed) or seed < 0:
        raise ValueError(f"seed={seed!r}: expected an int >= 0")
    out = prepare_out_dir(Path(out_dir), MODEL_FILES, build="a tiny-model build")
    return write_with_tiny_tokenizer(out, tiny_qwen3_moe_config, vocab_size, seed=seed)
