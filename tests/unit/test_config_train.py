"""`TrainConfig` (root of `python -m gyre.train`, conf/train.yaml): its defaults are the CPU demo and equal the YAML,
every bad value and every bad combination stops with ONE line naming the field, the value and what is allowed, and
Hydra composes conf/train.yaml with group choices and overrides."""

from __future__ import annotations

import dataclasses

import pytest

from gyre.config import (
    AlgoConfig,
    ClusterConfig,
    ConfigError,
    EngineConfig,
    HarnessConfig,
    LoggingConfig,
    ModelConfig,
    MooncakeConfig,
    PackingConfig,
    ProxyConfig,
    SamplingConfig,
    TasksConfig,
    TrainConfig,
    TrainerConfig,
    check_context_limit,
    layout_fields,
)
from gyre.config.harness import HARNESS_NAMES, ContainerConfig


def packing(batch_groups: int = 4, group_size: int = 8, budget: int = 1024) -> PackingConfig:
    return PackingConfig(batch_groups=batch_groups, group_size=group_size, max_tokens_per_microstep=budget)


def proxy(**fields) -> ProxyConfig:
    fields.setdefault("context_limit", 1024)
    return ProxyConfig(**fields)


def cells(**fields) -> ClusterConfig:
    return ClusterConfig(**{"num_cells": 4, "cell_size": 1, "cell_capacity": 8, **fields})


def demo_algo(**fields) -> AlgoConfig:
    return AlgoConfig(**{"group_size": 8, "batch_groups": 4, **fields})


def megatron(tp: int = 1, pp: int = 1) -> dict:
    return {
        "cluster": cells(cell_size=tp * pp),
        "trainer": TrainerConfig(backend="megatron", tensor_parallel_size=tp, pipeline_parallel_size=pp),
    }


def error_of(build) -> str:
    with pytest.raises(ConfigError) as info:
        build()
    return str(info.value)


# ----------------------------------------------------------------------------- defaults


def test_defaults_are_the_cpu_demo():
    cfg = TrainConfig()
    assert (cfg.cluster.num_cells, cfg.cluster.cell_size, cfg.world_size) == (4, 1, 4)
    assert (cfg.algo.mode, cfg.algo.group_size, cfg.algo.batch_groups) == ("elastic", 8, 4)
    assert (cfg.packing.group_size, cfg.packing.batch_groups) == (8, 4)
    assert cfg.model.uses_tiny and cfg.model.init == "warm_start"
    assert (cfg.trainer.backend, cfg.harness.name, cfg.harness.sandbox) == ("native", "builtin", "local")
    assert cfg.tasks.uses_recipe_tasks and cfg.tasks.evaluates
    assert cfg.logging.wandb == "offline"
    assert check_context_limit(cfg, cfg.model.tiny.max_position_embeddings) == 1024


def test_the_demo_algo_options_fit_the_demo_cells():
    for algo in (demo_algo(), demo_algo(mode="colocate", phi=0.0, mu=4), demo_algo(mode="async", phi=1.5, mu=1)):
        assert TrainConfig(algo=algo).algo.mode == algo.mode


def test_a_checkpoint_and_its_task_directories_construct():
    cfg = TrainConfig(
        model=ModelConfig(model_dir="/models/qwen3"),
        tasks=TasksConfig(task_dir="/data/tasks", held_out_dir="/data/held_out", num_held_out=0),
        proxy=proxy(context_limit=0),  # the checkpoint's limit: checked once its config.json is read
    )
    assert not cfg.model.uses_tiny and not cfg.tasks.uses_recipe_tasks and cfg.tasks.evaluates
    assert TasksConfig(task_dir="/data/tasks", eval_every=0).evaluates is False


def test_megatron_cells_of_tp2_construct():
    cfg = TrainConfig(**megatron(tp=2))
    assert (cfg.cluster.cell_size, cfg.trainer.model_parallel_size, cfg.world_size) == (2, 2, 8)


# ----------------------------------------------------------------------------- one line per bad value

