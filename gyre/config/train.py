"""Root config of the SPMD training program `python -m gyre.train` (conf/train.yaml) and the checks across its
sections.

`TrainConfig` composes the component configs as they are (`cluster` and `algo` exactly as the simulator reads them,
so one config can be simulated and run) plus the training run's own sections. Its defaults are the CPU demo: the
tiny model warm-started on the demo family, 4 cells of 1 slot, the builtin harness, N = 8 and B = 4.

Contract: a value a user can fix raises `ConfigError` (a ValueError) whose one-line message names the field, the
value and what is allowed (`gyre.config.checks`); the app prints that line and exits 2. `__post_init__` runs every
check that needs nothing but the config. Two checks need what only the job knows, and the program calls them once
it does: `layout_fields(cfg, world_size)` (does the job's size fit the cells?) and `check_context_limit(cfg,
max_position_embeddings)` (a checkpoint's context limit, read from its config.json; the tiny model's is checked at
construction). docs/configuration.md lists every field and check. Pure: stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gyre.config.algo import AlgoConfig
from gyre.config.checkpoint import CheckpointConfig, check_resume
from gyre.config.checks import require, require_int
from gyre.config.cluster import ClusterConfig
from gyre.config.engine import EngineConfig
from gyre.config.harness import ExecutionLimits, HarnessConfig
from gyre.config.loss import LossConfig
from gyre.config.model import ModelConfig
from gyre.config.obs import LoggingConfig
from gyre.config.packing import PackingConfig
from gyre.config.proxy import ProxyConfig, SamplingConfig
from gyre.config.publication import PublicationConfig
from gyre.config.recipe import RecipeConfig
from gyre.config.sim import check_capacity
from gyre.config.tasks import TasksConfig
from gyre.config.trainer import TrainerConfig, device_kind

# The CPU demo's shape: 4 cells of 1 slot serving 8 executions each, groups of N = 8, steps of B = 4 groups.
DEMO_CELLS = 4
DEMO_CELL_CAPACITY = 8
# conf/cluster/tiny.yaml's timings (minutes-long executions): what `python -m gyre.sim` assumes of this cluster.
DEMO_CLUSTER_TIMINGS = {"group_train_node_s": 120.0, "join_s": 10.0, "update_s": 10.0, "publish_s": 20.0}
DEMO_GROUP_SIZE = 8
DEMO_BATCH_GROUPS = 4
DEMO_TAU_S = 5.0  # a demo step takes seconds: the supply check's 60 s default would hold every transition back
# A demo episode is ~360 tokens (the ~300-token system prompt and tools block, then the turns); a call's context is
# capped well above that, and a micro-step holds one context, so a step of 32 executions is ~12 micro-steps that
# satellites can join mid-step.
DEMO_CONTEXT_LIMIT = 1024
DEMO_MAX_NEW_TOKENS = 128
# Every execution is a fresh harness process: the builtin harness's `import openai` costs ~0.45 CPU s, `import
# anthropic` ~1.3 (2 cores; docs/runtime.md, "Measured"), most of a demo execution's CPU.
DEMO_HARNESS_BACKEND = "openai"


@dataclass(kw_only=True)
class TrainConfig:
    """Root config of `python -m gyre.train` (conf/train.yaml); defaults: the CPU demo."""

    cluster: ClusterConfig = field(
        default_factory=lambda: ClusterConfig(
            num_cells=DEMO_CELLS, cell_size=1, cell_capacity=DEMO_CELL_CAPACITY, **DEMO_CLUSTER_TIMINGS
        )
    )
    """K cells of cell_size ranks (TP x PP of the trainer), C_e executions per rollout cell, C_s over separate_size
    rollout ranks; its timing fields are the simulator's model (a real run measures them)."""
    algo: AlgoConfig = field(
        default_factory=lambda: AlgoConfig(group_size=DEMO_GROUP_SIZE, batch_groups=DEMO_BATCH_GROUPS, tau_s=DEMO_TAU_S)
    )
    """The RL schedule (mode elastic|colocate|async, phi, mu, N, B, supply check, J_max)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The starting policy: a checkpoint directory, or the tiny model (warm-started by default)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The training cells' backend (native|megatron), its TP x PP, the optimizer."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The native engine every rollout cell serves."""
    proxy: ProxyConfig = field(
        default_factory=lambda: ProxyConfig(
            context_limit=DEMO_CONTEXT_LIMIT, sampling=SamplingConfig(max_new_tokens=DEMO_MAX_NEW_TOKENS)
        )
    )
    """The proxy the harnesses call (a thread on rank 0) and how rollouts sample."""
    packing: PackingConfig = field(
        default_factory=lambda: PackingConfig(
            batch_groups=DEMO_BATCH_GROUPS, group_size=DEMO_GROUP_SIZE, max_tokens_per_microstep=DEMO_CONTEXT_LIMIT
        )
    )
    """The stream packing buffer; batch_groups and group_size are algo's B and N (conf/train.yaml interpolates)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss's thresholds (Eq. 5-6)."""
    harness: HarnessConfig = field(default_factory=lambda: HarnessConfig(backend=DEMO_HARNESS_BACKEND))
    """Which harness runs each execution, in which sandbox (the builtin one on the OpenAI SDK: the lighter start)."""
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    """Where the starting model and the tasks come from when model.model_dir and tasks.task_dir are empty."""
    tasks: TasksConfig = field(default_factory=TasksConfig)
    """The training task set, the held-out set and the evaluation interval."""
    limits: ExecutionLimits = field(default_factory=ExecutionLimits)
    """Ceilings on every execution's budgets (a task's own are capped by them) and the sandbox's rlimits."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Console progress, metrics.jsonl, W&B, role_timeline.png."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When the run writes its checkpoints (`<run dir>/checkpoints/`) and how many it keeps."""
    publication: PublicationConfig = field(default_factory=PublicationConfig)
    """The weight stream's bucket size and how often the published weights are written as the policy directory."""
    resume: str = "never"
    """never: start afresh (a run directory holding checkpoints is refused); auto: from the latest complete checkpoint
    of the run directory, afresh if there is none (what a restarted torchrun or slurm job runs); or the path of one
    checkpoint directory."""
    steps: int = 16
    """Training steps (optimizer updates) to run; the CPU demo's 16 take ~7 minutes on 2 cores."""
    seed: int = 0
    """Seed of the run: demo task generation, task draws, the trainer (not the warm start's); the rollouts' sampling
    too with `proxy.sampling.seed: ${seed}` (null there: unseeded)."""

    def __post_init__(self) -> None:
        require_int("steps", self.steps, ge=1)
        require_int("seed", self.seed, ge=0)
        check_resume(self.resume)
        check_capacity(self.cluster, self.algo)
        check_packing_matches_algo(self.packing, self.algo)
        check_behavior_sampling(self.proxy.sampling)
        check_cell_layout(self.cluster, self.trainer)
        check_engine(self.engine, self.trainer)
        check_engine_slots(self.engine, self.cluster)
        check_policy_every(self)
        if self.model.uses_tiny:
            check_tiny_model_layout(self)
            check_context_limit(self, self.model.tiny.max_position_embeddings)

    @property
    def world_size(self) -> int:
        """Processes the job has: the cells' ranks, then the separate rollout pool's."""
        return expected_world_size(self.cluster)


