"""Mixture of experts in the Megatron trainer, on one process: the HF <-> Megatron mapping of routed experts under
expert parallelism (pure; round trips bit-identical at every TP x EP layout, qwen2_moe's shared expert included),
the TransformerConfig Qwen's router maps to, the layout and config rules, the routing checks, megatron's router
against Qwen's routing math, and a one-rank megatron MoE model against the shared native model (own routing and
replayed routing). The 2-rank expert-parallel runs are tests/integration/test_train_moe_ranks.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gyre.config.trainer import TrainerConfig, dense_replicas
from gyre.models.decoder import build_model, route_tokens
from gyre.models.moe import tiny_qwen3_moe_config
from gyre.trainer.convert import hf_to_megatron, load_hf_state_dict, megatron_to_hf
from gyre.trainer.model import build_gpt_model, cell_ranks, transformer_config, validate_layout
from gyre.trainer.moe import check_routed_experts, moe_layers

QWEN3_MOE = tiny_qwen3_moe_config(vocab_size=96, bos_token_id=None, eos_token_id=None)
QWEN2_MOE = dataclasses.replace(
    QWEN3_MOE,
    model_type="qwen2_moe",
    qk_norm=False,
    attention_qkv_bias=True,
    norm_topk_prob=False,
    shared_expert_intermediate_size=48,
    tie_word_embeddings=False,
    mlp_only_layers=(),
    decoder_sparse_step=2,  # layers 1 and 3 sparse, 0 and 2 dense
)
LAYOUTS = [(1, 1), (1, 2), (2, 2), (2, 1), (1, 4), (2, 4), (1, 8)]  # (tp, ep)


def hf_state(config, seed: int = 0) -> dict[str, torch.Tensor]:
    model = build_model(config, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    # Distinct values everywhere, so a swapped expert or a misplaced row cannot round-trip.
    return {n: torch.randn(t.shape, generator=generator) for n, t in model.state_dict().items()}


def cell_shards(hf, config, tp: int, ep: int) -> list[dict[str, torch.Tensor]]:
    """The Megatron state dicts of one cell's ranks (in-stage rank s: TP rank s % TP, EP rank s % EP)."""
    return [
        hf_to_megatron(hf, config, tp_rank=s % tp, tp_size=tp, ep_rank=s % ep, ep_size=ep)
        for s in range(tp * dense_replicas(tp, ep))
    ]