BAD = [
    # root
    (lambda: TrainConfig(steps=0), "steps=0 is not allowed: expected an integer >= 1"),
    (lambda: TrainConfig(seed=-1), "seed=-1 is not allowed"),
    # the schedule against the cells
    (
        lambda: TrainConfig(algo=demo_algo(mode="colocate", phi=0.5)),
        "algo.phi=0.5 is not allowed: expected 0 in colocate",
    ),
    (lambda: TrainConfig(algo=demo_algo(mode="async", train_cells=4)), "algo.train_cells=4 is not allowed"),
    (lambda: TrainConfig(algo=demo_algo(mode="elastic", train_cells=2)), "algo.train_cells=2 is not allowed"),
    (lambda: TrainConfig(cluster=cells(cell_capacity=1)), "cluster.cell_capacity=1 is not allowed"),
    (
        lambda: TrainConfig(cluster=cells(cell_capacity=7), algo=demo_algo(mode="async", phi=1.5, mu=1, train_cells=3)),
        "cluster.cell_capacity=7 is not allowed: expected rollout capacity of the async split (7) >= one group of 8",
    ),
    # the engine's slots against C_e
    (
        lambda: TrainConfig(engine=EngineConfig(max_running=7)),
        "engine.max_running=7 is not allowed: expected an integer >= cluster.cell_capacity (8)",
    ),
    (
        lambda: TrainConfig(cluster=cells(cell_capacity=32)),
        "engine.max_running=16 is not allowed: expected an integer >= cluster.cell_capacity (32)",
    ),
    # the packer against the schedule and the context
    (lambda: TrainConfig(packing=packing(batch_groups=8)), "packing.batch_groups=8 is not allowed: expected algo."),
    (lambda: TrainConfig(packing=packing(group_size=16)), "packing.group_size=16 is not allowed: expected algo."),
    (
        lambda: TrainConfig(packing=packing(budget=512)),
        "packing.max_tokens_per_microstep=512 is not allowed: expected an integer >= the context limit 1024",
    ),
    (
        lambda: TrainConfig(proxy=proxy(context_limit=0)),
        "packing.max_tokens_per_microstep=1024 is not allowed: expected an integer >= the context limit 4096",
    ),
    (lambda: TrainConfig(proxy=proxy(context_limit=8192)), "proxy.context_limit=8192 is not allowed"),
    # sampling the trainer can score
    (
        lambda: TrainConfig(proxy=proxy(sampling=SamplingConfig(temperature=0.0))),
        "proxy.sampling.temperature=0.0 is not allowed",
    ),
    (lambda: TrainConfig(proxy=proxy(sampling=SamplingConfig(top_p=0.9))), "proxy.sampling.top_p=0.9 is not allowed"),
    (lambda: TrainConfig(proxy=proxy(sampling=SamplingConfig(top_k=20))), "proxy.sampling.top_k=20 is not allowed"),
    (
        lambda: TrainConfig(proxy=proxy(sampling=SamplingConfig(seed=-1))),
        "sampling.seed=-1 is not allowed: expected null (unseeded) or an integer in [0, 2**63)",
    ),
    (
        lambda: TrainConfig(proxy=proxy(sampling=SamplingConfig(honor_client=True))),
        "proxy.sampling.honor_client=True is not allowed",
    ),
    # cells against the trainer and the model
    (lambda: TrainConfig(cluster=cells(cell_size=2)), "cluster.cell_size=2 is not allowed: expected trainer."),
    (
        lambda: TrainConfig(trainer=TrainerConfig(tensor_parallel_size=2)),
        "trainer.tensor_parallel_size=2 is not allowed: expected 1 with trainer.backend=native",
    ),
    (
        lambda: TrainConfig(**{**megatron(tp=2), "cluster": cells(cell_size=4)}),
        "cluster.cell_size=4 is not allowed: expected trainer.tensor_parallel_size * trainer.pipeline_parallel_size",
    ),
    (lambda: TrainConfig(**megatron(tp=4)), "model.tiny.num_key_value_heads=2 is not allowed: expected a multiple"),
    (lambda: TrainConfig(**megatron(tp=3)), "model.tiny.num_attention_heads=4 is not allowed"),
    (lambda: TrainConfig(**megatron(pp=3)), "model.tiny.num_hidden_layers=4 is not allowed"),
    # the engine a cell swaps with its trainer
    (lambda: TrainConfig(engine=EngineConfig(enabled=False)), "engine.enabled=False is not allowed"),
    (lambda: EngineConfig(max_total_tokens=1), "engine.max_total_tokens=1 is not allowed: expected 0 or at least 2"),
    (lambda: EngineConfig(max_total_tokens=-5), "engine.max_total_tokens=-5 is not allowed"),
    (
        lambda: TrainConfig(engine=EngineConfig(max_total_tokens=1000)),
        "engine.max_total_tokens=1000 is not allowed: expected 0 or an integer >= the context limit",
    ),
    (lambda: TrainConfig(engine=EngineConfig(device="cuda")), "engine.device='cuda' is not allowed: expected a cpu"),
    (lambda: TrainConfig(engine=EngineConfig(policy_version=3)), "engine.policy_version=3 is not allowed"),
    # sections
    (lambda: TrainerConfig(backend="deepspeed"), "trainer.backend='deepspeed' is not allowed: expected one of"),
    (lambda: TrainerConfig(lr=0.0), "trainer.lr=0.0 is not allowed"),
    (lambda: TrainerConfig(max_grad_norm=-1.0), "trainer.max_grad_norm=-1.0 is not allowed"),
    (lambda: TrainerConfig(dtype="float16"), "trainer.dtype='float16' is not allowed"),
    (lambda: TrainerConfig(recompute="partial"), "trainer.recompute='partial' is not allowed: expected one of"),
    (lambda: TrainerConfig(logprob_chunk_tokens=0), "trainer.logprob_chunk_tokens=0 is not allowed"),
    (lambda: TrainerConfig(context_parallel_size=0), "trainer.context_parallel_size=0 is not allowed"),
    (
        lambda: TrainerConfig(context_parallel_size=2),
        "trainer.context_parallel_size=2 is not allowed: expected 1 with trainer.backend=native",
    ),
    (lambda: TrainerConfig(weight_transport="nccl"), "trainer.weight_transport='nccl' is not allowed: expected one of"),
    (lambda: MooncakeConfig(protocol="ib"), "trainer.mooncake.protocol='ib' is not allowed: expected one of tcp, rdma"),
    (
        lambda: MooncakeConfig(device_names="mlx5_0"),
        "trainer.mooncake.device_names='mlx5_0' is not allowed: expected '' with trainer.mooncake.protocol=tcp",
    ),
    *[
        (
            lambda names=names: MooncakeConfig(protocol="rdma", device_names=names),
            f"trainer.mooncake.device_names={names!r} is not allowed: expected '' (every RDMA device Mooncake finds) "
            "or distinct RDMA device names joined by commas without spaces, e.g. mlx5_0,mlx5_1",
        )
        for names in ("mlx5_0, mlx5_1", "mlx5_0,,mlx5_1", "mlx5_0,", ",mlx5_0", "mlx5_0,mlx5_0", "mlx5_0;mlx5_1")
    ],
    (lambda: MooncakeConfig(protocol="rdma", device_names=None), "trainer.mooncake.device_names=None is not allowed"),
    (
        lambda: TrainerConfig(mooncake=MooncakeConfig(protocol="rdma")),
        "trainer.mooncake.protocol='rdma' is not allowed: expected tcp with trainer.weight_transport=store",
    ),
    (lambda: TrainerConfig(device="tpu"), "trainer.device='tpu' is not allowed"),
    (lambda: TrainerConfig(device="cuda:x"), "trainer.device='cuda:x' is not allowed"),
    (lambda: ModelConfig(init="zeros"), "model.init='zeros' is not allowed: expected one of warm_start, random"),
    (lambda: ModelConfig(warm_start_seed=-1), "model.warm_start_seed=-1 is not allowed"),
    (lambda: TasksConfig(num_demo_tasks=0), "tasks.num_demo_tasks=0 is not allowed"),
    (lambda: TasksConfig(eval_every=-1), "tasks.eval_every=-1 is not allowed"),
    (lambda: TasksConfig(num_held_out=0), "tasks.num_held_out=0 is not allowed"),
    (lambda: TasksConfig(task_dir="/data/t"), "tasks.eval_every=5 is not allowed: expected 0 when tasks.task_dir"),
    (
        lambda: TasksConfig(task_dir="/data/t", held_out_dir="/data/t/"),
        "tasks.held_out_dir='/data/t/' is not allowed: expected a directory other than tasks.task_dir",
    ),
    (lambda: LoggingConfig(wandb="on"), "logging.wandb='on' is not allowed: expected one of offline, online, disabled"),
    (lambda: LoggingConfig(wandb="online", wandb_project=""), "logging.wandb_project='' is not allowed"),
    (lambda: LoggingConfig(progress_every_s=-1.0), "logging.progress_every_s=-1.0 is not allowed"),
    (lambda: LoggingConfig(timeline=1), "logging.timeline=1 is not allowed: expected a bool"),
    (lambda: HarnessConfig(name="aider"), "harness.name='aider' is not allowed: expected one of builtin"),
    (lambda: HarnessConfig(backend="gemini"), "harness.backend='gemini' is not allowed"),
    (lambda: HarnessConfig(name="command"), "harness.argv=[] is not allowed: expected a non-empty argv template"),
    (lambda: HarnessConfig(argv=["x"]), "harness.argv=['x'] is not allowed: expected [] with harness.name=builtin"),
    (lambda: HarnessConfig(binary="/bin/claude"), "harness.binary='/bin/claude' is not allowed"),
    (
        lambda: HarnessConfig(name="command", argv=["agent"], extra_args=["-v"]),
        "harness.extra_args=['-v'] is not allowed",
    ),
    (lambda: HarnessConfig(sandbox="vm"), "harness.sandbox='vm' is not allowed"),
    (lambda: ContainerConfig(engine="lxc"), "harness.container.engine='lxc' is not allowed"),
    (lambda: ContainerConfig(max_starting=0), "harness.container.max_starting=0 is not allowed"),
    (lambda: ContainerConfig(workdir="rel"), "harness.container.workdir='rel' is not allowed"),
    (lambda: ContainerConfig(network="bridge"), "harness.container.network='bridge' is not allowed"),
    (lambda: ContainerConfig(image="--privileged"), "harness.container.image='--privileged' is not allowed"),
    (lambda: ContainerConfig(engine="apptainer", image="t.sif"), "harness.container.image='t.sif' is not allowed"),
    (lambda: HarnessConfig(env={"A": 1}), "harness.env={'A': 1} is not allowed"),
    (lambda: HarnessConfig(max_turns=0), "harness.max_turns=0 is not allowed"),
]


