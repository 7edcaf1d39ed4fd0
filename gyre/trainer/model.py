"""A Megatron-core `GPTModel` with the architecture of a native `DecoderConfig` (dense Llama/Qwen2/Qwen3, and the
Qwen3-MoE / Qwen2-MoE mixtures of experts with expert parallelism: `gyre.trainer.moe`).

Contract
- `build_gpt_model(config)` builds the model for this rank's tensor- and pipeline-parallel coordinate.
  Megatron's `parallel_state` must already be initialized by the caller (`init_model_parallel` does it on an
  existing torch.distributed group, e.g. a one-process gloo group in tests). Layer spec: megatron's local
  modules with gyre's `SDPACoreAttention` in the core-attention slot (memory linear in a row's length, packed
  rows in THD form; `gyre.trainer.attention`); TransformerEngine's when `transformer_engine` imports and CUDA is
  present (`layer_spec="auto"`).
- `model.final_hidden(ids, positions, packed_seq_params=)`: the forward up to the final norm, `[S, 1, hidden]`
  (any pipeline stage); `model.output_logits(h_NC)`: the vocab-parallel logits `[N, V / tp]` of some of them.
  `gyre.trainer.logprobs` takes log-probs through these a chunk at a time instead of the model's full logits.
- `recompute` (`RECOMPUTE`): none, selective (megatron recomputes the core attention in the backward) or full
  (every layer's activations recomputed: megatron's "full" granularity, uniform, one layer per checkpoint).
- Megatron's groups agree with gyre's (docs/distributed.md, Megatron's groups): every rank calls
  `build_process_groups_and_model_parallel(layout, tensor_parallel_size=, pipeline_parallel_size=)` once, which
  checks `cell_size == TP x PP` and the world (one ValueError on every rank, before any group exists), creates
  gyre's groups, then Megatron's with the rank order TP, PP, DP: each cell is one TP x PP replica in the same
  rank order (in-cell coordinate = pp_rank * TP + tp_rank), Megatron's DP group is the coordinate's K-cell
  prefix group (unused: gradients are summed over gyre's prefix groups). Megatron's groups cover the cell ranks
  only; a rollout-pool rank makes the same `new_group` calls but holds no Megatron group.
- Mapping of `DecoderConfig` fields: RMSNorm (`rms_norm_eps`), SwiGLU (`gated_linear_unit`, SiLU), RoPE with
  `rope_theta`; `rope_scaling` linear -> `seq_len_interpolation_factor`, llama3 -> megatron's `rope_scaling`
  (only with megatron's fixed low/high frequency factors 1/4 and original length 8192), yarn -> gyre's own
  frequencies (`gyre.models.decoder.rope_inv_freq`) with its attention factor squared in `softmax_scale`, GQA
  (`num_query_groups`), `qk_norm` -> `qk_layernorm`, `attention_qkv_bias` -> `add_qkv_bias`,
  `tie_word_embeddings` -> `share_embeddings_and_output_weights`. Biases on o_proj or the MLP are rejected.
- `validate_layout(config, tp, pp, ep)` raises a `ValueError` naming field, got and expected before anything is
  built: query and KV heads divisible by TP, vocab divisible by TP (megatron splits the vocabulary evenly;
  gyre does not pad it), layers divisible by PP; with expert parallelism (EP > 1) a model with experts, their
  number divisible by EP, and EP folding over the cell's ranks (`gyre.config.trainer.check_expert_layout`); a
  model with experts at PP > 1 needs EP = TP.
- Expert parallelism (`expert_parallel_size`, EP): a cell is TP x PP x R ranks, R = max(1, EP / TP) copies of the
  dense model (EP divides TP, or TP divides EP; at PP > 1, EP = TP): every rank of a cell sees the same tokens,
  and megatron's EP groups are blocks of EP consecutive ranks of a pipeline stage (its order puts EP right after
  TP), inside the cell. With R > 1 the R copies of each dense tensor are averaged after each step over the
  cell's replica group (`dense_replica_group`), so they stay identical.
- RoPE angles come from the caller's `position_ids` (megatron's own GPTModel uses 0..S-1 and ignores them), so a
  packed row whose positions restart at every sub-row rotates each sub-row exactly as if it ran alone.
- fp32 on CPU (`use_cpu_initialization`); fusions off (they need CUDA or torch.compile). Importing this module
  installs megatron's CPU patches (`gyre.trainer.cpu_patch`) on a CPU-only torch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_layer import MoELayer

from gyre.config.checks import is_int
from gyre.config.trainer import check_expert_layout, dense_replicas
from gyre.distributed.groups import ProcessGroups, build_process_groups
from gyre.distributed.layout import Layout
from gyre.models.decoder import rope_inv_freq
from gyre.models.decoder_config import DecoderConfig
from gyre.trainer.attention import SDPACoreAttention
from gyre.trainer.cpu_patch import apply_cpu_patches
from gyre.trainer.layout import validate_layout
from gyre.trainer.moe import TokenSplitMoELayer, moe_overrides

apply_cpu_patches()  # before megatron runs anything (CPU-only torch; no-op with CUDA)


def transformer_config(
    config: DecoderConfig,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    expert_parallel_size: int = 1,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> TransformerConfig:
    """Megatron's `TransformerConfig` for `config` (validated first); `overrides` go to TransformerConfig."""
    validate_layout(config, tensor_parallel_size, pipeline_parallel_size, expert_parallel_size)
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
        "expert_model_parallel_size": expert_parallel_size,
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
    attention_scaling = config.rope_scaling.attention_scaling()
    if attention_scaling != 1.0:
        # YaRN multiplies cos and sin by s, so every score q.k by s^2: megatron's GPT attention applies no such factor
        # (only its MLA reads one), so it goes into the softmax scale instead (docs/training.md, Long rows).
        kwargs["softmax_scale"] = attention_scaling**2 / math.sqrt(config.head_dim)
    kwargs.update(moe_overrides(config))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