def expected_world_size(cluster: ClusterConfig) -> int:
    """K * cell_size + separate_size: ranks of the cells (core first), then those of the separate rollout pool."""
    return cluster.num_cells * cluster.cell_size + cluster.separate_size


def layout_fields(cfg: TrainConfig, world_size: int) -> dict[str, int]:
    """The fields of `gyre.distributed.Layout` for a job of `world_size` processes (`Layout(**layout_fields(...))`),
    or ConfigError when the job does not fit the cells or a device names one GPU for every rank.

    gyre.config imports no other gyre package (docs/architecture.md, import rules), so the program builds the
    Layout from these fields."""
    require_int("world_size", world_size, ge=1)
    cl = cfg.cluster
    expected = expected_world_size(cl)
    hint = ""
    if cl.separate_size == 0 and world_size % cl.cell_size == 0:
        hint = f"; or cluster.num_cells={world_size // cl.cell_size} for {world_size} processes"
    require(
        world_size == expected,
        "world_size",
        world_size,
        f"cluster.num_cells * cluster.cell_size + cluster.separate_size = {cl.num_cells} * {cl.cell_size} + "
        f"{cl.separate_size} = {expected} processes (torchrun --nproc-per-node, srun --ntasks){hint}",
    )
    if world_size > 1:
        for name, device in (("engine.device", cfg.engine.device), ("trainer.device", cfg.trainer.device)):
            require(
                ":" not in device,
                name,
                device,
                f"{device_kind(device)} without an index in a job of {world_size} processes (each rank uses its local "
                "device, LOCAL_RANK)",
            )
    return {
        "world_size": world_size,
        "num_cells": cl.num_cells,
        "cell_size": cl.cell_size,
        "num_rollout_ranks": cl.separate_size,
    }


