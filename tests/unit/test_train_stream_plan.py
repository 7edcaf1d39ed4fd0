"""gyre.trainer.stream_plan: every layout's stream (TP, PP, EP, tied, MoE with a shared expert) covers each HF tensor
exactly once, its buckets respect the size, and a stage leader's assembly of its groups' parts gives back the HF
tensors bit for bit (the parts made by `hf_to_megatron` for every rank, as the trainer holds them)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_train_convert import CONFIG as DENSE  # qk-norm and q/k/v bias: every dense unit kind
from test_train_moe import QWEN2_MOE, QWEN3_MOE  # a shared expert, dense and sparse layers

from gyre.config.trainer import dense_replicas
from gyre.models.decoder import build_model
from gyre.models.decoder_config import DecoderConfig
from gyre.models.flat_weights import FlatWeights, unflatten_weights
from gyre.trainer.convert import hf_shapes, hf_to_megatron
from gyre.trainer.stream_plan import EP, TP, assemble, native_units, plan_buckets, stage_units

CASES = [
    (DENSE, 1, 1, 1),
    (DENSE, 2, 1, 1),
    (DENSE, 1, 2, 1),
    (DENSE, 2, 2, 1),
    (dataclasses.replace(DENSE, tie_word_embeddings=True), 2, 2, 1),
    (dataclasses.replace(DENSE, tie_word_embeddings=True), 2, 1, 1),
    (QWEN3_MOE, 1, 1, 2),
    (QWEN3_MOE, 2, 1, 2),
    (QWEN3_MOE, 2, 1, 1),
    (QWEN3_MOE, 1, 1, 4),
    (QWEN2_MOE, 2, 1, 2),
    (QWEN2_MOE, 2, 2, 2),
]


def hf_state(config: DecoderConfig) -> dict[str, torch.Tensor]:
    model = build_model(config, seed=0)
    generator = torch.Generator().manual_seed(1)
    return {n: torch.randn(t.shape, generator=generator) for n, t in model.state_dict().items()}


def stream_back(config, tp, pp, ep, *, dtype, bucket_bytes):
    """Every bucket of the stream assembled as a stage leader does (parts from its TP or EP group), unflattened."""
    hf = hf_state(config)
    shapes = hf_shapes(config)
    per_stage = tp * dense_replicas(tp, ep)
    shards = [
        [
            hf_to_megatron(hf, config, tp_rank=s % tp, tp_size=tp, pp_rank=k, pp_size=pp, ep_rank=s % ep, ep_size=ep)
            for s in range(per_stage)
        ]
        for k in range(pp)
    ]
    stages = [stage_units(config, shapes, stage=k, pp_size=pp, ep_size=ep) for k in range(pp)]
    buckets = plan_buckets(stages, dtype=dtype, bucket_bytes=bucket_bytes)
    back: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        buffer = torch.full((bucket.nbytes,), 0xFF, dtype=torch.uint8)  # garbage a missed write would leave
        out = unflatten_weights(FlatWeights(buffer=buffer, manifest=bucket.manifest))
        for unit in bucket.units:
            group = {TP: range(tp), EP: range(ep), None: range(1)}[unit.group]
            assemble(unit, [shards[bucket.stage][s][unit.local] for s in group], out, config)
        for name, tensor in out.items():
            assert name not in back, f"{name} sent twice"
            back[name] = tensor.clone()
    return hf, back, buckets


@pytest.mark.parametrize(("config", "tp", "pp", "ep"), CASES)
def test_the_stream_gives_back_every_hf_tensor_bit_for_bit(config, tp, pp, ep):
    hf, back, buckets = stream_back(config, tp, pp, ep, dtype=torch.float32, bucket_bytes=2048)
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    assert len(buckets) > pp  # the size cut them
    assert [b.index for b in buckets] == list(range(len(buckets)))
    for bucket in buckets:
        assert bucket.nbytes <= 2048 or len(bucket.units) == 1, (bucket.index, bucket.nbytes)


def test_the_stream_casts_to_the_engines_dtype():
    hf, back, _ = stream_back(DENSE, 2, 2, 1, dtype=torch.bfloat16, bucket_bytes=1 << 20)
    assert all(t.dtype == torch.bfloat16 for t in back.values())
    assert all(torch.equal(back[n], t.to(torch.bfloat16)) for n, t in hf.items())


def test_buckets_never_span_stages_and_hold_whole_units():
    shapes = hf_shapes(DENSE)
    stages = [stage_units(DENSE, shapes, stage=k, pp_size=2) for k in range(2)]
    one = plan_buckets(stages, dtype=torch.float32, bucket_bytes=1 << 30)
    assert [b.stage for b in one] == [0, 1]
    tiny = plan_buckets(stages, dtype=torch.float32, bucket_bytes=1)
    assert len(tiny) == sum(len(units) for units in stages)  # a unit bigger than the bucket travels alone
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        plan_buckets(stages, dtype=torch.float32, bucket_bytes=0)


def test_a_native_models_units_are_its_tensors_in_order():
    shapes = hf_shapes(DENSE)
    units = native_units(shapes)
    assert [u.outputs[0][0] for u in units] == list(shapes)
    assert all(u.kind == "whole" and u.group is None for u in units)
