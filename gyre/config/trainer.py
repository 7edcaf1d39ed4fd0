"""Config of the trainer a cell runs in the training role: backend, parallel layout, optimizer.

`backend` picks the `gyre.trainer.streaming.Trainable`: `native` (`gyre.trainer.native_trainable.NativeTrainable`, the
shared decoder in plain torch, one rank per cell) or `megatron` (`gyre.trainer.megatron_trainable.MegatronTrainable`
on a Megatron-core `GPTModel`, `gyre.trainer.model.build_gpt_model`, sharded TP x PP over the cell's ranks, a
mixture of experts' experts over EP of them: `cell_size`, `check_expert_layout`, docs/moe.md). Both
take `lr`, `weight_decay` and `max_grad_norm` as given here; the log-prob temperature is the rollouts' own
(`proxy.sampling.temperature`), so sampling and training score one distribution (docs/training.md).
`mooncake` (`MooncakeConfig`) says which link the Mooncake weight transport uses: TCP or RDMA, and which RDMA
devices. Pure: stdlib only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gyre.config.checks import require, require_bool, require_choice, require_int, require_number

TRAINER_BACKENDS = ("native", "megatron")
TRAINER_DTYPES = ("float32", "bfloat16")
DEVICE_KINDS = ("cpu", "cuda")
RECOMPUTE_CHOICES = ("none", "selective", "full")  # gyre.models.decoder.RECOMPUTE, gyre.trainer.model.RECOMPUTE
WEIGHT_TRANSPORTS = ("store", "mooncake", "auto")  # gyre.distributed.one_sided.ONE_SIDED_KINDS (config imports no
# other gyre package; tests/unit/test_config_train.py holds them equal)
MOONCAKE_PROTOCOLS = ("tcp", "rdma")  # the links gyre.distributed.transport_mooncake starts a Transfer Engine on
RDMA_DEVICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a verbs device name as `ibv_devices` lists it


def check_mooncake_link(where: str, protocol: object, device_names: object) -> None:
    """`protocol` one of MOONCAKE_PROTOCOLS; `device_names` "" or, with rdma only, distinct RDMA device names joined
    by commas without spaces. `where` qualifies the field names in the message (`trainer.mooncake`).

    Mooncake splits the names on commas and keeps the devices whose name equals one of them exactly, so
    "mlx5_0, mlx5_1" would silently drop mlx5_1 (its name has a space): refused here instead."""
    require_choice(f"{where}.protocol", protocol, MOONCAKE_PROTOCOLS)
    if protocol == "tcp":
        require(
            device_names == "",
            f"{where}.device_names",
            device_names,
            f"'' with {where}.protocol=tcp (device names pick RDMA devices; set {where}.protocol=rdma)",
        )
        return
    names = device_names.split(",") if isinstance(device_names, str) and device_names else []
    require(
        isinstance(device_names, str)
        and all(RDMA_DEVICE_NAME.fullmatch(name) for name in names)
        and len(set(names)) == len(names),
        f"{where}.device_names",
        device_names,
        "'' (every RDMA device Mooncake finds) or distinct RDMA device names joined by commas without spaces, "
        "e.g. mlx5_0,mlx5_1 (as `ibv_devices` lists them)",
    )


def dense_replicas(tensor_parallel_size: int, expert_parallel_size: int) -> int:
    """Copies of the dense model in a cell: EP / TP when the experts are spread over more ranks than the tensor-
    parallel ones, else 1 (the EP ranks are TP ranks: megatron's expert tensor parallelism 1 folded over them)."""
    return max(1, expert_parallel_size // tensor_parallel_size)


def check_expert_layout(
    tensor_parallel_size: int, pipeline_parallel_size: int, context_parallel_size: int, expert_parallel_size: int
) -> None:
    """ConfigError unless megatron can lay EP ranks over a cell of TP x PP x `dense_replicas` ranks that all see the
    same tokens: EP divides TP or TP divides EP (megatron's EP groups are EP consecutive ranks of a stage, its
    rank order tp-cp-ep-pp-dp), EP = TP at PP > 1 (megatron requires the expert and dense pipeline groups to
    coincide), CP = 1 (its ranks see different tokens: not wired)."""
    tp, pp, cp, ep = tensor_parallel_size, pipeline_parallel_size, context_parallel_size, expert_parallel_size
    if ep == 1:
        return
    require(
        ep % tp == 0 or tp % ep == 0,
        "trainer.expert_parallel_size",
        ep,
        f"a divisor or a multiple of trainer.tensor_parallel_size={tp} (the EP ranks are the cell's TP ranks, or "
        "EP / TP copies of them)",
    )
    require(
        pp == 1 or ep == tp,
        "trainer.expert_parallel_size",
        ep,
        f"1 or trainer.tensor_parallel_size={tp} with trainer.pipeline_parallel_size={pp} > 1 (megatron's expert "
        "and dense pipeline groups must coincide)",
    )
    require(
        cp == 1,
        "trainer.expert_parallel_size",
        ep,
        f"1 with trainer.context_parallel_size={cp} > 1 (expert parallelism over context-parallel ranks is not wired)",
    )


@dataclass(kw_only=True)
class MooncakeConfig:
    """The link of the Mooncake weight transport (`trainer.weight_transport=mooncake`, or `auto` where Mooncake
    imports): gyre.distributed.transport_mooncake starts every rank's Transfer Engine with it."""

    protocol: str = "tcp"
    """tcp: TCP sockets, on any host, RDMA NICs or not (gyre sets Mooncake's MC_FORCE_TCP while the engine starts,
    since Mooncake takes RDMA wherever it finds an RDMA device). rdma: RDMA verbs (InfiniBand, RoCE); a rank whose
    engine finds no RDMA device (among device_names) fails at start rather than fall back to TCP."""
    device_names: str = ""
    """With rdma: the RDMA devices Mooncake may use, joined by commas without spaces (mlx5_0,mlx5_1; Mooncake's
    device filter), or "" for every device it finds. With tcp: "". On the command line, quote a list:
    'trainer.mooncake.device_names="mlx5_0,mlx5_1"' (Hydra reads an unquoted a,b as a sweep)."""

    def __post_init__(self) -> None:
        check_mooncake_link("trainer.mooncake", self.protocol, self.device_names)


@dataclass(kw_only=True)
class TrainerConfig:
    """What a training cell builds: the trainable, its layout over the cell's ranks, AdamW and clipping."""

    backend: str = "native"
    """native: the shared decoder in plain torch (one rank per cell, CPU or one GPU); megatron: Megatron-core,
    tensor- and pipeline-parallel over the cell's ranks."""
    tensor_parallel_size: int = 1
    """TP ranks per model replica (megatron only; native: 1)."""
    pipeline_parallel_size: int = 1
    """PP stages per model replica (megatron only; native: 1). cluster.cell_size must be TP x PP."""
    context_parallel_size: int = 1
    """Ranks one row's tokens are split over (megatron's context parallelism, megatron only). Needs
    TransformerEngine's attention (CUDA): refused at start where it is absent (docs/training.md, "Long rows")."""
    expert_parallel_size: int = 1
    """Ranks a mixture of experts' routed experts are split over (megatron's expert parallelism, inside a cell;
    megatron only, a model with experts divisible by it). A divisor of TP (the TP ranks hold the experts too) or a
    multiple (EP / TP copies of the dense model per cell); at PP > 1, equal to TP. cluster.cell_size must be
    TP x PP x max(1, EP / TP) (docs/moe.md)."""
    routing_replay: bool = False
    """Mixture of experts: the trainer's routers use the experts the rollout's engine chose for each token (the
    rows' recorded routing), not their own top-k, so sampling and training score the same experts (docs/moe.md)."""
    lr: float = 1e-4
    """AdamW learning rate (> 0). The demo's tiny model learns at 5e-5..1e-4 and collapses at >= 2e-4."""
    weight_decay: float = 0.0
    """AdamW weight decay (>= 0)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm of each update to this (0: measure it, do not clip)."""
    dtype: str = "float32"
    """Training weights and optimizer dtype: float32 or bfloat16."""
    device: str = "cpu"
    """cpu or cuda (each rank then trains on its local GPU, LOCAL_RANK); the same kind as engine.device, since a
    cell swaps between its engine and its trainer in one process."""

    recompute: str = "none"
    """Activation recompute in the backward: none (keep every activation), selective (recompute the attention: in
    megatron its core attention, in the native trainer each layer's attention block), full (recompute each whole
    layer from its input: the least memory, ~1/3 more compute). Long rows want full (docs/training.md, "Long
    rows")."""
    logprob_chunk_tokens: int = 1024
    """Log-probs are taken from the final hidden states this many tokens at a time, so the [tokens, vocab] logits
    never exist whole; peak extra memory ~3 x chunk x vocab / TP x 4 bytes (docs/training.md, "Long rows")."""
    optimizer_offload_fraction: float = 0.0
    """The share of the core's parameters whose AdamW state and fp32 main weights live and step in host memory
    (megatron-core's `HybridDeviceOptimizer`), in [0, 1]; 0: all on the device. Megatron on CUDA only: on a CPU
    trainer they are in host memory already (docs/training.md, "Optimizer offload")."""

    weight_transport: str = "store"
    """How a satellite joining a step in flight pulls the core's weights (one-sided reads, docs/distributed.md):
    store (the snapshot in the job's store: anywhere, no extra package), mooncake (the Mooncake Transfer Engine:
    TCP or RDMA as trainer.mooncake says; needs mooncake-transfer-engine and its Debian libraries), auto (Mooncake
    where it imports, else store)."""
    mooncake: MooncakeConfig = field(default_factory=MooncakeConfig)
    """The Mooncake transport's link: protocol (tcp, rdma) and RDMA device names."""

    def __post_init__(self) -> None:
        require_choice("trainer.backend", self.backend, TRAINER_BACKENDS)
        require_choice("trainer.weight_transport", self.weight_transport, WEIGHT_TRANSPORTS)
        require(isinstance(self.mooncake, MooncakeConfig), "trainer.mooncake", self.mooncake, "a MooncakeConfig")
        require(
            self.weight_transport != "store" or self.mooncake.protocol == "tcp",
            "trainer.mooncake.protocol",
            self.mooncake.protocol,
            "tcp with trainer.weight_transport=store (the store snapshot does not use Mooncake; set "
            "trainer.weight_transport=mooncake)",
        )
        require_int("trainer.tensor_parallel_size", self.tensor_parallel_size, ge=1)
        require_int("trainer.pipeline_parallel_size", self.pipeline_parallel_size, ge=1)
        require_int("trainer.context_parallel_size", self.context_parallel_size, ge=1)
        require_int("trainer.expert_parallel_size", self.expert_parallel_size, ge=1)
        require_bool("trainer.routing_replay", self.routing_replay)
        require_number("trainer.lr", self.lr, gt=0)
        require_number("trainer.weight_decay", self.weight_decay, ge=0)
        require_number("trainer.max_grad_norm", self.max_grad_norm, ge=0, note="0 = no clipping")
        require_choice("trainer.dtype", self.dtype, TRAINER_DTYPES)
        require_choice("trainer.recompute", self.recompute, RECOMPUTE_CHOICES)
        require_int("trainer.logprob_chunk_tokens", self.logprob_chunk_tokens, ge=1)
        require_number("trainer.optimizer_offload_fraction", self.optimizer_offload_fraction, ge=0, le=1)
        require(
            device_kind(self.device) in DEVICE_KINDS,
            "trainer.device",
            self.device,
            "cpu or cuda (cuda:N names one GPU)",
        )
        if self.backend == "native":
            for name in (
                "tensor_parallel_size",
                "pipeline_parallel_size",
                "context_parallel_size",
                "expert_parallel_size",
            ):
                value = getattr(self, name)
                require(value == 1, f"trainer.{name}", value, "1 with trainer.backend=native (no model parallelism)")
        if self.optimizer_offload_fraction > 0:
            require(
                device_kind(self.device) == "cuda",
                "trainer.optimizer_offload_fraction",
                self.optimizer_offload_fraction,
                f"0 with trainer.device={self.device} (a CPU trainer's optimizer state is in host memory already)",
            )
            require(
                self.backend == "megatron",
                "trainer.optimizer_offload_fraction",
                self.optimizer_offload_fraction,
                "0 with trainer.backend=native (offload is megatron-core's HybridDeviceOptimizer: "
                "trainer.backend=megatron)",
            )
        check_expert_layout(
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.context_parallel_size,
            self.expert_parallel_size,
        )
        require(
            not (self.routing_replay and self.pipeline_parallel_size > 1 and self.recompute == "full"),
            "trainer.routing_replay",
            self.routing_replay,
            "false with trainer.pipeline_parallel_size > 1 and trainer.recompute=full (a stage recomputes a "
            "micro-step after later ones ran forward: their routes would be replayed)",
        )

    @property
    def model_parallel_size(self) -> int:
        """TP x PP x `dense_replicas` (1 without expert parallelism beyond TP): the ranks of one cell."""
        replicas = dense_replicas(self.tensor_parallel_size, self.expert_parallel_size)
        return self.tensor_parallel_size * self.pipeline_parallel_size * replicas


def device_kind(device: object) -> str:
    """`cuda` of `cuda:1`, `cpu` of `cpu`; an empty string for anything that is not a device name."""
    if not isinstance(device, str):
        return ""
    kind, _, index = device.partition(":")
    return kind if index == "" or index.isdigit() else ""
