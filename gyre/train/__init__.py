"""Training side of gyre: Megatron-core model build from a `DecoderConfig`, HF <-> Megatron weights, per-token
log-probs of packed micro-steps (see docs/training.md).

Importing the package itself imports neither megatron nor anything heavy. The megatron modules
(`gyre.train.model`, `gyre.train.convert`, `gyre.train.logprobs`) install the CPU patches megatron-core needs on a
CPU-only torch when they are imported (`apply_cpu_patches`, idempotent, a no-op when CUDA is available).
"""

from gyre.train.cpu_patch import apply_cpu_patches, cpu_device_mode

__all__ = ["apply_cpu_patches", "cpu_device_mode"]
