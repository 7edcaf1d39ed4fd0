"""`python -m gyre.train engine.backend=sglang`: without SGLang one line naming the `gpu` extra, exit 2; with gyre's
SGLang stand-in first on PYTHONPATH (`gyre.engine.sglang_standin`: SGLang's surface over the native engine, since
SGLang needs a GPU), a 2-step run through the SGLang adapter in every cell: each cell's leader builds one
`sglang.Engine` (tp_size = the cell's size), a cell that swaps to training releases its memory
(`release_memory_occupation`) and resumes it (`resume_memory_occupation`) when it comes back, each publication
reaches the engines inside a pause in place, and no call is aborted. Both publication paths: rank 0's broadcast
over each engine's weight group (`engine.weight_sync=auto`: `init_weights_update_group`,
`update_weights_from_distributed`), and the weights sent to each engine's endpoint (`engine.weight_sync=http`:
`update_weights_from_tensor`). The stand-in logs every call it gets (`$GYRE_SGLANG_STANDIN_LOG`). Cells of 2 ranks
(tp_size 2, a weight group of 3) run in test_train_program.py's Megatron TP 2 test."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest
from test_train_program import ROOT, SMALL, finish, train, wait_until_gone

from gyre.engine.sglang_standin import PATH as STANDIN

pytestmark = pytest.mark.warm_start


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_without_sglang_the_backend_is_one_line_naming_the_gpu_extra(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "gyre.train", "engine.backend=sglang", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert lines[-1].startswith("gyre.train: config error: engine.backend=sglang: the sglang package is not installed")
    assert "gpu extra" in lines[-1] and "Traceback" not in done.stderr


def standin_env(log_path) -> dict[str, str]:
    """The stand-in first on PYTHONPATH (so `import sglang` finds it in every rank), its calls logged to `log_path`."""
    path = os.pathsep.join(filter(None, [str(STANDIN), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "GYRE_SGLANG_STANDIN_LOG": str(log_path)}


def calls_by_engine(log_path) -> dict[int, list[dict]]:
    """The stand-in's logged calls, by the process of the engine that got them."""
    calls = defaultdict(list)
    for line in log_path.read_text().splitlines():
        call = json.loads(line)
        calls[call["pid"]].append(call)
    return calls


def check_adapter_calls(log_path, run_dir, update: str, *, tp_size: int, groups: list[tuple]) -> tuple[dict, list]:
    """What a run through the SGLang adapter must show in the stand-in's log (`update`: the publication path's call,
    `groups`: the (world_size, rank_offset) of each engine's weight group, none over HTTP): each engine built first
    and shut down last at `tp_size`; cells that went to training released their memory and resumed it before their
    update; every update succeeded, on one path only, inside a pause in place and a weight-update session, without
    flushing (the adapter flushes once nothing is in flight); no call aborted; the proxy answered
    exactly the calls the engines served. The engines' calls by process, and the updates."""
    engines = calls_by_engine(log_path)
    kinds = {pid: [c["call"] for c in calls] for pid, calls in engines.items()}
    assert all(k[0] == "init" and k[-1] == "shutdown" for k in kinds.values()), kinds
    assert all(c["tp_size"] == tp_size for calls in engines.values() for c in calls if c["call"] == "init")
    joined = [c for calls in engines.values() for c in calls if c["call"] == "init_group"]
    assert [(g["world_size"], g["rank_offset"], g["backend"]) for g in joined] == [(*g, "gloo") for g in groups], joined
    released = [pid for pid, k in kinds.items() if "release" in k]
    resumed = [pid for pid, k in kinds.items() if "resume" in k]
    assert released and resumed and set(resumed) <= set(released), kinds
    for pid in resumed:  # back from training: resumed before its update, and it serves after it
        k = kinds[pid]
        assert k.index("release") < k.index("resume") < k.index(update), k
    updates = [c for calls in engines.values() for c in calls if c["call"] == update]
    assert updates and all(u["success"] and u["tensors"] > 0 for u in updates), updates
    other = {"update": "update_distributed", "update_distributed": "update"}[update]
    assert not [c for calls in engines.values() for c in calls if c["call"] == other]  # one path only
    for k in kinds.values():  # every update inside a pause in place and a weight-update session (SGLang 0.5.23)
        for i, kind in enumerate(k):
            if kind == update:  # an idle engine's prefix cache is flushed before generation continues
                assert k[i - 2 : i + 2] == ["pause", "begin_update", update, "end_update"], k
                assert k[i + 2] == "continue" or k[i + 2 : i + 4] == ["flush", "continue"], k
    assert all(u["flush_cache"] is False for u in updates)
    assert all(c["mode"] == "in_place" for calls in engines.values() for c in calls if c["call"] == "pause")
    assert not [c for calls in engines.values() for c in calls if c["call"] == "abort"]  # no call aborted
    served = sum(k.count("generate") for k in kinds.values())
    log = (run_dir / "train.log").read_text()
    counts = json.loads([line for line in log.splitlines() if "proxy: calls" in line][-1].split("proxy: calls ", 1)[1])
    assert counts["answered"] == served and counts["failed"] == counts["refused"] == 0, (counts, served)
    return engines, updates


def test_a_two_step_run_goes_through_the_sglang_adapter(tmp_path):
    """Over HTTP (`engine.weight_sync=http`). Rank 0's broadcast over each engine's weight group
    (`engine.weight_sync=auto`) is `test_train_program.py`'s Megatron TP 2 run, checked with `check_adapter_calls`
    too (docs/testing.md, "Seventh round": it was a second run of this test)."""
    run_dir, log_path = tmp_path / "run", tmp_path / "standin.jsonl"
    env = standin_env(log_path)
    # Elastic, one step a burst, groups of 2: each step's burst ends with a publication to the engines that stayed
    # in rollout and to the cells that come back from training.
    args = [*SMALL, "algo.group_size=2", "algo.mu=1", "steps=2", "engine.backend=sglang"]
    process = train([*args, "engine.weight_sync=http"], run_dir, env=env)
    code, out, err = finish(process, 600)
    assert code == 0, err[-3000:]
    end = json.loads(out.strip().splitlines()[-1])
    assert end["end"] == "completed" and end["steps"] == 2

    engines, updates = check_adapter_calls(log_path, run_dir, "update", tp_size=1, groups=[])
    assert len(engines) == 4, engines.keys()  # one sglang.Engine per cell, each in its leader's process
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["train_tokens"] > 0 for r in records)
    # SGLang exports no KV: a reroute's calls in flight are re-prefilled, never migrated (counted per step).
    assert all(r["kv_migrations"] == 0 and r["calls_reprefilled"] >= 0 for r in records), records
    assert json.loads((run_dir / "policy" / "policy.json").read_text())["version"] == 2
    assert wait_until_gone(process) == []
    in_flight = [u["in_flight"] for u in updates]
    print(f"sglang stand-in: {len(updates)} updates (calls in flight then: {in_flight})")
