"""Build gyre's tiny default model, tokenizer included, as one HF-layout directory; deterministic, no downloads.

`build_tiny_model(out_dir, spec=None, seed=0)` trains the tokenizer (`build_tokenizer`), sizes a Qwen3-style
decoder from `TinyModelSpec` and the tokenizer's vocabulary, initializes it with `gyre.models.decoder.build_model`
(seeded) and writes `config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json` and
`special_tokens_map.json` into `out_dir`. Contract:
- `gyre.models.hf_weights.load_pretrained(out_dir)` and `load_tokenizer(out_dir)` load it, like a real local checkpoint;
- `config.json` carries `bos_token_id`, `eos_token_id` and `pad_token_id` equal to the tokenizer's ids of
  `BOS_TOKEN`, `EOS_TOKEN` and `PAD_TOKEN`, and `vocab_size` equal to the tokenizer's vocabulary;
- the same spec and seed give byte-identical files (for one version of torch, safetensors and tokenizers);
- `out_dir` must be absent, empty, or hold only the files a build writes: a build never deletes a user's
  checkpoint (`save_pretrained` removes `*.safetensors` it finds).
`tiny_model_dir(cache_root=None, spec=None, seed=0, ends_turns=False)` builds once per (spec, seed, tokenizer inputs,
library versions) under a cache root and returns the directory (`ends_turns`: biased toward ending its turn,
`bias_toward_end_of_turn`, for harnesses that treat a capped answer as an error); concurrent callers are safe
(staging directory, then an atomic rename). Importing this module imports neither torch nor tokenizers. See
docs/tiny-model.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gyre.config.checks import is_int
from gyre.config.model import TinyModelSpec
from gyre.models.chat_template import TEMPLATE_PATH
from gyre.models.model_files import (
    CONFIG_FILE,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
    default_cache_root,
    package_version,
    prepare_out_dir,
)
from gyre.models.tokenizer import (
    BOS_TOKEN,
    CORPUS_DIR,
    EOS_TOKEN,
    IM_END,
    PAD_TOKEN,
    build_tokenizer,
)

MODEL_FILES = (CONFIG_FILE, WEIGHTS_FILE, *TOKENIZER_FILES)
CACHE_PREFIX = "tiny-"
# Bump when the build changes its output for the same inputs in a way the hashed sources do not capture.
BUILD_FORMAT = 1


def decoder_config(spec: TinyModelSpec, *, vocab_size: int, bos_token_id: int, eos_token_id: int):
    """The `DecoderConfig` for a tokenizer of `vocab_size` entries."""
    from gyre.models.decoder_config import DecoderConfig

    return DecoderConfig(
        model_type=spec.model_type,
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        rms_norm_eps=spec.rms_norm_eps,
        rope_theta=spec.rope_theta,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        attention_qkv_bias=spec.model_type == "qwen2",
        attention_out_bias=False,
        qk_norm=spec.model_type == "qwen3",
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        torch_dtype="float32",
    )


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None, seed: int = 0) -> Path:
    """Write the tokenizer and a seeded random-init decoder into `out_dir` (HF layout); returns `out_dir`.

    Raises ValueError if `out_dir` is a file or a directory holding anything but the files a build writes.
    """
    spec = TinyModelSpec() if spec is None else spec
    if not isinstance(spec, TinyModelSpec):
        raise TypeError(f"spec: expected a TinyModelSpec, got {type(spec).__name__}")
    if not is_int(seed) or seed < 0:
        raise ValueError(f"seed={seed!r}: expected an int >= 0")
    out = prepare_out_dir(Path(out_dir), MODEL_FILES, build="a tiny-model build")
    return write_with_tiny_tokenizer(out, lambda **ids: decoder_config(spec, **ids), spec.vocab_size, seed=seed)


def write_with_tiny_tokenizer(out: Path, make_config: Callable[..., Any], vocab_size: int, *, seed: int) -> Path:
    """Into the prepared `out`: the tiny BPE tokenizer of `vocab_size` entries, and a seeded random-init decoder of
    `make_config(vocab_size=, bos_token_id=, eos_token_id=)` (a `DecoderConfig` with the tokenizer's ids), its
    `config.json` carrying the pad id too. Returns `out`."""
    from gyre.models.decoder import build_model
    from gyre.models.hf_weights import save_pretrained
    from gyre.models.tokenizer import load_tokenizer

    build_tokenizer(out, vocab_size=vocab_size)
    tokenizer = load_tokenizer(out)
    ids = {token: tokenizer.token_to_id(token) for token in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)}
    assert all(i is not None for i in ids.values()), ids  # build_tokenizer always adds the special tokens
    config = make_config(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        bos_token_id=ids[BOS_TOKEN],
        eos_token_id=ids[EOS_TOKEN],
    )
    save_pretrained(build_model(config, seed=seed), out)

    # DecoderConfig has no pad id; transformers and the engine read it from config.json (from_hf ignores it).
    config_path = out / CONFIG_FILE
    hf_config: dict[str, Any] = json.loads(config_path.read_text())
    hf_config["pad_token_id"] = ids[PAD_TOKEN]
    config_path.write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    return out


def count_parameters(model_dir: str | Path) -> int:
    """Parameters stored in `model_dir/model.safetensors`, read from the header (no tensor is loaded)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(Path(model_dir) / WEIGHTS_FILE), framework="pt") as reader:
        for name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
            shape = reader.get_slice(name).get_shape()
            n = 1
            for dim in shape:
                n *= dim
            total += n
    return total


