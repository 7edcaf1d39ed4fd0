"""gyre.trainer.weight_stream across 4 real gloo processes: a Megatron core at TP 2, PP 2, TP 2 x PP 2 and EP 2
(a MoE model with a shared expert) streams its weights as buckets of whole HF tensors, bit for bit the HF state it
was loaded from, in the engines' dtype; rank 0 never holds more than two buckets at once, and with `forward=False`
every stage leader gets its own stage's buckets (the policy directory's writers)."""

from __future__ import annotations

import dataclasses

from gyre.distributed.local import run_local

QUIET = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
TIMEOUT_S = 240
BUCKET_BYTES = 4096
# (name, tp, pp, ep): each a core of tp * pp * max(1, ep / tp) ranks among the 4
LAYOUTS = [("tp2", 2, 1, 1), ("pp2", 1, 2, 1), ("tp2pp2", 2, 2, 1), ("ep2_moe", 1, 1, 2), ("tp2ep2_moe", 2, 1, 2)]


def configs():
    from gyre.models.decoder_config import DecoderConfig
    from gyre.models.moe import tiny_qwen3_moe_config

    dense = DecoderConfig(
        model_type="qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        qk_norm=True,
        attention_qkv_bias=True,
    )
    moe = dataclasses.replace(
        tiny_qwen3_moe_config(vocab_size=96, bos_token_id=None, eos_token_id=None),
        model_type="qwen2_moe",
        qk_norm=False,
        attention_qkv_bias=True,
        norm_topk_prob=False,
        shared_expert_intermediate_size=48,
        tie_word_embeddings=False,
        mlp_only_layers=(),
        decoder_sparse_step=2,
    )
    return dense, moe


class Collect:
    """A sink that keeps copies of what it is given (the test's only: it holds everything), lending via a pipe."""

    def __init__(self):
        from gyre.trainer.weight_stream import BucketPipe

        self.pipe, self.got = BucketPipe(slots=2), {}

    def acquire(self, nbytes):
        return self.pipe.acquire(nbytes)

    def put(self, bucket):
        from gyre.models.flat_weights import unflatten_weights

        for name, tensor in unflatten_weights(bucket).items():
            assert name not in self.got, name
            self.got[name] = tensor.clone()
        self.pipe.release()

    def close(self):
        pass


def stream_worker(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from gyre.config.trainer import dense_replicas
    from gyre.models.decoder import build_model
    from gyre.trainer.convert import load_hf_state_dict
    from gyre.trainer.model import build_gpt_model, init_model_parallel
    from gyre.trainer.weight_stream import stream_weights

    dense, moe = configs()
    results = {}
    for name, tp, pp, ep in LAYOUTS:
        config = moe if "moe" in name else dense
        native = build_model(config, seed=3)
        generator = torch.Generator().manual_seed(4)
        hf = {n: torch.randn(t.shape, generator=generator) for n, t in native.state_dict().items()}
        init_model_parallel(tp, pp, expert_parallel_size=ep)
        model = build_gpt_model(config)
        load_hf_state_dict(model, hf, config)
        core = tp * pp * dense_replicas(tp, ep)
        out = {}
        if rank < core:
            for forward in (True, False):
                stage_size = core // pp
                sink = Collect() if rank == 0 or (not forward and rank % stage_size == 0) else None
                stats = stream_weights(
                    model, config, dtype=torch.bfloat16, bucket_bytes=BUCKET_BYTES, sink=sink, forward=forward
                )
                key = "forward" if forward else "own_stage"
                out[key] = {
                    "names": sorted(sink.got) if sink else [],
                    "identical": bool(sink)
                    and all(torch.equal(t, hf[n].to(torch.bfloat16)) for n, t in sink.got.items()),
                    "most_in_use": sink.pipe.most_in_use if sink else 0,
                    "buckets": stats.buckets,
                    "largest": stats.largest,
                }
            out["all_names"] = sorted(hf)
        results[name] = out
        dist.barrier()
    parallel_state.destroy_model_parallel()
    return results


def test_a_megatron_core_streams_its_weights_bit_for_bit_in_bounded_buckets():
    ranks = run_local(f"{__file__}:stream_worker", 4, timeout_s=TIMEOUT_S, env=QUIET)
    for name, tp, pp, ep in LAYOUTS:
        first = ranks[0][name]
        assert first["forward"]["names"] == first["all_names"], name
        assert first["forward"]["identical"], name
        assert first["forward"]["most_in_use"] <= 2, name
        assert first["forward"]["buckets"] > 2, name  # the bucket size cut the stream
        # forward=False: each stage leader holds exactly its stage's tensors, together every tensor once
        core = tp * pp * max(1, ep // tp)
        leaders = range(0, core, core // pp)
        names = [n for r in leaders for n in ranks[r][name]["own_stage"]["names"]]
        assert sorted(names) == first["all_names"], name
        assert all(ranks[r][name]["own_stage"]["identical"] for r in leaders), name
        others = [r for r in range(core) if r not in leaders]
        assert all(ranks[r][name]["own_stage"]["names"] == [] for r in others), name
