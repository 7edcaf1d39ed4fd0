"""Build gyre's tiny byte-level BPE tokenizer from the bundled corpus, deterministically, in HF layout.

`build_tokenizer(out_dir)` trains a byte-level BPE with the HF `tokenizers` library on
`gyre/models/corpus/*.txt` and writes `tokenizer.json`, `tokenizer_config.json` (with `chat_template`) and
`special_tokens_map.json`, so `tokenizers.Tokenizer.from_file` and `transformers.AutoTokenizer` load it like
a real checkpoint's tokenizer. Contract:
- ids 0..9 are `SPECIAL_TOKENS` in order, each one id, never split and never produced by merges;
- every byte has a token (no unknown token), so `decode(encode(s)) == s` for any string;
- digits are pre-split: each digit is its own token;
- `TOOL_CALL_TOKENS` (the fixed parts of the tool-call JSON) are one token each;
- the vocabulary has exactly `vocab_size` entries, and the same inputs give byte-identical files.
Nothing is downloaded. See docs/tiny-model.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from gyre.config.model import DEFAULT_VOCAB_SIZE
from gyre.models.chat_template import CHAT_TEMPLATE

CORPUS_DIR = Path(__file__).with_name("corpus")

ENDOFTEXT, IM_START, IM_END, PAD = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS: tuple[str, ...] = (
    ENDOFTEXT,
    IM_START,
    IM_END,
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    PAD,
)
# The byte-level pre-tokenizer cuts JSON at quotes and spaces, so merges can never join these; as added
# (non-special) tokens each is one id, which shortens every tool call by ~10 tokens (docs/warm-start.md: "the
# tool-call JSON preamble one token" is what let a tiny model learn tool use).
TOOL_CALL_TOKENS: tuple[str, ...] = ('{"name": "', '", "arguments": ')

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = ENDOFTEXT, IM_END, PAD


def bundled_corpus() -> list[str]:
    """The bundled training texts, one string per file, in file-name order."""
    files = sorted(CORPUS_DIR.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no corpus files (*.txt) in {CORPUS_DIR}; is the package data installed?")
    return [f.read_text(encoding="utf-8") for f in files]


def _min_vocab_size() -> int:
    return len(SPECIAL_TOKENS) + 256 + len(TOOL_CALL_TOKENS)


def train_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, corpus: Iterable[str] | None = None):
    """Train and return the `tokenizers.Tokenizer` (in memory); `build_tokenizer` also saves it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if not isinstance(vocab_size, int) or vocab_size < _min_vocab_size():
        raise ValueError(
            f"vocab_size: expected an int >= {_min_vocab_size()} "
            f"({len(SPECIAL_TOKENS)} special + 256 bytes + {len(TOOL_CALL_TOKENS)} tool-call tokens), "
            f"got {vocab_size!r}"
        )
    texts = bundled_corpus() if corpus is None else list(corpus)
    if not all(isinstance(t, str) for t in texts):
        raise TypeError("corpus: expected an iterable of str")

    tokenizer = Tokenizer(models.BPE())  # no unk token: every byte is in the alphabet
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_CALL_TOKENS),
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_CALL_TOKENS])
    return tokenizer


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")


def build_tokenizer(
    out_dir: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE, corpus: Iterable[str] | None = None
) -> Path:
    """Train on `corpus` (default: the bundled corpus) and save the HF-layout tokenizer into `out_dir`.

    `vocab_size` counts everything: special tokens, the 256 byte tokens, merges and tool-call tokens. With a
    small corpus the merges may run out first; the vocabulary is then smaller (never larger). Returns out_dir.
    """
    tokenizer = train_tokenizer(vocab_size, corpus)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)

    added = {
        str(tokenizer.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in SPECIAL_TOKENS + TOOL_CALL_TOKENS
    }
    extra_special = [t for t in SPECIAL_TOKENS if t not in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)]
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,  # document separator for packing; never added automatically
            "eos_token": EOS_TOKEN,  # a chat turn ends generation
            "pad_token": PAD_TOKEN,
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "split_special_tokens": False,
            "errors": "replace",
            "model_max_length": 1 << 30,
            "additional_special_tokens": extra_special,
            "extra_special_tokens": extra_special,
            "added_tokens_decoder": added,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "additional_special_tokens": extra_special,
        },
    )
    return out


def load_tokenizer(path: str | Path):
    """Load `tokenizer.json` from an HF-layout directory (or the file itself) as a `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer

    p = Path(path)
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))
