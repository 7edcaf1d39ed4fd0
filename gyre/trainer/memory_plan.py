"""A memory plan before anything starts: each rank's peak, by role, from the model config, the layout, the dtypes and
the token budget (docs/training.md, "The memory plan").

`memory_plan(MemoryInputs(...))` returns a `MemoryPlan`: one `RankMemory` per distinct rank (the core's stage s, a
satellite's stage s, a cell's leader, which also serves, the separate rollout pool's serving rank and its others),
each a list of `Term`s (bytes, and where the number comes from). On a CPU the roles of a rank are resident together
(its engine, its trainer, rank 0's controller: one process), so its peak is their sum; on a GPU a cell swaps between
rollout and training, so its peak is the larger of the two plus what stays. `MemoryPlan.misfit()` is None, or one
line naming the worst rank, its peak against the device's memory less the headroom, and the first setting that makes
it fit (found by planning again with it).

The terms follow gyre's own code, today's:
- training (`gyre.trainer.precision`, `megatron_trainable`, `streaming`): the model's weights in the trainer's dtype;
  fp32 gradients (a bf16 model's go to fp32 accumulators); on the core only (a satellite never steps), fp32 main
  weights (bf16) and AdamW's two fp32 moments, with optimizer offload their share f in host memory beside pinned
  gradient buffers (megatron's `HybridDeviceOptimizer`); the step's flat copy of the gradients
  (`reduce_gradients`); activations of the micro-step's tokens under the recompute mode (bytes per token and layer
  measured by counting what each forward saves for its backward: docs/training.md; a MoE layer's expert part split
  over EP), times the micro-steps in flight on pipeline stage s (1F1B: PP - s); the log-probs' chunk (last stage);
- publication, as gyre does it: every core rank gathers the whole model in the engine's dtype, and rank 0 also
  builds an fp32 copy of it for `policy/`;
- rollout (`gyre.engine.native`): the whole model in the engine's dtype on the cell's leader (SGLang: its share at
  tp_size = the cell's size on each of its ranks), and KV caches of `2 x layers x kv_heads x head_dim` values a
  token, for the engine's token budget plus the decode batch's own copy; the separate pool's ranks hold this role
  only (its engine on its first rank; SGLang's share on each at tp_size = `separate_size`);
- a process's own: the interpreter with torch, megatron and gyre imported (measured on CPU), or a CUDA context.

Pure: stdlib and `gyre.models.decoder_config`; no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from gyre.config import TrainConfig
from gyre.models.decoder_config import DecoderConfig

__all__ = [
    "MemoryInputs",
    "MemoryPlan",
    "RankMemory",
    "Term",
    "kv_bytes_per_token",
    "memory_inputs",
    "memory_plan",
    "rank_parameters",
    "training_terms",
]

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CPU_PROCESS_BYTES = int(0.5 * GIB)  # python + torch + megatron + gyre imported, gloo groups, arenas (docs/training.md)
CUDA_CONTEXT_BYTES = int(0.75 * GIB)  # a CUDA context and its allocator's first blocks
CONTROLLER_BYTES = int(0.5 * GIB)  # rank 0's proxy, buffers, scheduler and record writers (a run's first minutes)
DECODE_GROW = 64  # the native engine's decode batch grows its KV copy this many positions at a time
# Activations per token and layer of one micro-step, in bytes, by (dtype, recompute): R (replicated over TP, per unit
# of hidden size) and S (split over TP, per unit of 2(a+2k)d + 3ad + 4f), fitted to the saved-for-backward bytes of
# gyre's Megatron layers (h=256, a=4, k=2, d=64, f=704; docs/training.md, "The memory plan").
ACTIVATION_R = {("float32", "none"): 24.03, ("bfloat16", "none"): 22.03}
ACTIVATION_S = {("float32", "none"): 5.397, ("bfloat16", "none"): 2.759}
SELECTIVE_SHARE = {"float32": 0.92, "bfloat16": 0.985}  # selective recompute keeps this share (SDPA makes no scores)
LAYER_FREE_PER_H = 12.5  # bytes per token per unit of h outside the layers (embedding out, final norm), fp32
# A MoE layer: its attention as a dense layer's; then each token-expert pair on an EP rank (top_k / EP a token: the
# layer splits the tokens over the EP group) keeps EXPERT_PAIR_S units of S per unit of the expert's width and its
# hidden state (dtype bytes x h); the router and the combine keep MOE_ROUTER_PER_H bytes per unit of h of a token,
# split over EP (fitted the same way, fp32, h=256, 8 experts, top 2 and 4, width 256 and 512, EP 1 and 2).
EXPERT_PAIR_S = 4.447
MOE_ROUTER_PER_H = 4.5


@dataclass(frozen=True, kw_only=True)
class MemoryInputs:
    """Everything the plan reads: the model's config and the run's settings (no torch, no files)."""

    model: DecoderConfig
    num_cells: int = 1
    cell_size: int = 1
    trainer_backend: str = "native"
    tp: int = 1
    pp: int = 1
    ep: int = 1
    trainer_dtype: str = "float32"
    engine_dtype: str = "float32"
    engine_backend: str = "native"
    device: str = "cpu"  # cpu | cuda
    recompute: str = "none"
    tokens_per_microstep: int = 4096
    logprob_chunk_tokens: int = 1024
    max_running: int = 16
    max_total_tokens: int = 0  # 0: max_running x the model's positions (the native engine's default)
    separate_size: int = 0  # the separate rollout pool's ranks (after the cells'): they serve, never train
    optimizer_offload_fraction: float = 0.0  # the core's share of main weights and AdamW state in host memory (cuda)
    bucket_bytes: int = 512 << 20  # the weight stream's bucket (publication.bucket_mib)
    weight_transport: str = "store"  # trainer.weight_transport: the satellites' pull of the core's weights
    device_memory_bytes: int = 0  # 0: unknown: the plan is reported, never refused
    headroom: float = 0.1


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    source: str
    transient: bool = False  # held for a phase only: a role's peak holds its largest transient (rollout: all of them)
    host: bool = False  # in the host's memory (on a CPU run, the same memory; on a GPU run, not the device's)


@dataclass(frozen=True)
class RankMemory:
    """One kind of rank: where it sits, and its terms by role."""

    name: str  # e.g. "rank 0 (core, stage 0, cell leader, controller)"
    ranks: int  # how many ranks of the job are this kind
    training: tuple[Term, ...]
    rollout: tuple[Term, ...]
    resident: tuple[Term, ...]  # the process's own, and what stays whatever the role

    def held(self, role: str, *, host: bool = False) -> int:
        """What the role holds all along (in the device's memory, or with `host`, in the host's)."""
        return sum(term.bytes for term in getattr(self, role) if not term.transient and term.host == host)

    def phase(self, role: str) -> int:
        """The role's largest moment beyond what it holds: training's largest transient (the backward's activations,
        the step's flat gradients and the publication's gather come one after another); rollout's KV together."""
        transients = [term.bytes for term in getattr(self, role) if term.transient and not term.host]
        if role == "training":
            return max(transients, default=0)
        return sum(transients)

    def peak(self, device: str) -> int:
        """On a CPU both roles' weights stay resident (one process) and the larger phase comes on top; on a GPU a
        cell swaps, so the larger role with its phase, plus the process's own."""
        resident = self.held("resident")
        if device == "cpu":
            resident += sum(self.held(role, host=True) for role in ("training", "rollout", "resident"))
            return (
                resident
                + self.held("training")
                + self.held("rollout")
                + max(self.phase("training"), self.phase("rollout"))
            )
        training = self.held("training") + self.phase("training")
        rollout = self.held("rollout") + self.phase("rollout")
        return resident + max(training, rollout)

    def host_bytes(self) -> int:
        """On a GPU run, what it holds in the host's memory besides (the device's peak leaves it out)."""
        return sum(self.held(role, host=True) for role in ("training", "rollout", "resident"))


