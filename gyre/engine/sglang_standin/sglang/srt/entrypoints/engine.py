"""`Engine`: SGLang's offline engine as gyre's adapter uses it, over gyre's native engine on the CPU (package
docstring of `gyre.engine.sglang_standin`)."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import torch

from ..managers.tokenizer_manager import TokenizerManager

ACCEPTED_SERVER_ARGS = frozenset(
    {
        "model_path",
        "tp_size",
        "base_gpu_id",
        "dtype",
        "max_running_requests",
        "max_total_tokens",
        "random_seed",
        "skip_tokenizer_init",
        "enable_memory_saver",
        "mem_fraction_static",
        "context_length",
        "log_level",
        "enable_return_routed_experts",
    }
)
DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOG_ENV = "GYRE_SGLANG_STANDIN_LOG"


class Engine:
    def __init__(self, **kwargs):
        from gyre.engine.native import NativeEngine
        from gyre.models.hf_weights import load_pretrained

        if unknown := sorted(set(kwargs) - ACCEPTED_SERVER_ARGS):
            raise TypeError(f"the SGLang stand-in does not model the ServerArgs fields {unknown}")
        if "model_path" not in kwargs:
            raise TypeError("Engine() needs model_path")
        if not kwargs.get("skip_tokenizer_init"):
            raise ValueError("the SGLang stand-in serves token ids only: skip_tokenizer_init=True")
        if kwargs.get("dtype", "auto") not in DTYPES:
            raise ValueError(f"dtype={kwargs['dtype']!r}: the stand-in takes one of {sorted(DTYPES)}")
        defaults = {"tp_size": 1, "base_gpu_id": 0, "max_running_requests": None, "max_total_tokens": None}
        defaults["enable_return_routed_experts"] = False
        self.server_args = SimpleNamespace(**{**defaults, "random_seed": None, **kwargs})
        model = load_pretrained(kwargs["model_path"], DTYPES[kwargs.get("dtype", "auto")], "cpu")
        if kwargs.get("random_seed") is not None:
            torch.manual_seed(kwargs["random_seed"])
        self.native = NativeEngine(
            model,
            max_running=self.server_args.max_running_requests or 16,
            max_tokens_in_flight=self.server_args.max_total_tokens or None,
        )
        self.tokenizer_manager = TokenizerManager(self)
        self.scheduler_info = {
            "max_total_num_tokens": self.native.max_tokens_in_flight,
            "max_running_requests": self.native.max_running,
        }
        self._log("init", tp_size=self.server_args.tp_size, base_gpu_id=self.server_args.base_gpu_id)

    def _log(self, call: str, **fields) -> None:
        path = os.environ.get(LOG_ENV)
        if path:
            line = json.dumps({"pid": os.getpid(), "t": time.time(), "call": call, **fields})
            with open(path, "a") as out:
                out.write(line + "\n")

    async def async_generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        return_logprob=False,
        stream=False,
        rid=None,
        return_routed_experts=False,
        routed_experts_start_len=0,
    ):
        if prompt is not None or input_ids is None:
            raise ValueError("the SGLang stand-in takes input_ids (skip_tokenizer_init), not a prompt")
        if not (stream and return_logprob and isinstance(rid, str)):
            raise ValueError("the SGLang stand-in streams with log-probs under a rid (what gyre's adapter asks)")
        self._log("generate", rid=rid)
        routed_from = routed_experts_start_len if return_routed_experts else None
        return self.tokenizer_manager._stream(list(input_ids), dict(sampling_params or {}), rid, routed_from)

    def shutdown(self) -> None:
        self._log("shutdown")
