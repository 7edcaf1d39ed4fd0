"""A stand-in for the `sglang` package, for CPU tests of gyre's SGLang path (SGLang needs CUDA and a GPU).

It is not SGLang. It models exactly the surface `gyre.engine.sglang_engine` calls, with SGLang 0.5.23's names and
signatures (every method's parameters and every request type's fields are among the real ones: checked against
the pinned wheel's source by tests/unit/test_engine_sglang_contract.py), backed by gyre's native engine on the CPU:

- `sglang.Engine(**server_args)`: the `ServerArgs` fields in `ACCEPTED_SERVER_ARGS` (others raise `TypeError`, as
  an unknown field does in SGLang); the checkpoint at `model_path` is loaded in a `NativeEngine` on the CPU;
  `tp_size` is recorded (one weight payload per tensor-parallel rank is expected), not run.
- `Engine.async_generate(input_ids=, sampling_params=, return_logprob=True, stream=True, rid=, ...)` streams SGLang's
  output dicts (`meta_info`: cumulative `output_token_logprobs` triples, `completion_tokens`, `cached_tokens`,
  `finish_reason`). It stops at `stop_token_ids` only (SGLang also stops at the model's EOS ids). With
  `return_routed_experts=True, routed_experts_start_len=` and the server arg `enable_return_routed_experts`, the
  final output carries `routed_experts` in SGLang's encoding (base64 of int32 rows, 0 at dense layers).
- `tokenizer_manager`: `abort_request`, `pause_generation` / `continue_generation` (in place: the native engine
  underneath is held at its next step boundary, as SGLang's scheduler runs no forward while paused, and outputs are
  held until continued: a token sampled just before the pause reaches the caller after it), `begin_weight_update` /
  `end_weight_update` (a weight-update session: updates outside one are refused, with SGLang 0.5.23's message),
  `update_weights_from_tensor` (one payload per TP rank; its `weight_version` recorded; `flush_cache=True` with
  requests in flight loads the weights and then answers `(False, ...)` with SGLang 0.5.23's message: the cache was
  not flushed), `release_memory_occupation` / `resume_memory_occupation` (tags `weights`, `kv_cache`,
  None for both), `flush_cache`, `init_weights_update_group` / `update_weights_from_distributed` (each modelled TP
  worker a gloo member of rank 0's group, its store keys laid out as SGLang's `init_custom_process_group` and torch's
  `_new_process_group_helper` lay them; gloo only: NCCL needs GPUs).

Use: put `PATH` (this directory) first on `PYTHONPATH`; `import sglang` then finds the stand-in
(`sglang.STANDIN` is True). With `$GYRE_SGLANG_STANDIN_LOG` set, every call is appended to that file as one JSON
line (`{"pid", "call", ...}`), so a test can see what a run's engines were asked. docs/sglang.md, "The stand-in".
"""

from pathlib import Path

PATH = Path(__file__).resolve().parent