@dataclass(frozen=True)
class MemoryPlan:
    inputs: MemoryInputs
    ranks: tuple[RankMemory, ...]

    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda rank: rank.peak(self.inputs.device))

    def budget(self) -> int:
        """The bytes a rank may use: the device's memory less the headroom (0: unknown)."""
        return int(self.inputs.device_memory_bytes * (1.0 - self.inputs.headroom))

    def fits(self) -> bool:
        return not self.inputs.device_memory_bytes or self.worst().peak(self.inputs.device) <= self.budget()

    def table(self) -> str:
        """The plan as text: one block per kind of rank, GiB per term, its peak, the device's memory."""
        device = self.inputs.device
        lines = []
        for rank in self.ranks:
            peak = rank.peak(device)
            share = f" ({peak / self.inputs.device_memory_bytes:.0%} of the device)" if self.budget() else ""
            host = (
                f"; host memory besides: {rank.host_bytes() / GIB:.2f} GiB"
                if device != "cpu" and rank.host_bytes()
                else ""
            )
            lines.append(f"{rank.name} x{rank.ranks}: peak {peak / GIB:.2f} GiB{share}{host}")
            for role in ("training", "rollout", "resident"):
                for term in getattr(rank, role):
                    if term.bytes:
                        held = "host" if term.host else "at times" if term.transient else "held"
                        lines.append(f"  {role:<9} {term.name:<34} {term.bytes / GIB:9.3f} GiB {held:<8} {term.source}")
        if self.budget():
            lines.append(
                f"budget: {self.budget() / GIB:.2f} GiB a rank ({self.inputs.device_memory_bytes / GIB:.2f} GiB, "
                f"{self.inputs.headroom:.0%} kept free)"
            )
        return "\n".join(lines)

    def offload_note(self) -> str:
        """With optimizer offload, what of a core rank's optimizer it moves to host memory (text for the plan's
        line); empty without."""
        f = self.inputs.optimizer_offload_fraction
        if not f:
            return ""
        core = self.ranks[0]
        moved = sum(term.bytes for term in core.training if term.host and term.name.startswith("offloaded"))
        return (
            f"; trainer.optimizer_offload_fraction={f:g}: {f:.0%} of a core rank's fp32 main weights and AdamW "
            f"moments step in host memory ({moved / GIB:.2f} GiB of host memory on {core.name})"
        )

    def misfit(self) -> str | None:
        """None when every rank fits (or the device's memory is unknown); else one line: the worst rank, its peak
        against the budget, its largest terms, and the first setting that makes it fit."""
        if self.fits():
            return None
        worst = self.worst()
        peak = worst.peak(self.inputs.device)
        terms = sorted((*worst.training, *worst.rollout, *worst.resident), key=lambda term: -term.bytes)[:3]
        largest = ", ".join(f"{term.name} {term.bytes / GIB:.1f}" for term in terms)
        line = (
            f"{worst.name} needs {peak / GIB:.1f} GiB of {self.budget() / GIB:.1f} GiB "
            f"(cluster.device_memory_gib less cluster.memory_headroom; largest: {largest} GiB)"
        )
        fix = _first_fix(self.inputs)
        return f"{line}: {fix}" if fix else f"{line}: no single setting makes it fit; shard the model over more ranks"