RECOMPUTE = ("none", "selective", "full")


def recompute_overrides(recompute: str) -> dict[str, Any]:
    """Megatron's `TransformerConfig` fields for activation recompute `recompute` (one of `RECOMPUTE`)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not supported: expected one of {', '.join(RECOMPUTE)}")
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    return {}


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
    0..S-1: positions restart per packed row. `position_ids` is `[B, S]`; every pipeline stage needs it. Under
    THD packing megatron reads this table by token offset (one entry per packed token), so each row still
    rotates from 0.

    `final_hidden` and `output_logits` split the forward at the output layer (module docstring)."""

    _hidden_only = False

    def final_hidden(self, input_ids, position_ids, *, packed_seq_params=None, attention_mask=None) -> torch.Tensor:
        """`[S, 1, hidden]`: the decoder's output, after the final norm on the last pipeline stage (what the output
        layer would read), the activation to send on elsewhere."""
        self._hidden_only = True
        try:
            return self(input_ids, position_ids, attention_mask, packed_seq_params=packed_seq_params)
        finally:
            self._hidden_only = False

    def output_logits(self, hidden_NC: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel logits `[N, V / tp]` of final hidden states `[N, hidden]` (last pipeline stage)."""
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits_N1V, _ = self.output_layer(hidden_NC[:, None], weight=weight)
        return logits_N1V[:, 0]

    def _postprocess(self, hidden_states, *args, **kwargs):
        if self._hidden_only:
            return hidden_states
        return super()._postprocess(hidden_states, *args, **kwargs)

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


def layer_specs(config: DecoderConfig, megatron_config: TransformerConfig, transformer_engine: bool):
    """The decoder's layer spec: megatron's local modules with gyre's `SDPACoreAttention` (or TransformerEngine's);
    with experts, one spec per layer (`moe_layer_freq`), megatron's `MoELayer` at the MoE layers (`build_gpt_model`
    makes them gyre's `TokenSplitMoELayer`)."""
    if config.num_experts == 0:
        if transformer_engine:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_norm)
        spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_norm, normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
        return spec
    block = get_gpt_decoder_block_spec(
        megatron_config, use_transformer_engine=transformer_engine, normalization="RMSNorm"
    )
    for spec in block.layer_specs:  # this stage's layers; a dense and a MoE spec object, shared between layers
        if not transformer_engine:
            spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return block


