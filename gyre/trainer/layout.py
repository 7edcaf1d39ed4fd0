"""Whether a model can be built by gyre's Megatron trainer at a TP x PP x EP layout (`validate_layout`): arithmetic on
its `DecoderConfig`, importing neither torch nor megatron, so the run plan checks a checkpoint before anything heavy
is imported (gyre.runtime.job.plan; docs/training.md)."""

from __future__ import annotations

from gyre.config.checks import is_int
from gyre.config.trainer import check_expert_layout
from gyre.models.decoder_config import DecoderConfig

__all__ = ["MEGATRON_LLAMA3_FIXED", "validate_layout"]

# megatron's llama3 RoPE (`RotaryEmbedding._apply_scaling`) fixes these; other values compute other angles.
MEGATRON_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def validate_layout(
    config: DecoderConfig,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    expert_parallel_size: int = 1,
) -> None:
    """Raise ValueError (field, got, expected) if `config` cannot be built at this TP x PP x EP or by megatron."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if not (isinstance(tp, int) and tp >= 1):
        raise ValueError(f"tensor_parallel_size={tp!r} is not supported: expected a positive integer")
    if not (isinstance(pp, int) and pp >= 1):
        raise ValueError(f"pipeline_parallel_size={pp!r} is not supported: expected a positive integer")
    divisible = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "vocab_size": config.vocab_size,
    }
    if len(config.moe_layer_ids()) < config.num_hidden_layers:  # some layer keeps the dense MLP
        divisible["intermediate_size"] = config.intermediate_size
    if config.shared_expert_intermediate_size:
        divisible["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    for name, value in divisible.items():
        if value % tp:
            raise ValueError(
                f"{name}={value} is not divisible by tensor_parallel_size={tp}: expected a multiple of {tp} "
                "(each TP rank holds an equal share)"
            )
    if config.num_hidden_layers % pp:
        raise ValueError(
            f"num_hidden_layers={config.num_hidden_layers} is not divisible by pipeline_parallel_size={pp}: "
            f"expected a multiple of {pp} (equal layers per stage)"
        )
    if config.attention_out_bias:
        raise ValueError("attention_out_bias=True is not supported by gyre.trainer: expected False (no o_proj bias)")
    if config.mlp_bias:
        raise ValueError("mlp_bias=True is not supported by gyre.trainer: expected False (no MLP biases)")
    _validate_experts(config, tp, pp, expert_parallel_size)
    scaling = config.rope_scaling
    if scaling.rope_type == "llama3":
        for name, fixed in MEGATRON_LLAMA3_FIXED.items():
            if getattr(scaling, name) != fixed:
                raise ValueError(
                    f"rope_scaling.{name}={getattr(scaling, name)!r} is not supported by megatron-core's llama3 "
                    f"RoPE: expected {fixed}"
                )


def _validate_experts(config: DecoderConfig, tp: int, pp: int, ep: int) -> None:
    if not (is_int(ep) and ep >= 1):
        raise ValueError(f"expert_parallel_size={ep!r} is not supported: expected a positive integer")
    if ep > 1 and config.num_experts == 0:
        raise ValueError(
            f"expert_parallel_size={ep} needs a mixture-of-experts model: model_type={config.model_type!r} is dense "
            "(num_experts=0); expected expert_parallel_size=1"
        )
    check_expert_layout(tp, pp, 1, ep)
    if config.num_experts == 0:
        return
    if pp > 1 and ep != tp:
        raise ValueError(
            f"expert_parallel_size={ep} with pipeline_parallel_size={pp}: a mixture of experts at PP > 1 needs "
            f"expert_parallel_size = tensor_parallel_size = {tp} (megatron's expert and dense pipeline groups must "
            "coincide, and gyre keeps each expert whole on its rank)"
        )
    if config.num_experts % ep:
        raise ValueError(
            f"num_experts={config.num_experts} is not divisible by expert_parallel_size={ep}: expected a multiple "
            f"of {ep} (each EP rank holds an equal share of the experts)"
        )
    if config.num_experts_per_tok == 1 and config.norm_topk_prob:
        raise ValueError(
            "num_experts_per_tok=1 with norm_topk_prob=True is not supported by megatron's router (its weight "
            "would be 1.0; megatron takes the softmax before a top-1): expected norm_topk_prob=False"
        )
