"""`DecoderConfig`: the shape of a Llama/Qwen2/Qwen3-style decoder, dense or Qwen mixture-of-experts, read from and
written to HF `config.json`.

Contract: `DecoderConfig.from_hf(config_dict)` accepts the `config.json` of a dense `llama`, `qwen2` or `qwen3`
checkpoint or of a `qwen3_moe` / `qwen2_moe` mixture-of-experts checkpoint as written by transformers 4 or 5, fills
the fields a file may omit with the defaults of the matching transformers config class, and rejects with a
`ValueError` naming the field everything the native model would compute differently from transformers (other
mixture-of-experts families such as mixtral or deepseek, sliding-window attention, RoPE scaling types other than
`linear`, `llama3` and `yarn`, activations other than SiLU). `to_hf()` writes a transformers-4-style dict that
`from_hf` reads back to an equal config. `read_config(path)` reads the `config.json` of an HF-layout directory (the
proxy reads its model's vocabulary and context limit with it). Pure: stdlib only.

Mixture of experts: `num_experts == 0` means dense (every field below it unused); `is_moe_layer(i)` is transformers'
rule for which layers carry the sparse block. The router's auxiliary load-balancing loss is not computed by gyre's
trainers; `router_aux_loss_coef` is only kept so `to_hf` writes back what `from_hf` read.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gyre.models.model_files import CONFIG_FILE

DENSE_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")  # the mixture-of-experts layouts the native decoder computes
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + SUPPORTED_MOE_MODEL_TYPES
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
# Defaults of the transformers config classes for fields a config.json may omit.
DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768, "qwen3_moe": 32768, "qwen2_moe": 32768}
QWEN3_DEFAULT_HEAD_DIM = 128  # Qwen3Config(head_dim=128): not hidden_size // num_attention_heads (Qwen3Moe: it is)
# Qwen3MoeConfig / Qwen2MoeConfig defaults (transformers 5.x) for the mixture-of-experts fields a file may omit.
MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "shared_expert_intermediate_size": 0,
    },
    "qwen2_moe": {
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
    },
}
# Mixture-of-experts families whose routing the native decoder does not compute (rejected by from_hf).
MOE_MODEL_TYPES = ("mixtral", "deepseek_v2", "deepseek_v3", "llama4", "olmoe", "qwen3_next", "gpt_oss")
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")  # refused on dense
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LLAMA3_ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling; `rope_type="default"` is plain RoPE. Each type as transformers computes it
    (`transformers.modeling_rope_utils`): gyre's engine and both trainers use `gyre.models.decoder.rope_inv_freq`
    and `attention_scaling`, so all three rotate alike."""

    rope_type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0  # linear: positions divided by factor; llama3, yarn: low frequencies divided by factor
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3, yarn: the pre-extension context length
    beta_fast: float = 32.0  # yarn: rotations above which a frequency is kept (extrapolated)
    beta_slow: float = 1.0  # yarn: rotations below which a frequency is divided by factor (interpolated)
    attention_factor: float | None = None  # yarn: cos and sin multiplied by it; None: 0.1 ln(factor) + 1
    mscale: float | None = None  # yarn (DeepSeek): with mscale_all_dim, the attention factor's ratio form
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn: the correction range's bounds rounded to whole dimensions

    def attention_scaling(self) -> float:
        """What cos and sin are multiplied by (transformers' `attention_scaling`): 1.0 but for yarn."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim))
        return get_mscale(self.factor)


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Architecture of a pre-norm decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP or Qwen sparse MoE block)."""

    model_type: str  # llama | qwen2 | qwen3 | qwen3_moe | qwen2_moe (HF defaults and the architectures name on save)
    vocab_size: int  # rows of the embedding and of the lm_head
    hidden_size: int  # residual stream width
    intermediate_size: int  # SwiGLU inner width (MoE models: of the dense layers, those is_moe_layer(i) is False for)
    num_hidden_layers: int
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # key/value heads (GQA); divides num_attention_heads
    head_dim: int  # per-head width; hidden_size // num_attention_heads unless the config says otherwise
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 32768  # context limit the checkpoint was trained for (not enforced here)
    tie_word_embeddings: bool = False  # lm_head shares the embedding matrix
    attention_qkv_bias: bool = False  # q/k/v projections carry a bias (qwen2: always)
    attention_out_bias: bool = False  # o_proj carries a bias (llama/qwen3 attention_bias)
    mlp_bias: bool = False  # gate/up/down carry a bias (llama mlp_bias)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (qwen3)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "float32"  # dtype the weights were saved in (informational; load_pretrained casts)
    # Mixture of experts (qwen3_moe, qwen2_moe); the defaults mean dense.
    num_experts: int = 0  # routed experts per MoE layer; 0: dense model
    num_experts_per_tok: int = 0  # top-k experts each token is sent to
    moe_intermediate_size: int = 0  # SwiGLU inner width of each routed expert
    norm_topk_prob: bool = False  # renormalize the top-k softmax probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % decoder_sparse_step == 0 (and not mlp-only)
    mlp_only_layers: tuple[int, ...] = ()  # layer indices that keep the dense MLP
    shared_expert_intermediate_size: int = 0  # qwen2_moe: width of the always-on shared expert (sigmoid-gated)
    router_aux_loss_coef: float = 0.0  # kept for to_hf only: gyre's trainers add no load-balancing loss

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, name, value, "a positive integer")
        _require(
            isinstance(self.num_key_value_heads, int)
            and self.num_key_value_heads > 0
            and self.num_attention_heads % self.num_key_value_heads == 0,
            "num_key_value_heads",
            self.num_key_value_heads,
            f"a positive divisor of num_attention_heads={self.num_attention_heads}",
        )
        _require(
            isinstance(self.head_dim, int) and self.head_dim > 0 and self.head_dim % 2 == 0,
            "head_dim",
            self.head_dim,
            "a positive even integer (RoPE rotates pairs)",
        )
        _require(self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps), "rms_norm_eps", self.rms_norm_eps, "> 0")
        _require(self.rope_theta > 0 and math.isfinite(self.rope_theta), "rope_theta", self.rope_theta, "> 0")
        _require(
            self.model_type in SUPPORTED_MODEL_TYPES, "model_type", self.model_type, f"one of {SUPPORTED_MODEL_TYPES}"
        )
        self._check_moe()

    def _check_moe(self) -> None:
        _require(
            isinstance(self.num_experts, int) and self.num_experts >= 0, "num_experts", self.num_experts, "an int >= 0"
        )
        _require(
            isinstance(self.decoder_sparse_step, int) and self.decoder_sparse_step > 0,
            "decoder_sparse_step",
            self.decoder_sparse_step,
            "a positive integer",
        )
        _require(
            isinstance(self.mlp_only_layers, tuple)
            and all(isinstance(i, int) and 0 <= i < self.num_hidden_layers for i in self.mlp_only_layers),
            "mlp_only_layers",
            self.mlp_only_layers,
            f"a tuple of layer indices in [0, {self.num_hidden_layers})",
        )
        if self.num_experts == 0:
            return
        _require(
            self.model_type in SUPPORTED_MOE_MODEL_TYPES,
            "num_experts",
            self.num_experts,
            f"0 for model_type={self.model_type!r} (experts need one of {SUPPORTED_MOE_MODEL_TYPES})",
        )
        _require(
            isinstance(self.num_experts_per_tok, int) and 0 < self.num_experts_per_tok <= self.num_experts,
            "num_experts_per_tok",
            self.num_experts_per_tok,
            f"an integer in [1, num_experts={self.num_experts}]",
        )
        _require(
            isinstance(self.moe_intermediate_size, int) and self.moe_intermediate_size > 0,
            "moe_intermediate_size",
            self.moe_intermediate_size,
            "a positive integer",
        )
        if self.model_type == "qwen2_moe":
            ok = isinstance(self.shared_expert_intermediate_size, int) and self.shared_expert_intermediate_size > 0
            expected = "a positive integer (qwen2_moe's shared expert)"
        else:
            ok = self.shared_expert_intermediate_size == 0
            expected = f"0 (model_type={self.model_type!r} has no shared expert)"
        _require(ok, "shared_expert_intermediate_size", self.shared_expert_intermediate_size, expected)

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer `i` carries the sparse MoE block (transformers' Qwen3MoeDecoderLayer rule)."""
        return (i not in self.mlp_only_layers) and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    def moe_layer_ids(self) -> tuple[int, ...]:
        """The layers `is_moe_layer` holds for, in order: position m of a routed-experts tensor's layer axis is
        layer `moe_layer_ids()[m]`. Empty for a dense model."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> DecoderConfig:
        """Read an HF `config.json` dict; raise ValueError naming the field for anything unsupported."""
        if not isinstance(config, dict):
            raise TypeError(f"config must be the dict of a config.json, got {type(config).__name__}")
        model_type = config.get("model_type")
        if model_type in MOE_MODEL_TYPES:
            raise ValueError(
                f"model_type={model_type!r} is a mixture-of-experts model whose routing the native decoder does not "
                f"compute (mixture-of-experts supported: {SUPPORTED_MOE_MODEL_TYPES}; dense: {DENSE_MODEL_TYPES})"
            )
        _require(model_type in SUPPORTED_MODEL_TYPES, "model_type", model_type, f"one of {SUPPORTED_MODEL_TYPES}")
        if model_type in DENSE_MODEL_TYPES:
            for name in MOE_FIELDS:
                if config.get(name):
                    raise ValueError(
                        f"{name}={config[name]!r}: mixture-of-experts fields on a dense model_type={model_type!r} "
                        f"are not supported (mixture-of-experts supported: {SUPPORTED_MOE_MODEL_TYPES})"
                    )
        if config.get("use_sliding_window"):
            raise ValueError(
                f"use_sliding_window={config['use_sliding_window']!r} "
                f"(sliding_window={config.get('sliding_window')!r}) is not supported: the native decoder "
                "attends to the full context and would compute different logits"
            )
        if model_type == "llama" and config.get("sliding_window"):
            raise ValueError(f"sliding_window={config['sliding_window']!r} is not supported by the native decoder")
        layer_types = config.get("layer_types")
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"layer_types={sorted(set(layer_types))!r} is not supported: every layer must be 'full_attention'"
            )
        act = config.get("hidden_act", "silu")
        _require(act == "silu", "hidden_act", act, "'silu' (SwiGLU MLP)")
        if config.get("pretraining_tp", 1) not in (1, None):
            raise ValueError(f"pretraining_tp={config['pretraining_tp']!r} is not supported: expected 1")

        def required(name: str) -> Any:
            if name not in config or config[name] is None:
                raise ValueError(f"config.json is missing required field {name!r} (model_type={model_type!r})")
            return config[name]

        hidden_size = required("hidden_size")
        num_heads = required("num_attention_heads")
        head_dim = config.get("head_dim")
        if head_dim is None:  # Qwen3MoeConfig has no head_dim field: the attention falls back to hidden // heads
            head_dim = QWEN3_DEFAULT_HEAD_DIM if model_type == "qwen3" else hidden_size // num_heads
        num_kv_heads = config.get("num_key_value_heads")
        if num_kv_heads is None:
            num_kv_heads = num_heads
        rope_theta, rope_scaling = _read_rope(config)
        attention_bias = bool(config.get("attention_bias", False))
        dtype = config.get("torch_dtype", config.get("dtype")) or "float32"
        qwen2_family = model_type in ("qwen2", "qwen2_moe")
        # Qwen2Attention hard-codes bias=True on q/k/v and False on o_proj; Qwen2MoeAttention reads qkv_bias
        # (transformers 5; default True, hard-coded True in 4); llama, qwen3 and qwen3_moe use attention_bias.
        qkv_bias = bool(config.get("qkv_bias", True)) if model_type == "qwen2_moe" else True
        return cls(
            model_type=model_type,
            vocab_size=required("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=required("intermediate_size"),
            num_hidden_layers=required("num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", DEFAULT_MAX_POSITIONS[model_type])),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_qkv_bias=qkv_bias if qwen2_family else attention_bias,
            attention_out_bias=False if qwen2_family else attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=config.get("eos_token_id"),
            torch_dtype=str(dtype).removeprefix("torch."),
            **_read_moe(config, model_type),
        )

    def to_hf(self) -> dict[str, Any]:
        """A transformers-4-style config.json dict (transformers 5 reads it too) that `from_hf` maps back to self."""
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": self.torch_dtype,
        }
        if self.rope_scaling.rope_type != "default":
            scaling = asdict(self.rope_scaling)
            if self.rope_scaling.rope_type == "linear":
                scaling = {"rope_type": "linear", "factor": self.rope_scaling.factor}
            elif self.rope_scaling.rope_type == "yarn":
                names = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate")
                optional = ("attention_factor", "mscale", "mscale_all_dim")
                scaling = {"rope_type": "yarn", **{name: scaling[name] for name in names}}
                scaling |= {
                    name: scaling_value
                    for name in optional
                    if (scaling_value := getattr(self.rope_scaling, name)) is not None
                }
            else:
                scaling = {name: value for name, value in scaling.items() if name in ("rope_type", *LLAMA3_ROPE_FIELDS)}
            config["rope_scaling"] = scaling
        if self.model_type == "qwen2":
            config["use_sliding_window"] = False
        elif self.model_type == "qwen2_moe":
            if self.attention_out_bias:
                raise ValueError("model_type='qwen2_moe' has no o_proj bias; got attention_out_bias=True")
            config["use_sliding_window"] = False
            config["qkv_bias"] = self.attention_qkv_bias
        else:
            if self.attention_qkv_bias != self.attention_out_bias:
                raise ValueError(
                    f"model_type={self.model_type!r} has one attention_bias for q/k/v and o_proj; got "
                    f"attention_qkv_bias={self.attention_qkv_bias}, attention_out_bias={self.attention_out_bias}"
                )
            config["attention_bias"] = self.attention_qkv_bias
        if self.model_type in ("qwen3", "qwen3_moe"):
            config["use_sliding_window"] = False
        if self.model_type == "llama":
            config["mlp_bias"] = self.mlp_bias
        if self.model_type in SUPPORTED_MOE_MODEL_TYPES:
            config |= {
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": list(self.mlp_only_layers),
                "router_aux_loss_coef": self.router_aux_loss_coef,
                "output_router_logits": False,
            }
            if self.model_type == "qwen2_moe":
                config["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return config


def _read_moe(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a qwen3_moe / qwen2_moe config.json (empty for dense model types), with the
    transformers config class's defaults for the ones a file omits. Transformers 5 may name num_experts
    `num_local_experts` (Qwen3MoeConfig's attribute_map)."""
    if model_type not in SUPPORTED_MOE_MODEL_TYPES:
        return {}
    defaults = MOE_DEFAULTS[model_type]

    def read(name: str) -> Any:
        value = config.get(name)
        return defaults[name] if value is None else value

    num_experts = config.get("num_experts", config.get("num_local_experts"))
    mlp_only_layers = config.get("mlp_only_layers") or []
    _require(isinstance(mlp_only_layers, list), "mlp_only_layers", mlp_only_layers, "a list of layer indices")
    return {
        "num_experts": defaults["num_experts"] if num_experts is None else num_experts,
        "num_experts_per_tok": read("num_experts_per_tok"),
        "moe_intermediate_size": read("moe_intermediate_size"),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "decoder_sparse_step": config.get("decoder_sparse_step") or 1,
        "mlp_only_layers": tuple(mlp_only_layers),
        "shared_expert_intermediate_size": read("shared_expert_intermediate_size") if model_type == "qwen2_moe" else 0,
        "router_aux_loss_coef": float(config.get("router_aux_loss_coef", 0.001)),
    }


def _read_rope(config: dict[str, Any]) -> tuple[float, RopeScaling]:
    """rope_theta and scaling from transformers 4 (`rope_theta`, `rope_scaling`) or 5 (`rope_parameters`)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ValueError(f"rope_parameters/rope_scaling must be a dict or null, got {params!r} / {scaling!r}")
    merged = {**scaling, **params}
    theta = config.get("rope_theta", merged.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported: expected one of {SUPPORTED_ROPE_TYPES} "
            "(dynamic, longrope and others change attention in ways the native decoder does not implement)"
        )
    if rope_type == "default":
        return float(theta), RopeScaling()
    if rope_type == "yarn":
        return float(theta), _read_yarn(merged, config.get("max_position_embeddings", 32768))
    factor = merged.get("factor")
    _require(isinstance(factor, (int, float)) and factor >= 1.0, "rope_scaling.factor", factor, "a number >= 1")
    if rope_type == "linear":
        return float(theta), RopeScaling(rope_type="linear", factor=float(factor))
    missing = [name for name in LLAMA3_ROPE_FIELDS if merged.get(name) is None]
    if missing:
        raise ValueError(f"rope_scaling type 'llama3' needs fields {missing}")
    return float(theta), RopeScaling(
        rope_type="llama3",
        factor=float(factor),
        low_freq_factor=float(merged["low_freq_factor"]),
        high_freq_factor=float(merged["high_freq_factor"]),
        original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
    )


def _read_yarn(fields: dict[str, Any], max_position_embeddings: int) -> RopeScaling:
    """YaRN's fields as transformers reads them: the original length defaults to `max_position_embeddings`, and a
    missing factor is max_position_embeddings / original (DeepSeek-V3's convention)."""
    original = fields.get("original_max_position_embeddings") or max_position_embeddings
    _require(
        isinstance(original, int) and original > 0,
        "rope_scaling.original_max_position_embeddings",
        original,
        "a positive integer",
    )
    factor = fields.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    _require(isinstance(factor, (int, float)) and factor >= 1.0, "rope_scaling.factor", factor, "a number >= 1")
    numbers = {}
    for name in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
        value = fields.get(name)
        if value is not None:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
            _require(ok, f"rope_scaling.{name}", value, "a positive number")
            numbers[name] = float(value)
    truncate = fields.get("truncate", True)
    _require(isinstance(truncate, bool), "rope_scaling.truncate", truncate, "true or false")
    return RopeScaling(
        rope_type="yarn",
        factor=float(factor),
        original_max_position_embeddings=int(original),
        truncate=truncate,
        beta_fast=numbers.pop("beta_fast", 32.0),
        beta_slow=numbers.pop("beta_slow", 1.0),
        **numbers,
    )


def _require(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is not supported: expected {expected}")


def read_config(path: str | Path) -> DecoderConfig:
    """The `DecoderConfig` of an HF-layout directory."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"{config_path} not found: expected an HF-layout directory (config.json + *.safetensors)")
    return DecoderConfig.from_hf(json.loads(config_path.read_text()))