@pytest.mark.parametrize("config", [QWEN3_MOE, QWEN2_MOE], ids=["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize(("tp", "ep"), LAYOUTS)
def test_round_trip_with_expert_parallelism_is_bit_identical(config, tp, ep):
    hf = hf_state(config)
    back = megatron_to_hf([cell_shards(hf, config, tp, ep)], config, tensor_parallel_size=tp, expert_parallel_size=ep)
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


RANKS_TP2_EP2 = [{"tp_rank": r, "tp_size": 2, "ep_rank": r, "ep_size": 2} for r in (0, 1)]


def test_round_trip_at_pp2_with_ep_equal_to_tp():
    hf = hf_state(QWEN3_MOE)
    shards = [
        [
            hf_to_megatron(hf, QWEN3_MOE, tp_rank=r, tp_size=2, pp_rank=s, pp_size=2, ep_rank=r, ep_size=2)
            for r in (0, 1)
        ]
        for s in (0, 1)
    ]
    back = megatron_to_hf(shards, QWEN3_MOE, expert_parallel_size=2)
    assert sorted(back) == sorted(hf) and all(torch.equal(back[n], t) for n, t in hf.items())


def test_ep_shards_are_the_documented_experts():
    hf = hf_state(QWEN3_MOE)
    rank1 = hf_to_megatron(hf, QWEN3_MOE, ep_rank=1, ep_size=2)  # experts 4..7 as local experts 0..3
    src, dst = "model.layers.2.mlp.", "decoder.layers.2.mlp."
    for k in range(4):
        expert = f"{src}experts.{4 + k}."
        want_fc1 = torch.cat((hf[expert + "gate_proj.weight"], hf[expert + "up_proj.weight"]))
        assert torch.equal(rank1[f"{dst}experts.local_experts.{k}.linear_fc1.weight"], want_fc1)
        assert torch.equal(rank1[f"{dst}experts.local_experts.{k}.linear_fc2.weight"], hf[expert + "down_proj.weight"])
    assert f"{dst}experts.local_experts.4.linear_fc1.weight" not in rank1
    assert torch.equal(rank1[dst + "router.weight"], hf[src + "gate.weight"])
    assert "decoder.layers.0.mlp.linear_fc1.weight" in rank1  # mlp_only_layers=(0,): layer 0 keeps the dense MLP
    assert not any(n.startswith("decoder.layers.0.mlp.router") for n in rank1)


def test_shared_expert_splits_like_the_dense_mlp():
    hf = hf_state(QWEN2_MOE)
    rank1 = hf_to_megatron(hf, QWEN2_MOE, tp_rank=1, tp_size=2, ep_rank=1, ep_size=2)
    shared, half = "model.layers.1.mlp.shared_expert.", QWEN2_MOE.shared_expert_intermediate_size // 2
    want_fc1 = torch.cat((hf[shared + "gate_proj.weight"][half:], hf[shared + "up_proj.weight"][half:]))
    assert torch.equal(rank1["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"], want_fc1)
    assert torch.equal(
        rank1["decoder.layers.1.mlp.shared_experts.linear_fc2.weight"], hf[shared + "down_proj.weight"][:, half:]
    )
    assert torch.equal(
        rank1["decoder.layers.1.mlp.shared_experts.gate_weight"], hf["model.layers.1.mlp.shared_expert_gate.weight"]
    )


def test_megatron_config_carries_qwens_router():
    config = transformer_config(QWEN3_MOE, expert_parallel_size=2)
    assert config.num_moe_experts == 8 and config.moe_router_topk == 2 and config.moe_ffn_hidden_size == 64
    assert config.moe_layer_freq == [0, 1, 1, 1]  # mlp_only_layers=(0,)
    assert config.moe_router_score_function == "softmax" and not config.moe_router_pre_softmax  # norm_topk_prob
    assert config.moe_router_dtype == "fp32" and config.moe_aux_loss_coeff == 0.0
    assert config.moe_expert_capacity_factor is None and config.moe_token_dispatcher_type == "alltoall"
    assert config.expert_model_parallel_size == 2 and config.expert_tensor_parallel_size == 1
    assert not config.moe_grouped_gemm and config.moe_enable_routing_replay
    qwen2 = transformer_config(QWEN2_MOE)
    assert qwen2.moe_router_pre_softmax and qwen2.moe_layer_freq == [0, 1, 0, 1]  # decoder_sparse_step=2
    assert qwen2.moe_shared_expert_intermediate_size == 48 and qwen2.moe_shared_expert_gate
    dense = dataclasses.replace(QWEN3_MOE, model_type="qwen3", num_experts=0, num_experts_per_tok=0)
    assert transformer_config(dense).num_moe_experts is None


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_megatrons_router_computes_qwens_routing(norm_topk_prob):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    logits_NE = torch.randn(50, 8, generator=torch.Generator().manual_seed(3))
    weights_NK, experts_NK = route_tokens(logits_NE, 2, norm_topk_prob)
    probs_NE, map_NE = topk_routing_with_score_function(logits_NE, 2, use_pre_softmax=not norm_topk_prob)
    want_NE = torch.zeros_like(logits_NE).scatter(1, experts_NK, weights_NK)
    assert torch.equal(map_NE, want_NE > 0)
    assert (probs_NE - want_NE).abs().max() <= 1e-6


def test_layout_and_model_rules_are_refused_with_one_line():
    dense = dataclasses.replace(QWEN3_MOE, model_type="qwen3", num_experts=0, num_experts_per_tok=0)
    with pytest.raises(ValueError, match="expert_parallel_size=2 needs a mixture-of-experts model"):
        validate_layout(dense, 1, 1, 2)
    six = dataclasses.replace(QWEN3_MOE, num_experts=6)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by expert_parallel_size=4"):
        validate_layout(six, 1, 1, 4)
    with pytest.raises(ValueError, match=r"a divisor or a multiple of trainer\.tensor_parallel_size=2"):
        validate_layout(QWEN3_MOE, 2, 1, 3)
    with pytest.raises(ValueError, match="a mixture of experts at PP > 1 needs expert_parallel_size = tensor_parallel"):
        validate_layout(QWEN3_MOE, 2, 2, 1)
    validate_layout(QWEN3_MOE, 2, 2, 2)
    validate_layout(QWEN3_MOE, 1, 2, 1)
    with pytest.raises(ValueError, match="num_experts_per_tok=1 with norm_topk_prob=True"):
        validate_layout(dataclasses.replace(QWEN3_MOE, num_experts_per_tok=1), 1, 1, 1)
    assert [cell_ranks(tp, 1, ep) for tp, ep in LAYOUTS] == [1, 2, 2, 2, 4, 4, 8]


def test_trainer_config_rules():
    assert TrainerConfig(backend="megatron", tensor_parallel_size=2, expert_parallel_size=4).model_parallel_size == 4
    assert TrainerConfig(backend="megatron", tensor_parallel_size=2, expert_parallel_size=2).model_parallel_size == 2
    assert TrainerConfig(routing_replay=True).routing_replay  # the native trainer replays too
    refused = [
        (dict(expert_parallel_size=2), "expert_parallel_size=2 is not allowed: expected 1 with trainer.backend=native"),
        (dict(backend="megatron", expert_parallel_size=0), "expert_parallel_size=0 is not allowed"),
        (dict(backend="megatron", tensor_parallel_size=2, expert_parallel_size=3), "a divisor or a multiple"),
        (dict(backend="megatron", pipeline_parallel_size=2, expert_parallel_size=2), "pipeline groups must coincide"),
        (dict(backend="megatron", context_parallel_size=2, expert_parallel_size=2), "context_parallel_size=2 > 1"),
        (dict(routing_replay="yes"), "trainer.routing_replay='yes' is not allowed: expected a bool"),
        (dict(backend="megatron", pipeline_parallel_size=2, recompute="full", routing_replay=True), "recompute=full"),
    ]
    for kwargs, message in refused:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            TrainerConfig(**kwargs)


def test_routed_experts_are_checked():
    routes = torch.full((5, 4, 2), -1)
    routes[:, 1:] = torch.tensor([3, 0])
    check_routed_experts(routes, QWEN3_MOE, 5)  # layer 0 is dense: its -1 are ignored
    routes[4] = -1  # a token the engine never routed
    check_routed_experts(routes, QWEN3_MOE, 5)
    bad = routes.clone()
    bad[2, 3] = torch.tensor([1, 1])
    with pytest.raises(ValueError, match=r"routed experts \[1, 1\] \(token 2, layer 3\): expected 2 distinct"):
        check_routed_experts(bad, QWEN3_MOE, 5)
    bad[2, 3] = torch.tensor([1, 8])
    with pytest.raises(ValueError, match=r"in \[0, 8\)"):
        check_routed_experts(bad, QWEN3_MOE, 5)
    with pytest.raises(ValueError, match=r"integer \[U, num_hidden_layers, num_experts_per_tok\] = \[5, 4, 2\]"):
        check_routed_experts(routes.float(), QWEN3_MOE, 5)


def own_routes(native, row):
    return native(row[None], torch.arange(len(row))[None], return_routed_experts=True)[2][0]


def _rows_step(config, lengths, seed):
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, config.vocab_size, (n,), generator=generator) for n in lengths]
    offsets = np.array([0, *np.cumsum(lengths)])
    return rows, SimpleNamespace(ids_U=torch.cat(rows).numpy(), row_offsets_R1=offsets, num_tokens=int(offsets[-1]))