@pytest.mark.parametrize(("build", "message"), BAD, ids=[message.split(" ")[0] for _, message in BAD])
def test_every_bad_value_is_one_line_naming_field_value_and_allowed(build, message):
    text = error_of(build)
    assert text.startswith(message), text
    assert "\n" not in text and "is not allowed: expected" in text


# ----------------------------------------------------------------------------- the job's size and the checkpoint


def test_layout_fields_fit_the_job_and_build_a_layout():
    from gyre.distributed.layout import Layout

    fields = layout_fields(TrainConfig(), 4)
    assert fields == {"world_size": 4, "num_cells": 4, "cell_size": 1, "num_rollout_ranks": 0}
    layout = Layout(**fields)
    assert layout.cell_leaders == (0, 1, 2, 3)
    pooled = TrainConfig(cluster=cells(num_cells=3, separate_capacity=8, separate_size=1))
    assert Layout(**layout_fields(pooled, 4)).rollout_ranks == (3,)
    assert Layout(**layout_fields(TrainConfig(**megatron(tp=2)), 8)).cell_ranks(1) == (2, 3)


def test_a_separate_pool_serves_as_a_cell_unless_given_its_capacity_and_fits_the_engine_slots():
    assert TrainConfig(cluster=cells(separate_size=1)).cluster.separate_capacity == 8  # C_e of the demo's cells
    assert TrainConfig(cluster=cells(separate_size=2, separate_capacity=12)).cluster.separate_capacity == 12
    assert TrainConfig().cluster.separate_capacity == 0  # no pool
    text = error_of(lambda: TrainConfig(cluster=cells(separate_size=1, separate_capacity=32)))
    assert text.startswith("engine.max_running=16 is not allowed: expected an integer >= cluster.separate_capacity")


