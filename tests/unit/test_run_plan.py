"""The run plan (gyre/runtime/job/plan.py; docs/runtime.md, "The run plan"): built once, each check once, one error
type, no torch, and what the ranks receive.

The counting test wraps every check the plan and the config make (the plan's `CHECKS`, and the `TrainConfig` checks
of gyre/config/train.py) with a counter, builds a plan of the CPU demo's shape (4 cells, the demo recipe, the tiny
model at random init), hands it on as a plainly launched job hands it to its workers (pickled), makes the run's
sandbox from it, and counts: every check ran exactly once.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import pickle
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import gyre.config.train as config_train
import gyre.runtime.job.plan as plan_module
from gyre.config import TrainConfig
from gyre.config.engine import EngineConfig
from gyre.config.harness import HarnessConfig
from gyre.config.model import ModelConfig
from gyre.config.tasks import TasksConfig
from gyre.recipes.demo import DemoRecipe
from gyre.runtime.job.plan import CHECKS, PlanError, RunPlan, build_plan, plan_layout, run_sandbox

ROOT = Path(__file__).resolve().parents[2]
# The checks TrainConfig makes at construction (gyre/config/train.py), each a function of that module's namespace.
CONFIG_CHECKS = (
    "check_resume",
    "check_capacity",
    "check_packing_matches_algo",
    "check_behavior_sampling",
    "check_cell_layout",
    "check_engine",
    "check_engine_slots",
    "check_tiny_model_layout",
    "check_context_limit",
)
# Functions of gyre.config or the harness setup that the plan calls through its own namespace.
PLAN_CALLS = ("layout_fields", "check_context_limit", "check_harness")


def demo_config(**fields) -> TrainConfig:
    """The CPU demo's shape, small: the tiny model at random init, 16 generated tasks, 2 held-out problems."""
    defaults = {
        "model": ModelConfig(init="random"),
        "tasks": TasksConfig(num_demo_tasks=16, num_held_out=2),
        "harness": HarnessConfig(backend="anthropic-http"),
    }
    return TrainConfig(**{**defaults, **fields})


def make_plan(cfg: TrainConfig, run_dir: Path) -> RunPlan:
    return build_plan(cfg, DemoRecipe(), run_dir, layout=plan_layout(cfg, cfg.world_size), echo=lambda line: None)


@pytest.fixture
def counted(monkeypatch) -> dict[str, int]:
    """Every check of the config and the plan wrapped with a counter (one counter per function)."""
    counts: dict[str, int] = {}
    wrappers: dict[int, object] = {}

    def wrap(module, name: str) -> None:
        original = getattr(module, name)
        if id(original) not in wrappers:

            @functools.wraps(original)
            def counting(*args, **kwargs):
                counts[name] = counts.get(name, 0) + 1
                return original(*args, **kwargs)

            wrappers[id(original)] = counting
        monkeypatch.setattr(module, name, wrappers[id(original)])

    for name in CONFIG_CHECKS:
        wrap(config_train, name)
    for name in (*CHECKS, *PLAN_CALLS):
        wrap(plan_module, name)
    return counts


def test_a_plan_runs_each_check_once_and_its_ranks_check_nothing_again(counted, tmp_path):
    cfg = demo_config()
    plan = make_plan(cfg, tmp_path / "run")
    handed = pickle.loads(pickle.dumps(plan))  # what a plainly launched job's workers receive
    run_sandbox(handed)  # rank 0 makes the run's sandbox from the plan
    expected = {name: 1 for name in (*CONFIG_CHECKS, *CHECKS, *PLAN_CALLS)}
    assert counted == expected
    assert handed.layout == plan.layout and handed.layout.world_size == 4 and handed.layout.num_cells == 4
    assert handed.model.model_type and handed.context_limit == cfg.proxy.context_limit
    assert handed.start.trainer_dir == handed.model_dir and handed.checkpoint is None
    assert len(handed.task_sets.train) == 16 and handed.task_sets.held_out.size == 2


