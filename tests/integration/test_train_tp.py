"""gyre.trainer across 2 real gloo processes on 127.0.0.1: a TP=2 model loaded from HF shards gives the log-probs of
TP=1 (1e-5) and of the native engine (1e-4), and gathering the shards (TP=2, and the stages at PP=2) returns the HF
tensors bit-identical. The test starts this file as a script in two processes with torchrun's environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), bounded by timeouts; a straggler is killed by its PID. Three updates of
`MegatronTrainable` at TP=2 give the weights of the same updates at TP=1 (1e-5), the query and key norms (qk-norm)
included."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from gyre.distributed.local import free_port

WORLD_SIZE = 2
TIMEOUT_S = 180
ROW_LENGTHS = (7, 19, 3, 12)


def configs():
    from gyre.models.decoder_config import DecoderConfig

    base = DecoderConfig(
        model_type="qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        rope_theta=500.0,
        qk_norm=True,
    )
    return {
        "untied-qkv-bias": dataclasses.replace(base, attention_qkv_bias=True),
        "tied": dataclasses.replace(base, tie_word_embeddings=True),
    }


def worker(out_dir: Path) -> None:
    """One rank: TP=2 log-probs and gather, then TP=1 (DP=2) log-probs, then a PP=2 load and gather."""
    import torch.distributed as dist

    from gyre.engine.protocol import SamplingParams
    from gyre.engine.sampling import sequence_logprobs
    from gyre.models.decoder import build_model
    from gyre.trainer.convert import gather_hf_state_dict, load_hf_state_dict
    from gyre.trainer.logprobs import packed_logprobs
    from gyre.trainer.model import build_gpt_model, init_model_parallel

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    results = {}
    for name, config in configs().items():
        native = build_model(config, seed=7)  # the same weights in both processes
        generator = torch.Generator().manual_seed(8)
        with torch.no_grad():
            for pname, param in native.named_parameters():
                if pname.endswith(("norm.weight", ".bias")):
                    param.add_(0.2 * torch.randn(param.shape, generator=generator))
        hf = {n: t.detach().clone() for n, t in native.state_dict().items()}
        rows = [torch.randint(0, config.vocab_size, (n,), generator=generator) for n in ROW_LENGTHS]
        offsets = torch.tensor([0, *ROW_LENGTHS]).cumsum(0).tolist()
        ids = torch.cat(rows)
        result = {}
        with torch.no_grad():
            result["native"] = torch.cat(
                [torch.cat((torch.zeros(1), sequence_logprobs(native, r[:1], r[1:], SamplingParams()))) for r in rows]
            )
            init_model_parallel(2, 1)
            model = build_gpt_model(config)
            load_hf_state_dict(model, hf, config)
            result["qkv_shard_shape"] = tuple(
                model.state_dict()["decoder.layers.0.self_attention.linear_qkv.weight"].shape
            )
            result["tp2"] = packed_logprobs(model, ids, offsets)
            back = gather_hf_state_dict(model, config)
            result["tp2_gather_identical"] = sorted(back) == sorted(hf) and all(torch.equal(back[n], hf[n]) for n in hf)
            init_model_parallel(1, 1)  # DP=2: each rank a whole model
            model = build_gpt_model(config)
            load_hf_state_dict(model, hf, config)
            result["tp1"] = packed_logprobs(model, ids, offsets)
            init_model_parallel(1, 2)
            model = build_gpt_model(config)
            load_hf_state_dict(model, hf, config)
            result["pp2_num_layers"] = len(model.decoder.layers)
            back = gather_hf_state_dict(model, config)
            result["pp2_gather_identical"] = sorted(back) == sorted(hf) and all(torch.equal(back[n], hf[n]) for n in hf)
        for tp in (2, 1):  # three AdamW updates of the same loss at TP 2 and TP 1, the weights gathered after
            init_model_parallel(tp, 1)
            model = build_gpt_model(config)
            load_hf_state_dict(model, hf, config)
            result[f"tp{tp}_updated"] = updated(model, ids, offsets, config)
        results[name] = result
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    torch.save(results, out_dir / f"rank{rank}.pt")


def updated(model, ids, offsets, config) -> dict:
    """`model`'s HF weights after three `MegatronTrainable` updates on the sum of its packed log-probs."""
    from gyre.trainer.convert import gather_hf_state_dict
    from gyre.trainer.logprobs import packed_logprobs
    from gyre.trainer.megatron_trainable import MegatronTrainable

    trainer = MegatronTrainable(model, lr=1e-2, max_grad_norm=0.0)
    for _ in range(3):
        packed_logprobs(model, ids, offsets).sum().backward()
        trainer.update()
    with torch.no_grad():
        return gather_hf_state_dict(model, config)


@pytest.mark.slow
def test_tp2_matches_tp1_and_gathers_back(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(WORLD_SIZE)}
    env["PYTHONWARNINGS"] = "ignore"
    procs = []
    try:
        for rank in range(WORLD_SIZE):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, str(tmp_path)],
                    cwd=repo,
                    env=rank_env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outputs = [proc.communicate(timeout=TIMEOUT_S)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # by PID: only the processes this test started
                proc.wait(timeout=10)
    for rank, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{output[-4000:]}"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD_SIZE)]
    for name in configs():
        result = ranks[0][name]
        assert result["qkv_shard_shape"] == ((4 + 2 * 2) * 12 // 2, 32), "rank holds one KV group of q, k, v"
        assert (result["tp2"] - result["tp1"]).abs().max().item() <= 1e-5, name
        assert (result["tp2"] - result["native"]).abs().max().item() <= 1e-4, name
        assert torch.equal(ranks[1][name]["tp2"], result["tp2"]), "every TP rank gets the same log-probs"
        assert all(r[name]["tp2_gather_identical"] and r[name]["pp2_gather_identical"] for r in ranks), name
        assert [r[name]["pp2_num_layers"] for r in ranks] == [1, 1]
        # The same updates at TP 2 as at TP 1, the query and key norms included (each TP rank holds its heads'
        # share of their gradient: summed over the TP group before the update).
        tp2, tp1 = result["tp2_updated"], result["tp1_updated"]
        gaps = {n: (tp2[n] - tp1[n]).abs().max().item() for n in tp1}
        assert max(gaps.values()) <= 1e-5, (name, {n: g for n, g in gaps.items() if g > 1e-5})
        assert any("q_norm" in n for n in gaps) and (tp1["model.layers.0.self_attn.q_norm.weight"] != 1).any()


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
    sys.stdout.flush()
    os._exit(0)  # no interpreter finalization: it can race gloo's worker threads (see gyre.distributed.local._child)
