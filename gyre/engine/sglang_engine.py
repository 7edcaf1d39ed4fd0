"""The SGLang adapter: an `sglang.Engine` behind the `Engine` protocol, for GPU clusters.

Contract (beyond `gyre.engine.protocol`)
- sglang is imported lazily (`from_pretrained`, `load_sglang_io`): this module imports with neither sglang nor CUDA.
  Nothing here has run against a real SGLang; see `docs/sglang.md` ("What was and was not run against SGLang").
- Every call goes through the SGLang engine's `tokenizer_manager` coroutines (`generate_request` via
  `async_generate`, `abort_request`, `pause_generation`, `update_weights_from_tensor`, ...) on the caller's event
  loop. The synchronous `sglang.Engine` methods (`update_weights_from_tensor`, `release_memory_occupation`, ...)
  wrap `loop.run_until_complete` and cannot be called from inside a running loop. One event loop per adapter.
- Each request runs as one streamed SGLang request (`stream=True, return_logprob=True, rid=request_id`) pumped by
  one task; `generate` and `generate_stream` read the same chunks. Tokens and log-probs come from
  `meta_info["output_token_logprobs"]` (`(logprob, token_id, text)` triples), cumulative or incremental per
  SGLang's `--incremental-streaming-output`, told apart by `meta_info["completion_tokens"]` (`new_output_tokens`).
- Behavior log-probs: SGLang reports `log softmax(logits / temperature)` of the sampled token, before top-k /
  top-p (and the raw `log softmax(logits)` with `SGLANG_RETURN_ORIGINAL_LOGPROB`). That equals gyre's behavior
  log-prob only without filters (and, with that variable, only at temperature 1), so other requests raise
  `ValueError` unless `allow_unfiltered_logprobs=True` (`logprob_mismatch`). Greedy matches gyre's convention.
- Policy versions: SGLang 0.5.x does not say which weights produced a token; a chunk carries the adapter's version
  when it arrives.
- Weight updates: a session (`begin_update` .. `end_update`) pauses generation in place
  (`pause_generation(mode="in_place")`: running requests stay and continue under the new weights, as the protocol
  asks) and opens SGLang's own weight-update session (`begin_weight_update` .. `end_weight_update`: SGLang 0.5.23's
  scheduler refuses an update outside one). Each bucket is one `update_weights_from_tensor` (one serialized payload
  per tensor-parallel rank) with `flush_cache=False` and `weight_version=str(version)`; `update_weights` is a
  session of one bucket. SGLang cannot flush its prefix cache with requests in flight (the update call then reports
  the flush failed), so `end_update` flushes at once when nothing is in flight (still paused: nothing slips in) and
  else once the adapter is idle again. SGLang loads tensor by tensor: a bucket it refuses may be partly applied, so
  any bucket sent touches the session, and `abort_update` of a touched session aborts the requests in flight and
  refuses new ones until a whole version is loaded. With `parameter_names` the adapter refuses unknown names before
  sending and `end_update` checks completeness; without, neither (SGLang's names are its own).
- Publications across cells: `init_weights_group` makes SGLang's TP workers join a process group with rank 0
  (`init_weights_update_group`); `load_bucket_from_group` loads, in the session, a bucket that rank 0 broadcasts over
  it (`update_weights_from_distributed`, one broadcast per tensor: gyre's flat buffers align each tensor to 16 bytes
  where SGLang's `flattened_bucket` packs them back to back, so the buffer cannot be broadcast as SGLang's bucket),
  and `update_weights_from_group` a whole version so (a session of one such bucket);
  `gyre.runtime.cell.engines.GroupPublishing` drives them from rank 0.
- Routed experts: a request's `return_routed_experts` / `routed_experts_start` go to `async_generate` as SGLang's
  `return_routed_experts` / `routed_experts_start_len`; the final output's `meta_info["routed_experts"]` (base64 of
  int32 `[seqlen - 1 - start, num_hidden_layers, top_k]`, flat; 0 at dense layers, SGLang's buffer never being
  written there) becomes the protocol's int16 array with -1 at dense layers (`routed_experts_from_sglang`). The
  layout (layers, top-k, which layers route) is read from the model's HF config (`routed_layout`, Qwen's rule);
  SGLang records routing only when started with `enable_return_routed_experts=True` (`sglang_engine_args(...,
  return_routed_experts=True)`): a request that asks an engine known to run without it raises `ValueError`.
- `export_kv`/`import_kv` raise `NotImplementedError` (SGLang has no per-request KV export; the caller
  re-prefills elsewhere); `release_export` returns False. `load()` is an adapter-side estimate (no scheduler call).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gyre.config.checks import is_int
from gyre.engine.protocol import (
    AcceptingLifecycle,
    EngineBusyError,
    EngineLoad,
    EngineUnavailableError,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    GenerateTimings,
    KVExport,
    SamplingParams,
    TokenChunk,
    UpdateSession,
    WeightUpdateSessionError,
    check_request,
    partial_weights_error,
)
from gyre.models.flat_weights import FlatWeights, unflatten_weights

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"  # read by SGLang's sampler (sglang/srt/layers/sampler.py)
SGLANG_TOP_K_OFF = -1  # SGLang's "whole vocabulary"; its top_k=0 is invalid
WEIGHT_TAGS = ("weights",)  # release_memory_occupation tags (GPU_MEMORY_TYPE_WEIGHTS)
KV_TAGS = ("kv_cache",)  # GPU_MEMORY_TYPE_KV_CACHE; both released together -> tags=None (everything)
BAD_REQUEST = 400  # an abort with this status_code is SGLang rejecting the request's input


class SGLangUnavailableError(ImportError):
    """sglang does not import here (it needs CUDA torch and a GPU)."""


# ----------------------------------------------------------------- pure translation (tested without sglang)


def original_logprob_enabled(environ: Mapping[str, str]) -> bool:
    """Whether SGLang's sampler reports pre-temperature log-probs (same parsing as sglang's get_bool_env_var)."""
    return environ.get(ORIGINAL_LOGPROB_ENV, "false").strip().lower() in ("true", "1")


def logprob_mismatch(params: SamplingParams, *, original_logprob: bool) -> str | None:
    """Why SGLang's reported log-probs would not be gyre's behavior log-probs under `params`, or None if they are.

    SGLang (sampler.py, standard path) reports `log(softmax(logits / T))` at the sampled token, computed before
    top-k/top-p, so a filter makes it differ from `gyre.engine.sampling` by log(kept mass). With
    `SGLANG_RETURN_ORIGINAL_LOGPROB` it reports `log_softmax(logits)`, so any temperature but 1 differs. Greedy
    (SGLang: top_k=1, temperature 1) reports `log_softmax(logits)` either way, which is gyre's greedy convention.
    """
    if params.greedy:
        return None
    if original_logprob and params.temperature != 1:
        return (
            f"temperature={params.temperature} with {ORIGINAL_LOGPROB_ENV} set: SGLang would report log-probs "
            "before temperature, not of the distribution sampled (unset it, or sample at temperature 1)"
        )
    if params.filters:
        return (
            f"top_k={params.top_k}, top_p={params.top_p}: SGLang reports log-probs before top-k/top-p, not of the "
            "filtered distribution actually sampled (turn the filters off, or pass allow_unfiltered_logprobs=True "
            "to accept unfiltered log-probs)"
        )
    return None


def to_sglang_sampling_params(params: SamplingParams, *, forward_seed: bool = True) -> dict[str, Any]:
    """gyre `SamplingParams` -> the `sampling_params` dict of `sglang.Engine.async_generate`.

    Every distribution-shaping field is explicit, so server-side defaults (`--preferred-sampling-params`, a
    model's generation config) cannot change what is sampled. Stop ids: SGLang's `ignore_eos` switches off its
    stop-id check and its EOS check together, so with no stop ids we set it (the request ends only by length, as
    gyre asks); with stop ids SGLang also stops at the model's EOS ids (include them in `stop_token_ids`).
    """
    out: dict[str, Any] = {
        "temperature": 0.0 if params.greedy else float(params.temperature),
        "top_p": 1.0 if params.greedy else float(params.top_p),
        "top_k": SGLANG_TOP_K_OFF if params.greedy or params.top_k == 0 else params.top_k,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_new_tokens": 0,
        "max_new_tokens": params.max_new_tokens,
        "ignore_eos": not params.stop_token_ids,
        "no_stop_trim": True,  # keep the stop token in the output (it is the last output token in gyre)
    }
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if forward_seed and params.seed is not None:
        out["sampling_seed"] = params.seed
    return out


def map_finish_reason(raw: Any) -> FinishReason | None:
    """SGLang's `meta_info["finish_reason"]` -> gyre's finish reason (None while the request runs).

    SGLang sends `{"type": "stop", "matched": id | str}`, `{"type": "length", "length": n}` or
    `{"type": "abort", "message": ..., "status_code": ...}` (schedule_batch.py `FINISH_*.to_json`).
    """
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, Mapping) else raw
    if kind in ("stop", "length", "abort"):
        return kind
    raise ValueError(f"unknown SGLang finish_reason {raw!r}: expected type stop, length or abort")


def rejected_input_message(raw: Any) -> str | None:
    """The message of an abort that is SGLang rejecting the input (status 400), else None."""
    if isinstance(raw, Mapping) and raw.get("type") == "abort" and raw.get("status_code") == BAD_REQUEST:
        return str(raw.get("message"))
    return None


def new_output_tokens(meta_info: Mapping[str, Any], emitted: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The output tokens of one SGLang output not passed on yet (`emitted` were), with their log-probs.

    `meta_info["output_token_logprobs"]` is cumulative by default and a delta with
    `--incremental-streaming-output` (an abort's output is cumulative in both modes); `completion_tokens` counts
    all output tokens so far, so the list is cumulative iff its length equals it.
    """
    entries = meta_info.get("output_token_logprobs") or ()
    if not entries:  # e.g. an abort before any output, or a version that sends no log-probs with an abort
        return (), ()
    total = meta_info.get("completion_tokens")
    if total is None or len(entries) == total:
        if len(entries) < emitted:
            raise RuntimeError(f"SGLang sent {len(entries)} output log-probs after {emitted} were passed on")
        fresh = entries[emitted:]
    elif emitted + len(entries) == total:
        fresh = entries
    else:
        raise RuntimeError(
            f"SGLang output inconsistent: {len(entries)} log-probs, completion_tokens={total}, {emitted} passed on"
        )
    token_ids, logprobs = [], []
    for entry in fresh:
        logprob, token_id = entry[0], entry[1]
        if logprob is None:
            raise RuntimeError(f"SGLang sent no log-prob for output token {token_id}")
        token_ids.append(int(token_id))
        logprobs.append(float(logprob))
    return tuple(token_ids), tuple(logprobs)


def sglang_engine_args(
    *,
    tp_size: int,
    base_gpu_id: int,
    dtype: str,
    max_running: int,
    max_total_tokens: int,
    seed: int,
    return_routed_experts: bool = False,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The `sglang.Engine(model_path=..., **args)` arguments of a cell's engine (SGLang's `ServerArgs` fields; the
    contract test checks every key): the cell's `tp_size` GPUs from `base_gpu_id` on, token ids in and out, the
    memory saver that `release_memory_occupation` needs, gyre's slots and KV budget (0: SGLang sizes it), the
    run's seed, and with `return_routed_experts` (routing replay of a MoE model) SGLang's routing capture
    (`enable_return_routed_experts`: a host buffer of 4 bytes x layers x top-k per KV token). `extra`
    (`engine.sglang_args`) wins over all of them."""
    args: dict[str, Any] = {
        "tp_size": tp_size,
        "base_gpu_id": base_gpu_id,
        "dtype": dtype,
        "max_running_requests": max_running,
        "random_seed": seed,
        "skip_tokenizer_init": True,
        "enable_memory_saver": True,
    }
    if max_total_tokens:
        args["max_total_tokens"] = max_total_tokens
    if return_routed_experts:
        args["enable_return_routed_experts"] = True
    return {**args, **dict(extra or {})}


@dataclass(frozen=True, kw_only=True)
class RoutedLayout:
    """What the protocol's routed experts look like for a MoE model: `[positions, num_hidden_layers, top_k]`, expert
    ids at the layers in `moe_layers` and -1 at the others."""

    num_hidden_layers: int
    top_k: int
    moe_layers: tuple[int, ...]


def _config_value(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def routed_layout(hf_config: Any) -> RoutedLayout | None:
    """The routed-experts layout of a model from its HF config (an object such as SGLang's
    `model_config.hf_text_config`, or a dict), None for a dense model or a config without the fields.

    Which layers route is Qwen's rule, as `gyre.models.DecoderConfig.is_moe_layer`: layer i unless it is in
    `mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`. Other families (DeepSeek's `first_k_dense_replace`)
    need `SGLangEngine(routed_layout=...)`."""
    if hf_config is None:
        return None
    experts = _config_value(hf_config, "num_experts") or _config_value(hf_config, "num_local_experts")
    layers, top_k = _config_value(hf_config, "num_hidden_layers"), _config_value(hf_config, "num_experts_per_tok")
    if not (is_int(experts) and experts > 0 and is_int(layers) and layers > 0 and is_int(top_k) and top_k > 0):
        return None
    dense = set(_config_value(hf_config, "mlp_only_layers") or ())
    step = _config_value(hf_config, "decoder_sparse_step") or 1
    moe = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return RoutedLayout(num_hidden_layers=layers, top_k=top_k, moe_layers=moe)


def routed_experts_from_sglang(encoded: str | None, layout: RoutedLayout, *, rows: int) -> np.ndarray:
    """SGLang's `meta_info["routed_experts"]` -> the protocol's int16 `[rows, num_hidden_layers, top_k]`.

    SGLang sends base64 of its int32 host buffer rows `[routed_experts_start_len, seqlen - 1)` flattened
    (`tokenizer_manager`/`detokenizer_manager`: `b64encode(tensor.numpy().tobytes())`, native byte order: little
    endian on every GPU host), with 0 at the layers that do not route (their columns are never written): those
    become -1 here. None (SGLang sent none, e.g. with an abort) gives -1 everywhere, the protocol's "unknown". A
    payload that does not decode to `rows` rows raises `RuntimeError`: misaligned routing must not reach a trainer.
    """
    L, K = layout.num_hidden_layers, layout.top_k
    if encoded is None:
        return np.full((rows, L, K), -1, dtype=np.int16)
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise RuntimeError("SGLang's routed_experts is not base64") from None
    if len(raw) != 4 * rows * L * K:
        raise RuntimeError(
            f"SGLang sent {len(raw)} bytes of routed experts, expected {rows} positions x {L} layers x top-{K} "
            f"int32 ({4 * rows * L * K} bytes): its layout is not {layout}"
        )
    routed = np.frombuffer(raw, dtype="<i4").reshape(rows, L, K).astype(np.int16)
    dense = [i for i in range(L) if i not in set(layout.moe_layers)]
    routed[:, dense] = -1
    return routed


@dataclass(frozen=True, kw_only=True)
class SGLangLimits:
    """What the adapter knows of the SGLang engine's limits; None where it could not be read."""

    vocab_size: int | None  # input ids must be below it
    context_length: int | None  # prompt + max_new_tokens must fit
    max_running: int | None  # --max-running-requests (load().capacity)
    kv_tokens_total: int | None  # max_total_num_tokens of the scheduler (load().kv_tokens_total)
    tp_size: int = 1  # one serialized weight payload per tensor-parallel rank
    routed_layout: RoutedLayout | None = None  # MoE models: the routed experts' layout; None: dense or unknown
    routed_experts_enabled: bool | None = None  # server_args.enable_return_routed_experts; None: not readable


def _positive_int(value: Any) -> int | None:
    return value if is_int(value) and value > 0 else None


def read_limits(sgl_engine: Any) -> SGLangLimits:
    """Read limits from an `sglang.Engine` without a scheduler round trip (attributes of SGLang 0.5.x and main)."""
    manager = getattr(sgl_engine, "tokenizer_manager", None)
    server_args = getattr(sgl_engine, "server_args", None) or getattr(manager, "server_args", None)
    info = getattr(sgl_engine, "scheduler_info", None)  # 0.4/0.5: the first scheduler's init dict
    if info is None:  # later main: Engine._scheduler_init_result.scheduler_infos
        infos = getattr(getattr(sgl_engine, "_scheduler_init_result", None), "scheduler_infos", None)
        info = infos[0] if infos else None
    info = info if isinstance(info, Mapping) else {}
    model_config = getattr(manager, "model_config", None)
    enabled = getattr(server_args, "enable_return_routed_experts", None)
    return SGLangLimits(
        vocab_size=_positive_int(getattr(getattr(manager, "model_config", None), "vocab_size", None)),
        context_length=_positive_int(getattr(manager, "context_len", None)),
        max_running=_positive_int(info.get("max_running_requests"))
        or _positive_int(getattr(server_args, "max_running_requests", None)),
        kv_tokens_total=_positive_int(info.get("max_total_num_tokens")),
        tp_size=_positive_int(getattr(server_args, "tp_size", None)) or 1,
        routed_layout=routed_layout(getattr(model_config, "hf_text_config", None)),
        routed_experts_enabled=enabled if isinstance(enabled, bool) else None,
    )


@dataclass(frozen=True, kw_only=True)
class SGLangIO:
    """The SGLang request types and tensor serializer the adapter sends (from sglang, or stand-ins in tests)."""

    release_memory: Callable[..., Any]  # io_struct.ReleaseMemoryOccupationReqInput(tags=)
    resume_memory: Callable[..., Any]  # io_struct.ResumeMemoryOccupationReqInput(tags=)
    update_weights: Callable[..., Any]  # io_struct.UpdateWeightsFromTensorReqInput(serialized_named_tensors=, ...)
    pause: Callable[..., Any]  # io_struct.PauseGenerationReqInput(mode=)
    resume_generation: Callable[..., Any]  # io_struct.ContinueGenerationReqInput()
    serialize: Callable[[Any], Any]  # utils.MultiprocessingSerializer.serialize
    init_group: Callable[..., Any]  # io_struct.InitWeightsUpdateGroupReqInput(master_address=, ...)
    update_distributed: Callable[..., Any]  # io_struct.UpdateWeightsFromDistributedReqInput(names=, ...)
    begin_update: Callable[..., Any]  # io_struct.BeginWeightUpdateReqInput(selector=)
    end_update: Callable[..., Any]  # io_struct.EndWeightUpdateReqInput()


def load_sglang_io() -> SGLangIO:
    try:
        from sglang.srt.managers import io_struct
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError as exc:
        raise SGLangUnavailableError(_MISSING_SGLANG) from exc
    return SGLangIO(
        release_memory=io_struct.ReleaseMemoryOccupationReqInput,
        resume_memory=io_struct.ResumeMemoryOccupationReqInput,
        update_weights=io_struct.UpdateWeightsFromTensorReqInput,
        pause=io_struct.PauseGenerationReqInput,
        resume_generation=io_struct.ContinueGenerationReqInput,
        serialize=MultiprocessingSerializer.serialize,
        init_group=io_struct.InitWeightsUpdateGroupReqInput,
        update_distributed=io_struct.UpdateWeightsFromDistributedReqInput,
        begin_update=io_struct.BeginWeightUpdateReqInput,
        end_update=io_struct.EndWeightUpdateReqInput,
    )


_MISSING_SGLANG = (
    "the SGLang adapter needs the `sglang` package (0.5.x, CUDA torch, a GPU); it does not import here. "
    "Use the native engine (gyre.engine.NativeEngine) on machines without one."
)


def _check_group_fields(names: list, dtypes: list, shapes: list) -> None:
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(f"a weight group update needs as many names, dtypes and shapes, at least one: {names!r}")


# ----------------------------------------------------------------- the adapter


@dataclass(eq=False)
class _InFlight:
    request: GenerateRequest
    chunks: asyncio.Queue  # TokenChunk, or the exception that ended the pump
    submitted: float
    sent: bool = False  # async_generate was called: SGLang may know the rid
    abort_requested: bool = False
    abort_resent: bool = False
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    first_version: int | None = None
    last_version: int = 0
    cached_tokens: int = 0
    first_token: float | None = None
    finish_reason: FinishReason | None = None
    task: asyncio.Task | None = None

    @property
    def reserved_tokens(self) -> int:
        return self.request.reserved_tokens


class SGLangEngine(AcceptingLifecycle):
    """`gyre.engine.protocol.Engine` over an `sglang.Engine` (or anything with its `async_generate` and
    `tokenizer_manager`). Options:

    - `policy_version`: version of the weights the engine starts with.
    - `vocab_size`, `context_length`, `max_running`, `kv_tokens_total`: override what `read_limits` finds.
    - `allow_unfiltered_logprobs`: accept top-k/top-p requests whose reported log-probs are not gyre's behavior
      log-probs (see `logprob_mismatch`); default False rejects them with `ValueError`.
    - `forward_seed`: send `SamplingParams.seed` as SGLang's `sampling_seed`.
    - `pause_for_update`: pause generation in place around a weight update (protocol semantics); False makes the
      update wait until in-flight requests finish (SGLang's model-update lock).
    - `environ`: where to read `SGLANG_RETURN_ORIGINAL_LOGPROB` (the scheduler inherits this process's env).
    - `routed_layout`: the MoE layout of routed experts, overriding what `routed_layout` reads from the HF config.
    - `parameter_names`: every parameter a whole version carries, by HF name (`gyre.models.hf_weights.hf_shapes`
      of the checkpoint): buckets with another name are refused before anything is sent, and `end_update` checks
      that all were loaded. None: neither (the adapter cannot read them from SGLang).
    """

    def __init__(
        self,
        sgl_engine: Any,
        *,
        policy_version: int = 0,
        vocab_size: int | None = None,
        context_length: int | None = None,
        max_running: int | None = None,
        kv_tokens_total: int | None = None,
        allow_unfiltered_logprobs: bool = False,
        forward_seed: bool = True,
        pause_for_update: bool = True,
        sglang_io: SGLangIO | None = None,
        environ: Mapping[str, str] | None = None,
        owns_engine: bool = False,
        routed_layout: RoutedLayout | None = None,
        parameter_names: Iterable[str] | None = None,
    ):
        if not hasattr(sgl_engine, "async_generate") or not hasattr(sgl_engine, "tokenizer_manager"):
            raise TypeError(f"sgl_engine must be an sglang.Engine, got {type(sgl_engine).__name__}")
        if not isinstance(policy_version, int) or policy_version < 0:
            raise ValueError(f"policy_version={policy_version!r} is not allowed: expected an integer >= 0")
        found = read_limits(sgl_engine)
        self.limits = SGLangLimits(
            vocab_size=vocab_size or found.vocab_size,
            context_length=context_length or found.context_length,
            max_running=max_running or found.max_running,
            kv_tokens_total=kv_tokens_total or found.kv_tokens_total,
            tp_size=found.tp_size,
            routed_layout=routed_layout or found.routed_layout,
            routed_experts_enabled=found.routed_experts_enabled,
        )
        self.policy_version = policy_version
        self.allow_unfiltered_logprobs = allow_unfiltered_logprobs
        self.forward_seed = forward_seed
        self.pause_for_update = pause_for_update
        self.original_logprob = original_logprob_enabled(os.environ if environ is None else environ)
        self._sgl = sgl_engine
        self._io = sglang_io
        self._owns_engine = owns_engine
        self._in_flight: dict[str, _InFlight] = {}
        self._accepting = True
        self._weights_released = False
        self._kv_released = False
        self._idle = asyncio.Event()
        self._idle.set()
        self.parameter_names = None if parameter_names is None else tuple(parameter_names)
        self._parameter_set = frozenset(self.parameter_names or ())
        self._session: UpdateSession | None = None  # begin_update .. end_update (SGLang's weight-update session)
        self._paused = False  # generation paused in place for the session
        self._partial_weights: str | None = None  # why SGLang's weights are a mix of two versions (abort_update)
        self._flush_pending = False  # a weight update could not flush SGLang's prefix cache (requests in flight)
        self._flush_task: asyncio.Task | None = None

    @classmethod
    def from_pretrained(cls, model_path: str, *, adapter_options: Mapping[str, Any] | None = None, **engine_kwargs):
        """Build `sglang.Engine(model_path=..., **engine_kwargs)` and wrap it (`skip_tokenizer_init` defaults to
        True: the adapter sends token ids only). Raises `SGLangUnavailableError` where sglang does not import."""
        try:
            import sglang
        except ImportError as exc:
            raise SGLangUnavailableError(_MISSING_SGLANG) from exc
        engine_kwargs.setdefault("skip_tokenizer_init", True)
        sgl_engine = sglang.Engine(model_path=model_path, **engine_kwargs)
        return cls(sgl_engine, owns_engine=True, **dict(adapter_options or {}))

    @property
    def _manager(self) -> Any:
        return self._sgl.tokenizer_manager

    def _sglang_io(self) -> SGLangIO:
        if self._io is None:
            self._io = load_sglang_io()
        return self._io

    # ----------------------------------------------------------------- requests

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        entry = self._submit(request)
        try:
            while True:
                item = await entry.chunks.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    return self._result(entry, item)
        except asyncio.CancelledError:
            self.abort(request.request_id)
            raise

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        entry = self._submit(request)
        finished = False
        try:
            while True:
                item = await entry.chunks.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request.request_id)

    def _submit(self, request: GenerateRequest) -> _InFlight:
        if not isinstance(request, GenerateRequest):
            raise TypeError(f"request must be a GenerateRequest, got {type(request).__name__}")
        if not self._accepting:
            raise EngineUnavailableError("the engine stopped accepting requests (drain or stop_accepting)")
        if self._weights_released or self._kv_released:
            raise EngineUnavailableError("the engine's memory is released: call resume_memory first")
        if self._partial_weights is not None:
            raise partial_weights_error(self._partial_weights)
        self._validate(request)
        entry = _InFlight(request=request, chunks=asyncio.Queue(), submitted=time.monotonic())
        self._in_flight[request.request_id] = entry
        self._idle.clear()
        entry.task = asyncio.get_running_loop().create_task(self._pump(entry), name=f"gyre-sglang-{request.request_id}")
        return entry

    def _validate(self, request: GenerateRequest) -> None:
        check_request(
            request,
            in_flight=self._in_flight,
            vocab_size=self.limits.vocab_size,
            context_length=self.limits.context_length,
        )
        reason = logprob_mismatch(request.params, original_logprob=self.original_logprob)
        if reason is not None and not self.allow_unfiltered_logprobs:
            raise ValueError(f"request {request.request_id!r}: {reason}")
        if request.return_routed_experts and self.limits.routed_layout and self.limits.routed_experts_enabled is False:
            raise ValueError(
                f"request {request.request_id!r} asks for routed experts, but this SGLang engine was started without "
                "enable_return_routed_experts=True (sglang_engine_args(return_routed_experts=True))"
            )

    async def _pump(self, entry: _InFlight) -> None:
        """Run one SGLang request to its end, turning its outputs into chunks on `entry.chunks`."""
        request = entry.request
        try:
            if entry.abort_requested:  # aborted before SGLang saw it
                entry.chunks.put_nowait(self._absorb(entry, {"finish_reason": {"type": "abort"}}))
                return
            outputs = await self._sgl.async_generate(
                input_ids=list(request.input_ids),
                sampling_params=to_sglang_sampling_params(request.params, forward_seed=self.forward_seed),
                return_logprob=True,
                stream=True,
                rid=request.request_id,
                return_routed_experts=request.return_routed_experts,
                routed_experts_start_len=request.routed_experts_start,
            )
            entry.sent = True
            if entry.abort_requested:
                self._send_abort(entry)
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    chunk = self._absorb(entry, out["meta_info"])
                    if chunk is not None:
                        entry.chunks.put_nowait(chunk)
                    if entry.finish_reason is not None:
                        return
                    if entry.abort_requested and not entry.abort_resent:
                        # An abort sent before SGLang registered the rid is dropped; the request is registered
                        # once it produced output, so send it once more.
                        entry.abort_resent = True
                        self._send_abort(entry)
            raise RuntimeError(f"SGLang's stream for {request.request_id!r} ended without a finish reason")
        except Exception as exc:  # handed to the caller of generate / generate_stream, which raises it
            if entry.sent and entry.finish_reason is None:
                self._send_abort(entry)  # do not leave the request running in SGLang
            entry.chunks.put_nowait(exc)
        finally:
            self._in_flight.pop(request.request_id, None)
            if not self._in_flight:
                self._idle.set()
                self._flush_if_idle()

    def _absorb(self, entry: _InFlight, meta_info: Mapping[str, Any]) -> TokenChunk | None:
        """Record one SGLang output; return the chunk to pass on (None if it carries nothing new)."""
        raw_finish = meta_info.get("finish_reason")
        rejected = rejected_input_message(raw_finish)
        if rejected is not None:
            raise ValueError(f"SGLang rejected request {entry.request.request_id!r}: {rejected}")
        finish = map_finish_reason(raw_finish)
        index = len(entry.output_ids)
        token_ids, logprobs = new_output_tokens(meta_info, index)
        version = self.policy_version
        now = time.monotonic()
        if token_ids:
            if entry.first_token is None:
                entry.first_token, entry.first_version = now, version
            entry.output_ids.extend(token_ids)
            entry.output_logprobs.extend(logprobs)
            entry.last_version = version
        cached = meta_info.get("cached_tokens")
        if isinstance(cached, int):
            entry.cached_tokens = max(0, min(cached, len(entry.request.input_ids)))
        if finish is None:
            if not token_ids:
                return None
            return TokenChunk(
                request_id=entry.request.request_id,
                index=index,
                token_ids=token_ids,
                logprobs=logprobs,
                policy_version=version,
            )
        entry.finish_reason = finish
        if finish == "stop" and entry.output_ids and entry.output_ids[-1] not in entry.request.params.stop_token_ids:
            logger.warning(
                "request %r stopped at token %d, not one of its stop_token_ids (SGLang also stops at the model's "
                "EOS ids): include them in stop_token_ids",
                entry.request.request_id,
                entry.output_ids[-1],
            )
        total_s = now - entry.submitted
        first_token_s = entry.first_token - entry.submitted if entry.first_token is not None else total_s
        return TokenChunk(
            request_id=entry.request.request_id,
            index=index,
            token_ids=token_ids,
            logprobs=logprobs,
            policy_version=version,
            finish_reason=finish,
            # SGLang 0.5.x reports no admission time without metrics: queued_s is the time to first token, an
            # upper bound.
            timings=GenerateTimings(queued_s=first_token_s, first_token_s=first_token_s, total_s=total_s),
            cached_tokens=entry.cached_tokens,
            routed_experts=self._routed_experts(entry, meta_info),
        )

    def _routed_experts(self, entry: _InFlight, meta_info: Mapping[str, Any]) -> np.ndarray | None:
        """The final output's routed experts in the protocol's layout (None when not asked or the model is dense)."""
        request, layout = entry.request, self.limits.routed_layout
        if not request.return_routed_experts or layout is None:
            return None
        encoded = meta_info.get("routed_experts")
        if encoded is None and entry.finish_reason != "abort":
            logger.warning(
                "request %r asked for routed experts and SGLang sent none (started without "
                "enable_return_routed_experts=True?): -1 (unknown) at every position",
                request.request_id,
            )
        rows = max(0, len(request.input_ids) + len(entry.output_ids) - 1 - request.routed_experts_start)
        return routed_experts_from_sglang(encoded, layout, rows=rows)

    def _result(self, entry: _InFlight, last: TokenChunk) -> GenerateResult:
        first_version = entry.first_version if entry.first_version is not None else last.policy_version
        return GenerateResult(
            request_id=entry.request.request_id,
            output_ids=tuple(entry.output_ids),
            output_logprobs=tuple(entry.output_logprobs),
            finish_reason=last.finish_reason,
            policy_version=first_version,
            last_policy_version=entry.last_version if entry.output_ids else first_version,
            prompt_tokens=len(entry.request.input_ids),
            cached_tokens=entry.cached_tokens,
            timings=last.timings,
            routed_experts=last.routed_experts,
        )

    def abort(self, request_id: str) -> bool:
        entry = self._in_flight.get(request_id)
        if entry is None or entry.finish_reason is not None:
            return False
        entry.abort_requested = True
        if entry.sent:
            self._send_abort(entry)
        return True

    def _send_abort(self, entry: _InFlight) -> None:
        self._manager.abort_request(entry.request.request_id)

    # ----------------------------------------------------------------- accepting / drain

    def _in_flight_ids(self) -> list[str]:
        return list(self._in_flight)

    async def close(self) -> None:
        """Abort what is in flight, wait for it, and shut SGLang down if `from_pretrained` built it."""
        for request_id in list(self._in_flight):
            self.abort(request_id)
        await self._idle.wait()
        if self._flush_task is not None:
            await self._flush_task
        if self._owns_engine:
            self._sgl.shutdown()

    # ----------------------------------------------------------------- memory

    def _check_idle(self, what: str) -> None:
        if self._in_flight:
            raise EngineBusyError(
                f"{what} needs an idle engine: {len(self._in_flight)} requests in flight (drain first)"
            )

    @staticmethod
    def _tags(weights: bool, kv: bool) -> list[str] | None:
        return None if weights and kv else list(WEIGHT_TAGS if weights else KV_TAGS)

    async def release_memory(self, *, weights: bool = True, kv: bool = True) -> None:
        self._check_idle("release_memory")
        if self._session is not None:
            raise WeightUpdateSessionError("release_memory during a weight-update session: end or abort it first")
        if not weights and not kv:
            return
        io = self._sglang_io()
        await self._manager.release_memory_occupation(io.release_memory(tags=self._tags(weights, kv)), None)
        self._weights_released |= weights
        self._kv_released |= kv

    async def resume_memory(self, *, weights: bool = True, kv: bool = True) -> None:
        weights, kv = weights and self._weights_released, kv and self._kv_released
        if not weights and not kv:
            return
        io = self._sglang_io()
        await self._manager.resume_memory_occupation(io.resume_memory(tags=self._tags(weights, kv)), None)
        self._weights_released &= not weights
        self._kv_released &= not kv

    # ----------------------------------------------------------------- weights

    async def update_weights(self, weights: Mapping[str, torch.Tensor] | FlatWeights, *, version: int) -> None:
        """`begin_update`, one `load_bucket`, `end_update` without the completeness check (any subset); a failure in
        between aborts the session (`abort_update`: a bucket SGLang refused may be partly applied)."""
        await self.begin_update(version=version)
        await self._load_and_end(self.load_bucket(weights))

    async def begin_update(self, *, version: int) -> None:
        """Pause generation in place and open SGLang's weight-update session (`begin_weight_update`); a session that
        does not open raises `ValueError` and generation goes on (module docstring)."""
        self._session = UpdateSession.begin(
            self._session, version, self.policy_version, released=self._weights_released
        )
        io = self._sglang_io()
        opened, message = False, "it was not asked"
        try:
            if self.pause_for_update:
                await self._manager.pause_generation(io.pause(mode="in_place"))
                self._paused = True
            opened, message = await self._manager.begin_weight_update(io.begin_update(selector="all"), None)
        finally:
            if not opened:
                self._session = None
                await self._continue_generation()
        if not opened:
            raise ValueError(
                f"SGLang rejected the weight update to version {version}: no weight-update session: {message}"
            )

    async def load_bucket(self, bucket: Mapping[str, torch.Tensor] | FlatWeights) -> None:
        """One bucket by `update_weights_from_tensor` in the session (`flush_cache=False`, `weight_version`: the
        session's version); one serialized payload per tensor-parallel rank."""
        import torch

        session = UpdateSession.require(self._session, "load_bucket")
        named = unflatten_weights(bucket) if isinstance(bucket, FlatWeights) else dict(bucket)
        for name, tensor in named.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"update_weights: {name} is a {type(tensor).__name__}, expected a torch.Tensor")
        self._check_names(named)
        io = self._sglang_io()
        payload = [io.serialize(list(named.items())) for _ in range(self.limits.tp_size)]
        update = io.update_weights(
            serialized_named_tensors=payload, load_format=None, flush_cache=False, weight_version=str(session.version)
        )
        await self._load(session, list(named), self._manager.update_weights_from_tensor(update, None))

    async def end_update(self, *, version: int) -> None:
        """`end_weight_update`, the prefix cache flushed (at once when nothing is in flight, else once idle), then
        generation continues. Completeness is checked against `parameter_names` when the adapter was given them."""
        session = UpdateSession.require(self._session, "end_update")
        session.check_end(version, self.parameter_names)
        await self._close_session(session)

    async def abort_update(self) -> None:
        """SGLang's session closed with the version unchanged. A touched session (a bucket sent, whatever SGLang
        answered) leaves SGLang's weights mixed: the requests in flight are aborted before generation continues, new
        ones are refused until a whole version is loaded, and the prefix cache is flushed once idle."""
        session = self._session
        if session is None:
            return
        io = self._sglang_io()
        try:
            if session.touched:
                self._partial_weights = f"the update to version {session.version} was aborted after a bucket"
                for request_id in list(self._in_flight):
                    self.abort(request_id)
            await self._manager.end_weight_update(io.end_update(), None)  # else SGLang refuses the next session
        finally:
            self._session = None
            await self._continue_generation()
            if session.touched:
                self._flush_pending = True
                self._flush_if_idle()

    async def _load_and_end(self, loading: Awaitable) -> None:
        """A whole update's load and end (no completeness check); whatever fails in between aborts the session."""
        try:
            await loading
            await self._close_session(UpdateSession.require(self._session, "end_update"))
        except BaseException:
            await self.abort_update()
            raise

    async def _load(self, session: UpdateSession, names: list[str], sending: Awaitable) -> None:
        """Await one SGLang update call of the session; `(False, message)` raises `ValueError`."""
        session.touched = True  # SGLang loads tensor by tensor: whatever it answers, some may be written
        success, message = await sending
        if not success:
            raise ValueError(f"SGLang rejected the weight update to version {session.version}: {message}")
        session.loaded.update(names)

    def _check_names(self, names) -> None:
        """With `parameter_names`, a name the model does not have is refused before anything is sent."""
        if self.parameter_names is not None:
            unknown = [name for name in names if name not in self._parameter_set]
            if unknown:
                raise ValueError(f"update_weights: unknown parameter name {unknown[0]!r}")

    async def _close_session(self, session: UpdateSession) -> None:
        """SGLang's session ended; the prefix cache flushed at once if nothing is in flight (still paused: nothing can
        slip in before the flush), else once idle; generation continued; the version set."""
        io = self._sglang_io()
        try:
            closed, message = await self._manager.end_weight_update(io.end_update(), None)
            if not closed:  # what was loaded is not finalized: serve nothing on it
                self._partial_weights = f"the update to version {session.version} did not close in SGLang"
                for request_id in list(self._in_flight):
                    self.abort(request_id)
            flushed = closed and not self._in_flight and await self._flush_now()
        finally:
            self._session = None
            await self._continue_generation()
        if not closed:
            raise ValueError(f"SGLang's weight-update session for version {session.version} did not close: {message}")
        if self.parameter_names is None or session.loaded.issuperset(self.parameter_names):
            self._partial_weights = None  # a whole version again
        self.policy_version = session.version
        self._flush_pending = self._flush_pending or not flushed
        self._flush_if_idle()

    async def _continue_generation(self) -> None:
        if self._paused:
            self._paused = False
            await self._manager.continue_generation(self._sglang_io().resume_generation())

    async def init_weights_group(
        self, *, address: str, port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        """SGLang's tensor-parallel workers join the weight group `group_name` of `world_size` ranks (rank
        `rank_offset` + their TP rank) at the rendezvous `address:port`, which rank 0 serves
        (`gyre.distributed.weight_groups`); returns once they joined. ValueError when SGLang says it failed."""
        io = self._sglang_io()
        request = io.init_group(
            master_address=address,
            master_port=port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        success, message = await self._manager.init_weights_update_group(request, None)
        if not success:
            raise ValueError(f"SGLang could not join the weight group {group_name!r}: {message}")

    async def update_weights_from_group(
        self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, version: int
    ) -> None:
        """Load `version` from rank 0's broadcasts over the weight group `group_name` (one per name, in order, with
        those dtypes and shapes): `begin_update`, one `load_bucket_from_group`, `end_update` as `update_weights`
        (calls in flight continue under the new weights). Rank 0 broadcasts while this waits."""
        _check_group_fields(names, dtypes, shapes)
        await self.begin_update(version=version)
        bucket = self.load_bucket_from_group(names=names, dtypes=dtypes, shapes=shapes, group_name=group_name)
        await self._load_and_end(bucket)

    async def load_bucket_from_group(
        self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str
    ) -> None:
        """In the open session, one bucket from rank 0's broadcasts over the weight group (one per tensor, in order:
        gyre's buffers are 16-byte aligned per tensor, SGLang's `flattened_bucket` packs tensors back to back, so the
        per-tensor path is used), by `update_weights_from_distributed` (`flush_cache=False`, `weight_version`)."""
        session = UpdateSession.require(self._session, "load_bucket_from_group")
        _check_group_fields(names, dtypes, shapes)
        self._check_names(names)
        io = self._sglang_io()
        update = io.update_distributed(
            names=list(names),
            dtypes=list(dtypes),
            shapes=[list(shape) for shape in shapes],
            group_name=group_name,
            flush_cache=False,
            load_format=None,
            weight_version=str(session.version),
        )
        await self._load(session, list(names), self._manager.update_weights_from_distributed(update, None))

    def _flush_if_idle(self) -> None:
        """Drop SGLang's prefix cache (KV of old weights) once no request is in flight, if an update left it."""
        if self._flush_pending and not self._in_flight and self._flush_task is None:
            self._flush_task = asyncio.get_running_loop().create_task(self._flush_prefix_cache())

    async def _flush_prefix_cache(self) -> None:
        try:
            if await self._flush_now():
                self._flush_pending = False
        finally:
            self._flush_task = None

    async def _flush_now(self) -> bool:
        """SGLang's `flush_cache`; False when it refused (a request slipped in: the next idle moment tries again)."""
        result = await self._manager.flush_cache()
        return bool(getattr(result, "success", True))

    # ----------------------------------------------------------------- KV migration (not in SGLang)

    async def export_kv(self, request_id: str) -> KVExport:
        raise NotImplementedError(
            "SGLang has no per-request KV export: abort the request and re-prefill prompt + output elsewhere"
        )

    async def import_kv(self, export: KVExport) -> None:
        raise NotImplementedError("SGLang has no per-request KV import: send prompt + output as a new request")

    def release_export(self, request_id: str) -> bool:
        return False

    # ----------------------------------------------------------------- load

    def load(self) -> EngineLoad:
        """Adapter-side estimate: every request in flight counts as running and holding its full reservation
        (SGLang's running/waiting split and real KV use need a scheduler round trip, `get_load`)."""
        released = self._weights_released or self._kv_released
        total = 0 if self._kv_released else self.limits.kv_tokens_total or 0
        held = sum(entry.reserved_tokens for entry in self._in_flight.values())
        return EngineLoad(
            capacity=self.limits.max_running or 0,
            running=len(self._in_flight),
            queued=0,
            kv_tokens_total=total,
            kv_tokens_free=max(0, total - held),
            accepting=self._accepting and not released and self._partial_weights is None,
            memory_released=released,
            policy_version=self.policy_version,
        )
