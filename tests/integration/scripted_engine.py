"""`ScriptedEngine`: a stand-in for a model that writes tool calls on cue (the random tiny model never does).

Served behind the real engine endpoint, it answers each request with the text `respond(request, prompt)` returns
(`prompt` is the decoded context), encoded with the served template and ended with its end-of-turn token, so the
real proxy parses, records and returns it like any model output. Used by the proxy's tool round trips and the
builtin harness's scripted episodes (imported as `scripted_engine`; pytest puts this directory on sys.path).
"""

from __future__ import annotations

from collections.abc import Callable

from gyre.engine.protocol import EngineLoad, GenerateRequest, GenerateResult, GenerateTimings, TokenChunk
from gyre.proxy.render import ChatTemplate

LOGPROB = -0.5  # every scripted token's "behavior log-prob"


class ScriptedEngine:
    """Implements the parts of `gyre.engine.protocol.Engine` the endpoint serves; one chunk per token."""

    def __init__(self, template: ChatTemplate, respond: Callable[[GenerateRequest, str], str]):
        self.template = template
        self.respond = respond
        (self.stop_id,) = template.end_of_turn_ids

    async def generate_stream(self, request: GenerateRequest):
        prompt = self.template.tokenizer.decode(list(request.input_ids), skip_special_tokens=False)
        ids = [*self.template.encode(self.respond(request, prompt)), self.stop_id][: request.params.max_new_tokens]
        for index, token in enumerate(ids):
            last = index == len(ids) - 1
            yield TokenChunk(
                request_id=request.request_id,
                index=index,
                token_ids=(token,),
                logprobs=(LOGPROB,),
                policy_version=0,
                finish_reason=("stop" if token == self.stop_id else "length") if last else None,
                timings=GenerateTimings(queued_s=0.0, first_token_s=0.0, total_s=0.0) if last else None,
                cached_tokens=0 if last else None,
            )

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        chunks = [chunk async for chunk in self.generate_stream(request)]
        ids = tuple(t for c in chunks for t in c.token_ids)
        return GenerateResult(
            request_id=request.request_id,
            output_ids=ids,
            output_logprobs=(LOGPROB,) * len(ids),
            finish_reason=chunks[-1].finish_reason,
            policy_version=0,
            last_policy_version=0,
            prompt_tokens=len(request.input_ids),
            cached_tokens=0,
            timings=chunks[-1].timings,
        )

    def abort(self, request_id: str) -> bool:
        return False

    def load(self) -> EngineLoad:
        return EngineLoad(
            capacity=64,
            running=0,
            queued=0,
            kv_tokens_total=1 << 20,
            kv_tokens_free=1 << 20,
            accepting=True,
            memory_released=False,
            policy_version=0,
        )
