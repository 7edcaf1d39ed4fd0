"""The plan of a weight stream: which local tensor of which pipeline stage becomes which whole HF tensors, and how
the stream cuts them into buckets (docs/training.md, "Publication"). Pure: torch tensors only, no collective, no
Megatron import, so every rank computes the same plan alone and tests prove it exactly.

A `Unit` is one local tensor of a stage (a Megatron local-spec name, `gyre.trainer.convert`'s mapping) and the whole
HF tensors it becomes once the parts of its group are put together:

| kind | group | its parts (one per group rank r) become |
|---|---|---|
| `whole` | none | the stage leader's own copy (norms, the router, the shared expert's gate): one HF tensor |
| `rows` | TP | rows `chunk r` of one HF tensor (embedding, lm_head) |
| `cols` | TP | columns `chunk r` of one HF tensor (o_proj, down_proj, the shared expert's down_proj) |
| `qkv` | TP | rank r's KV groups of `linear_qkv` (per group: its query heads, key, value): rows of q, k and v |
| `fc1` | TP | `linear_fc1` = [gate shard r; up shard r]: rows `chunk r` of gate_proj and of up_proj |
| `expert_fc1` | EP | EP rank r's local expert k: gate_proj and up_proj of expert `r E / EP + k`, whole |
| `expert_fc2` | EP | EP rank r's local expert k: down_proj of expert `r E / EP + k`, whole |

`stage_units(config, ...)` lists a stage's units in the order of `gyre.trainer.convert.megatron_tensors` (the tied
embedding's copy on the last stage at PP > 1 is never sent: the embedding is). `native_units(names_shapes)`: a
native (whole) model's tensors, each `whole`. `plan_buckets(units, dtype=, bucket_bytes=)` cuts a stage's units
into `Bucket`s: consecutive units whose HF tensors, laid out as a `FlatWeights` (16-byte aligned), fit in
`bucket_bytes`; a unit bigger than that is a bucket of its own. `assemble(unit, parts, out, config, ...)` writes a
unit's HF tensors from its group's parts into `out` (views of a bucket), cast to their dtype: the inverse of
`megatron_tensors` for one unit (tests/unit/test_train_stream_plan.py proves every layout's round trip bit for bit).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from gyre.models.decoder_config import DecoderConfig
from gyre.models.flat_weights import ALIGN, TensorSpec, dtype_name

__all__ = ["Bucket", "Unit", "assemble", "bucket_manifest", "native_units", "plan_buckets", "stage_units"]

TP, EP = "tp", "ep"


@dataclass(frozen=True)
class Unit:
    """One local tensor of a stage and the whole HF tensors (names and shapes, in bucket order) it becomes."""

    local: str
    kind: str
    group: str | None
    outputs: tuple[tuple[str, tuple[int, ...]], ...]

    def nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of its HF tensors in `dtype`, each padded to `ALIGN` as in a flat buffer."""
        size = torch.empty(0, dtype=dtype).element_size()
        return sum(_aligned(torch.Size(shape).numel() * size) for _, shape in self.outputs)


@dataclass(frozen=True)
class Bucket:
    """Consecutive units of one stage sent together, and their flat layout."""

    stage: int
    index: int  # its position in the whole stream
    units: tuple[Unit, ...]
    manifest: tuple[TensorSpec, ...]
    nbytes: int


def _aligned(nbytes: int) -> int:
    return nbytes + (-nbytes % ALIGN)