@pytest.mark.slow
@pytest.mark.parametrize("config", [QWEN3_MOE, QWEN2_MOE], ids=["qwen3_moe", "qwen2_moe"])
def test_one_rank_megatron_moe_equals_the_native_model(model_parallel, config):
    from gyre.trainer.logprobs import packed_logprobs
    from gyre.trainer.native_trainable import packed_logprobs as native_logprobs

    native = build_model(config, seed=5)
    rows, step = _rows_step(config, (6, 11, 4), seed=6)
    with torch.no_grad():
        routes = torch.cat(
            [native(r[None], torch.arange(len(r))[None], return_routed_experts=True)[2][0] for r in rows]
        )
        other = routes.clone()
        moe = list(config.moe_layer_ids())
        other[:, moe] = (routes[:, moe] + 1) % config.num_experts  # other experts than the router's own choice
        model = build_gpt_model(config)
        load_hf_state_dict(model, native.state_dict(), config)
        assert len(moe_layers(model)) == len(moe)
        ids, offsets = torch.from_numpy(step.ids_U), step.row_offsets_R1.tolist()
        own = packed_logprobs(model, ids, offsets)
        replayed = packed_logprobs(model, ids, offsets, routed_experts_ULK=other)
        again = packed_logprobs(model, ids, offsets)  # the routes do not outlive the call that set them
        want_own = native_logprobs(native, step)
        want_replayed = native_logprobs(native, step, routed_experts_ULK=other)
    assert (own - want_own).abs().max() <= 1e-5
    assert (replayed - want_replayed).abs().max() <= 1e-5
    assert (replayed - own).abs().max() > 1e-3
    assert torch.equal(again, own)
    with pytest.raises(ValueError, match="expected 2 distinct expert ids"):
        packed_logprobs(model, ids, offsets, routed_experts_ULK=torch.zeros_like(other))


