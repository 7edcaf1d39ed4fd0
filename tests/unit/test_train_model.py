"""gyre.trainer model build and packed log-probs (one process, TP=1 on a one-rank gloo group): a Megatron GPTModel
loaded from a native `DecoderLM`'s HF state dict gives the native model's teacher-forced log-probs (fp32: 1e-4),
packed rows give what each row gives alone, and layouts megatron cannot build are refused before building."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gyre.engine.protocol import SamplingParams
from gyre.engine.sampling import sequence_logprobs
from gyre.models.decoder import build_model
from gyre.models.decoder_config import DecoderConfig, RopeScaling, read_config
from gyre.models.hf_weights import read_state_dict
from gyre.models.tiny import tiny_model_dir
from gyre.trainer.convert import load_hf_state_dict
from gyre.trainer.logprobs import packed_logprobs
from gyre.trainer.model import build_gpt_model, transformer_config, validate_layout

pytestmark = pytest.mark.slow  # megatron import and model builds: several seconds

PARITY_TOL = 1e-4  # docs/architecture.md, contract 5 (fp32)
SMALL = DecoderConfig(
    model_type="qwen3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA 4:2
    head_dim=12,  # != hidden / heads
    rope_theta=500.0,  # small base: short rows rotate every frequency noticeably
    qk_norm=True,
)
VARIANTS = {
    "qwen3-untied-qkv-bias": dataclasses.replace(SMALL, attention_qkv_bias=True),
    "qwen3-tied": dataclasses.replace(SMALL, tie_word_embeddings=True),
    "llama-linear-rope": dataclasses.replace(
        SMALL, model_type="llama", qk_norm=False, rope_scaling=RopeScaling(rope_type="linear", factor=2.0)
    ),
    # theta 1e6: the longest wavelengths exceed 8192 / low_freq_factor, so llama3 scaling changes some of them.
    "llama3-rope": dataclasses.replace(
        SMALL,
        model_type="llama",
        qk_norm=False,
        rope_theta=1e6,
        rope_scaling=RopeScaling(rope_type="llama3", factor=8.0),
    ),
    # YaRN (Qwen3's long context): positions past 16 are past the original length; the attention factor !=1.
    "qwen3-yarn-rope": dataclasses.replace(
        SMALL, rope_scaling=RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)
    ),
}


def perturbed_native(config: DecoderConfig, seed: int):
    """A native model whose norms and biases are not 1 and 0, so a mis-mapped norm or bias shows in the logits."""
    model = build_model(config, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
    return model.eval()


def hf_state(model) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def native_row_logprobs(model, row: torch.Tensor) -> torch.Tensor:
    """The native engine's teacher-forced log-probs of a row's tokens 1.. given the row before them; 0 first."""
    logp = sequence_logprobs(model, row[:1], row[1:], SamplingParams(temperature=1.0))
    return torch.cat((torch.zeros(1), logp))


def rows_of(vocab_size: int, lengths: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator) for n in lengths]


def check_parity(megatron_model, native, rows: list[torch.Tensor]) -> tuple[float, float]:
    """(max |packed - native|, max |packed - each row alone|) over every token of `rows` packed back to back."""
    lengths = [len(r) for r in rows]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    with torch.no_grad():
        packed = packed_logprobs(megatron_model, torch.cat(rows), offsets)
        alone = torch.cat([packed_logprobs(megatron_model, r, [0, len(r)]) for r in rows])
        reference = torch.cat([native_row_logprobs(native, r) for r in rows])
    assert packed.dtype == torch.float32 and packed.shape == (offsets[-1],)
    assert (packed[torch.tensor(offsets[:-1])] == 0).all(), "a row's first token has no context: log-prob 0"
    return (packed - reference).abs().max().item(), (packed - alone).abs().max().item()


def test_tiny_model_parity_with_native_engine(model_parallel):
    path = tiny_model_dir()
    config = read_config(path)
    state = read_state_dict(path, dtype=torch.float32, device="cpu")
    native = build_model(config)
    native.load_state_dict(state)
    megatron_model = build_gpt_model(config)
    load_hf_state_dict(megatron_model, state, config)
    vs_native, vs_alone = check_parity(megatron_model, native.eval(), rows_of(config.vocab_size, (9, 17, 4, 30), 0))
    assert vs_native <= PARITY_TOL, vs_native
    assert vs_alone <= 1e-5, vs_alone


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_parity_with_native_engine(model_parallel, name):
    config = VARIANTS[name]
    native = perturbed_native(config, seed=3)
    megatron_model = build_gpt_model(config)
    load_hf_state_dict(megatron_model, hf_state(native), config)
    # Row 2 is 40 tokens: positions past 32 exercise the scaled RoPE frequencies.
    vs_native, vs_alone = check_parity(megatron_model, native, rows_of(config.vocab_size, (6, 40, 2, 11), 1))
    assert vs_native <= PARITY_TOL, (name, vs_native)
    assert vs_alone <= 1e-5, (name, vs_alone)


def test_temperature_divides_the_logits(model_parallel):
    config = VARIANTS["qwen3-tied"]
    native = perturbed_native(config, seed=5)
    megatron_model = build_gpt_model(config)
    load_hf_state_dict(megatron_model, hf_state(native), config)
    row = rows_of(config.vocab_size, (12,), 2)[0]
    with torch.no_grad():
        got = packed_logprobs(megatron_model, row, [0, 12], temperature=0.7)
        want = sequence_logprobs(native, row[:1], row[1:], SamplingParams(temperature=0.7))
    assert (got[1:] - want).abs().max().item() <= PARITY_TOL


def test_bad_layouts_are_refused_before_building():
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        validate_layout(SMALL, tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 is not divisible by tensor_parallel_size=4"):
        validate_layout(SMALL, tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"vocab_size=63 is not divisible by tensor_parallel_size=2"):
        validate_layout(dataclasses.replace(SMALL, vocab_size=63), tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"num_hidden_layers=2 is not divisible by pipeline_parallel_size=3"):
        validate_layout(SMALL, pipeline_parallel_size=3)
    with pytest.raises(ValueError, match=r"rope_scaling.low_freq_factor=2.0"):
        scaling = RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=2.0)
        validate_layout(dataclasses.replace(SMALL, rope_scaling=scaling))
    with pytest.raises(ValueError, match=r"mlp_bias=True"):
        validate_layout(dataclasses.replace(SMALL, model_type="llama", qk_norm=False, mlp_bias=True))


def test_bad_packing_is_refused(model_parallel):
    megatron_model = build_gpt_model(SMALL)
    with pytest.raises(ValueError, match=r"row_offsets_R1=\[0, 3, 2, 5\]"):
        packed_logprobs(megatron_model, torch.zeros(5, dtype=torch.long), [0, 3, 2, 5])
    with pytest.raises(ValueError, match=r"expected \[0, \.\.\., U=5\]"):
        packed_logprobs(megatron_model, torch.zeros(5, dtype=torch.long), [0, 4])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches are a no-op where CUDA is available")
def test_cpu_patches_allow_a_training_step(model_parallel):
    """Patches 3 and 4 (docs/training.md): megatron's DDP, DistributedOptimizer (type() checks, device="cuda" scalars),
    gradient clipping and schedule run on CPU, and log-probs from `packed_logprobs` carry gradients."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from gyre.trainer import apply_cpu_patches, cpu_patch

    assert apply_cpu_patches() is True and apply_cpu_patches() is True  # idempotent
    assert getattr(get_megatron_optimizer, "_gyre_cpu_device_mode", False)
    config = VARIANTS["qwen3-tied"]
    model = build_gpt_model(config)
    load_hf_state_dict(model, hf_state(perturbed_native(config, seed=9)), config)
    model.train()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True, clip_grad=1.0), [ddp]
    )
    ids = torch.cat(rows_of(config.vocab_size, (5, 9), 4))

    def forward_step(data_iterator, chunk):
        logp_U = packed_logprobs(chunk, ids, [0, 5, 14])
        return logp_U, lambda out: (-out.sum(), {"nll": -out.sum().detach()})

    nll = []
    for _ in range(3):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([None]),
            model=[ddp],
            num_microbatches=1,
            seq_length=len(ids),
            micro_batch_size=1,
            forward_only=False,
        )
        ok, grad_norm, _ = optimizer.step()
        assert ok and grad_norm > 0
        nll.append(losses[0]["nll"].item())
    assert nll[2] < nll[0], nll  # fitting the same tokens lowers their NLL
    with pytest.raises((AssertionError, RuntimeError)):  # the device rewrite is scoped: not left active here
        torch.zeros(1, device="cuda")
    with cpu_patch.cpu_device_mode():
        assert torch.zeros(1, device="cuda").device.type == "cpu"
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"