def test_the_plan_is_what_the_ranks_receive_not_the_raw_config():
    """The worker entry and every rank's part take the plan (gyre/runtime/job/program.py); the rank-0 set-up too."""
    import inspect

    from gyre.runtime.controller.setup import run_controller
    from gyre.runtime.job.program import run_rank, run_worker

    assert list(inspect.signature(run_worker).parameters) == ["plan"]
    assert next(iter(inspect.signature(run_rank).parameters)) == "plan"
    assert next(iter(inspect.signature(run_controller).parameters)) == "plan"


def test_no_module_after_the_plan_calls_a_check_again():
    """Static: outside the plan (and the config that defines them), no runtime module names a check of the plan or
    of the config. The one exception is a node's harness host, which checks its own node's harness
    (docs/cluster.md, "Harness hosts on every node")."""
    names = set(CHECKS) | set(CONFIG_CHECKS) | {"layout_fields", "validate_layout", "check_harness"}
    allowed = {"gyre/runtime/job/plan.py": names, "gyre/runtime/job/program.py": {"check_harness"}}
    found = []
    for path in sorted((ROOT / "gyre" / "runtime").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name in names and name not in allowed.get(relative, set()):
                found.append(f"{relative}:{node.lineno}: {name}")
    assert found == []


def test_building_a_plan_imports_no_torch(tmp_path):
    """A fresh interpreter builds the demo's plan on a model directory and a task set on disk: no torch, no
    megatron (the tiny model is made here first, by this process)."""
    from gyre.models.tiny import tiny_model_dir

    model_dir = tiny_model_dir(spec=ModelConfig().tiny)
    probe = textwrap.dedent(
        f"""
        import json, sys
        from pathlib import Path
        from gyre.config import TrainConfig
        from gyre.config.harness import HarnessConfig
        from gyre.config.model import ModelConfig
        from gyre.config.tasks import TasksConfig
        from gyre.recipes.demo import DemoRecipe
        from gyre.runtime.job.plan import build_plan, plan_layout
        cfg = TrainConfig(
            model=ModelConfig(model_dir={str(model_dir)!r}),
            tasks=TasksConfig(num_demo_tasks=8, num_held_out=2),
            harness=HarnessConfig(backend="anthropic-http"),
        )
        plan = build_plan(cfg, DemoRecipe(), Path({str(tmp_path / "run")!r}), layout=plan_layout(cfg, 4), echo=print)
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron"))))
        """
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda cfg, tmp: (cfg, 3), "world_size"),
        (lambda cfg, tmp: (demo_config(engine=EngineConfig(backend="sglang")), 4), "engine.backend"),
        (lambda cfg, tmp: (demo_config(model=ModelConfig(model_dir=str(tmp / "nothing"))), 4), "model.model_dir"),
        (lambda cfg, tmp: (demo_config(resume=str(tmp / "no-checkpoint")), 4), "resume"),
        (
            lambda cfg, tmp: (demo_config(tasks=TasksConfig(task_dir=str(tmp / "no-tasks"), eval_every=0)), 4),
            "tasks.task_dir",
        ),
    ],
)
def test_a_mistake_is_one_plan_error_naming_its_field(change, field, tmp_path):
    cfg, world_size = change(demo_config(), tmp_path)
    with pytest.raises(PlanError) as error:
        build_plan(cfg, DemoRecipe(), tmp_path / "run", layout=plan_layout(cfg, world_size), echo=lambda line: None)
    message = str(error.value)
    assert message.startswith(field) and "\n" not in message, message


def test_a_busy_proxy_port_is_one_plan_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cfg = demo_config(proxy=dataclasses.replace(TrainConfig().proxy, port=busy.getsockname()[1]))
        with pytest.raises(PlanError, match=r"^proxy\.port="):
            make_plan(cfg, tmp_path / "run")
