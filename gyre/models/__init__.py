"""gyre's tiny default model, built locally with no downloads: tokenizer and chat template.

- `build_tokenizer(out_dir, vocab_size=512, corpus=None)`: byte-level BPE trained deterministically on the
  bundled corpus, saved in HF layout (`tokenizer.json`, `tokenizer_config.json` with the chat template,
  `special_tokens_map.json`); `load_tokenizer(dir)` reads it back as a `tokenizers.Tokenizer`.
- `render_chat(messages, tools=None, add_generation_prompt=True)`: the Qwen/Hermes chat template in plain
  Python, equal to the Jinja `CHAT_TEMPLATE` stored in `tokenizer_config.json`.
- `build_tiny_model(out_dir, spec=None, seed=0)`: tokenizer plus a seeded random-init Qwen3-style decoder
  (`gyre.config.TinyModelSpec`) in one HF-layout directory; `tiny_model_dir()` builds it once under `~/.cache/gyre`
  (`$GYRE_CACHE`). CLI: `python -m gyre.models build-tiny OUT_DIR [--seed N]`.

Importing this package imports neither `torch`, `tokenizers` nor `jinja2`; building or Jinja rendering does.
See docs/tiny-model.md.
"""

from gyre.models.chat_template import CHAT_TEMPLATE, render_chat, render_chat_jinja
from gyre.models.tiny import build_tiny_model, count_parameters, tiny_model_dir
from gyre.models.tokenizer import (
    BOS_TOKEN,
    DEFAULT_VOCAB_SIZE,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TOOL_CALL_TOKENS,
    build_tokenizer,
    bundled_corpus,
    load_tokenizer,
    train_tokenizer,
)

__all__ = [
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "DEFAULT_VOCAB_SIZE",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "TOOL_CALL_TOKENS",
    "build_tiny_model",
    "build_tokenizer",
    "bundled_corpus",
    "count_parameters",
    "load_tokenizer",
    "render_chat",
    "render_chat_jinja",
    "tiny_model_dir",
    "train_tokenizer",
]
