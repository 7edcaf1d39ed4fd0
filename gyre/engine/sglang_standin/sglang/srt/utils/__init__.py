"""`MultiprocessingSerializer` (SGLang's moves CUDA tensors by IPC handle; this one pickles CPU tensors)."""

from __future__ import annotations

import io

import torch


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str: bool = False):
        if output_str:
            raise NotImplementedError("the stand-in serializes to bytes only")
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return buffer.getvalue()

    @staticmethod
    def deserialize(data):
        return torch.load(io.BytesIO(data), weights_only=True)
