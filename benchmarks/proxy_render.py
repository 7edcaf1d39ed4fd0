"""Proxy templating cost at long histories: `PromptBuilder.build` for the next turn vs JSON-parsing the request.

A synthetic Claude-Code-like execution (system prompt, tools, then our tool-calling answers echoed back with tool
results) is grown to ~7K and ~700K tokens with the tiny model's template and tokenizer. Measured side by side:
- `build_ms`: CPU time of `PromptBuilder.build` for a request that extends the history by our echoed answer and a
  new tool result (median over repetitions; each repetition is a new turn);
- `json_ms`: `orjson.loads` of the equivalent Anthropic Messages body (what every dialect must do anyway).
Target: build_ms <= 3 x json_ms at 700K tokens, and flat in history length.

    python benchmarks/proxy_render.py [--reps 30] [--out benchmarks/results/proxy_render.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import orjson

from benchmarks.report import emit
from gyre.models.tiny import tiny_model_dir
from gyre.proxy.conversation import AssistantOutput, ChatRequest, ToolCall, ToolSpec, Turn
from gyre.proxy.payload import PayloadCache
from gyre.proxy.render import ChatTemplate, PromptBuilder

TOOL_RESULT = "".join(f"line {i}: def function_{i}(x): return x * {i}  # comment\n" for i in range(40))
TOOLS = tuple(
    ToolSpec(
        name=f"tool_{i}",
        description="Does one thing to the workspace.",
        parameters={"type": "object", "properties": {"a": {}}},
    )
    for i in range(24)
)


def answer(step: int) -> AssistantOutput:
    call = ToolCall(id=f"toolu_{step:06d}", name="tool_1", arguments=f'{{"path": "src/f{step}.py"}}')
    return AssistantOutput(text=f"Step {step}: reading the next file.", tool_calls=(call,))


def anthropic_body(request: ChatRequest) -> bytes:
    messages = []
    for turn in request.turns:
        if turn.role == "assistant":
            content = [{"type": "text", "text": turn.text}] + [
                {"type": "tool_use", "id": c.id, "name": c.name, "input": orjson.loads(c.arguments)}
                for c in turn.tool_calls
            ]
            messages.append({"role": "assistant", "content": content})
        elif turn.role == "tool":
            block = {"type": "tool_result", "tool_use_id": turn.tool_call_id, "content": turn.text}
            messages.append({"role": "user", "content": [block]})
        else:
            messages.append({"role": "user", "content": [{"type": "text", "text": turn.text}]})
    tools = [{"name": t.name, "description": t.description, "input_schema": t.parameters} for t in request.tools]
    body = {
        "model": "tiny",
        "max_tokens": 1024,
        "system": [{"type": "text", "text": request.system}],
        "messages": messages,
        "tools": tools,
        "stream": True,
    }
    return orjson.dumps(body)


def measure(template: ChatTemplate, target_tokens: int, reps: int) -> dict:
    payloads = PayloadCache()
    builder = PromptBuilder(template, payloads)
    turns = [Turn(role="user", text="Fix the failing tests.")]
    step = 0

    def next_request() -> ChatRequest:
        nonlocal step
        output = answer(step)
        payloads.remember(output, [*template.encode(output.text), template.end_of_turn_ids[0]])
        turns.append(Turn(role="assistant", text=output.text, tool_calls=output.tool_calls))
        turns.append(Turn(role="tool", text=TOOL_RESULT, tool_call_id=output.tool_calls[0].id))
        step += 1
        return ChatRequest(
            dialect="anthropic", model="tiny", system="You are an agent. " * 50, turns=tuple(turns), tools=TOOLS
        )

    # Grow the history in one fresh build (a windowed render of every turn), then extend turn by turn.
    per_step = len(template.encode(TOOL_RESULT)) + 12
    request = next_request()
    header = len(template.encode(template.render_request(request)))
    while header + len(turns) * per_step / 2 < target_tokens:
        request = next_request()
    started = time.perf_counter()
    prompt = builder.build(request)
    fresh_ms = (time.perf_counter() - started) * 1e3
    start_tokens = prompt.num_tokens
    build, parse = [], []
    for _ in range(reps):
        request = next_request()
        body = anthropic_body(request)
        started = time.perf_counter()
        prompt = builder.build(request)
        build.append(time.perf_counter() - started)
        started = time.perf_counter()
        orjson.loads(body)
        parse.append(time.perf_counter() - started)
        assert prompt.rendered_turns == 2 and prompt.restored_turns == 1, prompt
    build_ms, json_ms = statistics.median(build) * 1e3, statistics.median(parse) * 1e3
    return {
        "history_tokens_first": start_tokens,
        "history_tokens_last": prompt.num_tokens,
        "turns": len(request.turns),
        "segments": len(prompt.segments),
        "body_bytes": len(body),
        "build_ms": round(build_ms, 3),
        "json_ms": round(json_ms, 3),
        "build_over_json": round(build_ms / json_ms, 2),
        "fresh_build_ms": round(fresh_ms, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    template = ChatTemplate.from_pretrained(tiny_model_dir())
    small = measure(template, 7_000, args.reps)
    large = measure(template, 700_000, args.reps)
    emit(
        {
            "benchmark": "proxy_render",
            "tokenizer": "gyre tiny (512 ids)",
            "new_turn_tokens": len(template.encode(TOOL_RESULT)),
            "history_7k": small,
            "history_700k": large,
            "build_ratio_700k_over_7k": round(large["build_ms"] / small["build_ms"], 2),
            "target": "build_ms <= 3 x json_ms at 700K",
        },
        args.out,
    )


if __name__ == "__main__":
    main()
