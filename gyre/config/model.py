"""The model settings a user chooses: the shape of gyre's tiny default model (`TinyModelSpec`), and a training run's
starting policy (`ModelConfig`: a checkpoint directory, or the tiny model warm-started on the demo family).

Which checkpoint a serving app serves is `model_dir` of its root config (`ServeConfig`, `EngineServeConfig`); a
training run's is `TrainConfig.model.model_dir`; its dtype and device are `EngineConfig` fields. A checkpoint's
own architecture (`DecoderConfig`, read from its config.json) is not a user setting and lives with the model code.
Pure: stdlib only. See docs/tiny-model.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gyre.config.checks import require, require_bool, require_choice, require_int, require_number
from gyre.config.warm_start import WarmStartConfig

TINY_MODEL_TYPES = ("qwen3", "qwen2", "llama")
DEFAULT_VOCAB_SIZE = 512  # asked of the tokenizer trained for the tiny model (gyre.models.tokenizer)
TINY_INITS = ("warm_start", "random")


@dataclass(kw_only=True)
class TinyModelSpec:
    """Shape of the tiny decoder. Defaults follow the prototype (docs/warm-start.md) that learned tool use on 2 cores.

    `model_type` is `qwen3` (no attention biases, per-head RMSNorm on q and k before RoPE): QK-norm bounds the
    attention logits, which keeps a tiny model stable under the high warm-start learning rate (1e-3) and under
    RL updates, and Qwen3 is the architecture of the real checkpoints gyre serves, so the tiny model exercises
    the same code path (`qwen2` would add q/k/v biases and no QK-norm; `llama` is also accepted).
    """

    model_type: str = "qwen3"
    """qwen3 | qwen2 | llama (model types the native decoder supports)."""
    vocab_size: int = DEFAULT_VOCAB_SIZE
    """Tokenizer vocabulary asked for; config.json gets the one trained."""
    hidden_size: int = 192
    """Residual width (prototype: d 192); a multiple of num_attention_heads with an even head_dim."""
    num_hidden_layers: int = 4
    """Decoder layers."""
    num_attention_heads: int = 4
    """Query heads (head_dim 48)."""
    num_key_value_heads: int = 2
    """GQA: 2 query heads per KV head, as real Qwen models (halves KV bytes); divides num_attention_heads."""
    intermediate_size: int = 512
    """SwiGLU inner width (prototype: SwiGLU 512)."""
    tie_word_embeddings: bool = True
    """The embedding is the output layer: at d 192 a separate lm_head would be a large share."""
    rope_theta: float = 10000.0
    """RoPE base (> 0); contexts are short (episodes ~41-70 tokens)."""
    max_position_embeddings: int = 4096
    """Context limit recorded in config.json for the engine."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon (> 0)."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            require_int(f"TinyModelSpec.{name}", getattr(self, name), gt=0)
        require(
            self.hidden_size % self.num_attention_heads == 0,
            "TinyModelSpec.hidden_size",
            self.hidden_size,
            f"a multiple of num_attention_heads={self.num_attention_heads}",
        )
        require(
            (self.hidden_size // self.num_attention_heads) % 2 == 0,
            "TinyModelSpec.hidden_size",
            self.hidden_size,
            f"hidden_size / num_attention_heads even (RoPE rotates pairs); got head_dim "
            f"{self.hidden_size // self.num_attention_heads}",
        )
        require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            "TinyModelSpec.num_key_value_heads",
            self.num_key_value_heads,
            f"a divisor of num_attention_heads={self.num_attention_heads}",
        )
        require_choice("TinyModelSpec.model_type", self.model_type, TINY_MODEL_TYPES)
        require_bool("TinyModelSpec.tie_word_embeddings", self.tie_word_embeddings)
        require_number("TinyModelSpec.rope_theta", self.rope_theta, gt=0)
        require_number("TinyModelSpec.rms_norm_eps", self.rms_norm_eps, gt=0)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(kw_only=True)
class ModelConfig:
    """The policy a training run starts from (docs/tiny-model.md, docs/warm-start.md)."""

    model_dir: str = ""
    """HF-layout directory of the starting policy (config.json, safetensors, tokenizer.json, tokenizer_config.json
    with a chat template). Empty: the tiny default model of shape `tiny`, built locally and cached."""
    init: str = "warm_start"
    """Empty model_dir only: how the tiny model starts. warm_start: the demo family's supervised warm start
    (`warm_start`, cached under $GYRE_CACHE; minutes of CPU the first time); random: its random init (RL on the
    demo family then never finds the tool, docs/warm-start.md)."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """The warm start's demonstrations and optimizer (init=warm_start)."""
    warm_start_seed: int = 0
    """Seed of the warm start (part of its cache key); apart from the run's seed, so seeds of RL share one warm
    start."""
    tiny: TinyModelSpec = field(default_factory=TinyModelSpec)
    """Shape of the tiny default model (empty model_dir)."""

    def __post_init__(self) -> None:
        require(isinstance(self.model_dir, str), "model.model_dir", self.model_dir, "a directory path")
        require_choice("model.init", self.init, TINY_INITS)
        require_int("model.warm_start_seed", self.warm_start_seed, ge=0)

    @property
    def uses_tiny(self) -> bool:
        """The run starts from the tiny default model (no model_dir)."""
        return not self.model_dir