def build_gpt_model(
    config: DecoderConfig,
    *,
    dtype: torch.dtype = torch.float32,
    layer_spec: str = "auto",
    recompute: str = "none",
    **config_overrides: Any,
) -> PositionIdGPTModel:
    """The Megatron model of `config` for this rank (TP shard, PP stage). Weights are megatron's random init: load
    real ones with `gyre.trainer.convert.load_hf_state_dict`. `recompute`: `RECOMPUTE`. In eval mode, but in training
    mode with recompute: megatron recomputes only there (dropout is 0 either way, so nothing else changes)."""
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "megatron parallel_state is not initialized: call gyre.trainer.model.init_model_parallel(...) (or "
            "megatron.core.parallel_state.initialize_model_parallel) after torch.distributed.init_process_group"
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    megatron_config = transformer_config(
        config,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        expert_parallel_size=ep,
        dtype=dtype,
        **{**recompute_overrides(recompute), **config_overrides},
    )
    spec = layer_specs(config, megatron_config, use_transformer_engine(layer_spec))
    scaling = config.rope_scaling
    model = PositionIdGPTModel(
        config=megatron_config,
        transformer_layer_spec=spec,
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,  # logits stay vocab-parallel; gyre.trainer.logprobs uses vocab-parallel CE
        share_embeddings_and_output_weights=config.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=config.rope_theta,
        rope_scaling=scaling.rope_type == "llama3",
        rope_scaling_factor=scaling.factor if scaling.rope_type == "llama3" else 8.0,
        seq_len_interpolation_factor=scaling.factor if scaling.rope_type == "linear" else None,
    )
    if scaling.rope_type == "yarn" and getattr(model, "rotary_pos_emb", None) is not None:
        # Megatron's GPT RoPE has no YaRN frequencies (its yarn embedding belongs to MLA): gyre's own, which the
        # engine and the native trainer use too (`_preprocess` rotates by them).
        rope = model.rotary_pos_emb
        rope.inv_freq = rope_inv_freq(config, device=rope.inv_freq.device)
    model.decoder_config = config  # routing replay checks routes against it (gyre.trainer.logprobs)
    for module in model.modules():
        # Megatron's TransformerLayer hands its process groups only to the MoE classes it knows by identity, so the
        # layers are built as MoELayer and become gyre's subclass here (methods only: no state of its own).
        if type(module) is MoELayer:
            module.__class__ = TokenSplitMoELayer
    if dtype != torch.float32:
        # The local spec's norms (torch's RMSNorm) are built in fp32 whatever params_dtype says; megatron's
        # Float16Module casts the whole module. Parameters only: RoPE's frequencies stay fp32.
        for param in model.parameters():
            if param.dtype != dtype:
                param.data = param.data.to(dtype)
    return model.train() if recompute != "none" else model.eval()


# Megatron's rank order, fastest-varying first: TP, then PP, then DP, so one model replica (TP x PP) is a block of
# consecutive ranks, as gyre's cells are. Megatron's default "tp-cp-ep-dp-pp" puts DP inside PP, so at PP > 1 and
# more than one cell its pipeline stages would span cells (docs/distributed.md, Megatron's groups).
MEGATRON_RANK_ORDER = "tp-cp-ep-pp-dp"


def cell_ranks(tensor_parallel_size: int, pipeline_parallel_size: int, expert_parallel_size: int = 1) -> int:
    """The ranks of one cell: TP x PP x `dense_replicas(TP, EP)` (module docstring)."""
    return tensor_parallel_size * pipeline_parallel_size * dense_replicas(tensor_parallel_size, expert_parallel_size)


def check_megatron_cells(
    layout: Layout, tensor_parallel_size: int, pipeline_parallel_size: int, expert_parallel_size: int = 1
) -> None:
    """Raise ValueError (field, got, expected) unless Megatron's TP x PP (x EP) layout fills `layout`'s cells
    exactly and `layout` fits the initialized world. Pure arithmetic on arguments every rank holds alike: every
    rank raises the same error, before any group exists."""
    tp, pp, ep = tensor_parallel_size, pipeline_parallel_size, expert_parallel_size
    _check_parallel_sizes(tp, pp, ep)
    check_expert_layout(tp, pp, 1, ep)
    expected = cell_ranks(tp, pp, ep)
    if layout.cell_size != expected:
        replicas = dense_replicas(tp, ep)
        how = f"{tp} * {pp}" + (f" * (expert_parallel_size {ep} / {tp})" if replicas > 1 else "")
        raise ValueError(
            f"cell_size: got {layout.cell_size}, expected tensor_parallel_size * pipeline_parallel_size"
            f"{' * dense replicas' if replicas > 1 else ''} = {how} = {expected} (a cell is one Megatron model "
            "replica)"
        )
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group('gloo', ...) first")
    if layout.world_size != dist.get_world_size():
        raise ValueError(
            f"world_size: the layout has {layout.world_size}, the process group has {dist.get_world_size()}"
        )


def _check_parallel_sizes(
    tensor_parallel_size: int, pipeline_parallel_size: int, expert_parallel_size: int = 1
) -> None:
    for name, value in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("pipeline_parallel_size", pipeline_parallel_size),
        ("expert_parallel_size", expert_parallel_size),
    ):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name}: got {value!r}, expected a positive integer")


_dense_replica_group: dist.ProcessGroup | None = None  # this rank's copies of the dense model in its cell (R > 1)


def dense_replica_group() -> dist.ProcessGroup | None:
    """The ranks of this rank's cell that hold the same dense shard (same TP rank: the cell's R = EP / TP copies of
    the dense model), or None when R = 1 or on a rank outside the cells. Set by `init_model_parallel`."""
    return _dense_replica_group