def spec_hash(spec: TinyModelSpec | None = None, seed: int = 0) -> str:
    """16 hex digits identifying a build: spec, seed, tokenizer inputs, build sources and library versions."""
    spec = TinyModelSpec() if spec is None else spec
    digest = hashlib.sha256()
    digest.update(json.dumps({"spec": asdict(spec), "seed": seed, "format": BUILD_FORMAT}, sort_keys=True).encode())
    here = Path(__file__).parent
    sources = [
        *sorted(CORPUS_DIR.glob("*.txt")),
        TEMPLATE_PATH,
        here / "tokenizer.py",
        here / "tiny.py",
        here / "decoder_config.py",
        here / "decoder.py",
        here / "hf_weights.py",
    ]
    for path in sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for package in ("torch", "safetensors", "tokenizers"):
        digest.update(f"{package}={package_version(package)}\0".encode())
    return digest.hexdigest()[:16]


def bias_toward_end_of_turn(model_dir: str | Path, token: str = IM_END) -> None:
    """Edit a tiny model's tied embedding in place so that it ends its turn (samples `token`) with probability
    ~0.2-0.3 at every position, whatever the input: a random-init model almost never does (~1 / vocabulary), so every
    answer ran to the output cap, which Claude Code and Codex report as an error ("exceeded the output token
    maximum", "Incomplete response"). Every row gets a shared component `4 e_0`, so the final hidden state after
    RMSNorm points along e_0; the logits of all tokens shift alike except `token`'s, whose row gets `0.4 e_0` more:
    it leads by up to 0.4 sqrt(hidden) (5.5 at hidden 192). Measured on random prompts: p 0.20-0.29 per position
    (tests/integration/test_harness_clis.py)."""
    import torch
    from safetensors.torch import load_file, save_file

    from gyre.models.tokenizer import load_tokenizer

    token_id = load_tokenizer(model_dir).token_to_id(token)
    if token_id is None:
        raise ValueError(f"{model_dir}: the tokenizer has no {token!r}")
    weights_file = Path(model_dir) / WEIGHTS_FILE
    state = load_file(str(weights_file))
    embed = state["model.embed_tokens.weight"]
    direction = torch.zeros(embed.shape[1], dtype=embed.dtype)
    direction[0] = 1.0
    embed += 4.0 * direction
    embed[token_id] += 0.4 * direction
    save_file(state, str(weights_file), metadata={"format": "pt"})


def tiny_model_dir(
    cache_root: str | Path | None = None,
    spec: TinyModelSpec | None = None,
    seed: int = 0,
    *,
    ends_turns: bool = False,
) -> Path:
    """The cached tiny model directory `<cache_root>/tiny-<spec_hash>`, built on first use; `ends_turns`: with
    `bias_toward_end_of_turn` applied (`tiny-<spec_hash>-ends-turns`).

    A builder writes into a private staging directory next to the target and renames it into place; `rename`
    of a directory is atomic on one filesystem, so a reader sees either no directory or a complete one. When
    several processes or threads race, each builds, one rename wins and the others discard their copy.
    """
    root = default_cache_root() if cache_root is None else Path(cache_root)
    target = root / f"{CACHE_PREFIX}{spec_hash(spec, seed)}{'-ends-turns' if ends_turns else ''}"
    if _is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-{os.getpid()}-", dir=root))
    try:
        build_tiny_model(staging, spec=spec, seed=seed)
        if ends_turns:
            bias_toward_end_of_turn(staging)
        try:
            os.rename(staging, target)
        except OSError:
            # Another builder renamed first (ENOTEMPTY/EEXIST); its copy is byte-identical to ours.
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in MODEL_FILES)
