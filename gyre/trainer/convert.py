"""HF-named state dicts (as `gyre.models.hf_weights.read_state_dict` reads them) <-> Megatron `GPTModel` state dicts.

A hand-written dense mapping (docs/training.md, "Weight mapping"); per layer `i` (HF) of PP stage `s`, local
index `i - s * L / pp` (Megatron numbers layers per stage):

| HF | Megatron | TP split |
|---|---|---|
| `model.embed_tokens.weight` | `embedding.word_embeddings.weight` (first stage) | rows (vocab) |
| `model.layers.i.input_layernorm.weight` | `decoder.layers.j.input_layernorm.weight` | replicated |
| `model.layers.i.self_attn.{q,k,v}_proj.{weight,bias}` | `decoder.layers.j.self_attention.linear_qkv.*` | KV groups |
| `model.layers.i.self_attn.{q,k}_norm.weight` | `decoder.layers.j.self_attention.{q,k}_layernorm.weight` | replicated |
| `model.layers.i.self_attn.o_proj.weight` | `decoder.layers.j.self_attention.linear_proj.weight` | columns |
| `model.layers.i.post_attention_layernorm.weight` | `decoder.layers.j.pre_mlp_layernorm.weight` | replicated |
| `model.layers.i.mlp.{gate,up}_proj.weight` | `decoder.layers.j.mlp.linear_fc1.weight` | gate and up each by rows |
| `model.layers.i.mlp.down_proj.weight` | `decoder.layers.j.mlp.linear_fc2.weight` | columns |
| `model.norm.weight` | `decoder.final_layernorm.weight` (last stage) | replicated |
| `lm_head.weight` (embedding if tied) | `output_layer.weight` (last stage; absent if tied at PP=1) | rows (vocab) |

`linear_qkv` is interleaved per KV group: for each group, the rows of its query heads, then its key head, then its
value head (plain concatenation computes wrong attention); TP rank r holds groups [r K/t, (r+1) K/t).
`linear_fc1` of rank r is [gate shard r; up shard r].

Mixture of experts, a layer i with `config.is_moe_layer(i)` (docs/moe.md): megatron's `MoELayer` with `SequentialMLP`
experts, expert tensor parallelism 1 (an expert is whole on its rank), EP rank e holding experts
[e E/ep, (e+1) E/ep) as its local experts 0 .. E/ep - 1:

Per MoE layer, HF `model.layers.i.mlp.` -> Megatron `decoder.layers.j.mlp.`:

| HF | Megatron | split |
|---|---|---|
| `gate.weight` `[E, H]` | `router.weight` | replicated |
| `experts.{e E/ep + k}.{gate,up}_proj.weight` | `experts.local_experts.k.linear_fc1.weight` = [gate; up] | EP rank e |
| `experts.{e E/ep + k}.down_proj.weight` | `experts.local_experts.k.linear_fc2.weight` | EP rank e |
| `shared_expert.{gate,up}_proj.weight` (qwen2_moe) | `shared_experts.linear_fc1.weight` | gate, up by rows (TP) |
| `shared_expert.down_proj.weight` | `shared_experts.linear_fc2.weight` | columns (TP) |
| `shared_expert_gate.weight` `[1, H]` | `shared_experts.gate_weight` | replicated |

A cell's in-stage rank s holds the dense shard of TP rank s mod TP and the experts of EP rank s mod EP
(`gyre.trainer.model`: EP folds over the TP ranks, or the cell holds EP / TP copies of them).

Contract: `hf_to_megatron` and `load_hf_state_dict` are strict. Missing, unexpected or mis-shaped HF tensors, and a
converted dict that does not match the model's parameters, raise one ValueError listing them before anything is
loaded. Tolerated, as in `gyre.models.hf_weights.load_pretrained`: `*.rotary_emb.inv_freq`, and a tied checkpoint's
`lm_head.weight` equal to the embedding. `megatron_to_hf` inverts the mapping from every TP shard of every stage;
the round trip returns bit-identical tensors (only copies and concatenations, no arithmetic).

Under TransformerEngine's layer spec the two per-layer norms live in the fused linears
(`self_attention.linear_qkv.layer_norm_weight`, `mlp.linear_fc1.layer_norm_weight`): `load_hf_state_dict` and
`gather_hf_state_dict` rename them (`to_model_names`, `to_local_names`; not run on these CPU machines).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from gyre.config.trainer import dense_replicas
from gyre.models.decoder_config import DecoderConfig
from gyre.models.hf_weights import hf_shapes, state_mismatch, without_tolerated
from gyre.trainer.cpu_patch import apply_cpu_patches
from gyre.trainer.model import validate_layout
from gyre.trainer.moe import is_expert_param

apply_cpu_patches()  # before megatron runs anything (CPU-only torch; no-op with CUDA)

EXTRA_STATE = "_extra_state"  # megatron/TE serialization slots, not weights


def check_hf_state_dict(hf_state: Mapping[str, torch.Tensor], config: DecoderConfig) -> dict[str, torch.Tensor]:
    """`hf_state` without tolerated extras; ValueError listing missing, unexpected and mis-shaped tensors."""
    state = without_tolerated(dict(hf_state), config, where="HF state dict")
    mismatch = state_mismatch(state, hf_shapes(config))
    if mismatch:
        raise ValueError(f"HF state dict does not match the config (model_type={config.model_type!r}): {mismatch}")
    return state


def _stage_layers(config: DecoderConfig, pp_rank: int, pp_size: int) -> range:
    per_stage = config.num_hidden_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def _interleave_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, config: DecoderConfig
) -> torch.Tensor:
    """[groups, (G + 2) * D, ...]: per KV group its G query heads' rows, its key rows, its value rows (`q`, `k`, `v`
    hold `groups` consecutive KV groups: all of them, or one TP rank's)."""
    D = config.head_dim
    G = config.num_attention_heads // config.num_key_value_heads
    rest = q.shape[1:]
    return torch.cat((q.reshape(groups, G * D, *rest), k.reshape(groups, D, *rest), v.reshape(groups, D, *rest)), 1)


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """`[start, stop)` of `torch.chunk(x, parts)[index]` along a dimension of `size`."""
    step = -(-size // parts)
    return min(index * step, size), min((index + 1) * step, size)


class HFSource:
    """Where `megatron_tensors` reads HF tensors: whole (`full`) or one TP rank's share by rows or by columns."""

    def full(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, name: str, parts: int, index: int) -> torch.Tensor:
        raise NotImplementedError

    def cols(self, name: str, parts: int, index: int) -> torch.Tensor:
        raise NotImplementedError


class StateDictSource(HFSource):
    """An HF state dict in memory (checked by `check_hf_state_dict`); every tensor returned is a copy."""

    def __init__(self, state: Mapping[str, torch.Tensor]):
        self.state = state

    def full(self, name: str) -> torch.Tensor:
        return self.state[name].clone()

    def rows(self, name: str, parts: int, index: int) -> torch.Tensor:
        return self.state[name].chunk(parts, dim=0)[index].clone()

    def cols(self, name: str, parts: int, index: int) -> torch.Tensor:
        return self.state[name].chunk(parts, dim=1)[index].clone()


def _moe_tensors(
    source: HFSource,
    config: DecoderConfig,
    src: str,
    dst: str,
    *,
    tp_rank: int,
    tp_size: int,
    ep_rank: int,
    ep_size: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """One MoE layer's router, this EP rank's experts and the shared expert's TP share (module docstring)."""
    yield dst + "mlp.router.weight", source.full(src + "mlp.gate.weight")
    local = config.num_experts // ep_size
    for k in range(local):
        expert = f"{src}mlp.experts.{ep_rank * local + k}."
        gate, up = source.full(expert + "gate_proj.weight"), source.full(expert + "up_proj.weight")
        yield f"{dst}mlp.experts.local_experts.{k}.linear_fc1.weight", torch.cat((gate, up))
        yield f"{dst}mlp.experts.local_experts.{k}.linear_fc2.weight", source.full(expert + "down_proj.weight")
    if config.shared_expert_intermediate_size:
        t, r, shared = tp_size, tp_rank, src + "mlp.shared_expert."
        gate, up = source.rows(shared + "gate_proj.weight", t, r), source.rows(shared + "up_proj.weight", t, r)
        yield dst + "mlp.shared_experts.linear_fc1.weight", torch.cat((gate, up))
        yield dst + "mlp.shared_experts.linear_fc2.weight", source.cols(shared + "down_proj.weight", t, r)
        yield dst + "mlp.shared_experts.gate_weight", source.full(src + "mlp.shared_expert_gate.weight")


def megatron_tensors(
    source: HFSource,
    config: DecoderConfig,
    *,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Megatron name, tensor) of TP rank `tp_rank`, PP stage `pp_rank` and EP rank `ep_rank`, one at a time, read
    from `source` (the module docstring's mapping). A TP rank's share of `linear_qkv` is its own KV groups: the
    interleaving of its rows of q, k and v, equal to rows of the whole interleaving."""
    t, r = tp_size, tp_rank
    groups = config.num_key_value_heads // t
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    if first:
        yield "embedding.word_embeddings.weight", source.rows("model.embed_tokens.weight", t, r)
    for j, i in enumerate(_stage_layers(config, pp_rank, pp_size)):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{j}."
        attn = src + "self_attn."
        yield dst + "input_layernorm.weight", source.full(src + "input_layernorm.weight")
        yield dst + "pre_mlp_layernorm.weight", source.full(src + "post_attention_layernorm.weight")
        for suffix in ("weight", "bias") if config.attention_qkv_bias else ("weight",):
            q, k, v = (source.rows(f"{attn}{p}_proj.{suffix}", t, r) for p in "qkv")
            yield f"{dst}self_attention.linear_qkv.{suffix}", _interleave_qkv(q, k, v, groups, config).flatten(0, 1)
        if config.qk_norm:
            yield dst + "self_attention.q_layernorm.weight", source.full(attn + "q_norm.weight")
            yield dst + "self_attention.k_layernorm.weight", source.full(attn + "k_norm.weight")
        yield dst + "self_attention.linear_proj.weight", source.cols(attn + "o_proj.weight", t, r)
        if config.is_moe_layer(i):
            yield from _moe_tensors(source, config, src, dst, tp_rank=r, tp_size=t, ep_rank=ep_rank, ep_size=ep_size)
            continue
        gate, up = source.rows(src + "mlp.gate_proj.weight", t, r), source.rows(src + "mlp.up_proj.weight", t, r)
        yield dst + "mlp.linear_fc1.weight", torch.cat((gate, up))
        yield dst + "mlp.linear_fc2.weight", source.cols(src + "mlp.down_proj.weight", t, r)
    if last:
        yield "decoder.final_layernorm.weight", source.full("model.norm.weight")
        if not config.tie_word_embeddings:
            yield "output_layer.weight", source.rows("lm_head.weight", t, r)
        elif pp_size > 1:  # the last stage keeps its own copy of the tied embedding
            yield "output_layer.weight", source.rows("model.embed_tokens.weight", t, r)


def check_ranks(
    config: DecoderConfig,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> None:
    validate_layout(config, tp_size, pp_size, ep_size)
    if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size and 0 <= ep_rank < ep_size):
        raise ValueError(
            f"tp_rank={tp_rank}, pp_rank={pp_rank}, ep_rank={ep_rank}: expected 0 <= rank < size ({tp_size}, "
            f"{pp_size}, {ep_size})"
        )


def hf_to_megatron(
    hf_state: Mapping[str, torch.Tensor],
    config: DecoderConfig,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> dict[str, torch.Tensor]:
    """The Megatron state dict of TP rank `tp_rank`, PP stage `pp_rank` and EP rank `ep_rank` (strict check of
    `hf_state` first)."""
    ranks = {"tp_rank": tp_rank, "tp_size": tp_size, "pp_rank": pp_rank, "pp_size": pp_size}
    ranks |= {"ep_rank": ep_rank, "ep_size": ep_size}
    check_ranks(config, **ranks)
    source = StateDictSource(check_hf_state_dict(hf_state, config))
    return dict(megatron_tensors(source, config, **ranks))


def _moe_to_hf(
    hf: dict[str, torch.Tensor],
    stage: Sequence[Mapping[str, torch.Tensor]],
    config: DecoderConfig,
    src: str,
    dst: str,
    *,
    tp_size: int,
    ep_size: int,
) -> None:
    """One MoE layer's HF tensors from a stage's shards (in-stage rank s: EP rank s mod EP; module docstring)."""
    hf[dst + "mlp.gate.weight"] = stage[0][src + "mlp.router.weight"].clone()
    local = config.num_experts // ep_size
    for e in range(ep_size):
        for k in range(local):
            expert, fc = f"{dst}mlp.experts.{e * local + k}.", f"{src}mlp.experts.local_experts.{k}."
            gate, up = stage[e][fc + "linear_fc1.weight"].chunk(2, dim=0)
            hf[expert + "gate_proj.weight"], hf[expert + "up_proj.weight"] = gate.clone(), up.clone()
            hf[expert + "down_proj.weight"] = stage[e][fc + "linear_fc2.weight"].clone()
    if config.shared_expert_intermediate_size:
        shared, fc = dst + "mlp.shared_expert.", src + "mlp.shared_experts."
        gate_up = [stage[t][fc + "linear_fc1.weight"].chunk(2, dim=0) for t in range(tp_size)]
        hf[shared + "gate_proj.weight"] = torch.cat([g for g, _ in gate_up])
        hf[shared + "up_proj.weight"] = torch.cat([u for _, u in gate_up])
        hf[shared + "down_proj.weight"] = torch.cat([stage[t][fc + "linear_fc2.weight"] for t in range(tp_size)], 1)
        hf[dst + "mlp.shared_expert_gate.weight"] = stage[0][fc + "gate_weight"].clone()


def megatron_to_hf(
    shards: Sequence[Sequence[Mapping[str, torch.Tensor]]],
    config: DecoderConfig,
    *,
    tensor_parallel_size: int | None = None,
    expert_parallel_size: int = 1,
) -> dict[str, torch.Tensor]:
    """The HF state dict from `shards[pp_rank][s]`, the Megatron state dicts of every stage and in-stage rank s:
    TP rank s mod TP and EP rank s mod EP (module docstring). `tensor_parallel_size` None: every in-stage rank is a
    TP rank (no expert parallelism beyond TP); else the stage has TP x max(1, EP / TP) shards."""
    pp_size = len(shards)
    tp_size = len(shards[0]) if tensor_parallel_size is None else tensor_parallel_size
    ep_size = expert_parallel_size
    per_stage = tp_size * dense_replicas(tp_size, ep_size)
    if any(len(stage) != per_stage for stage in shards):
        raise ValueError(
            f"shards must be [pp][in-stage rank] with TP {tp_size} x max(1, EP {ep_size} / TP) = {per_stage} per "
            f"stage, got {[len(s) for s in shards]}"
        )
    K, D = config.num_key_value_heads, config.head_dim
    G = config.num_attention_heads // K

    def by_rows(stage: Sequence[Mapping[str, torch.Tensor]], name: str) -> torch.Tensor:
        return torch.cat([shard[name] for shard in stage[:tp_size]], dim=0)

    def by_cols(stage: Sequence[Mapping[str, torch.Tensor]], name: str) -> torch.Tensor:
        return torch.cat([shard[name] for shard in stage[:tp_size]], dim=1)

    hf: dict[str, torch.Tensor] = {}
    for s, stage in enumerate(shards):
        if s == 0:
            hf["model.embed_tokens.weight"] = by_rows(stage, "embedding.word_embeddings.weight")
        for j, i in enumerate(_stage_layers(config, s, pp_size)):
            src, dst = f"decoder.layers.{j}.", f"model.layers.{i}."
            attn = dst + "self_attn."
            hf[dst + "input_layernorm.weight"] = stage[0][src + "input_layernorm.weight"].clone()
            hf[dst + "post_attention_layernorm.weight"] = stage[0][src + "pre_mlp_layernorm.weight"].clone()
            for suffix in ("weight", "bias") if config.attention_qkv_bias else ("weight",):
                qkv = by_rows(stage, f"{src}self_attention.linear_qkv.{suffix}")
                q, k, v = qkv.reshape(K, (G + 2) * D, *qkv.shape[1:]).split((G * D, D, D), dim=1)
                hf[f"{attn}q_proj.{suffix}"] = q.flatten(0, 1).clone()
                hf[f"{attn}k_proj.{suffix}"] = k.flatten(0, 1).clone()
                hf[f"{attn}v_proj.{suffix}"] = v.flatten(0, 1).clone()
            if config.qk_norm:
                hf[attn + "q_norm.weight"] = stage[0][src + "self_attention.q_layernorm.weight"].clone()
                hf[attn + "k_norm.weight"] = stage[0][src + "self_attention.k_layernorm.weight"].clone()
            hf[attn + "o_proj.weight"] = by_cols(stage, src + "self_attention.linear_proj.weight")
            if config.is_moe_layer(i):
                _moe_to_hf(hf, stage, config, src, dst, tp_size=tp_size, ep_size=ep_size)
                continue
            gate_up = [shard[src + "mlp.linear_fc1.weight"].chunk(2, dim=0) for shard in stage[:tp_size]]
            hf[dst + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in gate_up])
            hf[dst + "mlp.up_proj.weight"] = torch.cat([u for _, u in gate_up])
            hf[dst + "mlp.down_proj.weight"] = by_cols(stage, src + "mlp.linear_fc2.weight")
        if s == pp_size - 1:
            hf["model.norm.weight"] = stage[0]["decoder.final_layernorm.weight"].clone()
            if not config.tie_word_embeddings:
                hf["lm_head.weight"] = by_rows(stage, "output_layer.weight")
    return hf


# TransformerEngine's layer spec fuses the pre-attention and pre-MLP norms into the following linear layer.
TE_FUSED_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def to_model_names(state: Mapping[str, torch.Tensor], model_names: Collection[str]) -> dict[str, torch.Tensor]:
    """`state` (local-spec names) renamed to a TransformerEngine-spec model's fused norm names where the model has
    them; unchanged for a local-spec model."""
    out = {}
    for name, tensor in state.items():
        for local, fused in TE_FUSED_NORMS.items():
            if name.endswith(local) and name.removesuffix(local) + fused in model_names:
                name = name.removesuffix(local) + fused
        out[name] = tensor
    return out


def to_local_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `to_model_names`: TransformerEngine's fused norm names back to the local spec's."""
    out = {}
    for name, tensor in state.items():
        for local, fused in TE_FUSED_NORMS.items():
            if name.endswith(fused):
                name = name.removesuffix(fused) + local
        out[name] = tensor
    return out


def model_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Weight names and shapes of a Megatron module (its `_extra_state` slots left out)."""
    return {n: tuple(t.shape) for n, t in model.state_dict().items() if not n.endswith(EXTRA_STATE)}


def rank_layout() -> dict[str, int]:
    """This rank's TP, PP and EP ranks and sizes, from megatron's `parallel_state` (`megatron_tensors`' keywords)."""
    return {
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "pp_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "ep_rank": parallel_state.get_expert_model_parallel_rank(),
        "ep_size": parallel_state.get_expert_model_parallel_world_size(),
    }


def load_hf_state_dict(model: torch.nn.Module, hf_state: Mapping[str, torch.Tensor], config: DecoderConfig) -> None:
    """Load HF weights into this rank's Megatron model (its TP shard and PP stage from `parallel_state`).
    Everything is checked first; nothing is copied unless every tensor matches."""
    state = hf_to_megatron(hf_state, config, **rank_layout())
    expected = model_shapes(model)
    state = to_model_names(state, expected)
    mismatch = state_mismatch(state, expected)
    if mismatch:
        raise ValueError(f"converted state dict does not match the Megatron model: {mismatch}")
    result = model.load_state_dict(state, strict=False)
    leftover = [n for n in result.missing_keys if not n.endswith(EXTRA_STATE)]
    assert not leftover and not result.unexpected_keys, (leftover, result.unexpected_keys)


def _gather(tensor: torch.Tensor, group: dist.ProcessGroup, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [tensor.clone()]
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def gather_hf_state_dict(model: torch.nn.Module, config: DecoderConfig) -> dict[str, torch.Tensor]:
    """The full HF state dict, on every rank, from the TP shards, EP shards (routed experts) and PP stages of
    `model` across the model-parallel groups (collective: every TP, EP and PP rank must call it). PP stages travel as
    objects (fine for CPU and tests)."""
    local = {n: t.detach() for n, t in model.state_dict().items() if not n.endswith(EXTRA_STATE)}
    return gather_hf_tensors(local, config)


def gather_hf_tensors(local_state: Mapping[str, torch.Tensor], config: DecoderConfig) -> dict[str, torch.Tensor]:
    """`gather_hf_state_dict` of any tensors named and shaped as this rank's Megatron state dict (its gradients,
    say): the HF-named whole tensors on every rank (collective)."""
    local = to_local_names({n: t for n, t in local_state.items() if not n.endswith(EXTRA_STATE)})
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    tp_group, ep_group = (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_expert_model_parallel_group(),
    )
    stage: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size * dense_replicas(tp_size, ep_size))]
    for name in sorted(local):  # the same order on every rank of a stage
        if is_expert_param(name):
            parts, size = _gather(local[name], ep_group, ep_size), ep_size
        else:
            parts, size = _gather(local[name], tp_group, tp_size), tp_size
        for s, shard in enumerate(stage):
            shard[name] = parts[s % size]
    layout = {"tensor_parallel_size": tp_size, "expert_parallel_size": ep_size}
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if pp_size == 1:
        return megatron_to_hf([stage], config, **layout)
    stages: list[list[dict[str, torch.Tensor]] | None] = [None] * pp_size
    dist.all_gather_object(stages, stage, group=parallel_state.get_pipeline_model_parallel_group())
    return megatron_to_hf(stages, config, **layout)
