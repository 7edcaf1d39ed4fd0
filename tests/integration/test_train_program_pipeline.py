"""`python -m gyre.train` with Megatron cells of two pipeline stages (docs/runtime.md, "Megatron cells"): a real
subprocess, 2 cells x PP 2 on 4 gloo worker processes started by the program.

- `trainer.backend=megatron trainer.pipeline_parallel_size=2 cluster.cell_size=2 cluster.num_cells=2 steps=2`
  (colocate, one step a burst) exits 0: both cells train every step through their streaming 1F1B pipeline (the
  satellite's two stages pull the core's two stages' weights), the loss and its metrics reach the step records
  from the last stage (on-policy: the stages' log-probs are the engines' to 1e-4), each step is published (the
  core's stages gathered into the engines' HF layout), `policy/` holds exactly the weights of the final
  checkpoint's `trainer/`, and the checkpoint keeps each stage's optimizer state (`optimizer-0.pt`,
  `optimizer-1.pt`);
- `resume=auto steps=3` goes on from it, each stage loading its own optimizer state exactly (the digest it logs
  after loading is the saved file's).
"""

from __future__ import annotations

import json

import pytest
from test_train_program import SMALL, finish, train, wait_until_gone

pytestmark = pytest.mark.warm_start  # tests/conftest.py: ordered after the modules that do not need it
PIPELINE = [  # the command of issue 27, with the small demo settings of test_train_program.py
    "trainer.backend=megatron",
    "trainer.pipeline_parallel_size=2",
    "cluster.cell_size=2",
    "cluster.num_cells=2",
]
QUIET = {"PYTHONWARNINGS": "ignore"}  # megatron's import-time deprecation warnings


@pytest.mark.slow  # two program runs of 4 Megatron processes (2 steps, then a resumed 3rd)
def test_cells_of_two_pipeline_stages_train_publish_checkpoint_and_resume(tmp_path):
    import torch
    from safetensors.torch import load_file

    from gyre.obs.record import record_from_dict
    from gyre.runtime.audit import audit_run
    from gyre.runtime.cell.trainers import state_digest

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    args = [*SMALL, *PIPELINE, "algo=colocate", "algo.mu=1", "tasks.eval_every=0", "logging.wandb=disabled"]
    # 2 steps: step 1's rollouts run on the publication of step 0, which is what the on-policy check needs.
    process = train([*args, "steps=2"], run_dir, env=QUIET)
    code, out, err = finish(process, 600)
    assert code == 0, err[-3000:]
    assert wait_until_gone(process) == []
    end = json.loads(out.strip().splitlines()[-1])
    assert end["end"] == "completed" and end["steps"] == 2
    records = [record_from_dict(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r.step for r in records] == [0, 1] and [r.training_cells for r in records] == [2, 2]
    assert all(r.train_tokens > 0 and r.grad_norm is not None for r in records)
    # The loss metrics come from the last stage. On-policy (colocate, one step a burst: every step's rollouts ran on
    # the publication of the step before), the stages' log-probs are the engines' own: the stages were loaded and
    # the publications gathered right.
    assert all(r.loss["abs_log_ratio_mean"] < 1e-4 for r in records), [r.loss for r in records]
    log = (run_dir / "train.log").read_text()
    assert "rank 1 (cell 0): trained steps [0, 1]" in log, log[-3000:]  # the core's second stage
    for rank in (2, 3):  # both stages of the satellite
        assert f"rank {rank} (cell 1): trained steps [0, 1], pulled the core's weights at [0, 1]" in log

    # The publication is the core's stages streamed: policy/ is the final checkpoint's trainer/, tensor for tensor.
    saved = run_dir / "checkpoints" / "step-000002"
    assert json.loads((run_dir / "policy" / "policy.json").read_text())["version"] == 2
    policy = {n: t for part in (run_dir / "policy").glob("*.safetensors") for n, t in load_file(str(part)).items()}
    assert len(list((run_dir / "policy").glob("*.safetensors"))) > 1  # written in parts, by each stage's leader
    kept = load_file(str(saved / "trainer" / "model.safetensors"))
    assert sorted(policy) == sorted(kept) and all(torch.equal(policy[n], kept[n]) for n in kept)
    names = ["optimizer-0.pt", "optimizer-1.pt"]
    files = [torch.load(saved / "trainer" / name, weights_only=True) for name in names]
    layout = {"trainer.backend": "megatron", "trainer.tensor_parallel_size": 1, "trainer.pipeline_parallel_size": 2}
    assert [(f["coordinate"], f["layout"]) for f in files] == [(0, layout), (1, layout)]
    assert all(int(e["step"]) == 2 for f in files for e in f["optimizer"]["state"].values())
    audit = audit_run(run_dir)
    assert audit["retries"] == audit["api_errors"] == audit["duplicate_request_ids"] == 0, audit

    process = train([*args, "steps=3", "resume=auto"], run_dir, env=QUIET)
    code, out, err = finish(process, 600)
    assert code == 0, err[-3000:]
    assert wait_until_gone(process) == []
    assert f"resuming from {saved} (step 2 of 3)" in out
    log = (run_dir / "train.log").read_text()
    for coordinate, f in enumerate(files):  # rank j is the core's stage j
        digest = state_digest({"optimizer": f["optimizer"], "rng": f["rng"]})
        said = f"[rank {coordinate}] gyre.runtime.cell.trainers: optimizer state of in-cell coordinate {coordinate} "
        assert said in log
        assert f"{saved / 'trainer' / names[coordinate]} (digest {digest})" in log, log[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