def test_a_world_size_that_does_not_fit_names_the_cells():
    text = error_of(lambda: layout_fields(TrainConfig(), 3))
    assert text == (
        "world_size=3 is not allowed: expected cluster.num_cells * cluster.cell_size + cluster.separate_size = "
        "4 * 1 + 0 = 4 processes (torchrun --nproc-per-node, srun --ntasks); or cluster.num_cells=3 for 3 processes"
    )
    text = error_of(lambda: layout_fields(TrainConfig(**megatron(tp=2)), 6))
    assert text.startswith("world_size=6 is not allowed: expected") and "= 4 * 2 + 0 = 8 processes" in text
    assert "cluster.num_cells=3 for 6 processes" in text
    assert error_of(lambda: layout_fields(TrainConfig(**megatron(tp=2)), 5)).endswith("srun --ntasks)")
    assert error_of(lambda: layout_fields(TrainConfig(), 0)).startswith("world_size=0 is not allowed")


def test_one_gpu_named_for_every_rank_is_refused_in_a_job_of_several():
    gpu = {"engine": EngineConfig(device="cuda:0"), "trainer": TrainerConfig(device="cuda:0")}
    assert layout_fields(TrainConfig(cluster=cells(num_cells=1), **gpu), 1)["world_size"] == 1
    text = error_of(lambda: layout_fields(TrainConfig(**gpu), 4))
    assert text.startswith("engine.device='cuda:0' is not allowed: expected cuda without an index in a job of 4")
    on_cuda = {"engine": EngineConfig(device="cuda"), "trainer": TrainerConfig(device="cuda")}
    assert layout_fields(TrainConfig(**on_cuda), 4)["num_cells"] == 4


