"""Config of the rollout engine (`EngineConfig`) and root config of `python -m gyre.engine serve`.

`EngineConfig` is what a run sets of an engine, wherever it runs: embedded in `python -m gyre.serve`
(`ServeConfig.engine`), standalone behind its HTTP endpoint (`EngineServeConfig.engine`, docs/endpoint.md), or in
the cells of `python -m gyre.train` (`TrainConfig.engine`, the only place `backend=sglang` is taken: docs/sglang.md,
"In the training program"). Pure: stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gyre.config.checks import require, require_bool, require_choice, require_int

DTYPES = ("float32", "bfloat16", "float16")
BACKENDS = ("native", "sglang")
# SGLang arguments the runtime sets from the cell (gyre.engine.sglang_engine.sglang_engine_args) and relies on: the
# weight group's size, the cell's GPUs, token ids in and out, the memory release of a swap.
SGLANG_ARGS_OF_THE_CELL = {
    "model_path": "model.model_dir (or the run's checkpoint)",
    "tp_size": "cluster.cell_size",
    "base_gpu_id": "the cell leader's GPU",
    "skip_tokenizer_init": "the proxy renders and parses: token ids in and out",
    "enable_memory_saver": "a swap to training releases the engine's memory",
}
WEIGHT_SYNCS = ("auto", "http", "broadcast")


@dataclass(kw_only=True)
class EngineConfig:
    """The rollout engine: which one, how many requests it decodes at once, where its weights live, in which
    dtype."""

    backend: str = "native"
    """`native`: gyre's engine (docs/engine.md). `sglang`: one `sglang.Engine` per cell, its tensor-parallel group
    the cell's GPUs (`python -m gyre.train` only; needs the `gpu` extra and CUDA GPUs: docs/sglang.md)."""
    sglang_args: dict[str, Any] = field(default_factory=dict)
    """backend=sglang: more `sglang.Engine` arguments (SGLang's `ServerArgs` fields), e.g.
    `+engine.sglang_args.mem_fraction_static=0.7`; they win over what gyre derives from `engine.` (dtype, slots, KV
    budget, seed), except the ones the cell fixes (`SGLANG_ARGS_OF_THE_CELL`, refused) (docs/sglang.md)."""
    weight_sync: str = "auto"
    """How a publication reaches the cells' engines (`python -m gyre.train`): `http` each engine loads the weights
    sent to its endpoint (`update_weights`); `broadcast` rank 0 broadcasts them over a process group with each SGLang
    engine's workers (SGLang's `update_weights_from_distributed`; backend=sglang only); `auto` broadcast with
    SGLang, http with the native engine (docs/sglang.md, "In the training program")."""
    enabled: bool = True
    """`gyre.serve` only: serve from an embedded native engine; false with `engine_urls` to serve only from
    external engines. `python -m gyre.engine serve` always runs one (false is refused there)."""
    max_running: int = 16
    """Requests decoded concurrently."""
    max_total_tokens: int = 0
    """The KV budget in tokens: admission keeps the running requests' prompt + max_new_tokens (and pinned exports)
    within it, queues what does not fit yet and refuses a request that could never fit. 0: max_running x the
    model's max_position_embeddings. Long-context models want it set (KV bytes a token: 2 x layers x KV heads x
    head_dim x dtype bytes)."""
    device: str = "cpu"
    """torch device, e.g. cpu or cuda:0."""
    dtype: str = "float32"
    """Weights and KV dtype: float32, bfloat16 or float16."""
    policy_version: int = 0
    """Version of the served weights at start (>= 0); results report it, staleness accounting reads it."""

    def __post_init__(self) -> None:
        require_choice("engine.backend", self.backend, BACKENDS)
        require(
            isinstance(self.sglang_args, dict) and all(isinstance(key, str) and key for key in self.sglang_args),
            "engine.sglang_args",
            self.sglang_args,
            "a mapping of SGLang ServerArgs names to values",
        )
        for key in self.sglang_args:
            require(
                key not in SGLANG_ARGS_OF_THE_CELL,
                f"engine.sglang_args.{key}",
                self.sglang_args[key],
                f"no value: gyre sets it from the cell ({SGLANG_ARGS_OF_THE_CELL.get(key)}; docs/sglang.md)",
            )
        require(
            not self.sglang_args or self.backend == "sglang",
            "engine.sglang_args",
            self.sglang_args,
            "empty unless engine.backend=sglang (they are SGLang's arguments)",
        )
        require_choice("engine.weight_sync", self.weight_sync, WEIGHT_SYNCS)
        require(
            self.weight_sync != "broadcast" or self.backend == "sglang",
            "engine.weight_sync",
            self.weight_sync,
            "http or auto with engine.backend=native (the native engine loads publications from its endpoint only)",
        )
        require_bool("engine.enabled", self.enabled)
        require_int("engine.max_running", self.max_running, ge=1)
        require_int("engine.max_total_tokens", self.max_total_tokens, ge=0, note="0 = max_running x context length")
        require(
            self.max_total_tokens != 1, "engine.max_total_tokens", 1, "0 or at least 2 (a prompt token and one new)"
        )
        require(isinstance(self.device, str) and bool(self.device), "engine.device", self.device, "a torch device")
        require_choice("engine.dtype", self.dtype, DTYPES)
        require_int("engine.policy_version", self.policy_version, ge=0)


@dataclass(kw_only=True)
class EngineServeConfig:
    """Root config of `python -m gyre.engine serve`: one native engine on its HTTP endpoint (conf/engine.yaml)."""

    model_dir: str = ""
    """HF-layout model directory (config.json + safetensors). Empty: the tiny default model, built locally on
    first use."""
    host: str = "127.0.0.1"
    """Address the endpoint binds. Keep 127.0.0.1 unless the proxy runs on another machine."""
    port: int = 0
    """Port the endpoint binds; 0 picks a free one (printed at start as `engine endpoint: <url>`)."""
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        require(isinstance(self.host, str) and bool(self.host), "host", self.host, "an address to bind")
        require_int("port", self.port, ge=0, le=65535, note="0 = any free port")
        require(
            self.engine.backend == "native",
            "engine.backend",
            self.engine.backend,
            "native (python -m gyre.engine serve serves gyre's engine; SGLang runs in python -m gyre.train's cells)",
        )
        require(
            self.engine.enabled,
            "engine.enabled",
            self.engine.enabled,
            "true (python -m gyre.engine serve always runs its engine)",
        )