def _chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    step = -(-size // parts)
    return min(index * step, size), min((index + 1) * step, size)


def stage_units(
    config: DecoderConfig, shapes: Mapping[str, tuple[int, ...]], *, stage: int, pp_size: int, ep_size: int = 1
) -> list[Unit]:
    """Stage `stage`'s units (module docstring), in `megatron_tensors`' order; `shapes`: the HF names and shapes of
    the model (`gyre.trainer.convert.hf_shapes`)."""

    def unit(local: str, kind: str, group: str | None, *names: str) -> Unit:
        return Unit(local, kind, group, tuple((name, tuple(shapes[name])) for name in names))

    units: list[Unit] = []
    first, last = stage == 0, stage == pp_size - 1
    per_stage = config.num_hidden_layers // pp_size
    if first:
        units.append(unit("embedding.word_embeddings.weight", "rows", TP, "model.embed_tokens.weight"))
    for j, i in enumerate(range(stage * per_stage, (stage + 1) * per_stage)):
        src, dst = f"decoder.layers.{j}.", f"model.layers.{i}."
        attn = dst + "self_attn."
        units.append(unit(src + "input_layernorm.weight", "whole", None, dst + "input_layernorm.weight"))
        units.append(unit(src + "pre_mlp_layernorm.weight", "whole", None, dst + "post_attention_layernorm.weight"))
        for suffix in ("weight", "bias") if config.attention_qkv_bias else ("weight",):
            names = (f"{attn}{p}_proj.{suffix}" for p in "qkv")
            units.append(unit(f"{src}self_attention.linear_qkv.{suffix}", "qkv", TP, *names))
        if config.qk_norm:
            units.append(unit(src + "self_attention.q_layernorm.weight", "whole", None, attn + "q_norm.weight"))
            units.append(unit(src + "self_attention.k_layernorm.weight", "whole", None, attn + "k_norm.weight"))
        units.append(unit(src + "self_attention.linear_proj.weight", "cols", TP, attn + "o_proj.weight"))
        mlp, fc = dst + "mlp.", src + "mlp."
        if not config.is_moe_layer(i):
            units.append(unit(fc + "linear_fc1.weight", "fc1", TP, mlp + "gate_proj.weight", mlp + "up_proj.weight"))
            units.append(unit(fc + "linear_fc2.weight", "cols", TP, mlp + "down_proj.weight"))
            continue
        units.append(unit(fc + "router.weight", "whole", None, mlp + "gate.weight"))
        local = config.num_experts // ep_size
        for k in range(local):
            experts = [f"{mlp}experts.{e * local + k}." for e in range(ep_size)]
            gate_up = [name + p for name in experts for p in ("gate_proj.weight", "up_proj.weight")]
            units.append(unit(f"{fc}experts.local_experts.{k}.linear_fc1.weight", "expert_fc1", EP, *gate_up))
            down = [name + "down_proj.weight" for name in experts]
            units.append(unit(f"{fc}experts.local_experts.{k}.linear_fc2.weight", "expert_fc2", EP, *down))
        if config.shared_expert_intermediate_size:
            shared, sfc = mlp + "shared_expert.", fc + "shared_experts."
            units.append(
                unit(sfc + "linear_fc1.weight", "fc1", TP, shared + "gate_proj.weight", shared + "up_proj.weight")
            )
            units.append(unit(sfc + "linear_fc2.weight", "cols", TP, shared + "down_proj.weight"))
            units.append(unit(sfc + "gate_weight", "whole", None, mlp + "shared_expert_gate.weight"))
    if last:
        units.append(unit("decoder.final_layernorm.weight", "whole", None, "model.norm.weight"))
        if not config.tie_word_embeddings:
            units.append(unit("output_layer.weight", "rows", TP, "lm_head.weight"))
    return units


def native_units(shapes: Mapping[str, tuple[int, ...]]) -> list[Unit]:
    """A whole model's tensors (the native trainer's, HF-named), each its own `whole` unit."""
    return [Unit(name, "whole", None, ((name, tuple(shape)),)) for name, shape in shapes.items()]


def bucket_manifest(units: Sequence[Unit], dtype: torch.dtype) -> tuple[tuple[TensorSpec, ...], int]:
    """The flat layout of `units`' HF tensors in `dtype` (`gyre.models.flat_weights`), and its bytes."""
    size = torch.empty(0, dtype=dtype).element_size()
    manifest, offset = [], 0
    for unit in units:
        for name, shape in unit.outputs:
            manifest.append(TensorSpec(name=name, dtype=dtype_name(dtype), shape=shape, offset=offset))
            offset += _aligned(torch.Size(shape).numel() * size)
    return tuple(manifest), offset


def plan_buckets(
    stages: Sequence[Sequence[Unit]], *, dtype: torch.dtype, bucket_bytes: int, start: int = 0
) -> list[Bucket]:
    """Every stage's units cut into buckets of at most `bucket_bytes` (a bigger unit alone), stage after stage; a
    bucket never spans two stages. `start`: the first bucket's index."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} is not allowed: expected an integer >= 1")
    buckets: list[Bucket] = []

    def close(stage: int, units: list[Unit]) -> None:
        if units:
            manifest, nbytes = bucket_manifest(units, dtype)
            buckets.append(Bucket(stage, start + len(buckets), tuple(units), manifest, nbytes))

    for stage, units in enumerate(stages):
        current: list[Unit] = []
        held = 0
        for unit in units:
            size = unit.nbytes(dtype)
            if current and held + size > bucket_bytes:
                close(stage, current)
                current, held = [], 0
            current.append(unit)
            held += size
        close(stage, current)
    return buckets


def assemble(
    unit: Unit,
    parts: Sequence[torch.Tensor],
    out: Mapping[str, torch.Tensor],
    config: DecoderConfig,
) -> None:
    """Write `unit`'s HF tensors into `out[name]` (whole tensors, any dtype: the parts are cast) from `parts`, the
    unit's local tensor of each rank of its group in group order (one part for `whole`)."""
    targets = [out[name] for name, _ in unit.outputs]
    kind = unit.kind
    with torch.no_grad():
        if kind == "whole":
            targets[0].copy_(parts[0])
        elif kind == "rows":
            for r, part in enumerate(parts):
                lo, hi = _chunk(targets[0].shape[0], len(parts), r)
                targets[0][lo:hi].copy_(part)
        elif kind == "cols":
            for r, part in enumerate(parts):
                lo, hi = _chunk(targets[0].shape[1], len(parts), r)
                targets[0][:, lo:hi].copy_(part)
        elif kind == "qkv":
            K, D = config.num_key_value_heads, config.head_dim
            G = config.num_attention_heads // K
            groups = K // len(parts)
            for r, part in enumerate(parts):
                q, k, v = part.reshape(groups, (G + 2) * D, *part.shape[1:]).split((G * D, D, D), dim=1)
                for target, piece in zip(targets, (q, k, v), strict=True):
                    rows = piece.flatten(0, 1)
                    target[r * rows.shape[0] : (r + 1) * rows.shape[0]].copy_(rows)
        elif kind == "fc1":
            for r, part in enumerate(parts):
                for target, piece in zip(targets, part.chunk(2, dim=0), strict=True):
                    lo, hi = _chunk(target.shape[0], len(parts), r)
                    target[lo:hi].copy_(piece)
        elif kind == "expert_fc1":
            for r, part in enumerate(parts):
                gate, up = part.chunk(2, dim=0)
                targets[2 * r].copy_(gate)
                targets[2 * r + 1].copy_(up)
        elif kind == "expert_fc2":
            for r, part in enumerate(parts):
                targets[r].copy_(part)
        else:
            raise ValueError(f"unit {unit.local}: unknown kind {kind!r}")