def check_context_limit(cfg: TrainConfig, max_position_embeddings: int) -> int:
    """The context limit of the run's model calls (proxy.context_limit, 0: the model's max_position_embeddings);
    ConfigError when the proxy allows more than the model or a micro-step cannot hold one whole context."""
    require_int("max_position_embeddings", max_position_embeddings, ge=1)
    limit = cfg.proxy.context_limit
    require(
        limit <= max_position_embeddings,
        "proxy.context_limit",
        limit,
        f"an integer <= the model's max_position_embeddings ({max_position_embeddings}), or 0 for it",
    )
    limit = limit or max_position_embeddings
    budget = cfg.packing.max_tokens_per_microstep
    require(
        budget >= limit,
        "packing.max_tokens_per_microstep",
        budget,
        f"an integer >= the context limit {limit} (proxy.context_limit, 0 = the model's max_position_embeddings): "
        "a row is one call's whole context and is never split",
    )
    kv_budget = cfg.engine.max_total_tokens
    require(
        kv_budget == 0 or kv_budget >= limit,
        "engine.max_total_tokens",
        kv_budget,
        f"0 or an integer >= the context limit {limit}: an engine refuses a call that could never fit its KV budget",
    )
    return limit


def check_packing_matches_algo(packing: PackingConfig, algo: AlgoConfig) -> None:
    """The packer's B and N are the schedule's: it closes a batch after B groups of N executions."""
    for name in ("batch_groups", "group_size"):
        value, wanted = getattr(packing, name), getattr(algo, name)
        require(
            value == wanted,
            f"packing.{name}",
            value,
            f"algo.{name} ({wanted}): the packer closes a batch of the schedule's B groups of N executions "
            f"(conf/train.yaml sets packing.{name}: ${{algo.{name}}})",
        )


def check_behavior_sampling(sampling: SamplingConfig) -> None:
    """Rollouts sample one distribution the trainer can score: temperature T > 0, no top-p or top-k filter (the
    trainer's log-probs are log_softmax(logits / T), gyre.trainer.logprobs), and no client may change T."""
    require(
        sampling.temperature > 0,
        "proxy.sampling.temperature",
        sampling.temperature,
        "a number > 0 (rollouts sample; the trainer scores the tokens at this temperature)",
    )
    why = "the trainer's log-probs have no top-p/top-k filter, so the importance ratios would be biased"
    require(sampling.top_p == 1, "proxy.sampling.top_p", sampling.top_p, f"1 ({why})")
    require(sampling.top_k == 0, "proxy.sampling.top_k", sampling.top_k, f"0 ({why})")
    require(
        not sampling.honor_client,
        "proxy.sampling.honor_client",
        sampling.honor_client,
        "false (a harness's own temperature would make the behavior policy one the trainer does not score)",
    )