def _build_dense_replica_groups(layout: Layout, tensor_parallel_size: int, replicas: int) -> None:
    """Every rank creates every cell's replica groups, in one order (cells, then TP ranks); each keeps its own.
    Megatron's in-cell rank of TP rank t, copy c is c * TP + t (its order puts DP right after TP at PP = 1)."""
    global _dense_replica_group
    _dense_replica_group = None
    if replicas == 1:
        return
    rank = dist.get_rank()
    for cell in range(layout.num_cells):
        base = cell * layout.cell_size
        for t in range(tensor_parallel_size):
            ranks = [base + c * tensor_parallel_size + t for c in range(replicas)]
            group = dist.new_group(ranks)
            if rank in ranks:
                _dense_replica_group = group


@contextlib.contextmanager
def _megatron_world_of(num_ranks: int) -> Iterator[None]:
    """Megatron reads the world size once, from `torch.distributed.get_world_size()`, and lays its groups over
    ranks 0..world-1: within this block that call (without a group) answers `num_ranks`, so Megatron's groups
    cover the cells and leave the rollout pool after them out. torch's own `new_group` reads the default group's
    size itself, so every group is still created over the real world. Start-up only: the swap is process-wide
    and no other thread may ask for the world size meanwhile."""
    real_get_world_size = dist.get_world_size

    def cell_ranks_world_size(group: dist.ProcessGroup | None = None) -> int:
        return num_ranks if group is None else real_get_world_size(group)

    dist.get_world_size = cell_ranks_world_size
    try:
        yield
    finally:
        dist.get_world_size = real_get_world_size


def init_model_parallel(
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    seed: int = 0,
    *,
    layout: Layout | None = None,
    expert_parallel_size: int = 1,
) -> None:
    """Initialize megatron's `parallel_state` (each cell of `layout` one TP x PP replica, its experts over EP ranks)
    and its RNG tracker on the already-initialized default torch.distributed group (gloo on CPU). Re-initializes if
    a layout was set up before (tests run several layouts in one process).

    `layout` None: the whole world is cells of `cell_ranks(TP, PP, EP)`. With a rollout pool, every rank (pool
    ranks too) makes Megatron's `new_group` calls, in the same order, but the groups cover the cell ranks only: a
    pool rank holds no Megatron group and gets no RNG seed (`build_gpt_model` there raises). In the SPMD runtime
    call `build_process_groups_and_model_parallel`, which also builds gyre's groups first (docs/distributed.md)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group('gloo', ...) first")
    tp, pp, ep = tensor_parallel_size, pipeline_parallel_size, expert_parallel_size
    if layout is None:
        _check_parallel_sizes(tp, pp, ep)
        check_expert_layout(tp, pp, 1, ep)
        world_size, cell_size = dist.get_world_size(), cell_ranks(tp, pp, ep)
        if world_size % cell_size:
            raise ValueError(
                f"the cell's ranks (tensor_parallel_size {tp}, pipeline_parallel_size {pp}, expert_parallel_size "
                f"{ep}): got {cell_size}, expected a divisor of world_size {world_size}"
            )
        layout = Layout(world_size=world_size, num_cells=world_size // cell_size, cell_size=cell_size)
    check_megatron_cells(layout, tp, pp, ep)
    parallel_state.destroy_model_parallel()  # idempotent; a pool rank holds only megatron's memory buffer
    with _megatron_world_of(layout.num_cell_ranks):
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            # Experts are whole on their rank (1); at PP > 1 megatron needs expert TP x EP = TP under this order,
            # which is 1 for a model with experts (validate_layout: EP = TP there) and TP for a dense one, as before.
            expert_tensor_parallel_size=1 if pp == 1 else tp // ep,
            order=MEGATRON_RANK_ORDER,
        )
    _build_dense_replica_groups(layout, tp, dense_replicas(tp, ep))
    if layout.cell_of(dist.get_rank()) is not None:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_process_groups_and_model_parallel(
    layout: Layout,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    expert_parallel_size: int = 1,
    seed: int = 0,
    backend: str = "gloo",
) -> ProcessGroups:
    """Every rank of the job calls this once, after `init_process_group`: it checks the layout (one ValueError on
    every rank, before any group exists), creates gyre's groups (`build_process_groups`), then Megatron's
    (`init_model_parallel`), in that order (docs/distributed.md, Megatron's groups). Megatron's TP x PP groups
    are then exactly gyre's cells, in the same rank order."""
    check_megatron_cells(layout, tensor_parallel_size, pipeline_parallel_size, expert_parallel_size)
    groups = build_process_groups(layout, backend=backend)
    init_model_parallel(
        tensor_parallel_size, pipeline_parallel_size, seed, layout=layout, expert_parallel_size=expert_parallel_size
    )
    return groups