def test_megatron_imported_after_gyre_train_loads_no_compiler_stack():
    """Patch 5 (gyre/trainer/cpu_patch.py): on a CPU-only torch, megatron's fusion functions are not wrapped in
    `torch.compile` at import, so torch's compiler stack (dynamo, inductor) is not imported. A fresh process: this
    one may have imported them for other tests."""
    import subprocess
    import sys

    code = (
        "import sys, gyre.trainer, megatron.core, megatron.core.jit as jit; "
        "print(jit.jit_fuser is jit.noop_decorator, 'torch._dynamo' in sys.modules, 'torch._inductor' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False", "False"], out.stdout


def test_recompute_maps_to_megatrons_own_options():
    from gyre.config.trainer import RECOMPUTE_CHOICES
    from gyre.trainer.model import RECOMPUTE, recompute_overrides

    assert RECOMPUTE == RECOMPUTE_CHOICES
    assert recompute_overrides("none") == {}
    assert transformer_config(SMALL, **recompute_overrides("full")).recompute_granularity == "full"
    assert transformer_config(SMALL, **recompute_overrides("selective")).recompute_modules == ["core_attn"]
    with pytest.raises(ValueError, match="recompute='some' is not supported"):
        recompute_overrides("some")


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_model_built_to_recompute_is_in_training_mode(model_parallel, recompute):
    """Megatron recomputes only in training mode: a model built with recompute must be in it, or trainer.recompute
    would do nothing in the runtime's cells (found in issue 28; dropout is 0, so the mode changes nothing else)."""
    from gyre.trainer.model import build_gpt_model

    model = build_gpt_model(SMALL, recompute=recompute)
    assert model.training is (recompute != "none")
