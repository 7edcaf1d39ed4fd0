"""The memory plan (`gyre.trainer.memory_plan`, docs/training.md "The memory plan"): parameter shares by layout, the
terms of each role as gyre's code holds them, the refusal of a layout that cannot fit with the setting that makes it
fit, and `python -m gyre.train.plan`. Pure arithmetic: no torch is imported."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from gyre.config import TrainConfig
from gyre.config.cluster import ClusterConfig
from gyre.models.decoder_config import DecoderConfig
from gyre.runtime.job.plan import PlanError, check_memory
from gyre.trainer.memory_plan import (
    GIB,
    MemoryInputs,
    kv_bytes_per_token,
    memory_plan,
    rank_parameters,
    total_parameters,
)

QWEN3_0_6B = DecoderConfig(  # Qwen3-0.6B's config.json shape
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    qk_norm=True,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
)
QWEN3_30B_A3B = DecoderConfig(  # Qwen3-30B-A3B's config.json shape
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    qk_norm=True,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    max_position_embeddings=40960,
)


def test_parameter_counts_match_the_published_models():
    assert total_parameters(QWEN3_0_6B) == 596_049_920  # "0.6B" (0.44B without the embedding)
    assert round(total_parameters(QWEN3_30B_A3B) / 1e9, 1) == 30.5  # "30.5B in total"


def test_shares_by_layout():
    untied = replace(QWEN3_0_6B, tie_word_embeddings=False)
    whole = total_parameters(untied)
    assert rank_parameters(untied, pp=2, stage=0) + rank_parameters(untied, pp=2, stage=1) == whole
    half = rank_parameters(untied, tp=2)
    assert whole / 2 < half < whole / 2 + 28 * 4 * 1024  # matrices halved, norms replicated
    experts = 48 * 128 * 3 * 2048 * 768
    assert rank_parameters(QWEN3_30B_A3B) - rank_parameters(QWEN3_30B_A3B, ep=2) == experts // 2
    assert kv_bytes_per_token(QWEN3_30B_A3B, "bfloat16") == 2 * 48 * 4 * 128 * 2


def test_the_core_holds_main_weights_and_adamw_and_a_satellite_neither():
    inputs = MemoryInputs(model=QWEN3_0_6B, num_cells=2, trainer_dtype="bfloat16", engine_dtype="bfloat16")
    core, satellite = memory_plan(inputs).ranks
    params = total_parameters(QWEN3_0_6B)
    assert core.held("training") == (2 + 4 + 4 + 8 + 2) * params  # weights, grads, main, AdamW, the published copy
    assert satellite.held("training") == (2 + 4) * params  # bf16 weights and fp32 gradient accumulators
    assert {t.name for t in core.training if t.transient} >= {"activations", "publication buckets"}


def test_a_gpu_rank_swaps_roles_and_keeps_host_terms_apart():
    inputs = MemoryInputs(model=QWEN3_0_6B, device="cuda", trainer_dtype="bfloat16", engine_dtype="bfloat16")
    (rank0,) = memory_plan(inputs).ranks
    training = rank0.held("training") + rank0.phase("training")
    rollout = rank0.held("rollout") + rank0.phase("rollout")
    assert rank0.peak("cuda") == rank0.held("resident") + max(training, rollout)
    assert rank0.host_bytes() == total_parameters(QWEN3_0_6B) * 4  # the fp32 policy/ copy: host memory
    assert rank0.peak("cpu") > rank0.peak("cuda")  # one process on a CPU: both roles resident


def test_a_layout_that_cannot_fit_names_the_setting_that_makes_it_fit():
    inputs = MemoryInputs(
        model=QWEN3_0_6B,
        device="cuda",
        trainer_dtype="bfloat16",
        engine_dtype="bfloat16",
        tokens_per_microstep=65536,
        max_total_tokens=65536,
    )
    full = memory_plan(replace(inputs, recompute="full")).worst().peak("cuda")
    none = memory_plan(inputs).worst().peak("cuda")
    assert full < none
    device = int((full + (none - full) / 2) / 0.9)  # fits with full recompute only
    plan = memory_plan(replace(inputs, device_memory_bytes=device))
    line = plan.misfit()
    assert line is not None and "\n" not in line
    assert line.startswith("rank 0 (core, cell leader, controller) needs") and "set trainer.recompute=full" in line
    assert memory_plan(replace(inputs, device_memory_bytes=device, recompute="full")).misfit() is None
    assert memory_plan(inputs).misfit() is None  # the device's memory unknown: reported, never refused
    huge = memory_plan(replace(inputs, model=QWEN3_30B_A3B, device_memory_bytes=80 * GIB)).misfit()
    assert huge is not None and "shard the model over more ranks" in huge


def test_the_run_plan_refuses_before_anything_starts():
    cfg = TrainConfig(cluster=ClusterConfig(num_cells=1, cell_size=1, cell_capacity=16, device_memory_gib=0.25))
    echoed: list[str] = []
    with pytest.raises(PlanError, match=r"needs .* GiB of 0\.2 GiB"):
        check_memory(cfg, QWEN3_0_6B, echoed.append)
    assert echoed and echoed[0].startswith("memory plan: peak per rank of 0.22: rank 0 (core, cell leader")


def test_the_plan_imports_no_torch():
    code = "import sys, gyre.trainer.memory_plan; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False"


def test_the_cli(tmp_path):
    config = tmp_path / "model"
    config.mkdir()
    fields = {k: v for k, v in vars(QWEN3_30B_A3B).items() if k not in ("rope_scaling", "mlp_only_layers")}
    (config / "config.json").write_text(json.dumps({**fields, "architectures": ["Qwen3MoeForCausalLM"]}))

    def plan(*overrides: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "gyre.train.plan", *overrides], capture_output=True, text=True, timeout=120
        )

    done = plan()
    assert done.returncode == 0 and done.stdout.startswith("rank 0 (core, cell leader, controller) x1: peak")
    big = [f"model.model_dir={config}", "trainer.dtype=bfloat16", "engine.dtype=bfloat16", "cluster.num_cells=2"]
    done = plan(*big, "cluster.device_memory_gib=80", "trainer.device=cuda", "engine.device=cuda")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("gyre.train.plan: rank 0 (core, cell leader, controller) needs")
    assert "main weights (fp32)" in done.stdout and "AdamW moments (fp32)" in done.stdout
    done = plan("cluster.device_memory_gib=-1")
    assert done.returncode == 2 and "cluster.device_memory_gib=-1" in done.stderr and "Traceback" not in done.stderr
    done = plan(f"model.model_dir={tmp_path / 'nowhere'}")
    assert done.returncode == 2 and "no config.json there" in done.stderr


def test_optimizer_offload_moves_its_share_of_main_weights_and_adamw_to_the_host():
    """f of a core rank's parameters: their fp32 main weights (4 B), AdamW moments (8 B) and pinned fp32 gradient
    buffers (4 B) in host memory, the rest on the device; the plan's line says so."""
    inputs = MemoryInputs(
        model=QWEN3_0_6B,
        trainer_backend="megatron",
        device="cuda",
        trainer_dtype="bfloat16",
        engine_dtype="bfloat16",
        max_total_tokens=4096,  # training is the larger role
    )
    params = total_parameters(QWEN3_0_6B)
    whole = memory_plan(inputs).ranks[0]
    half = memory_plan(replace(inputs, optimizer_offload_fraction=0.5)).ranks[0]
    on_host = params // 2
    assert whole.held("training") - half.held("training") == 12 * on_host  # main 4 + AdamW 8 off the device
    assert half.held("training", host=True) == 16 * on_host and whole.held("training", host=True) == 0
    assert whole.peak("cuda") - half.peak("cuda") == 12 * on_host
    fp32 = replace(inputs, trainer_dtype="float32", optimizer_offload_fraction=0.5)
    assert (
        memory_plan(replace(fp32, optimizer_offload_fraction=0)).ranks[0].held("training")
        - memory_plan(fp32).ranks[0].held("training")
        == 8 * on_host
    )  # fp32: the weights are the main weights; AdamW only
    note = memory_plan(replace(inputs, optimizer_offload_fraction=0.5)).offload_note()
    assert note.startswith("; trainer.optimizer_offload_fraction=0.5: 50% of a core rank's fp32 main weights")
    assert f"({16 * on_host / GIB:.2f} GiB of host memory on rank 0" in note
    assert memory_plan(inputs).offload_note() == ""