def test_a_checkpoints_context_limit_is_checked_against_its_config():
    cfg = TrainConfig(model=ModelConfig(model_dir="/models/m"), proxy=proxy(context_limit=0), packing=packing())
    assert check_context_limit(cfg, 1024) == 1024
    assert error_of(lambda: check_context_limit(cfg, 40960)).startswith(
        "packing.max_tokens_per_microstep=1024 is not allowed: expected an integer >= the context limit 40960"
    )
    capped = dataclasses.replace(cfg, proxy=proxy(context_limit=2048))
    assert error_of(lambda: check_context_limit(capped, 1024)).startswith(
        "proxy.context_limit=2048 is not allowed: expected an integer <= the model's max_position_embeddings (1024)"
    )


def test_the_weight_transports_are_the_one_sided_kinds():
    from gyre.config.trainer import WEIGHT_TRANSPORTS
    from gyre.distributed.one_sided import ONE_SIDED_KINDS

    assert set(WEIGHT_TRANSPORTS) == set(ONE_SIDED_KINDS)


def test_the_mooncake_link_takes_tcp_or_rdma_with_device_names():
    assert (MooncakeConfig().protocol, MooncakeConfig().device_names) == ("tcp", "")
    assert TrainerConfig().mooncake == MooncakeConfig()
    for names in ("", "mlx5_0", "mlx5_0,mlx5_1", "rocep1s0f0,bnxt_re0,irdma-1.2"):
        assert MooncakeConfig(protocol="rdma", device_names=names).device_names == names
    rdma = MooncakeConfig(protocol="rdma", device_names="mlx5_0,mlx5_1")
    for transport in ("mooncake", "auto"):
        assert TrainerConfig(weight_transport=transport, mooncake=rdma).mooncake is rdma


def test_the_harness_names_are_the_runner_registry():
    from gyre.harness.runners import RUNNERS

    assert set(HARNESS_NAMES) == set(RUNNERS)


# ----------------------------------------------------------------------------- conf/train.yaml through Hydra


def compose_train(overrides=(), *, hydra_config: bool = False):
    from hydra import compose, initialize_config_dir

    from gyre.config import register_configs
    from gyre.config.hydra_errors import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="train", overrides=list(overrides), return_hydra_config=hydra_config)


def train_config(overrides=()) -> TrainConfig:
    from gyre.config.hydra_errors import to_config

    return to_config(compose_train(overrides), TrainConfig)


