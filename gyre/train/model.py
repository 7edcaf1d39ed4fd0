"""A Megatron-core `GPTModel` with the architecture of a native `DecoderConfig` (dense Llama/Qwen2/Qwen3).

Contract
- `build_gpt_model(config)` builds the model for this rank's tensor- and pipeline-parallel coordinate.
  Megatron's `parallel_state` must already be initialized by the caller (`init_model_parallel` does it on an
  existing torch.distributed group, e.g. a one-process gloo group in tests). Layer spec: megatron's local
  modules; TransformerEngine's when `transformer_engine` imports and CUDA is present (`layer_spec="auto"`).
- Mapping of `DecoderConfig` fields: RMSNorm (`rms_norm_eps`), SwiGLU (`gated_linear_unit`, SiLU), RoPE with
  `rope_theta`; `rope_scaling` linear -> `seq_len_interpolation_factor`, llama3 -> megatron's `rope_scaling`
  (only with megatron's fixed low/high frequency factors 1/4 and original length 8192), GQA
  (`num_query_groups`), `qk_norm` -> `qk_layernorm`, `attention_qkv_bias` -> `add_qkv_bias`,
  `tie_word_embeddings` -> `share_embeddings_and_output_weights`. Biases on o_proj or the MLP are rejected.
- `validate_layout(config, tp, pp)` raises a `ValueError` naming field, got and expected before anything is
  built: query and KV heads divisible by TP, vocab divisible by TP (megatron splits the vocabulary evenly;
  gyre does not pad it), layers divisible by PP.
- RoPE angles come from the caller's `position_ids` (megatron's own GPTModel uses 0..S-1 and ignores them), so a
  packed row whose positions restart at every sub-row rotates each sub-row exactly as if it ran alone.
- fp32 on CPU (`use_cpu_initialization`); fusions off (they need CUDA or torch.compile). Importing this module
  installs megatron's CPU patches (`gyre.train.cpu_patch`) on a CPU-only torch.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from gyre.engine.hf_config import DecoderConfig
from gyre.train.cpu_patch import apply_cpu_patches

apply_cpu_patches()  # before megatron runs anything (CPU-only torch; no-op with CUDA)

# megatron's llama3 RoPE (`RotaryEmbedding._apply_scaling`) fixes these; other values compute other angles.
MEGATRON_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def validate_layout(config: DecoderConfig, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> None:
    """Raise ValueError (field, got, expected) if `config` cannot be built at this TP x PP or by megatron at all."""
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
        raise ValueError("attention_out_bias=True is not supported by gyre.train: expected False (no o_proj bias)")
    if config.mlp_bias:
        raise ValueError("mlp_bias=True is not supported by gyre.train: expected False (no MLP biases)")
    scaling = config.rope_scaling
    if scaling.rope_type == "llama3":
        for name, fixed in MEGATRON_LLAMA3_FIXED.items():
            if getattr(scaling, name) != fixed:
                raise ValueError(
                    f"rope_scaling.{name}={getattr(scaling, name)!r} is not supported by megatron-core's llama3 "
                    f"RoPE: expected {fixed}"
                )


def transformer_config(
    config: DecoderConfig,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> TransformerConfig:
    """Megatron's `TransformerConfig` for `config` (validated first); `overrides` go to TransformerConfig."""
    validate_layout(config, tensor_parallel_size, pipeline_parallel_size)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype={dtype} is not supported: expected torch.float32, torch.bfloat16 or torch.float16")
    on_cpu = not torch.cuda.is_available()
    kwargs: dict[str, Any] = {
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "ffn_hidden_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_query_groups": config.num_key_value_heads,
        "kv_channels": config.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": config.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": config.attention_qkv_bias,
        "qk_layernorm": config.qk_norm,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tensor_model_parallel_size": tensor_parallel_size,
        "pipeline_model_parallel_size": pipeline_parallel_size,
        "sequence_parallel": False,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,  # dtype of the activations sent between stages (megatron requires it at PP > 1)
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        "use_cpu_initialization": on_cpu,
        # Fusions need CUDA kernels or torch.compile (docs/training.md): off.
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "gradient_accumulation_fusion": False,
        "apply_rope_fusion": False,
    }
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def use_transformer_engine(layer_spec: str = "auto") -> bool:
    """Whether `build_gpt_model` uses TransformerEngine's layer spec: "te", "local", or "auto" (TE iff it
    imports and CUDA is available)."""
    if layer_spec not in ("auto", "local", "te"):
        raise ValueError(f"layer_spec={layer_spec!r} is not supported: expected 'auto', 'local' or 'te'")
    if layer_spec == "auto":
        return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
    return layer_spec == "te"


class PositionIdGPTModel(GPTModel):
    """`GPTModel` whose RoPE angles are `position_ids * inv_freq` (megatron's inv_freq and scaling) instead of
    0..S-1: positions restart per packed row. `position_ids` is `[B, S]`; every pipeline stage needs it."""

    def _preprocess(self, input_ids, position_ids, *args, **kwargs):
        out = super()._preprocess(input_ids, position_ids, *args, **kwargs)
        if out[1] is None or position_ids is None:
            return out
        rope = self.rotary_pos_emb
        positions_BS = position_ids.to(device=rope.inv_freq.device, dtype=rope.inv_freq.dtype)
        if rope.seq_len_interpolation_factor is not None:
            positions_BS = positions_BS * (1 / rope.seq_len_interpolation_factor)  # megatron's order of ops
        freqs_BSF = positions_BS[..., None] * rope.inv_freq
        emb_SB1D = torch.cat((freqs_BSF, freqs_BSF), dim=-1).transpose(0, 1)[:, :, None, :]
        return (out[0], emb_SB1D, *out[2:])


def build_gpt_model(
    config: DecoderConfig,
    *,
    dtype: torch.dtype = torch.float32,
    layer_spec: str = "auto",
    **config_overrides: Any,
) -> PositionIdGPTModel:
    """The Megatron model of `config` for this rank (TP shard, PP stage), in eval mode. Weights are megatron's
    random init: load real ones with `gyre.train.convert.load_hf_state_dict`."""
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "megatron parallel_state is not initialized: call gyre.train.model.init_model_parallel(...) (or "
            "megatron.core.parallel_state.initialize_model_parallel) after torch.distributed.init_process_group"
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    megatron_config = transformer_config(
        config, tensor_parallel_size=tp, pipeline_parallel_size=pp, dtype=dtype, **config_overrides
    )
    if use_transformer_engine(layer_spec):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_norm)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_norm, normalization="RMSNorm")
    scaling = config.rope_scaling
    model = PositionIdGPTModel(
        config=megatron_config,
        transformer_layer_spec=spec,
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,  # logits stay vocab-parallel; gyre.train.logprobs uses vocab-parallel CE
        share_embeddings_and_output_weights=config.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=config.rope_theta,
        rope_scaling=scaling.rope_type == "llama3",
        rope_scaling_factor=scaling.factor if scaling.rope_type == "llama3" else 8.0,
        seq_len_interpolation_factor=scaling.factor if scaling.rope_type == "linear" else None,
    )
    return model.eval()


def init_model_parallel(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, seed: int = 0) -> None:
    """Initialize megatron's `parallel_state` (TP x PP; the rest of the world is data parallel) and its RNG
    tracker on the already-initialized default torch.distributed group (gloo on CPU). Re-initializes if a
    layout was set up before (tests run several layouts in one process)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group('gloo', ...) first")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel_size,
        pipeline_model_parallel_size=pipeline_parallel_size,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
