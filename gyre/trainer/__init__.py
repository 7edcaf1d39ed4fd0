"""Training side of gyre: Megatron-core model build from a `DecoderConfig`, HF <-> Megatron weights, per-token
log-probs of packed micro-steps (see docs/training.md).

Importing the package imports neither torch nor megatron, so the runtime's modules can import it before a config
is checked. It installs patch 5 of the CPU patches (`gyre.trainer.jit_patch`, an
import hook that must be in place before megatron is imported). The megatron modules (`gyre.trainer.model`,
`gyre.trainer.convert`, `gyre.trainer.logprobs`, `gyre.trainer.pipeline`) install the other CPU patches megatron-core
needs on a CPU-only torch when they are imported (`apply_cpu_patches`, idempotent, a no-op when CUDA is available).
"""

from gyre.trainer.jit_patch import install_jit_fuser_patch

install_jit_fuser_patch()

__all__ = ["apply_cpu_patches", "cpu_device_mode"]


def __getattr__(name: str):
    if name in __all__:  # torch is imported here, on first use, not with the package
        from gyre.trainer import cpu_patch

        return getattr(cpu_patch, name)
    raise AttributeError(f"module 'gyre.trainer' has no attribute {name!r}")
