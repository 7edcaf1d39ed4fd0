"""The trainer's side of an in-process role swap: move a trainable's device state to host memory and back.

A cell that turns from training to rollout offloads its training state so the rollout engine can use the device
memory, and restores it when it turns back (the paper's role change: "offloads rollout parameters and frees KV
cache ... then restores training parameters and buffers; backend processes and communication groups stay alive").

Contract
- State covered (`TrainerState(trainable)`, a `MegatronTrainable` or anything with `.model` and `.optimizer`):
  the model's parameters and buffers (counted as `params`), their `.grad`, and every tensor of the optimizer
  state (AdamW `exp_avg`, `exp_avg_sq`, `step`): every such tensor on the training device (the device of the first
  parameter; tensors elsewhere, e.g. a CPU `step` next to CUDA parameters, are not device memory and stay put).
- `offload()` copies the bytes of every storage behind those tensors into one flat host buffer (pinned on CUDA),
  then frees each storage with `untyped_storage().resize_(0)`: the device memory is released
  (`torch.cuda.memory_allocated` drops; the cache is emptied so another process can take it) while every tensor
  object, and every view of the storages, stays alive. While offloaded the tensors show an empty placeholder
  (shape `(0,)`), so a stray read raises instead of reading freed memory, and parameters have no `.grad`.
- `restore()` re-allocates each storage, copies its bytes back and re-attaches the tensors: afterwards they are
  the SAME tensor objects with bit-identical values (strides and offsets too), so the optimizer (keyed by
  parameter object), hooks and process groups keep working; nothing is re-created. The host buffer is dropped.
  A `restore()` that fails part way (the device is still full) leaves the state offloaded and can be called again:
  re-sizing a storage to its size again and re-copying its bytes change nothing.
- Errors (`RuntimeError` naming the state): `offload()` while offloaded, `restore()` while resident, and, while
  offloaded, a forward of the model, its `state_dict()` (so `gather_hf_state_dict`) or an optimizer step (so
  `MegatronTrainable.update`), `drop_grads()`. A storage that cannot be resized raises before anything moves.
- On CPU the same code runs (the host buffer is ordinary memory), so the path is exercised in CPU tests: the
  device-side bytes are released, process RAM is not (the bytes now live in the host buffer).
- `memory_bytes()`: bytes of live device storages by kind (`params`, `grads`, `optimizer`); `host_bytes`: the size
  of the host buffer while offloaded (0 otherwise).

Call it at a step boundary (no backward in flight). See docs (section "Role swap").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

__all__ = ["TrainerState"]

KINDS = ("params", "grads", "optimizer")
ALIGN = 64  # byte alignment of each storage in the host buffer (fast copies)


@dataclass(eq=False)
class _Slot:
    """One offloaded storage (kept alive here while freed) and where its bytes sit in the host buffer."""

    storage: torch.UntypedStorage
    offset: int  # byte offset in the host buffer
    nbytes: int  # the storage's size before it was freed


class TrainerState:
    """Offload and restore the device state (params, grads, optimizer) of one trainable; see the module docstring."""

    def __init__(self, trainable) -> None:
        model, optimizer = getattr(trainable, "model", None), getattr(trainable, "optimizer", None)
        if not isinstance(model, torch.nn.Module) or not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"trainable must have .model (a torch.nn.Module) and .optimizer (a torch.optim.Optimizer), "
                f"got {type(trainable).__name__}"
            )
        self.model: torch.nn.Module = model
        self.optimizer: torch.optim.Optimizer = optimizer
        first = next(self.model.parameters(), None)
        if first is None:
            raise ValueError("trainable.model has no parameters: nothing to offload")
        self.device = first.device
        self._slots: list[_Slot] = []
        self._host: torch.Tensor | None = None  # flat uint8 host buffer while offloaded
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, saved view of its storage)
        self._grads: list[tuple[torch.Tensor, torch.Tensor]] = []  # (param, its grad) detached while offloaded
        # Every way the training code reads the state goes through one of these: fail clearly, not on freed memory.
        self.model.register_forward_pre_hook(lambda *_: self._check_resident("a forward of the model"))
        self.model.register_state_dict_pre_hook(lambda *_: self._check_resident("model.state_dict()"))
        self.optimizer.register_step_pre_hook(lambda *_: self._check_resident("an optimizer step"))

    @property
    def offloaded(self) -> bool:
        return self._host is not None

    @property
    def host_bytes(self) -> int:
        return 0 if self._host is None else self._host.numel()

    # ----------------------------------------------------------------- what is held

    def _params(self) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {id(p): p for p in self.model.parameters()}
        for group in self.optimizer.param_groups:
            seen.update((id(p), p) for p in group["params"])
        return [*seen.values(), *self.model.buffers()]

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(kind, tensor) of every tensor the state holds on the training device, params first."""
        params = self._params()
        out = [("params", t) for t in params]
        out += [("grads", t.grad) for t in params if t.grad is not None]
        for state in self.optimizer.state.values():
            out += [("optimizer", v) for v in state.values() if isinstance(v, torch.Tensor)]
        unique: dict[int, tuple[str, torch.Tensor]] = {}
        for kind, t in out:
            if t.device == self.device:
                unique.setdefault(id(t), (kind, t))  # one entry per tensor object, under its first kind
        return list(unique.values())

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the live device storages behind params, grads and optimizer state (each storage once)."""
        out = dict.fromkeys(KINDS, 0)
        seen: set[int] = set()
        for kind, t in self._tensors():
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                out[kind] += storage.nbytes()
        return out

    # ----------------------------------------------------------------- role swap

    def drop_grads(self) -> None:
        """Free the gradients instead of offloading them (`.grad = None`), e.g. at a step boundary."""
        self._check_resident("drop_grads()")
        for p in self._params():
            p.grad = None

    @torch.no_grad()
    def offload(self) -> int:
        """Move every storage to one host buffer and free it on the device; returns the bytes released."""
        if self.offloaded:
            raise RuntimeError("offload() called while the trainer state is already offloaded: restore() first")
        tensors = self._tensors()
        slots: dict[int, _Slot] = {}
        total = 0
        for kind, t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in slots:
                continue
            if not storage.resizable():
                raise RuntimeError(
                    f"a {kind} tensor {tuple(t.shape)} has a storage that cannot be resized: not offloaded"
                )
            slots[storage.data_ptr()] = _Slot(storage, total, storage.nbytes())
            total += -(-storage.nbytes() // ALIGN) * ALIGN
        host = torch.empty(total, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        for slot in slots.values():
            host[slot.offset : slot.offset + slot.nbytes].copy_(_bytes_of(slot.storage), non_blocking=True)
        _synchronize(self.device)  # the copies are done before the storages are freed
        # Grads leave their parameters (a gradient norm or zero_grad skips them); the other tensors show a placeholder.
        self._grads = [(p, p.grad) for p in self._params() if p.grad is not None and p.grad.device == self.device]
        for p, _ in self._grads:
            p.grad = None
        self._views = [(t, t.detach()) for kind, t in tensors if kind != "grads"]
        for t, _ in self._views:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        for slot in slots.values():
            slot.storage.resize_(0)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the blocks back so another process (an SGLang server) can use them
        self._slots, self._host = list(slots.values()), host
        released = sum(s.nbytes for s in self._slots)
        logger.info("trainer state offloaded: %d bytes released on %s", released, self.device)
        return released

    @torch.no_grad()
    def restore(self) -> int:
        """Re-allocate every storage, copy its bytes back, re-attach the same tensors; returns the bytes restored."""
        if not self.offloaded:
            raise RuntimeError("restore() called while the trainer state is resident (not offloaded): offload() first")
        host = self._host
        for slot in self._slots:
            slot.storage.resize_(slot.nbytes)
            _bytes_of(slot.storage).copy_(host[slot.offset : slot.offset + slot.nbytes], non_blocking=True)
        _synchronize(self.device)
        for t, view in self._views:
            t.data = view
        for p, grad in self._grads:
            p.grad = grad
        restored = sum(s.nbytes for s in self._slots)
        self._slots, self._views, self._grads, self._host = [], [], [], None
        return restored

    def _check_resident(self, what: str) -> None:
        if self.offloaded:
            raise RuntimeError(f"{what} while the trainer state is offloaded: call restore() first")


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a 1-D uint8 tensor (a view, no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
