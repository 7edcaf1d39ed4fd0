"""Patch 5 of the CPU patches (`gyre.trainer.cpu_patch`, docs/training.md, "CPU patches"), kept free of torch.

Installed when `gyre.trainer` is imported, before megatron is: when `megatron.core.jit` loads on a CPU-only torch
build, `disable_jit_fuser()` (megatron's own switch) runs right after it, so `jit_fuser` is the no-op decorator
before the fusion modules read it. Megatron decorates its fusion functions with `torch.compile` when its modules
load, which imports torch's compiler stack (dynamo, inductor: ~2.7 of the ~7.5 CPU seconds of
`import megatron.core`, measured); on CPU the fusion flags are off, so nothing of it is used.

This module imports no torch: importing the `gyre.trainer` package stays light, and `python -m gyre.train` reports a
user's config mistake before torch is loaded (~1.5 CPU s instead of ~3.4). The build is asked when
`megatron.core.jit` loads (torch is imported by then); not `torch.cuda.is_available()`, which would initialize
CUDA in every process that imports megatron.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

__all__ = ["JIT_MODULE", "install_jit_fuser_patch"]

JIT_MODULE = "megatron.core.jit"


def _cpu_only_torch() -> bool:
    import torch

    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


class _NoJitFuserFinder(importlib.abc.MetaPathFinder):
    """Finds `megatron.core.jit` as usual and, on a CPU-only torch, runs `disable_jit_fuser()` right after it loads,
    before the fusion modules read `jit_fuser`."""

    def find_spec(self, fullname, path, target=None):
        if fullname != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load = spec.loader.exec_module

        def exec_module(module) -> None:
            load(module)
            if _cpu_only_torch():
                module.disable_jit_fuser()

        spec.loader.exec_module = exec_module
        return spec


def install_jit_fuser_patch() -> None:
    """Install the finder (idempotent). Megatron imported already: its fusion functions are decorated already, the
    switch is turned for what comes after."""
    if JIT_MODULE in sys.modules:
        if _cpu_only_torch():
            sys.modules[JIT_MODULE].disable_jit_fuser()
    elif not any(isinstance(finder, _NoJitFuserFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _NoJitFuserFinder())