def composed_error(overrides) -> str:
    """The one line the app prints for these overrides (compose errors and checks alike)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from gyre.config.hydra_errors import describe_config_error

    try:
        train_config(overrides)
    except ConfigError as exc:
        return str(exc)
    except (HydraException, OmegaConfBaseException) as exc:
        return describe_config_error(exc)
    raise AssertionError(f"{overrides} composed without an error")


def test_conf_train_yaml_composes_to_the_defaults():
    assert train_config() == TrainConfig()
    hydra = compose_train(hydra_config=True).hydra
    assert hydra.job.name == "train"
    assert hydra.run.dir.startswith("outputs/train/")


def test_group_choices_and_overrides_compose():
    colocate = train_config(["algo=colocate"])
    assert (colocate.algo.mode, colocate.algo.phi, colocate.algo.mu, colocate.algo.group_size) == ("colocate", 0, 4, 8)
    assert train_config(["algo=async"]).algo.train_cells == 0  # half of the cells at run time
    bigger = train_config(["algo.batch_groups=8", "algo.group_size=4", "steps=3", "seed=2"])
    assert (bigger.packing.batch_groups, bigger.packing.group_size, bigger.steps, bigger.seed) == (8, 4, 3, 2)
    codex = train_config(["harness=codex", "harness.binary=/opt/codex"])
    assert (codex.harness.name, codex.harness.binary) == ("codex", "/opt/codex")
    command = train_config(["harness=command", "harness.argv=[python,agent.py,'{prompt}']"])
    assert command.harness.argv == ["python", "agent.py", "{prompt}"]
    tp2 = train_config(["trainer.backend=megatron", "trainer.tensor_parallel_size=2", "cluster.cell_size=2"])
    assert tp2.world_size == 8
    logs = train_config(["logging.wandb=online", "logging.wandb_entity=me", "tasks.eval_every=0"])
    assert (logs.logging.wandb, logs.logging.wandb_entity, logs.tasks.evaluates) == ("online", "me", False)
    rdma = train_config(
        [
            "trainer.weight_transport=mooncake",
            "trainer.mooncake.protocol=rdma",
            "trainer.mooncake.device_names='mlx5_0,mlx5_1'",  # quoted: an unquoted a,b is a Hydra sweep
        ]
    )
    assert rdma.trainer.mooncake == MooncakeConfig(protocol="rdma", device_names="mlx5_0,mlx5_1")
    warm = train_config(["model.warm_start.steps=10", "model.tiny.num_hidden_layers=2"])
    assert (warm.model.warm_start.steps, warm.model.tiny.num_hidden_layers) == (10, 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["packing.batch_groups=8"], "packing.batch_groups=8 is not allowed: expected algo.batch_groups (4)"),
        (["cluster=paper_8x4"], "cluster.cell_size=4 is not allowed: expected trainer.tensor_parallel_size"),
        (["harness=command"], "harness.argv=[] is not allowed: expected a non-empty argv template"),
        (["harness=nope"], "harness='nope' is not allowed: expected one of builtin, claude_code, codex, command"),
        (["algo=colocate", "algo.phi=0.5"], "algo.phi=0.5 is not allowed: expected 0 in colocate"),
        (["trainer.lr=abc"], "trainer.lr='abc' is not allowed: expected a number"),
        (["+trainer.lrr=1"], "trainer.lrr=1 is not allowed: expected one of the TrainerConfig fields"),
        (["proxy.sampling.top_p=0.95"], "proxy.sampling.top_p=0.95 is not allowed"),
        (["trainer.mooncake.protocol=ib"], "trainer.mooncake.protocol='ib' is not allowed: expected one of tcp, rdma"),
        (
            [
                "trainer.weight_transport=mooncake",
                "trainer.mooncake.protocol=rdma",
                "trainer.mooncake.device_names=a b",
            ],
            "trainer.mooncake.device_names='a b' is not allowed",
        ),
        (["tasks.task_dir=/data/tasks"], "tasks.eval_every=5 is not allowed: expected 0 when tasks.task_dir"),
    ],
)
def test_bad_overrides_end_in_one_line(overrides, message):
    text = composed_error(overrides)
    assert text.startswith(message), text
    assert "\n" not in text


def test_the_recompute_choices_are_the_trainers_own():
    from gyre.config.trainer import RECOMPUTE_CHOICES
    from gyre.models.decoder import RECOMPUTE

    assert RECOMPUTE_CHOICES == RECOMPUTE  # gyre.trainer.model.RECOMPUTE too: tests/unit/test_train_model.py


def test_apptainer_takes_the_path_of_a_sif_and_podman_a_reference():
    assert ContainerConfig(engine="apptainer", image="/images/task.sif").image == "/images/task.sif"
    assert ContainerConfig(engine="podman", image="ghcr.io/acme/task:1@sha256:" + "a" * 64).engine == "podman"
