"""Make megatron-core 0.16.1 run on a CPU-only torch (gloo): four patches, applied by `apply_cpu_patches()`, and
a fifth, installed when this module is imported (before megatron is).

megatron-core assumes a CUDA device in a few places the forward, backward, optimizer and schedules go through
(docs/training.md, "CPU patches"). On a CPU-only torch `apply_cpu_patches()` installs, once
(idempotent; a no-op when CUDA is available, so the same program runs unchanged on GPUs):

1. `torch.cuda.current_device()` returns `torch.device("cpu")`. Megatron passes it as `device=` when it
   allocates buffers: `parallel_state.get_global_memory_buffer` (local attention), the all-gather / reduce
   buffers of `tensor_parallel.mappings` and `tensor_parallel.layers`, `RotaryEmbedding.get_emb` (which moves
   `inv_freq` to the "current device" on every forward). On a CPU-only torch the call would raise instead.
2. A CPU-generator RNG tracker in `megatron.core.tensor_parallel.random`: `CudaRNGStatesTracker.add` and
   `fork` read and seed `torch.cuda`'s generator (`model_parallel_cuda_manual_seed`, the dropout forks of
   attention and of the TP layers' initialization); `_get_cuda_rng_state` / `_set_cuda_rng_state` (used by
   `fork` and by activation recomputation) are replaced by their CPU-generator versions, and
   `initialize_rng_tracker` builds `CpuRNGStatesTracker` (a tracker built earlier is reset).
3. Hard-coded `device="cuda"` and `.cuda()` in the optimizer (`optimizer.py`, `grad_scaler.py`,
   `clip_grads.py`) and the schedules (`total_num_tokens = torch.zeros(..., device="cuda")`): a
   `torch.overrides.TorchFunctionMode` (`CudaToCpuMode`) rewrites CUDA devices to CPU and makes `.cuda()` the
   identity. It is active only inside `cpu_device_mode()`, which `apply_cpu_patches` enters around
   `get_megatron_optimizer`, `LanguageModule.setup_embeddings_and_output_layer` (tied embeddings at PP > 1 move
   the last stage's copy with `.cuda()` before all-reducing it), the `step` of `MixedPrecisionOptimizer`,
   `FP32Optimizer` and `ChainedOptimizer` (`DistributedOptimizer` inherits the first) and the three
   `forward_backward_*` functions that `get_forward_backward_func` returns. A `get_megatron_optimizer` imported
   by name BEFORE the patch stays unwrapped: call `apply_cpu_patches()` first (importing `gyre.trainer.model`,
   `.convert` or `.logprobs` does).
4. `Tensor.type()` string checks: the optimizers accept a parameter only if `param.type()` is
   `torch.cuda.FloatTensor` (or Half/BFloat16), and `clip_grads` asserts it. Inside `cpu_device_mode()` a CPU
   tensor's `type()` (no arguments) answers the `torch.cuda.*` name of its dtype.

5. Installed on import of `gyre.trainer` (and of this module), before megatron is imported, on a CPU-only torch
   build: `megatron.core.jit` loads with `jit_fuser` the no-op decorator (`disable_jit_fuser()`, megatron's own
   switch). Megatron decorates its fusion functions with `torch.compile` when its modules load, which imports
   torch's compiler stack (dynamo, inductor: ~2.7 of the ~7.5 CPU seconds of `import megatron.core`, measured);
   on CPU the fusion flags are off, so nothing of it is used (`gyre.trainer.jit_patch`, free of torch;
   docs/training.md, "CPU patches").

Not patched (not needed here): the fused kernels and `torch.compile` paths (leave the fusion flags off) and the
default causal mask built on "cuda" in `fused_softmax` / `transformer.utils` (always pass an attention mask on
CPU, as `gyre.trainer.logprobs` does).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from gyre.trainer.jit_patch import install_jit_fuser_patch

logger = logging.getLogger(__name__)

_applied = False


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites `device="cuda"` to CPU, makes `Tensor.cuda()` the identity, and answers `Tensor.type()` of a CPU
    tensor with its `torch.cuda.*Tensor` name (patches 3 and 4)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(args[0])
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": torch.device("cpu")}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_device_mode() -> Iterator[None]:
    """Patches 3 and 4 for the duration of the block; nothing when CUDA is available."""
    if torch.cuda.is_available():
        yield
        return
    with CudaToCpuMode():
        yield


def _in_cpu_device_mode(fn: Callable) -> Callable:
    if getattr(fn, "_gyre_cpu_device_mode", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with cpu_device_mode():
            return fn(*args, **kwargs)

    wrapper._gyre_cpu_device_mode = True
    return wrapper


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _install_rng_tracker() -> None:
    """Patch 2: RNG states of the CPU generator in place of the CUDA generator's."""
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        state = torch.get_rng_state()
        return state.clone() if clone else state

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """`CudaRNGStatesTracker` over the CPU generator (no CUDA-graph variant)."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")  # megatron's own check and message
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            # megatron's fork warns when the CPU generator moved inside it, which is the point here.
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker  # initialize_rng_tracker reads the module global
    mrandom.CpuRNGStatesTracker = CpuRNGStatesTracker
    if mrandom._CUDA_RNG_STATE_TRACKER is not None and not isinstance(
        mrandom._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker
    ):
        mrandom.initialize_rng_tracker(force_reset=True)


def _wrap_cuda_functions() -> None:
    """Patch 3 (and 4) around the megatron functions that allocate on "cuda" or check `type()` strings."""
    import megatron.core.optimizer as moptimizer
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import optimizer as moptimizer_impl
    from megatron.core.pipeline_parallel import schedules

    moptimizer.get_megatron_optimizer = _in_cpu_device_mode(moptimizer.get_megatron_optimizer)
    # Tied embeddings at PP > 1: `weight.data.cuda()` before the first/last-stage all-reduce of the copy.
    LanguageModule.setup_embeddings_and_output_layer = _in_cpu_device_mode(
        LanguageModule.setup_embeddings_and_output_layer
    )
    for cls in (
        moptimizer_impl.MixedPrecisionOptimizer,
        moptimizer_impl.FP32Optimizer,
        moptimizer_impl.ChainedOptimizer,
    ):
        cls.step = _in_cpu_device_mode(cls.step)
    for name in (
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_without_interleaving",
        "forward_backward_pipelining_with_interleaving",
    ):
        setattr(schedules, name, _in_cpu_device_mode(getattr(schedules, name)))


def apply_cpu_patches() -> bool:
    """Install the four patches once; returns True if they are (now or already) installed, False with CUDA."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    torch.cuda.current_device = _cpu_current_device  # patch 1
    _install_rng_tracker()  # patch 2
    _wrap_cuda_functions()  # patches 3 and 4
    _applied = True
    logger.debug("megatron-core CPU patches installed")
    return True


install_jit_fuser_patch()  # patch 5 (gyre.trainer.jit_patch); the package installs it too, before this module