def test_native_trainable_replays_and_routes_a_step_without_routes_itself(caplog):
    """A micro-step none of whose calls kept routing (found in review: it trained or raised depending on what it
    was packed with) is routed by the trainer's own routers, with a warning, as any token no call routed."""
    from gyre.trainer.native_trainable import NativeTrainable

    native = build_model(QWEN3_MOE, seed=5)
    _, step = _rows_step(QWEN3_MOE, (5, 3), seed=2)
    trainable = NativeTrainable(native, lr=1e-3, routing_replay=True)
    step.index, step.batch = 0, 0
    with torch.no_grad():
        unrouted = trainable.logprobs(step)
        own = NativeTrainable(native, lr=1e-3).logprobs(step)
    assert torch.equal(unrouted, own) and "carries no routed experts" in caplog.text
    routes = torch.full((8, 4, 2), -1)
    routes[:, 1:] = torch.tensor([6, 2])
    step.routed_experts_ULK = routes.numpy()
    with torch.no_grad():
        got = trainable.logprobs(step)
        row = torch.from_numpy(step.ids_U[:5])[None]
        logits, _ = native(row[:, :-1], torch.arange(4)[None], routed_experts_BTLK=routes[None, :4])
    want = torch.log_softmax(logits[0].float(), -1).gather(1, row[0, 1:, None])[:, 0]
    assert (got[1:5] - want).abs().max() <= 1e-5
    dense = dataclasses.replace(QWEN3_MOE, model_type="qwen3", num_experts=0, num_experts_per_tok=0)
    with pytest.raises(ValueError, match="routing_replay=True needs a mixture-of-experts model"):
        NativeTrainable(build_model(dense, seed=0), lr=1e-3, routing_replay=True)


def test_sharded_loading_reads_each_ranks_experts(tmp_path):
    from gyre.models.hf_weights import save_pretrained
    from gyre.trainer.shard_loading import read_megatron_shard

    native = build_model(QWEN3_MOE, seed=3)
    save_pretrained(native, tmp_path)
    hf = {n: t.detach() for n, t in native.state_dict().items()}
    for tp, ep in ((1, 2), (2, 2), (1, 4)):
        for s in range(cell_ranks(tp, 1, ep)):
            ranks = {"tp_rank": s % tp, "tp_size": tp, "pp_rank": 0, "pp_size": 1, "ep_rank": s % ep, "ep_size": ep}
            got = read_megatron_shard(tmp_path, QWEN3_MOE, **ranks)
            want = hf_to_megatron(hf, QWEN3_MOE, **ranks)
            assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want), (tp, ep, s)
