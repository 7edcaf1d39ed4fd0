"""`python -m gyre.train.plan [overrides]`: a run's memory plan, and nothing else (docs/training.md, "The memory plan").

The same Hydra overrides as `python -m gyre.train` (composed from `conf/train.yaml`; no run directory is made, no
model is built, no process starts): each kind of rank's terms by role and its peak (`gyre.trainer.memory_plan`), so
a user sizes a cluster from a laptop. The model is `model.model_dir`'s config.json (a directory holding only that
file is enough), or the tiny model's spec when the run would start from it. Exit 0 when every rank fits
`cluster.device_memory_gib` (or it is 0: unknown); 2 with one line naming the worst rank and the setting that makes it
fit, or a config error.

    python -m gyre.train.plan model.model_dir=~/models/Qwen3-30B-A3B trainer.backend=megatron \\
        trainer.tensor_parallel_size=4 trainer.expert_parallel_size=4 cluster.cell_size=8 cluster.num_cells=16 \\
        trainer.dtype=bfloat16 engine.dtype=bfloat16 trainer.device=cuda engine.device=cuda \\
        cluster.device_memory_gib=80 packing.max_tokens_per_microstep=65536 trainer.recompute=full
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

PROG = "gyre.train.plan"


def _fail(message: str) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from gyre.config import ConfigError, TrainConfig, register_configs
    from gyre.config.hydra_errors import CONF_DIR, describe_config_error, to_config
    from gyre.runtime.job.plan import PlanError, check_model_layout, starting_model_config
    from gyre.trainer.memory_plan import memory_inputs, memory_plan

    overrides = list(sys.argv[1:] if argv is None else argv)
    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = to_config(compose(config_name="train", overrides=overrides), TrainConfig)
    except (HydraException, OmegaConfBaseException) as error:
        return _fail(f"config error: {describe_config_error(error)}")
    except ConfigError as error:
        return _fail(f"config error: {error}")
    if cfg.model.model_dir:
        cfg.model.model_dir = str(Path(cfg.model.model_dir).expanduser())
    try:
        model = starting_model_config(cfg)
        check_model_layout(cfg, model)
    except PlanError as error:
        return _fail(f"config error: {error}")
    plan = memory_plan(memory_inputs(cfg, model))
    print(plan.table())
    if plan.offload_note():
        print(plan.offload_note().removeprefix("; "))
    misfit = plan.misfit()
    return 0 if misfit is None else _fail(misfit)


if __name__ == "__main__":
    raise SystemExit(main())