# -- parameters ---------------------------------------------------------------------------------------------------


def _is_moe_layer(model: DecoderConfig, index: int) -> bool:
    return (
        model.num_experts > 0
        and index not in model.mlp_only_layers
        and (index + 1) % max(1, model.decoder_sparse_step) == 0
    )


def rank_parameters(model: DecoderConfig, *, tp: int = 1, pp: int = 1, ep: int = 1, stage: int = 0) -> int:
    """The parameters one rank of pipeline stage `stage` holds at TP x PP x EP (gyre.trainer.layout's split): each
    dense matrix split over TP, the experts over EP (whole on their rank), norms and routers replicated."""
    h, a, k, d = model.hidden_size, model.num_attention_heads, model.num_key_value_heads, model.head_dim
    per_stage = model.num_hidden_layers // pp
    first = stage * per_stage
    total = 0
    for index in range(first, first + per_stage):
        attention = (h * (a + 2 * k) * d + a * d * h) // tp + 2 * h
        attention += (a + 2 * k) * d // tp if model.attention_qkv_bias else 0
        attention += 2 * d if model.qk_norm else 0
        if _is_moe_layer(model, index):
            experts = model.num_experts // ep * 3 * h * model.moe_intermediate_size
            shared = (
                3 * h * model.shared_expert_intermediate_size // tp + h if model.shared_expert_intermediate_size else 0
            )
            mlp = model.num_experts * h + experts + shared
        else:
            mlp = 3 * h * model.intermediate_size // tp
        total += attention + mlp
    vocab = model.vocab_size * h // tp
    if stage == 0:
        total += vocab
    if stage == pp - 1:
        total += h  # the final norm
        if not model.tie_word_embeddings or pp > 1:
            total += vocab  # the output layer (tied at PP > 1: a copy on the last stage)
    return total