def check_cell_layout(cluster: ClusterConfig, trainer: TrainerConfig) -> None:
    """Every cell's ranks hold one model replica: cell_size = TP x PP x max(1, EP / TP) (a native cell has one rank;
    with more expert-parallel ranks than TP ranks, the cell holds EP / TP copies of the dense part: docs/moe.md)."""
    tp, pp, ep = trainer.tensor_parallel_size, trainer.pipeline_parallel_size, trainer.expert_parallel_size
    formula = f"trainer.tensor_parallel_size * trainer.pipeline_parallel_size = {tp} * {pp}"
    if ep > tp:
        formula = f"{formula} * (trainer.expert_parallel_size / trainer.tensor_parallel_size = {ep // tp})"
    require(
        cluster.cell_size == trainer.model_parallel_size,
        "cluster.cell_size",
        cluster.cell_size,
        f"{formula} = {trainer.model_parallel_size} (a cell's ranks hold one model replica; "
        f"trainer.backend={trainer.backend})",
    )


def check_policy_every(cfg: TrainConfig) -> None:
    """`publication.policy_every` other than 1 only where nothing needs a publication's weights after the core moved
    on: a cell that returns to rollout inside a burst (elastic and colocate modes) and a checkpoint taken inside a
    burst (mu > 1 with checkpoints) load them from the publication's policy directory (docs/runtime.md,
    "Publication")."""
    every = cfg.publication.policy_every
    if every == 1:
        return
    mode, mu = cfg.algo.mode, cfg.algo.mu
    require(
        mode == "async" and (mu == 1 or cfg.checkpoint.every_steps == 0),
        "publication.policy_every",
        every,
        f"1 with algo.mode={mode}, algo.mu={mu} and checkpoint.every_steps={cfg.checkpoint.every_steps}: cells that "
        "return to rollout inside a burst (elastic, colocate) and checkpoints inside a burst (mu > 1) load the last "
        "publication from its policy directory",
    )


def check_engine(engine: EngineConfig, trainer: TrainerConfig) -> None:
    """Every cell serves an embedded engine on the device its trainer uses, starting at version 0."""
    require(engine.enabled, "engine.enabled", engine.enabled, "true (every rollout cell serves its engine)")
    kind = device_kind(engine.device)
    require(
        kind == device_kind(trainer.device),
        "engine.device",
        engine.device,
        f"a {device_kind(trainer.device)} device like trainer.device={trainer.device!r} (a cell swaps between its "
        "engine and its trainer in one process)",
    )
    require(
        engine.policy_version == 0,
        "engine.policy_version",
        engine.policy_version,
        "0 (the starting policy is version 0; each publication adds one)",
    )


def check_engine_slots(engine: EngineConfig, cluster: ClusterConfig) -> None:
    """A rollout cell's engine decodes a call of each of its C_e executions at once, the separate pool's engine one
    of each of its C_s: the scheduler counts them as served, so executions beyond the engine's slots would queue
    inside the engine, where the scheduler cannot see them."""
    require(
        engine.max_running >= cluster.cell_capacity,
        "engine.max_running",
        engine.max_running,
        f"an integer >= cluster.cell_capacity ({cluster.cell_capacity}): a rollout cell's engine runs a call of "
        "each of its C_e executions at once (more would queue inside the engine, unseen by the scheduler)",
    )
    require(
        engine.max_running >= cluster.separate_capacity,
        "engine.max_running",
        engine.max_running,
        f"an integer >= cluster.separate_capacity ({cluster.separate_capacity}): the separate rollout pool's engine "
        "runs a call of each of its C_s executions at once (more would queue inside the engine, unseen by the "
        "scheduler)",
    )


def check_tiny_model_layout(cfg: TrainConfig) -> None:
    """The tiny model splits evenly over the trainer's TP x PP (a checkpoint's config.json is checked by the
    trainer when it builds the model: gyre.trainer.model.validate_layout)."""
    spec, tp, pp = cfg.model.tiny, cfg.trainer.tensor_parallel_size, cfg.trainer.pipeline_parallel_size
    for name in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(spec, name)
        require(
            value % tp == 0,
            f"model.tiny.{name}",
            value,
            f"a multiple of trainer.tensor_parallel_size ({tp}): each TP rank holds an equal share of the heads",
        )
    require(
        spec.num_hidden_layers % pp == 0,
        "model.tiny.num_hidden_layers",
        spec.num_hidden_layers,
        f"a multiple of trainer.pipeline_parallel_size ({pp}): each stage holds an equal share of the layers",
    )
