"""`python -m gyre.train` as a user runs it: a real subprocess, the warm-started tiny model, the builtin harness on
demo tasks, 4 cells on 4 gloo worker processes started by the program itself (docs/runtime.md, "The program").

- A 2-step elastic run (the CI smoke of the SPMD program) completes with exit 0 and writes every output:
  metrics.jsonl (one line per step, strict JSON), held_out.jsonl (before the first step and after the last),
  summary.json with the simulator's keys, role_timeline.png, policy/ that loads as a checkpoint with its chat
  template, W&B offline, the record files; every model call the proxy admitted is recorded exactly once (its
  counters vs the record files), none failed or was refused; no process of the run is left. Every cell's engine
  endpoint answers a call without the job's secret with 401 while the run goes, and the secret (set by the test as
  $GYRE_JOB_SECRET) is written to no file of the run directory.
- Ctrl-C mid-run (SIGINT to the foreground process group, as a terminal sends it) exits 130 within 10 s with
  metrics, timeline and summary written, and no process left.
- Megatron cells: 2 cells x TP 2 on 4 processes run 2 steps of a burst with the satellite cell training beside
  the core (it pulls the core's shards) and a publication (the core's shards gathered into the engines' HF
  layout, the engines updated, `policy/` written), every output as above; the satellite pulls over Mooncake where
  it imports (`trainer.weight_transport=auto`), else over the store. The cells serve SGLang's stand-in: one
  `sglang.Engine` of tp_size 2 per cell whose 2 workers join a weight group of 3 with rank 0, each publication
  broadcast by rank 0 over it (`update_weights_from_distributed`).
- A user's mistakes exit 2 with one line naming the field: a world size that does not fit the cells (under
  torchrun's variables), pipeline stages the model's layers do not split into, a model a Megatron cell cannot
  shard, a model directory without a checkpoint, a bad value, a held-out directory that is not there, a recipe
  that does not exist, a `$GYRE_JOB_SECRET` that cannot be sent (named, its value not shown), a busy proxy port.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from gyre.distributed.local import HOST

pytestmark = pytest.mark.warm_start  # tests/conftest.py: ordered after the modules that do not need it
ROOT = Path(__file__).resolve().parents[2]
SMALL = [  # 4 cells x C_e 8 (the default cluster), groups of 4, steps of 2 groups, 2 steps per burst
    "algo.mu=2",
    "algo.group_size=4",
    "algo.batch_groups=2",
    "algo.tau_s=0",  # a satellite may join as soon as a ready group waits: the control plane is exercised
    "tasks.num_demo_tasks=64",
    "tasks.num_held_out=4",  # the held-out path runs the same with 4 problems as with 8 (each is a harness process)
    "tasks.demo.max_digits=1",  # single-digit sums: a group's rewards usually differ, so the weights move
    "harness.max_turns=4",
    "logging.wandb=offline",
    "logging.progress_every_s=0",
    # The builtin harness on the Messages API without an SDK: the same requests and records, and each harness
    # process starts ~1.5 CPU s sooner than with the Anthropic SDK (docs/testing.md). The SDKs' own paths through the
    # program: the README's main command and test_demo_end_to_end.py (both SDKs).
    "harness.backend=anthropic-http",
]
# Runs that prove a launch, a stop or a rank's death, not what a step learns: groups of 2 (4 executions a step, so
# half the harness processes, ~1.3 CPU s each); every step still trains two groups.
PAIRS = ["algo.group_size=2"]
SIM_SUMMARY_KEYS = {
    "experiment",
    "mode",
    "phi",
    "mu",
    "total_time_s",
    "total_time_h",
    "steps",
    "step_times_s",
    "staleness",
    "utilization",
    "counters",
    "outcomes",
    "transitions",
    "reroutes",
}


def pid_of_rank(marker: str, rank: int, run_dir: Path, timeout_s: float = 60.0) -> int:
    """The PID of the job's worker of `rank`: the one train.log names (`gyre.runtime.job.spmd: job ready: rank 2: ...;
    pid N`, the last such line; a plainly launched job's ranks all log there), else the `gyre.train` process with
    RANK=`rank` and `marker` (the run's GYRE_TEST_RUN) in its environment (torchrun's workers, which log to train.log
    on rank 0 only).

    Not any process with RANK in /proc/<pid>/environ: a plainly launched job's workers fork from a forkserver and set
    RANK after they start (their /proc environ lacks it), while rank 0's wandb-core, exec'd by rank 0, has RANK=0 in
    its environment (a test killed it instead of rank 0)."""
    deadline = time.monotonic() + timeout_s
    log = run_dir / "train.log"
    pattern = re.compile(rf"\[rank {rank}\] gyre\.runtime\.job\.spmd: job ready: .*; pid (\d+)$", re.M)
    ours, of_rank = f"GYRE_TEST_RUN={marker}".encode(), f"RANK={rank}".encode()
    while time.monotonic() < deadline:
        named = pattern.findall(log.read_text() if log.is_file() else "")
        candidates = [int(named[-1])] if named else [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]
        for pid in candidates:
            try:
                environ = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if ours in environ and (named or (of_rank in environ and b"gyre.train" in cmdline)):
                return pid
        time.sleep(0.2)
    raise AssertionError(f"no live worker of rank {rank} found (train.log: {log})")


def train(args: list[str], run_dir: Path, env: dict | None = None) -> subprocess.Popen:
    marker = uuid.uuid4().hex
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GYRE_TEST_RUN": marker, **(env or {})}
    stderr = open(run_dir.parent / f"stderr-{marker}.log", "w+")  # noqa: SIM115 (closed by finish; a full pipe would block the logging)
    process = subprocess.Popen(
        [sys.executable, "-m", "gyre.train", *args, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        start_new_session=True,  # a process group of its own, as a terminal's foreground job
    )
    process.marker, process.run_dir, process.stderr_file = marker, run_dir, stderr
    return process


def left_of(process: subprocess.Popen) -> list[str]:
    """Processes of the run still alive: its workers (they carry the marker in their environment) and its
    harnesses and evaluators (they run in the run directory; their environment is their own)."""
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            cwd = os.readlink(entry / "cwd")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if process.marker.encode() in environ or cwd.startswith(str(process.run_dir)):
            left.append(f"{entry.name}: {cmdline[:200]}")
    return left


def finish(process: subprocess.Popen, timeout_s: float) -> tuple[int, str, str]:
    try:
        out, _ = process.communicate(timeout=timeout_s)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    process.stderr_file.seek(0)
    err = process.stderr_file.read()
    process.stderr_file.close()
    return process.returncode, out, err


class EndpointProbe(threading.Thread):
    """While a run goes, calls every engine endpoint its train.log names ("engine endpoint serving at <url>")
    without the job's secret, once each: `answers` maps the URL to the HTTP statuses of GET /load and POST
    /update_weights (an endpoint that is gone by then: no entry)."""

    def __init__(self, log_path: Path):
        super().__init__(daemon=True)
        self.log_path, self.answers, self.done = log_path, {}, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
            for url in re.findall(r"engine endpoint serving at (http://\S+)", text):
                if url not in self.answers:
                    self.answers[url] = [self.status(url + "/load", None), self.status(url + "/update_weights", b"")]

    @staticmethod
    def status(url: str, body: bytes | None) -> int | None:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=10) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code
        except OSError:
            return None

    def stop(self) -> dict[str, list]:
        self.done.set()
        self.join(30)
        return {url: statuses for url, statuses in self.answers.items() if None not in statuses}


def trace_lanes(run_dir: Path) -> list[str]:
    return json.loads((run_dir / "timeline.json").read_text())["lanes"]


def wait_until_gone(process: subprocess.Popen, timeout_s: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := left_of(process)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.slow
def test_a_two_step_run_completes_and_writes_every_output(tmp_path):
    from gyre.models.hf_weights import load_pretrained
    from gyre.obs.record import record_from_dict
    from gyre.proxy.render import ChatTemplate
    from gyre.runtime.audit import audit_run
    from gyre.runtime.controller.execution_log import read_executions
    from gyre.traj.store import load_tree

    run_dir = tmp_path / "run"
    secret = "job-secret-" + uuid.uuid4().hex
    process = train(
        [*SMALL, "steps=2", "tasks.eval_every=5", "proxy.sampling.seed=7"], run_dir, env={"GYRE_JOB_SECRET": secret}
    )
    probe = EndpointProbe(run_dir / "train.log")
    probe.start()
    try:
        code, out, err = finish(process, 900)
    finally:
        refused = probe.stop()
    assert code == 0, err[-3000:]
    assert wait_until_gone(process) == []
    # Every cell's engine endpoint refused a call without the job's secret (401), and the secret is in no output.
    assert len(refused) == 4 and all(statuses == [401, 401] for statuses in refused.values()), refused
    leaks = [str(path) for path in run_dir.rglob("*") if path.is_file() and secret.encode() in path.read_bytes()]
    assert leaks == [] and secret not in out + err, leaks
    end = json.loads(out.strip().splitlines()[-1])
    assert end["end"] == "completed" and end["steps"] == 2 and end["run_dir"] == str(run_dir)

    records = [record_from_dict(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r.step for r in records] == [0, 1]
    assert all(r.reward_mean is not None and r.train_tokens > 0 and r.grad_norm is not None for r in records)
    assert all(0 <= r.loss["clip_fraction"] <= 1 and r.loss["abs_log_ratio_mean"] >= 0 for r in records), records
    assert records[0].transitions and records[0].transitions[0].to == "training"
    held = [json.loads(line) for line in (run_dir / "held_out.jsonl").read_text().splitlines()]
    assert [line["version"] for line in held] == [0, 2] and all(line["episodes"] == 4 for line in held)
    assert end["held_out_pass_rate"] == {"first": held[0]["pass_rate"], "last": held[-1]["pass_rate"]}

    summary = json.loads((run_dir / "summary.json").read_text())
    # the simulator's keys, and what the real steps trained
    assert set(summary) == SIM_SUMMARY_KEYS | {"training", "role_time_s"} and summary["steps"] == 2
    assert summary["mode"] == "elastic" and list(summary["role_time_s"]) == trace_lanes(run_dir)
    assert summary["training"]["trained_steps"] == 2 and summary["training"]["nothing"] is False
    assert (run_dir / "role_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((run_dir / "wandb").glob("offline-run-*")), "W&B offline run missing"
    use = summary["utilization"]
    assert 0 < use["rollout"] < 1 and 0 < use["training"] < 1 and use["idle"] >= 0, use
    assert all(r.train_compute_s > 0 for r in records), records
    trace = json.loads((run_dir / "timeline.json").read_text())
    assert len(trace["loads"]) == 4 and len(trace["step_ends_s"]) == len(records)
    assert all(abs(t - r.wall_time_s) < 1.0 for t, r in zip(trace["step_ends_s"], records, strict=True)), trace
    lines = read_executions(run_dir / "executions.jsonl")
    assert len(lines) == summary["counters"]["started"] and len({x.execution for x in lines}) == len(lines)
    closed = [x for x in lines if x.outcome is not None]
    assert closed and all(x.start_s <= x.harness_end_s <= x.end_s for x in closed), closed[:3]
    assert sum(x.outcome == "completed" for x in lines) == summary["outcomes"]["completed"], summary["outcomes"]

    policy = run_dir / "policy"
    assert json.loads((policy / "policy.json").read_text())["version"] == 2
    load_pretrained(policy)
    ChatTemplate.from_pretrained(policy)

    # Every call the proxy served is in exactly one record file, once (request ids distinct).
    calls = 0
    for path in sorted((run_dir / "records").glob("*.jsonl")):
        tree = load_tree(path)
        assert len({c.meta.request_id for c in tree.calls}) == len(tree.calls), path.name
        calls += len(tree.calls)
    proxy_lines = [line for line in (run_dir / "train.log").read_text().splitlines() if "proxy: calls" in line]
    assert proxy_lines, "the run logs the proxy's counters at its end"
    counts = json.loads(proxy_lines[-1].split("proxy: calls ", 1)[1])
    assert counts["recorded"] == calls > 0 and counts["failed"] == counts["refused"] == 0, counts
    assert counts["requests"] == counts["admitted"] == counts["answered"] + counts["hung_up"], counts
    # Every answered call is recorded; a call hung up on (executions cancelled at the run's end) is recorded when it
    # had sampled tokens (docs/proxy.md, "Counters").
    assert counts["answered"] <= calls <= counts["answered"] + counts["hung_up"], counts
    audit = audit_run(run_dir)  # what the harnesses' own transcripts say
    assert audit["retries"] == audit["api_errors"] == audit["duplicate_request_ids"] == 0, audit
    assert audit["calls_recorded"] == calls and audit["proxy"] == counts, audit
    assert audit["ends"].get("answered", 0) >= 1, audit
    print(f"2-step run: {len(records)} steps, {calls} calls recorded, proxy {counts}, harness ends {audit['ends']}")


def mooncake_missing() -> str | None:
    from gyre.distributed.transport_mooncake import import_transfer_engine

    try:
        import_transfer_engine()
    except ImportError as error:
        return str(error)
    return None


@pytest.mark.slow
def test_megatron_cells_of_two_tensor_parallel_ranks_train_with_a_satellite_and_publish(tmp_path):
    from safetensors import safe_open
    from test_train_sglang_standin import calls_by_engine, check_adapter_calls, standin_env

    from gyre.models.hf_weights import load_pretrained
    from gyre.obs.record import record_from_dict
    from gyre.runtime.audit import audit_run

    run_dir = tmp_path / "run"
    # Colocate, one step a burst: both cells train every step (cell 1 a satellite: it pulls the core's shards at its
    # first step of a burst, its gradients are summed onto the core's ranks), each step is published (the core's
    # shards gathered into the engines' layout), both cells return to rollout. Whether an elastic satellite joins
    # a step in flight depends on timing; docs/runtime.md, "Megatron cells", has the measured runs.
    # In bf16 (the GPU default) with the engines in fp32: fp32 main weights on both cells, the satellite's fp32
    # gradients summed onto the core's, and the publication cast once into the engines' dtype. Megatron in fp32 is
    # the unit and integration tests' (test_train_tp.py, test_train_streaming.py, test_train_pipeline.py).
    args = [*SMALL, *MEGATRON_TP2, "algo=colocate", "algo.mu=1", "steps=2", "tasks.eval_every=1"]
    args.append("trainer.dtype=bfloat16")
    # The cells serve SGLang's stand-in (test_train_sglang_standin.py): one sglang.Engine per cell, tp_size 2, its
    # two workers in a weight group of 3 with rank 0, over which rank 0 broadcasts each publication.
    args.append("engine.backend=sglang")
    standin_log = tmp_path / "standin.jsonl"
    env = {"PYTHONWARNINGS": "ignore", **standin_env(standin_log)}
    process = train([*args, "trainer.weight_transport=auto"], run_dir, env=env)
    code, out, err = finish(process, 900)
    assert code == 0, err[-3000:]
    engines = calls_by_engine(standin_log)
    inits = [c for calls in engines.values() for c in calls if c["call"] == "init"]
    assert len(engines) == 2 and [c["tp_size"] for c in inits] == [2, 2], engines
    groups = [c for calls in engines.values() for c in calls if c["call"] == "init_group"]
    assert [(g["world_size"], g["rank_offset"]) for g in groups] == [(3, 1), (3, 1)], groups
    updates = [c for calls in engines.values() for c in calls if c["call"] == "update_distributed"]
    # Each publication reaches both cells: the one after step 0, and the last one where the cells returned to
    # rollout before the run ended (timing; else it is policy/ only). Both workers of each received it.
    per_engine = [sum(c["call"] == "update_distributed" for c in calls) for calls in engines.values()]
    assert per_engine in ([1, 1], [2, 2]) and all(u["success"] and u["workers"] == 2 for u in updates), updates
    # The adapter's calls as test_train_sglang_standin.py checks them over HTTP, here on the weight-group path
    # (`engine.weight_sync=auto`; that module's second run until docs/testing.md's "Seventh round"): built first and
    # shut down last, released and resumed around training, each update inside a pause in place, on one path, no
    # call aborted, every call the proxy answered served by an engine.
    check_adapter_calls(standin_log, run_dir, "update_distributed", tp_size=2, groups=[(3, 1), (3, 1)])
    assert ("Transfer Engine" in err) == (mooncake_missing() is None), err[-3000:]  # Mooncake's own log lines
    assert wait_until_gone(process) == []
    end = json.loads(out.strip().splitlines()[-1])
    assert end["end"] == "completed" and end["steps"] == 2
    records = [record_from_dict(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r.step for r in records] == [0, 1] and [r.burst for r in records] == [0, 1]
    assert [r.training_cells for r in records] == [2, 2]
    assert all(r.train_tokens > 0 and r.grad_norm is not None and "seq_ratio_max" in r.loss for r in records)
    assert all(r.kv_migrations == 0 and r.calls_reprefilled >= 0 for r in records)  # SGLang exports no KV
    returned = {t.cell for r in records for t in r.transitions if t.to == "rollout"}
    assert returned == {0, 1}, [r.transitions for r in records]  # back to rollout with the publication
    log = (run_dir / "train.log").read_text()
    for rank, line in ((1, "(cell 0): trained steps [0, 1]"), (2, "(cell 1): trained steps [0, 1]")):
        assert f"rank {rank} {line}" in log, log[-3000:]  # the core's second rank, the satellite's leader
    assert "rank 3 (cell 1): trained steps [0, 1], pulled the core's weights at [0, 1]" in log, log[-3000:]
    # the policy directory is written after the engines have the version, by the core's stage leader
    assert log.index("published version 1:") < log.index("policy 1 written"), log[-3000:]
    held = [json.loads(line) for line in (run_dir / "held_out.jsonl").read_text().splitlines()]
    assert [line["version"] for line in held] == [0, 1, 2]
    policy = run_dir / "policy"
    assert json.loads((policy / "policy.json").read_text())["version"] == 2
    load_pretrained(policy)
    for part in policy.glob("*.safetensors"):  # the model's dtype (trainer.dtype), as a user's checkpoint is
        with safe_open(str(part), framework="pt") as weights:
            assert {weights.get_slice(name).get_dtype() for name in weights.keys()} == {"BF16"}  # noqa: SIM118
    audit = audit_run(run_dir)
    assert audit["retries"] == audit["api_errors"] == audit["duplicate_request_ids"] == 0, audit
    assert audit["proxy"]["failed"] == audit["proxy"]["refused"] == 0, audit
    norms = [round(r.grad_norm, 3) for r in records]
    print(f"megatron 2 cells x TP 2: training cells {[r.training_cells for r in records]}, grad norms {norms}")


@pytest.mark.slow
def test_ctrl_c_mid_run_exits_promptly_with_its_outputs_written(tmp_path):
    run_dir = tmp_path / "run"
    # In the Async baseline (two cells train throughout, two roll out): a stop proves the same in any mode, and so
    # the suite also runs the third mode end to end (elastic: the two-step run; colocate: the Megatron run).
    args = [*SMALL, *PAIRS, "algo=async", "algo.train_cells=2", "steps=50", "tasks.eval_every=0"]
    process = train(args, run_dir)
    deadline = time.monotonic() + 600
    seen = ""
    while time.monotonic() < deadline:  # wait for the first step's progress line
        line = process.stdout.readline()
        if not line:
            break
        seen += line
        if line.startswith("step 1/50"):
            break
    assert "step 1/50" in seen, seen[-2000:]
    time.sleep(2.0)  # into the rollout of the next step
    os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground job
    started = time.monotonic()
    code, _, err = finish(process, 60)
    elapsed = time.monotonic() - started
    assert code == 130, err[-3000:]
    assert elapsed < 10.0, elapsed
    assert wait_until_gone(process, 5.0) == []
    assert (run_dir / "metrics.jsonl").read_text().count("\n") >= 1
    assert json.loads((run_dir / "summary.json").read_text())["steps"] >= 1
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["roles"] == ["training", "training", "rollout", "rollout"], first["roles"]  # async's fixed split
    assert (run_dir / "role_timeline.png").is_file()
    print(f"ctrl-c: exit {code} after {elapsed:.1f}s")


def busy_port() -> socket.socket:
    sock = socket.socket()
    sock.bind((HOST, 0))
    sock.listen()
    return sock


MEGATRON_TP2 = [
    "trainer.backend=megatron",
    "trainer.tensor_parallel_size=2",
    "cluster.num_cells=2",
    "cluster.cell_size=2",
]
ONE_CELL_OF_4 = ["cluster.num_cells=1", "cluster.cell_size=4"]
ONE_CELL_OF_3 = ["cluster.num_cells=1", "cluster.cell_size=3"]  # 3 stages: the tiny model's 4 layers do not split
TORCHRUN_3 = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": HOST, "MASTER_PORT": "29999"}


@pytest.mark.parametrize(
    ("args", "env", "names"),
    [
        ([], TORCHRUN_3, "world_size"),  # 3 processes for the default 4 cells
        (["trainer.backend=megatron", "trainer.pipeline_parallel_size=3", *ONE_CELL_OF_3], None, "pipeline_parallel"),
        (["trainer.backend=megatron", "trainer.tensor_parallel_size=4", *ONE_CELL_OF_4], None, "tensor_parallel_size"),
        (["model.model_dir=/nonexistent/model"], None, "model.model_dir"),
        (["steps=0"], None, "steps"),
        (["packing.group_size=3"], None, "packing.group_size"),
        (["harness.isolate_user=maybe"], None, "harness.isolate_user"),
        (["tasks.held_out_dir=/nonexistent/held_out"], None, "tasks.held_out_dir"),
        (["tasks.demo.context_words=900"], None, "tasks.demo.context_words"),  # 2,892 tokens of notes > 1,024
        (["recipe=nope"], None, "recipe"),  # no conf/recipe/nope.yaml
        (["recipe.name=gyre.nowhere:Recipe"], None, "recipe.name"),  # a recipe of one's own that does not import
        ([], {"GYRE_JOB_SECRET": "two words"}, "GYRE_JOB_SECRET"),  # the line names it, never shows its value
    ],
)
def test_a_user_mistake_exits_2_with_one_line_naming_it(tmp_path, args, env, names):
    code, _, err = finish(train([*args, "logging.wandb=disabled"], tmp_path / "run", env), 300)
    lines = [line for line in err.splitlines() if line.startswith("gyre.train:")]
    assert code == 2, err[-2000:]
    assert len(lines) == 1 and names in lines[0], err[-2000:]
    assert "Traceback" not in err and "two words" not in err


@pytest.mark.slow
def test_a_busy_proxy_port_exits_2_naming_it(tmp_path):
    with busy_port() as sock:
        port = sock.getsockname()[1]
        args = [*SMALL, "steps=1", f"proxy.port={port}", "logging.wandb=disabled"]
        code, _, err = finish(train(args, tmp_path / "run"), 300)
    assert code == 2, err[-2000:]
    line = [line for line in err.splitlines() if line.startswith("gyre.train:")]
    assert len(line) == 1 and "port" in line[0] and str(port) in line[0], err[-2000:]
    assert "Traceback" not in err
