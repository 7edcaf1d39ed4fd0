"""`TokenizerManager`: the coroutines gyre's adapter calls on SGLang's tokenizer manager, over the stand-in
engine's native engine (package docstring of `gyre.engine.sglang_standin`)."""

from __future__ import annotations

import asyncio
import base64
import datetime
from types import SimpleNamespace
from typing import Any

import torch
from torch import distributed as dist

from .io_struct import FlushCacheReqOutput

TOP_K_OFF = -1
GROUP_TIMEOUT_S = 600.0


class TokenizerManager:
    def __init__(self, engine: Any):
        self._engine = engine
        self.server_args = engine.server_args
        config = engine.native.model.config
        hf_text_config = SimpleNamespace(  # what the adapter reads of SGLang's ModelConfig.hf_text_config
            num_hidden_layers=config.num_hidden_layers,
            num_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            mlp_only_layers=list(config.mlp_only_layers),
            decoder_sparse_step=config.decoder_sparse_step,
        )
        self.model_config = SimpleNamespace(vocab_size=config.vocab_size, hf_text_config=hf_text_config)
        self.context_len = config.max_position_embeddings
        self._running = asyncio.Event()  # cleared while paused in place
        self._running.set()
        self._version = 0  # SGLang counts no versions; the native engine underneath needs increasing ones
        self._in_flight: set[str] = set()
        self._groups: dict[str, list] = {}  # weight groups: one gloo backend per modelled TP worker
        self._session = False  # a weight-update session is open (SGLang 0.5.23 loads weights only inside one)
        self.weight_version: str | None = None  # the last update's weight_version (SGLang's server_args keeps it)

    async def _stream(self, input_ids: list[int], sampling_params: dict, rid: str, routed_from: int | None = None):
        """SGLang's outputs for one request; `routed_from`: `routed_experts_start_len` of a request that asked for
        routed experts (recorded only with `enable_return_routed_experts`, as SGLang)."""
        from gyre.engine.protocol import GenerateRequest, SamplingParams

        greedy = sampling_params.get("temperature", 1.0) == 0
        top_k = sampling_params.get("top_k", TOP_K_OFF)
        params = SamplingParams(
            temperature=0.0 if greedy else float(sampling_params.get("temperature", 1.0)),
            top_p=float(sampling_params.get("top_p", 1.0)),
            top_k=0 if top_k == TOP_K_OFF else int(top_k),
            max_new_tokens=int(sampling_params["max_new_tokens"]),
            stop_token_ids=tuple(sampling_params.get("stop_token_ids", ())),
            seed=sampling_params.get("sampling_seed"),
        )
        routed = routed_from is not None and bool(self.server_args.enable_return_routed_experts)
        request = GenerateRequest(
            request_id=rid,
            execution_id=rid,
            input_ids=tuple(input_ids),
            params=params,
            return_routed_experts=routed,
            routed_experts_start=min(routed_from, len(input_ids)) if routed else 0,
        )
        triples: list[tuple[float, int, None]] = []
        self._in_flight.add(rid)
        try:
            async for chunk in self._engine.native.generate_stream(request):
                pairs = zip(chunk.token_ids, chunk.logprobs, strict=True)
                triples.extend((logprob, token, None) for token, logprob in pairs)
                await self._running.wait()  # held while paused in place
                finish = None if chunk.finish_reason is None else {"type": chunk.finish_reason}
                meta = {
                    "output_token_logprobs": list(triples),
                    "completion_tokens": len(triples),
                    "cached_tokens": chunk.cached_tokens or 0,
                    "finish_reason": finish,
                }
                if chunk.routed_experts is not None:
                    meta["routed_experts"] = self._sglang_routing(chunk.routed_experts)
                yield {"meta_info": meta}
        finally:
            self._in_flight.discard(rid)

    def _sglang_routing(self, routed) -> str:
        """SGLang's encoding of routed experts: base64 of int32 rows, 0 (never written) at layers that do not route."""
        config = self._engine.native.model.config
        routed = routed.astype("<i4")
        routed[:, [i for i in range(config.num_hidden_layers) if not config.is_moe_layer(i)]] = 0
        return base64.b64encode(routed.tobytes()).decode("utf-8")

    def abort_request(self, rid: str = "", abort_all: bool = False):
        rids = list(self._in_flight) if abort_all else [rid]
        self._engine._log("abort", rids=rids)
        for one in rids:
            self._engine.native.abort(one)

    async def pause_generation(self, obj):
        self._engine._log("pause", mode=obj.mode)
        if obj.mode != "in_place":
            raise NotImplementedError(f"the SGLang stand-in pauses in place only, not mode={obj.mode!r}")
        self._running.clear()
        self._engine.native.hold()  # SGLang's scheduler runs no forward while paused; aborts still end requests

    async def continue_generation(self, obj):
        self._engine._log("continue")
        self._running.set()
        self._engine.native.release()

    async def begin_weight_update(self, obj, request=None):
        self._engine._log("begin_update", selector=obj.selector)
        if self._session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self._session = True
        return True, "Success"

    async def end_weight_update(self, obj, request=None):
        self._engine._log("end_update")
        if not self._session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self._session = False
        return True, "Success"

    def _outside_session(self, call: str) -> tuple[bool, str] | None:
        """SGLang's scheduler refuses a weight update outside a session, with this message."""
        if self._session:
            return None
        return False, f"{call} must run between begin_weight_update() and end_weight_update()"

    async def update_weights_from_tensor(self, obj, request=None):
        from sglang.srt.utils import MultiprocessingSerializer

        if (refused := self._outside_session("update_weights_from_tensor")) is not None:
            return refused

        tp_size = self.server_args.tp_size
        if len(obj.serialized_named_tensors) != tp_size:
            return False, f"{len(obj.serialized_named_tensors)} payloads for tp_size={tp_size}"
        named = dict(MultiprocessingSerializer.deserialize(obj.serialized_named_tensors[0]))
        return await self._load(named, obj, "update", "Success")

    async def _load(self, named: dict, obj, call: str, succeeded: str, **fields) -> tuple[bool, str]:
        """The native engine loads `named` as the next version; the call logged as `call` (with `fields`). After a
        load, as SGLang 0.5.23: the weight version recorded (`weight_version`), and with `flush_cache=True` the
        prefix cache flushed, which fails the call while requests are in flight (the weights stay loaded)."""
        fields |= {"tensors": len(named), "in_flight": len(self._in_flight), "flush_cache": obj.flush_cache}
        fields |= {"weight_version": obj.weight_version}
        try:
            await self._engine.native.update_weights(named, version=self._version + 1)
        except ValueError as error:
            self._engine._log(call, success=False, **fields)
            return False, str(error)
        self._version += 1
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
        if obj.flush_cache and self._in_flight:
            self._engine._log(call, success=False, **fields)
            return False, (
                "Weights were updated, but the cache was not flushed because requests are still running or queued. "
                "Retract or finish them, then call /flush_cache."
            )
        self._engine._log(call, success=True, **fields)
        return True, succeeded

    async def init_weights_update_group(self, obj, request=None):
        """Each modelled TP worker joins the group as rank `rank_offset + tp_rank`, built as SGLang's
        `init_custom_process_group` builds it (a TCP rendezvous at master_address:master_port, the store prefixed by
        the group's name, then `_new_process_group_helper`'s own prefixes: the group's name and the device), as
        gloo's backend object itself: the workers are threads of one process here, where SGLang's are processes."""
        self._engine._log("init_group", world_size=obj.world_size, rank_offset=obj.rank_offset, backend=obj.backend)
        if obj.backend != "gloo":
            return False, f"the SGLang stand-in joins gloo groups only, not {obj.backend}"
        tp_size = self.server_args.tp_size
        if obj.rank_offset + tp_size > obj.world_size:
            return False, f"rank_offset {obj.rank_offset} + tp_size {tp_size} > world_size {obj.world_size}"

        def join(tp_rank: int):
            timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
            store = dist.TCPStore(obj.master_address, obj.master_port, obj.world_size, is_master=False, timeout=timeout)
            store = dist.PrefixStore(
                "cpu/", dist.PrefixStore(f"{obj.group_name}/", dist.PrefixStore(obj.group_name, store))
            )
            return dist.ProcessGroupGloo(store, obj.rank_offset + tp_rank, obj.world_size, timeout)

        try:
            groups = await asyncio.gather(*(asyncio.to_thread(join, r) for r in range(tp_size)))
        except Exception as error:
            return False, f"Failed to initialize custom process group: {error}."
        self._groups[obj.group_name] = groups
        return True, "Succeeded to initialize custom process group."

    async def update_weights_from_distributed(self, obj, request=None):
        """Every modelled TP worker receives the broadcasts from rank 0, in order; the native engine loads the
        first worker's copy."""
        if (refused := self._outside_session("update_weights_from_distributed")) is not None:
            return refused
        groups = self._groups.get(obj.group_name)
        if groups is None:
            return False, f"Group {obj.group_name} not initialized: call init_weights_update_group first"

        def receive(group) -> dict:
            options = dist.BroadcastOptions()
            options.rootRank, options.rootTensor = 0, 0
            named = {}
            for name, dtype, shape in zip(obj.names, obj.dtypes, obj.shapes, strict=True):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                group.broadcast([tensor], options).wait()
                named[name] = tensor
            return named

        received = await asyncio.gather(*(asyncio.to_thread(receive, group) for group in groups))
        return await self._load(
            received[0], obj, "update_distributed", "Succeeded to update parameter online.", workers=len(groups)
        )

    @staticmethod
    def _parts(tags) -> dict[str, bool]:
        return {"weights": tags is None or "weights" in tags, "kv": tags is None or "kv_cache" in tags}

    async def release_memory_occupation(self, obj, request=None):
        self._engine._log("release", tags=obj.tags)
        await self._engine.native.release_memory(**self._parts(obj.tags))

    async def resume_memory_occupation(self, obj, request=None):
        self._engine._log("resume", tags=obj.tags)
        await self._engine.native.resume_memory(**self._parts(obj.tags))

    async def flush_cache(self, timeout_s=None):
        self._engine._log("flush", in_flight=len(self._in_flight))
        return FlushCacheReqOutput(success=not self._in_flight)