def total_parameters(model: DecoderConfig) -> int:
    return rank_parameters(model)


def kv_bytes_per_token(model: DecoderConfig, dtype: str) -> int:
    """K and V of every layer for one token: 2 x layers x kv_heads x head_dim values."""
    return 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * DTYPE_BYTES[dtype]


def publication_bytes(inputs: MemoryInputs) -> int:
    """A core rank's most during a publication by the weight stream: two buckets, each at least the largest HF tensor,
    in the engines' dtype (never more than the whole model), and on a stage leader one unit's gathered parts in the
    trainer's dtype (docs/training.md, "Publication")."""
    m = inputs.model
    h = m.hidden_size
    largest = max(m.vocab_size * h, m.intermediate_size * h, m.num_attention_heads * m.head_dim * h)
    attention = (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim * h
    unit = max(m.vocab_size * h, attention, 2 * m.intermediate_size * h, inputs.ep * 2 * m.moe_intermediate_size * h)
    b_e = DTYPE_BYTES[inputs.engine_dtype]
    bucket = max(inputs.bucket_bytes, largest * b_e)
    return min(2 * bucket, total_parameters(m) * b_e) + unit * DTYPE_BYTES[inputs.trainer_dtype]


def layer_activation_bytes(model: DecoderConfig, index: int, *, tp: int, ep: int, dtype: str) -> float:
    """Bytes a token of one micro-step keeps for the backward in layer `index`, without recompute (module
    docstring; the coefficients above)."""
    h, a, k, d = model.hidden_size, model.num_attention_heads, model.num_key_value_heads, model.head_dim
    r, s = ACTIVATION_R[(dtype, "none")], ACTIVATION_S[(dtype, "none")]
    attention = r * h + s * (2 * (a + 2 * k) * d + 3 * a * d) / tp
    if not _is_moe_layer(model, index):
        return attention + s * 4 * model.intermediate_size / tp
    pairs = model.num_experts_per_tok / ep  # a token's expert pairs on this rank
    experts = pairs * (s * EXPERT_PAIR_S * model.moe_intermediate_size + DTYPE_BYTES[dtype] * h)
    shared = s * 4 * model.shared_expert_intermediate_size / tp  # qwen2_moe's shared expert: every token, TP-split
    return attention + experts + MOE_ROUTER_PER_H * h / ep + shared


def activation_bytes(model: DecoderConfig, inputs: MemoryInputs, *, stage: int) -> int:
    """Activations of stage `stage` for one step's micro-steps in flight (module docstring)."""
    dtype = inputs.trainer_dtype if inputs.trainer_dtype in ("float32", "bfloat16") else "bfloat16"
    megatron = inputs.trainer_backend == "megatron"
    tp, ep, stages = (inputs.tp, inputs.ep, inputs.pp) if megatron else (1, 1, 1)
    per_stage = model.num_hidden_layers // stages
    layers = [
        layer_activation_bytes(model, index, tp=tp, ep=ep, dtype=dtype)
        for index in range(stage * per_stage, (stage + 1) * per_stage)
    ]
    if inputs.recompute == "full":
        kept = len(layers) * DTYPE_BYTES[dtype] * model.hidden_size + max(layers)  # inputs, and one layer rebuilt
    else:
        share = SELECTIVE_SHARE[dtype] if inputs.recompute == "selective" else 1.0
        kept = sum(layers) * share
    kept += LAYER_FREE_PER_H * model.hidden_size
    in_flight = stages - stage  # 1F1B: stage s holds PP - s micro-steps' activations (one at PP 1)
    logits = 3 * inputs.logprob_chunk_tokens * model.vocab_size // tp * 4 if stage == stages - 1 else 0
    return int(inputs.tokens_per_microstep * kept * in_flight + logits)


# -- the plan -----------------------------------------------------------------------------------------------------


def training_terms(inputs: MemoryInputs, *, stage: int = 0, core: bool = True) -> tuple[Term, ...]:
    """The training role's terms of a rank of pipeline stage `stage`, the core's or a satellite's."""
    return _training(inputs, stage=stage, core=core)


def _training(inputs: MemoryInputs, *, stage: int, core: bool) -> tuple[Term, ...]:
    megatron = inputs.trainer_backend == "megatron"
    params = (
        rank_parameters(inputs.model, tp=inputs.tp, pp=inputs.pp, ep=inputs.ep, stage=stage)
        if megatron
        else (total_parameters(inputs.model))
    )
    b_w = DTYPE_BYTES[inputs.trainer_dtype]
    mixed = b_w != 4
    where = "gyre/trainer/precision.py"
    terms = [
        Term("weights", params * b_w, f"{params:,} parameters in {inputs.trainer_dtype}"),
        Term("gradients (fp32)", params * 4, where),
        Term("step's flat gradients", params * 4, "gyre/trainer/streaming.py reduce_gradients", transient=True),
        Term(
            "activations",
            activation_bytes(inputs.model, inputs, stage=stage),
            f"recompute={inputs.recompute}, {inputs.tokens_per_microstep:,} tokens a micro-step",
            transient=True,
        ),
    ]
    if core:
        f = inputs.optimizer_offload_fraction
        on_host = math.floor(params * f)  # the hybrid optimizer's host share, in parameters
        on_device = params - on_host
        hybrid = "megatron HybridDeviceOptimizer, trainer.optimizer_offload_fraction"
        terms += [
            Term("main weights (fp32)", on_device * 4 if mixed else 0, where if not f else hybrid),
            Term("AdamW moments (fp32)", on_device * 8, "torch.optim.AdamW" if not f else hybrid),
            Term("offloaded main weights (fp32)", on_host * 4, hybrid, host=True),
            Term("offloaded AdamW moments (fp32)", on_host * 8, hybrid, host=True),
            Term("offloaded gradients (pinned fp32)", on_host * 4, hybrid, host=True),
            Term("published snapshot", params * b_w, "gyre/trainer/streaming.py publish_parameters"),
            Term(
                "publication buckets",
                publication_bytes(inputs),
                "gyre/trainer/weight_stream.py: two buckets (publication.bucket_mib, at least the largest tensor) "
                "and a unit's gathered parts",
                transient=True,
            ),
            Term(
                "checkpoint's whole model",
                total_parameters(inputs.model) * DTYPE_BYTES[inputs.engine_dtype],
                "gyre/trainer/convert.py gather_hf_state_dict: a checkpoint's trainer/ (and the demo's held-out "
                "evaluation) gather the whole model on every core rank",
                transient=True,
            ),
        ]
    return tuple(terms)


def _rollout(inputs: MemoryInputs, *, ranks: int, field: str = "cluster.cell_size") -> tuple[Term, ...]:
    """What one rank of an engine of `ranks` ranks holds to serve: the native engine runs on its first rank alone
    (call it for that rank); SGLang's tensor-parallel group spans all of them, a share each."""
    model, b_e = inputs.model, DTYPE_BYTES[inputs.engine_dtype]
    whole = total_parameters(model) * b_e
    if inputs.engine_backend == "sglang":
        return (Term("engine weights", whole // ranks, f"SGLang at tp_size = {field}"),)
    budget = inputs.max_total_tokens or inputs.max_running * model.max_position_embeddings
    per_token = kv_bytes_per_token(model, inputs.engine_dtype)
    batch = inputs.max_running * (min(budget, model.max_position_embeddings) + DECODE_GROW)
    return (
        Term("engine weights", whole, f"the whole model in {inputs.engine_dtype} (gyre.engine.native)"),
        Term(
            "KV caches",
            budget * per_token,
            f"{budget:,} tokens x {per_token:,} B (engine.max_total_tokens)",
            transient=True,
        ),
        Term(
            "decode batch's KV copy", min(batch, budget) * per_token, "gyre/engine/native.py _BatchKV", transient=True
        ),
    )


def _resident(inputs: MemoryInputs, *, controller: bool) -> tuple[Term, ...]:
    own = CPU_PROCESS_BYTES if inputs.device == "cpu" else CUDA_CONTEXT_BYTES
    terms = [
        Term(
            "process",
            own,
            "measured: python, torch, megatron, gyre imported" if inputs.device == "cpu" else "a CUDA context",
        )
    ]
    if controller:
        terms.append(Term("controller", CONTROLLER_BYTES, "rank 0: proxy, buffers, scheduler"))
        terms.append(
            Term(
                "checkpoint's trainer/ copy (fp32)",
                total_parameters(inputs.model) * 4,
                "gyre/runtime/cell/trainers.py policy_model (an fp32 copy of the whole model, on rank 0)",
                host=True,
            )
        )
        if inputs.weight_transport == "store" and inputs.num_cells > 1:
            terms.append(
                Term(
                    "weight store (2 versions)",
                    2 * total_parameters(inputs.model) * DTYPE_BYTES[inputs.trainer_dtype],
                    "gyre/distributed/transport_store.py: the job's store, in rank 0's process, keeps the core's "
                    "weights of the last 2 steps for the satellites (trainer.weight_transport=mooncake: none)",
                    host=True,
                )
            )
    return tuple(terms)


def memory_plan(inputs: MemoryInputs) -> MemoryPlan:
    """Each kind of rank's terms (module docstring). A Megatron cell's ranks differ by pipeline stage; the ranks of a
    stage hold the same (TP and EP split evenly). The cell's leader (coordinate 0, stage 0) also serves."""
    megatron = inputs.trainer_backend == "megatron"
    sglang = inputs.engine_backend == "sglang"
    stages = inputs.pp if megatron else 1
    per_stage = inputs.cell_size // stages
    kinds = []
    for core in (True, False):
        if not core and inputs.num_cells < 2:
            continue
        cells = 1 if core else inputs.num_cells - 1
        for stage in range(stages):
            training = _training(inputs, stage=stage, core=core)
            role = "core" if core else "satellite"
            where = f", stage {stage}" if stages > 1 else ""
            if stage == 0:  # the leader: serves, and on the core, is the controller
                leader = "cell leader, controller" if core else "cell leader"
                name = f"rank {0 if core else inputs.cell_size} ({role}{where}, {leader})"
                kinds.append(
                    RankMemory(
                        name=name,
                        ranks=cells,
                        training=training,
                        rollout=_rollout(inputs, ranks=inputs.cell_size),
                        resident=_resident(inputs, controller=core),
                    )
                )
            others = per_stage - 1 if stage == 0 else per_stage
            if others > 0:
                kinds.append(
                    RankMemory(
                        name=f"{role} rank{where}",
                        ranks=cells * others,
                        training=training,
                        rollout=_rollout(inputs, ranks=inputs.cell_size) if sglang else (),
                        resident=_resident(inputs, controller=False),
                    )
                )
    kinds += _pool(inputs)
    return MemoryPlan(inputs=inputs, ranks=tuple(kinds))


def _pool(inputs: MemoryInputs) -> list[RankMemory]:
    """The separate rollout pool's ranks (`gyre.runtime.cell.pool`): the rollout role only, never a trainer. Its
    first rank serves the pool's engine (the cells' engine config; SGLang at tp_size = the pool's size, a share on
    each of its ranks; the native engine on the first rank alone, the others waiting)."""
    size = inputs.separate_size
    if size == 0:
        return []
    first = inputs.num_cells * inputs.cell_size
    serving = _rollout(inputs, ranks=size, field="cluster.separate_size")
    kinds = [
        RankMemory(
            name=f"rank {first} (separate rollout pool, serves)",
            ranks=1,
            training=(),
            rollout=serving,
            resident=_resident(inputs, controller=False),
        )
    ]
    if size > 1:
        kinds.append(
            RankMemory(
                name="separate rollout pool rank",
                ranks=size - 1,
                training=(),
                rollout=serving if inputs.engine_backend == "sglang" else (),
                resident=_resident(inputs, controller=False),
            )
        )
    return kinds


def _first_fix(inputs: MemoryInputs) -> str | None:
    """The first of the usual settings that makes the plan fit, planned again with it."""
    candidates: list[tuple[str, MemoryInputs]] = []
    if inputs.recompute != "full":
        candidates.append(("set trainer.recompute=full", replace(inputs, recompute="full")))
    if inputs.device == "cuda" and inputs.trainer_backend == "megatron":
        for fraction in (0.25, 0.5, 0.75, 1.0):
            if fraction > inputs.optimizer_offload_fraction:
                candidates.append(
                    (
                        f"set trainer.optimizer_offload_fraction={fraction:g} (AdamW steps that share in host memory)",
                        replace(inputs, optimizer_offload_fraction=fraction),
                    )
                )
    tokens = inputs.tokens_per_microstep
    while tokens > 1024:
        tokens //= 2
        candidates.append(
            (
                f"set packing.max_tokens_per_microstep={tokens} (rows longer than it no longer fit)",
                replace(inputs, tokens_per_microstep=tokens),
            )
        )
    bucket = inputs.bucket_bytes
    while bucket > 64 << 20:
        bucket //= 2
        candidates.append((f"set publication.bucket_mib={bucket >> 20}", replace(inputs, bucket_bytes=bucket)))
    if inputs.weight_transport == "store" and inputs.num_cells > 1:
        candidates.append(
            (
                "set trainer.weight_transport=mooncake (the store keeps the satellites' weights in rank 0)",
                replace(inputs, weight_transport="mooncake"),
            )
        )
    if inputs.engine_backend == "native":
        budget = inputs.max_total_tokens or inputs.max_running * inputs.model.max_position_embeddings
        while budget > 4096:
            budget //= 2
            candidates.append((f"set engine.max_total_tokens={budget}", replace(inputs, max_total_tokens=budget)))
    for text, changed in candidates:
        if memory_plan(changed).fits():
            return f"{text} (then {memory_plan(changed).worst().peak(inputs.device) / GIB:.1f} GiB)"
    return None


def memory_inputs(cfg: TrainConfig, model: DecoderConfig) -> MemoryInputs:
    """The plan's inputs from a run's config and its model's."""
    t, e = cfg.trainer, cfg.engine
    return MemoryInputs(
        model=model,
        num_cells=cfg.cluster.num_cells,
        cell_size=cfg.cluster.cell_size,
        trainer_backend=t.backend,
        tp=t.tensor_parallel_size,
        pp=t.pipeline_parallel_size,
        ep=t.expert_parallel_size,
        trainer_dtype=t.dtype,
        engine_dtype=e.dtype,
        engine_backend=e.backend,
        device="cuda" if t.device.startswith("cuda") else "cpu",
        recompute=t.recompute,
        tokens_per_microstep=cfg.packing.max_tokens_per_microstep,
        logprob_chunk_tokens=t.logprob_chunk_tokens,
        max_running=e.max_running,
        max_total_tokens=e.max_total_tokens,
        separate_size=cfg.cluster.separate_size,
        optimizer_offload_fraction=t.optimizer_offload_fraction,
        bucket_bytes=cfg.publication.bucket_bytes,
        weight_transport=t.weight_transport,
        device_memory_bytes=math.floor(cfg.cluster.device_memory_gib * GIB),
        headroom=cfg.cluster.memory_headroom,
    )