def test_a_megatron_gpu_layout_that_fits_with_offload_is_told_so():
    inputs = MemoryInputs(
        model=QWEN3_0_6B,
        trainer_backend="megatron",
        device="cuda",
        trainer_dtype="bfloat16",
        engine_dtype="bfloat16",
        recompute="full",
        tokens_per_microstep=1024,
        max_total_tokens=4096,
    )
    peak = memory_plan(inputs).worst().peak("cuda")
    saved = 12 * (total_parameters(QWEN3_0_6B) // 4)  # a quarter offloaded
    device = int((peak - saved // 2) / 0.9)  # fits once a quarter is off the device
    line = memory_plan(replace(inputs, device_memory_bytes=device)).misfit()
    assert line is not None and "set trainer.optimizer_offload_fraction=0.25" in line, line
    assert memory_plan(replace(inputs, device_memory_bytes=device, optimizer_offload_fraction=0.25)).misfit() is None


def test_the_separate_pool_serves_and_holds_no_trainer():
    """`cluster.separate_size` ranks after the cells': the first serves the pool's engine (the native engine: the
    whole model and its KV), the others wait (native) or hold their SGLang share; none trains."""
    inputs = MemoryInputs(model=QWEN3_0_6B, num_cells=2, separate_size=2, max_total_tokens=8192)
    kinds = {rank.name: rank for rank in memory_plan(inputs).ranks}
    serving, waiting = kinds["rank 2 (separate rollout pool, serves)"], kinds["separate rollout pool rank"]
    assert serving.ranks == 1 and waiting.ranks == 1
    assert serving.training == () and waiting.training == () and waiting.rollout == ()
    leader = kinds["rank 1 (satellite, cell leader)"]
    assert serving.rollout == leader.rollout  # the cells' engine config
    assert serving.peak("cpu") == serving.held("resident") + serving.held("rollout") + serving.phase("rollout")
    sglang = {
        rank.name: rank
        for rank in memory_plan(replace(inputs, engine_backend="sglang", device="cuda", cell_size=2)).ranks
    }
    share = total_parameters(QWEN3_0_6B) * 4 // 2
    pool = sglang["separate rollout pool rank"]
    assert pool.training == () and [t.bytes for t in pool.rollout] == [share]
    assert [t.bytes for t in sglang["satellite rank"].rollout] == [share]  # SGLang's group spans the cell


def test_a_satellite_holds_no_main_weights_and_no_adamw_in_either_dtype():
    for dtype in ("float32", "bfloat16"):
        inputs = MemoryInputs(model=QWEN3_0_6B, num_cells=3, trainer_dtype=dtype)
        satellite = memory_plan(inputs).ranks[1]
        assert satellite.ranks == 2 and satellite.name == "rank 1 (satellite, cell leader)"
        names = {t.name for t in satellite.training if t.bytes}
        assert names == {"weights", "gradients (fp32)", "step's flat gradients", "activations"}, names


def test_a_publication_costs_two_buckets_and_the_store_transport_is_charged_to_rank_0():
    from gyre.trainer.memory_plan import publication_bytes

    model = QWEN3_0_6B
    inputs = MemoryInputs(model=model, num_cells=2, trainer_dtype="bfloat16", engine_dtype="bfloat16", bucket_bytes=1)
    largest = model.vocab_size * model.hidden_size  # the embedding: a bucket is at least the largest tensor
    assert publication_bytes(inputs) == 2 * largest * 2 + largest * 2
    big = MemoryInputs(model=model, bucket_bytes=1 << 30)  # fp32: a bucket above the embedding's 0.62 GB
    assert publication_bytes(big) == 2 * (1 << 30) + largest * 4
    whole = total_parameters(model) * 4  # two buckets never hold more than the whole model
    assert publication_bytes(MemoryInputs(model=model, bucket_bytes=4 << 30)) == whole + largest * 4
    rank0 = memory_plan(inputs).ranks[0]
    store = [t for t in rank0.resident if t.name.startswith("weight store")]
    assert store and store[0].bytes == 2 * total_parameters(model) * 2 and store[0].host
    mooncake = memory_plan(replace(inputs, weight_transport="mooncake")).ranks[0]
    assert not [t for t in mooncake.resident if t.name.startswith("weight store")]
